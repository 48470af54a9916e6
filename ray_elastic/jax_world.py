"""The JAX side of a slice process: join the world, build the mesh, train.

Nothing here imports Ray. The slice actor (``worker.py``) calls it, and so does
the bare multi-process baseline in ``bench/overhead.py``: both run exactly the
same step function.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Optional

import jax
import numpy as np
import optax
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
    """Join the multi-controller JAX world of ``plan`` (gloo collectives on CPU).

    A process that connects before process 0 has started the coordination service is
    retried after about a second, and holds the whole world back that long (measured:
    ~1 s vs ~0.01 s for 3 processes); so every other process first waits until the
    coordinator's port accepts connections.
    """
    if process_id != 0:
        _wait_for_port(coordinator_address, timeout_s)
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


def _wait_for_port(address: str, timeout_s: float, poll_s: float = 0.005) -> None:
    """Until ``host:port`` accepts a TCP connection (or the timeout: initialize then says why)."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, int(port)), timeout=0.1):
                return
        except OSError:
            time.sleep(poll_s)


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


def _abstract_state(task, seed: int, update_scale: Optional[float]):
    def make():
        model = task.create_model(nnx.Rngs(seed))
        tx = task.create_optimizer()
        if update_scale is not None:
            # Scale policy with an lr rule: the world's factor on every update.
            tx = optax.chain(tx, optax.scale(update_scale))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    return make, nnx.split(nnx.eval_shape(make))


def local_block(arr: jax.Array) -> np.ndarray:
    """This process's part of a global array, as one numpy block.

    A process's devices sit in one row of the (replica, fsdp) mesh, so its shards of
    an fsdp-sharded array are one contiguous slab, and of a replicated array the
    whole array. This is what ``make_array_from_process_local_data`` takes back.
    """
    if arr.ndim == 0:
        return np.asarray(arr.addressable_shards[0].data)
    unique = {}
    for sh in arr.addressable_shards:
        key = tuple((sl.start or 0, dim if sl.stop is None else sl.stop) for sl, dim in zip(sh.index, arr.shape))
        unique.setdefault(key, sh)
    lo = [min(k[d][0] for k in unique) for d in range(arr.ndim)]
    hi = [max(k[d][1] for k in unique) for d in range(arr.ndim)]
    block = np.empty([h - l for l, h in zip(lo, hi)], dtype=arr.dtype)
    for key, sh in unique.items():
        block[tuple(slice(a - l, b - l) for (a, b), l in zip(key, lo))] = np.asarray(sh.data)
    return block


class TrainLoop:
    """Sharded train state and a compiled step on one world's mesh.

    Args:
        task: the user's TrainTask.
        plan: this world's layout.
        process_id: this process's place in ``plan``.
        seed: parameter initialisation seed.
        mesh: from :func:`build_mesh`.
        fsdp_min_size: see ``ElasticConfig.fsdp_min_size``.
        batches: the task's data by step (built once per process, reused across worlds).
        restore: per-leaf blocks from :meth:`snapshot` of the same host position in an
            earlier world; ``None`` initialises fresh parameters.
        scale_updates: wrap the optimizer with the plan's ``lr_scale`` (scale policy + lr rule).
        checkpointer: this world's :class:`~ray_elastic.checkpoints.Checkpointer` (None: no checkpoints).
        checkpoint_step: load this committed checkpoint (steps completed) instead of ``restore``,
            resharded onto this world's mesh.
    """

    def __init__(self, task, plan: WorldPlan, process_id: int, seed: int, mesh: Mesh, fsdp_min_size: int,
                 batches: StepBatches, restore: Optional[list] = None, scale_updates: bool = False,
                 checkpointer=None, checkpoint_step: Optional[int] = None):
        self.plan = plan
        self.mesh = mesh
        self.process_id = process_id
        self.row_range = plan.process_rows(process_id)
        self.batches = batches

        make, (graphdef, abstract) = _abstract_state(task, seed, plan.lr_scale if scale_updates else None)
        fsdp = plan.mesh_shape[FSDP_AXIS]
        self.state_shardings = jax.tree.map(
            lambda x: NamedSharding(mesh, P(*param_partition(x.shape, fsdp, fsdp_min_size))), abstract
        )
        self.sharded_params = sum(1 for sh in jax.tree.leaves(self.state_shardings) if any(sh.spec))
        self.batch_sharding = NamedSharding(mesh, P((REPLICA_AXIS, FSDP_AXIS)))
        replicated = NamedSharding(mesh, P())

        self.checkpointer = checkpointer
        self.restored_metadata: Optional[dict] = None
        if checkpoint_step is not None:
            target = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                                  abstract, self.state_shardings)
            self.state, self.restored_metadata = checkpointer.restore(checkpoint_step, target)
        elif restore is None:
            self.state = jax.jit(lambda: nnx.split(make())[1], out_shardings=self.state_shardings)()
        else:
            leaves, treedef = jax.tree.flatten(abstract)
            shardings = jax.tree.leaves(self.state_shardings)
            if len(restore) != len(leaves):
                raise ValueError(f"snapshot has {len(restore)} arrays, the model's state has {len(leaves)}")
            self.state = jax.tree.unflatten(treedef, [
                jax.make_array_from_process_local_data(sh, np.asarray(blk, dtype=a.dtype), a.shape)
                for sh, blk, a in zip(shardings, restore, leaves)
            ])

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

    def step(self, step: int) -> dict:
        """Run one training step; its loss and wall time."""
        t0 = time.perf_counter()
        self.state, loss = self._step(self.state, self.global_batch_array(step))
        value = float(np.asarray(loss.addressable_shards[0].data))
        return {"step": step, "loss": value, "step_time_s": time.perf_counter() - t0}

    def run(self, start_step: int, num_steps: int) -> list[dict]:
        """Run ``num_steps`` steps from ``start_step``; per-step loss and wall time."""
        return [self.step(s) for s in range(start_step, start_step + num_steps)]

    def save_checkpoint(self, steps_done: int, metadata: dict) -> float:
        """Start an async save of the state as checkpoint ``steps_done``; seconds the step was blocked."""
        return self.checkpointer.save(steps_done, self.state, metadata)

    def snapshot(self) -> list[np.ndarray]:
        """Host copy of this process's part of the train state (params and optimizer state)."""
        return [local_block(x) for x in jax.tree.leaves(self.state)]
