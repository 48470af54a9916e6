"""Replicas of the train state must hold the same bits: fingerprints, the vote, and the flip the
simulated cluster injects (one process, CPU). The cluster path (a flipped bit found, its slice
evicted) is in ``test_recovery.py``."""

import numpy as np
import pytest

from ray_elastic.decide.integrity import Mismatch, compare

PLACE = {0: ("a", 0), 1: ("b", 0), 2: ("c", 0), 3: ("a", 1), 4: ("b", 1), 5: ("c", 1)}  # 3 slices x 2 hosts


def test_the_slice_out_voted_at_any_host_position_is_corrupt():
    same = {p: (1, 2, 3) if PLACE[p][1] == 0 else (4, 5, 6) for p in PLACE}
    assert compare(9, same, PLACE) is None
    # Host 1 of slice b disagrees on array 2: b is out-voted by a and c (host 0's agree: only that host drifted).
    assert compare(9, {**same, 4: (4, 5, 7)}, PLACE) == Mismatch(9, ("b",), (2,))
    # Two replicas, or a three-way split: no majority, no slice named.
    two = {p: fp for p, fp in same.items() if PLACE[p][0] != "c"}
    assert compare(9, {**two, 4: (4, 5, 7)}, PLACE) == Mismatch(9, (), (2,))
    assert compare(9, {**same, 4: (4, 5, 7), 5: (4, 0, 6)}, PLACE) == Mismatch(9, (), (1, 2))


@pytest.mark.cluster  # runs JAX programs
def test_a_fingerprint_is_the_same_for_the_same_bits_and_changes_with_one_flipped_bit():
    import jax
    import jax.numpy as jnp

    from ray_elastic.slice.integrity import Fingerprints, flip_one_bit

    state = {"w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4), "h": jnp.ones(5, jnp.bfloat16), "k": jnp.uint32(7)}

    def fingerprint(s, step=4):
        f = Fingerprints(every=5)
        f.dispatched(step, s)
        f.finished(step)
        return f.done[step]

    base = fingerprint(state)
    assert len(base) == 3 and base == fingerprint(jax.tree.map(jnp.copy, state))
    for leaf in range(3):
        flipped = fingerprint(flip_one_bit(state, leaf, 3))
        assert [a != b for a, b in zip(base, flipped)] == [i == leaf for i in range(3)]
    assert Fingerprints(every=5).dispatched(3, state) is None  # not a fingerprinted step
    changed = np.asarray(flip_one_bit(state, 2, 0)["w"])  # leaves in key order: h, k, w
    assert np.count_nonzero(changed != np.asarray(state["w"])) == 1


def test_a_new_world_trusts_what_its_replicas_loaded_from_one_source_or_what_was_compared():
    from ray_elastic.decide.integrity import trusted_at_start

    assert trusted_at_start(0, False, None) == -1  # fresh parameters, the same seed on every replica
    assert trusted_at_start(501, False, 200) == 500  # one checkpoint, loaded by every replica
    assert trusted_at_start(501, True, None) == 500  # a takeover's first world: nothing compared before
    # After a failure each holder loads its own snapshot, taken since the last check: back to that check.
    assert trusted_at_start(531, True, 500) == 500
    assert trusted_at_start(531, True, 530) == 530  # a planned stop compared its boundary
    assert trusted_at_start(401, True, 500) == 400  # a rollback to before the newest check
