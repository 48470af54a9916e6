"""The JAX side of a slice process: join the world, build the mesh, train.

Nothing here imports Ray. The slice actor (``worker.py``) calls it, and so does
the bare multi-process baseline in ``bench/overhead.py``: both run exactly the
same step function.
"""

from __future__ import annotations

import os
import time
from typing import Optional

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ray_elastic.data import StepBatches
from ray_elastic.plan import FSDP_AXIS, REPLICA_AXIS, WorldPlan, param_partition


def enable_compilation_cache(cache_dir: Optional[str]) -> None:
    """Persistent compilation cache: a new generation recompiles from disk, not from scratch."""
    if not cache_dir:
        return
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def initialize(coordinator_address: str, plan: WorldPlan, process_id: int, timeout_s: float) -> None:
    """Join the multi-controller JAX world of ``plan`` (gloo collectives on CPU)."""
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=plan.num_processes,
        process_id=process_id,
        initialization_timeout=int(timeout_s),
    )
    expected = plan.num_processes * plan.devices_per_host
    if jax.device_count() != expected:
        raise RuntimeError(
            f"JAX world has {jax.device_count()} devices, plan expects {expected} "
            f"({plan.num_processes} processes x {plan.devices_per_host}); check devices_per_host"
        )


def build_mesh(plan: WorldPlan) -> Mesh:
    """A (replica, fsdp) mesh: one row per slice, that slice's devices along fsdp.

    On real multi-slice TPUs the devices carry ``slice_index`` and the hybrid
    (ICI x DCN) helper lays them out; on CPU processes are grouped by process id,
    which ``plan`` numbers slice-major.
    """
    devices = jax.devices()
    shape = plan.mesh_shape
    if devices[0].platform == "tpu" and plan.num_slices > 1:
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_hybrid_device_mesh(
            (1, shape[FSDP_AXIS]), (shape[REPLICA_AXIS], 1), devices=devices
        )
    else:
        ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
        grid = np.array(ordered).reshape(shape[REPLICA_AXIS], shape[FSDP_AXIS])
    return Mesh(grid, (REPLICA_AXIS, FSDP_AXIS))


def _abstract_state(task, seed: int):
    def make():
        model = task.create_model(nnx.Rngs(seed))
        return model, nnx.Optimizer(model, task.create_optimizer(), wrt=nnx.Param)

    return make, nnx.split(nnx.eval_shape(make))


class TrainLoop:
    """Sharded train state and a compiled step on one world's mesh."""

    def __init__(self, task, plan: WorldPlan, process_id: int, seed: int, mesh: Mesh, fsdp_min_size: int):
        self.plan = plan
        self.mesh = mesh
        self.process_id = process_id
        self.row_range = plan.process_rows(process_id)
        self.batches = StepBatches(task.dataset(), plan.global_batch_size, seed)

        make, (graphdef, abstract) = _abstract_state(task, seed)
        fsdp = plan.mesh_shape[FSDP_AXIS]
        self.state_shardings = jax.tree.map(
            lambda x: NamedSharding(mesh, P(*param_partition(x.shape, fsdp, fsdp_min_size))), abstract
        )
        self.sharded_params = sum(1 for sh in jax.tree.leaves(self.state_shardings) if any(sh.spec))
        self.batch_sharding = NamedSharding(mesh, P((REPLICA_AXIS, FSDP_AXIS)))
        replicated = NamedSharding(mesh, P())

        self.state = jax.jit(lambda: nnx.split(make())[1], out_shardings=self.state_shardings)()

        def train_step(state, batch):
            model, optimizer = nnx.merge(graphdef, state)
            loss, grads = nnx.value_and_grad(lambda m: task.loss(m, batch))(model)
            optimizer.update(model, grads)
            return nnx.state((model, optimizer)), loss

        self._step = jax.jit(
            train_step,
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, replicated),
            donate_argnums=0,
        )

    def global_batch_array(self, step: int) -> dict:
        """This process's rows of step ``step``, assembled into global jax.Arrays."""
        lo, hi = self.row_range
        local = self.batches.rows(step, lo, hi)
        B = self.plan.global_batch_size
        return {
            k: jax.make_array_from_process_local_data(self.batch_sharding, v, (B,) + v.shape[1:])
            for k, v in local.items()
        }

    def compile(self, step: int) -> float:
        """Compile the step (from the persistent cache when warm); returns seconds."""
        t0 = time.perf_counter()
        self._step = self._step.lower(self.state, self.global_batch_array(step)).compile()
        return time.perf_counter() - t0

    def run(self, start_step: int, num_steps: int) -> list[dict]:
        """Run ``num_steps`` steps from ``start_step``; per-step loss and wall time."""
        out = []
        for step in range(start_step, start_step + num_steps):
            t0 = time.perf_counter()
            batch = self.global_batch_array(step)
            self.state, loss = self._step(self.state, batch)
            value = float(np.asarray(loss.addressable_shards[0].data))
            out.append({"step": step, "loss": value, "step_time_s": time.perf_counter() - t0})
        return out

