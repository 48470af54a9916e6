"""The data order by step: what a run has read is fixed by the dataset, the seed and the step, as
grain's ``shuffle(seed).repeat()`` orders it (a run resumed by another version reads the same rows)."""

import grain
import numpy as np
import pytest

from ray_elastic.slice.data import EvalBatches, StepBatches

N, B, SEED = 37, 8, 5  # 37 examples, 8 a step: epochs end inside steps


def _examples():
    return [{"x": np.full((2,), i, np.float32), "y": np.int32(i)} for i in range(N)]


def _grain_order(ds, steps: int, shuffle: bool = True) -> np.ndarray:
    ds = ds if isinstance(ds, grain.MapDataset) else grain.MapDataset.source(ds)
    ds = (ds.shuffle(seed=SEED) if shuffle else ds).repeat()
    return np.stack([ds[i]["x"] for i in range(steps * B)])


@pytest.mark.parametrize("shuffle", [True, False])
def test_rows_are_grains_shuffled_repeated_order_for_a_sequence(shuffle):
    batches = StepBatches(_examples(), B, SEED, shuffle=shuffle)
    steps = 3 * N // B + 1  # over three epochs: each epoch shuffled anew
    got = np.concatenate(
        [np.concatenate([batches.rows(s, 0, 3)["x"], batches.rows(s, 3, B)["x"]]) for s in range(steps)]
    )
    np.testing.assert_array_equal(got, _grain_order(_examples(), steps, shuffle))
    assert shuffle == (not np.array_equal(got[:N, 0], np.arange(N)))


def test_a_map_dataset_with_a_random_map_draws_as_grain_does_in_every_epoch():
    """A random augmentation is drawn from the element's index with its epoch: epochs differ."""

    def ds():
        return grain.MapDataset.source(_examples()).random_map(
            lambda e, rng: {**e, "x": e["x"] + rng.integers(0, 1000, 2)}, seed=1
        )

    steps = 2 * N // B + 1
    got = np.concatenate([StepBatches(ds(), B, SEED).rows(s, 0, B)["x"] for s in range(steps)])
    np.testing.assert_array_equal(got, _grain_order(ds(), steps))


def test_eval_batches_are_read_in_order():
    ev = EvalBatches(_examples(), 4)
    assert len(ev) == N
    np.testing.assert_array_equal(ev.rows(2, 1, 3)["y"], [9, 10])


def test_an_empty_dataset_is_refused():
    with pytest.raises(ValueError, match="dataset is empty"):
        StepBatches([], B, 0)
