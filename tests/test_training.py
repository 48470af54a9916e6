"""Multi-slice training on a real (simulated-TPU) Ray cluster with real multi-process JAX."""

import numpy as np
import pytest
import ray
from conftest import reference_losses

from ray_elastic import ElasticConfig, ElasticTrainer
from ray_elastic.examples.char_transformer import CharTransformerTask
from ray_elastic.examples.digits_mlp import DigitsMLPTask

SIM_CLUSTER = {"num_slices": 3}
SHARE_CLUSTER = True  # conftest.py: one cluster for the modules of plain 1-host slices


@pytest.fixture(scope="module")
def mlp_run(sim_cluster):
    cfg = ElasticConfig(
        num_slices=3, global_batch_size=48, slice=sim_cluster.slice_spec, steps_per_chunk=16, seed=3, standby_workers=0
    )  # no failure here: no processes started ahead of need
    trainer = ElasticTrainer(DigitsMLPTask(), cfg, progress=False)
    return trainer, trainer.fit(60)


def test_three_slice_losses_equal_single_process_reference(mlp_run):
    _trainer, result = mlp_run
    assert result.steps == list(range(60))
    ref = reference_losses(DigitsMLPTask(), global_batch_size=48, seed=3, num_steps=60)
    got = np.array(result.losses)
    rel = np.abs(got - ref) / np.abs(ref)
    assert rel.max() <= 1e-4, f"max relative error {rel.max():.2e} at step {rel.argmax()}"
    assert got[-1] < 0.5 * got[0], "the model should actually learn"


def test_one_actor_per_slice_on_that_slices_node(mlp_run, sim_cluster):
    trainer, _ = mlp_run
    infos = trainer.world.host_infos
    assert len(infos) == 3
    by_slice = {s.name: s.node_ids[0] for s in sim_cluster.alive_slices()}
    assert sorted(i["slice_name"] for i in infos) == sorted(by_slice)
    for info in infos:
        assert info["node_id"] == by_slice[info["slice_name"]], info
    assert len({i["pid"] for i in infos}) == 3


def test_mesh_replica_axis_equals_number_of_slices(mlp_run):
    trainer, result = mlp_run
    assert result.summary["mesh"] == {"replica": 3, "fsdp": 2, "tensor": 1}
    for j in trainer.world.join_infos:
        assert j["mesh_shape"] == {"replica": 3, "fsdp": 2, "tensor": 1}
        assert j["local_devices"] == 2


def test_resources_released_after_fit(mlp_run):
    # Slice reservations are given back: all TPU capacity is free again.
    assert ray.available_resources().get("TPU", 0) == ray.cluster_resources()["TPU"]


def test_transformer_trains_on_three_slices(sim_cluster):
    task = CharTransformerTask(seq_len=32, d_model=32, num_layers=1, max_chars=100_000)
    cfg = ElasticConfig(
        num_slices=3, global_batch_size=12, slice=sim_cluster.slice_spec, steps_per_chunk=10, standby_workers=0
    )
    result = ElasticTrainer(task, cfg, progress=False).fit(20)
    ref = reference_losses(task, global_batch_size=12, seed=0, num_steps=20)
    rel = np.abs(np.array(result.losses) - ref) / np.abs(ref)
    assert rel.max() <= 1e-4, rel.max()


def test_a_trainer_can_fit_again(mlp_run):
    """A second ``fit`` is a new run: fresh worlds, events and records, the same losses from step 0."""
    trainer, first = mlp_run
    again = trainer.fit(12)
    assert again.steps == list(range(12))
    np.testing.assert_allclose(again.losses, first.losses[:12], rtol=1e-6)
    assert len(trainer.worlds) == 1 and again.summary["generations"] == 1
    assert [e["kind"] for e in again.events].count("run_started") == 1
    assert trainer.state.value == "finished"
