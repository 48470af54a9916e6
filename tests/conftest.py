"""Shared fixtures: one simulated cluster per test module, a tiny reference trainer."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

# The driver process never needs more than one CPU device.
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def reference_run(task, global_batch_size: int, seed: int, num_steps: int):
    """Single-process training on the same global batches from the same initial parameters.

    Written directly against Flax NNX + Optax (not through ray_elastic's train loop),
    so a wrong batch split, sharding or step in the distributed path shows up here.
    Returns the per-step losses and the final train state as a pure dict of arrays.
    """
    from flax import nnx

    from ray_elastic.slice.data import StepBatches

    model = task.create_model(nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, task.create_optimizer(), wrt=nnx.Param)
    batches = StepBatches(task.dataset(), global_batch_size, seed)

    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lambda m: task.loss(m, batch))(model)
        optimizer.update(model, grads)
        return loss

    losses = np.array([float(step(model, optimizer, batches.global_batch(s))) for s in range(num_steps)])
    return losses, nnx.to_pure_dict(nnx.state((model, optimizer)))


def restore_in_this_process(directory: str, step: int):
    """Load a checkpoint of :class:`DigitsMLPTask` written by a multi-process world into one local
    device: its train state (a pure dict) and its metadata."""
    import jax
    from flax import nnx

    from ray_elastic.examples.digits_mlp import DigitsMLPTask
    from ray_elastic.state.checkpoints import Checkpointer

    task = DigitsMLPTask()
    model = task.create_model(nnx.Rngs(0))
    state = nnx.state((model, nnx.Optimizer(model, task.create_optimizer(), wrt=nnx.Param)))
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev), state)
    ckpt = Checkpointer(directory, max_to_keep=None)
    try:
        restored, meta = ckpt.restore(step, target)
    finally:
        ckpt.close()
    return nnx.to_pure_dict(restored), meta


def reference_losses(task, global_batch_size: int, seed: int, num_steps: int) -> np.ndarray:
    return reference_run(task, global_batch_size, seed, num_steps)[0]


@pytest.fixture(scope="session")
def local_gcs():
    """One fake-gcs-server for the whole session (GCS clients cache their endpoint per process)."""
    from ray_elastic.sim.local_gcs import LocalGCS

    gcs = LocalGCS()
    saved = {k: os.environ.get(k) for k in gcs.env}
    gcs.activate()
    yield gcs
    gcs.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


class Breaches:
    """The TPU runtime stand-in's breach log (``ray_elastic.sim.tpu_runtime``) as one test sees it:
    ``take()`` returns the breaches since the test began (or the last take), which it then expects."""

    def __init__(self):
        self.seen = len(self._all())

    @staticmethod
    def _all() -> list[dict]:
        from ray_elastic.sim.tpu_runtime import breaches

        return breaches()

    def take(self) -> list[dict]:
        new = self._all()[self.seen :]
        self.seen += len(new)
        return new


@pytest.fixture
def tpu_breaches():
    """For a test that makes a process break a TPU runtime rule on purpose."""
    return _breaches.setdefault("current", Breaches())


_breaches: dict = {}


@pytest.fixture(autouse=True)
def nothing_left_behind():
    """Every test on a live cluster: once it is over (``fit`` returned or raised, whatever the
    exit), no placement group and no actor that ray-elastic started during it is still alive, no
    process holds a simulated host's chips (the next test's world would be refused there), and no
    process on a simulated TPU host broke a rule of the TPU runtime (that it did not expect)."""
    import ray
    from faults import chips_held, cluster_state, left_behind

    before = cluster_state() if ray.is_initialized() else None
    _breaches["current"] = Breaches()
    yield
    unexpected = _breaches.pop("current").take()
    assert not unexpected, "TPU runtime rules broken during the test:\n" + "\n".join(map(str, unexpected))
    if before is not None and ray.is_initialized():
        left = left_behind(before)
        assert not left, f"left behind after the test: {left}"
        held = chips_held()
        assert not held, f"chips still held after the test: {held}"


def _shares_cluster(module) -> bool:
    """A module whose cluster is plain 1-host slices (``SIM_CLUSTER`` names only ``num_slices``) and
    that says ``SHARE_CLUSTER = True`` runs on the one cluster such modules share."""
    return getattr(module, "SHARE_CLUSTER", False) and set(getattr(module, "SIM_CLUSTER", {})) <= {"num_slices"}


AREAS = {  # module -> what it tests, as a marker: ``pytest -m recovery`` (CONTRIBUTING.md: which for which change)
    **dict.fromkeys(
        [
            "test_recovery",
            "test_multihost",
            "test_tpu_runtime",
            "test_autoscaler",
            "test_autoscaler_multihost",
            "test_notices",
            "test_integrity",
            "test_bad_steps",
            "test_stop_gate",
        ],
        "recovery",
    ),
    **dict.fromkeys(["test_checkpoints", "test_tensorboard_gcs"], "checkpoints"),
    **dict.fromkeys(["test_driver_loss", "test_head_loss"], "driver_loss"),
    **dict.fromkeys(
        ["test_cli", "test_job_submit", "test_notebook", "test_check", "test_examples", "test_sim"], "interfaces"
    ),
    **dict.fromkeys(
        [
            "test_training",
            "test_jax_world",
            "test_model_layout",
            "test_observability",
            "test_snapshot_slots",
            "test_data",
        ],
        "training",
    ),
}
CLUSTER_FIXTURES = {"sim_cluster", "shared_sim_cluster", "local_gcs"}
# Modules whose tests start a cluster, Ray or JAX processes of their own (not through a fixture);
# single tests elsewhere that do, or that compile real JAX programs, say so with @pytest.mark.cluster.
STARTS_PROCESSES = {
    "test_job_submit",
    "test_notebook",
    "test_driver_loss",
    "test_head_loss",
    "test_bench_smoke",
    "test_cli",
    "test_jax_world",
}


def pytest_collection_modifyitems(items):
    """Markers: each test's area (``AREAS``), and ``cluster`` on every test that needs a live Ray
    cluster or starts processes (``make test-fast`` runs the others: the pure and fake-backend
    tests). The modules that share a cluster run last, one after the other (the sort keeps every
    module's tests together and in order): their cluster then never lives beside another module's own."""
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        if module in AREAS:
            item.add_marker(getattr(pytest.mark, AREAS[module]))
        if CLUSTER_FIXTURES & set(item.fixturenames) or module in STARTS_PROCESSES:
            item.add_marker(pytest.mark.cluster)
    items.sort(key=lambda item: _shares_cluster(item.module))


def _start_cluster(kwargs: dict):
    from ray_elastic.sim.cluster import SimulatedTPUCluster

    return SimulatedTPUCluster(log_to_driver=False, **{"num_slices": 3, **kwargs})


def _shut_down(cluster) -> None:
    cluster.shutdown()
    deadline = time.monotonic() + 10  # Ray's agents also exit on their own once their raylet is gone
    while (stray := cluster.stray_processes()) and time.monotonic() < deadline:
        time.sleep(0.5)
    for p in stray:
        p.kill()  # so one module's leak does not slow the next ones
    assert not stray, f"processes of the cluster's slice hosts outlived its shutdown: {stray}"


@pytest.fixture(scope="session")
def shared_sim_cluster():
    """The cluster of the modules that share one (started once: ~8 s and its nodes' processes)."""
    cluster = _start_cluster({})
    yield cluster
    _shut_down(cluster)


@pytest.fixture(scope="module")
def sim_cluster(request):
    """A 3-slice simulated TPU cluster (1 host x 2 devices per slice), connected: the module's own
    (``SIM_CLUSTER``: its arguments), or the shared one with exactly ``num_slices`` live slices."""
    kwargs = getattr(request.module, "SIM_CLUSTER", {})
    if _shares_cluster(request.module):
        from faults import ensure_slices

        cluster = request.getfixturevalue("shared_sim_cluster")
        ensure_slices(cluster, kwargs.get("num_slices", 3))  # what earlier modules left: killed, hung, added
        yield cluster
        return
    cluster = _start_cluster(kwargs)
    yield cluster
    _shut_down(cluster)
