"""The slice actor: one Ray actor per slice host, a thin shell around ``jax_world``.

It owns one JAX process for the lifetime of one world generation. It can be
started ahead of need (a *standby*: Python, JAX and the task's data already
loaded) and promoted when the next generation forms. The controller never sends
it per-step work: it asks for chunks of steps, streamed back step by step, with
the state snapshots of snapshot-keeping slices in between.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Optional

import ray

from ray_elastic.errors import SliceDownError
from ray_elastic.plan import WorldPlan, is_snapshot_step


@ray.remote(max_restarts=0, max_task_retries=0, concurrency_groups={"health": 1})
class SliceWorker:
    """One process of the JAX world, pinned to one host of one slice.

    Args:
        task: the user's TrainTask.
        seed: initialisation and data-order seed.
        data_stride: examples per step in the data order (the full-size global batch).
        cache_dir: JAX persistent compilation cache.
        fsdp_min_size: see ``ElasticConfig.fsdp_min_size``.
        snapshot_every: steps between snapshots (on snapshot-keeping slices).
        scale_updates: the optimizer carries the world's lr scale (scale policy + lr rule).
    """

    def __init__(self, task, seed: int, data_stride: int, cache_dir: Optional[str], fsdp_min_size: int,
                 snapshot_every: int, scale_updates: bool):
        self.task = task
        self.seed = seed
        self.data_stride = data_stride
        self.cache_dir = cache_dir
        self.fsdp_min_size = fsdp_min_size
        self.snapshot_every = snapshot_every
        self.scale_updates = scale_updates
        self.plan: Optional[WorldPlan] = None
        self.process_id: Optional[int] = None
        self.loop = None
        self.batches = None
        self.last_step = -1

    def prepare(self) -> dict:
        """Everything that does not need the world: import JAX, load the task's data."""
        t0 = time.perf_counter()
        from ray_elastic import jax_world
        from ray_elastic.data import StepBatches

        jax_world.enable_compilation_cache(self.cache_dir)
        self.batches = StepBatches(self.task.dataset(), self.data_stride, self.seed)
        return self.host_info() | {"prepare_s": time.perf_counter() - t0}

    def host_info(self) -> dict:
        """Where this process really runs (for placement checks and event logs)."""
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "slice_name": os.environ.get("TPU_NAME", ""),
            "tpu_worker_id": os.environ.get("TPU_WORKER_ID", ""),
            "pid": os.getpid(),
            "ip": ray.util.get_node_ip_address(),
        }

    @ray.method(concurrency_group="health")
    def probe(self) -> dict:
        """Answered on its own thread even while a step is blocked in a collective."""
        return {"pid": os.getpid(), "last_step": self.last_step}

    def reserve_coordinator_port(self) -> str:
        """Process 0 hosts the JAX coordination service: pick a free port on its host."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def join_world(self, plan: WorldPlan, slice_index: int, host_index: int, coordinator_address: str,
                   timeout_s: float, restore: Optional[list] = None) -> dict:
        """``jax.distributed.initialize``, mesh, and the state: fresh, or loaded from a snapshot.

        ``restore`` is ``[ref]`` of a snapshot from the same host position of an earlier
        world (wrapped in a list so Ray hands over the ref, and the load is timed here).
        """
        from ray_elastic import jax_world as jw

        if self.batches is None:
            self.prepare()
        self.plan = plan
        self.process_id = plan.process_id(slice_index, host_index)
        t0 = time.perf_counter()
        jw.initialize(coordinator_address, plan, self.process_id, timeout_s)
        t_init = time.perf_counter() - t0
        blocks, t_fetch = None, 0.0
        if restore is not None:
            t1 = time.perf_counter()
            snap = ray.get(restore[0])
            blocks = snap["leaves"]
            self.last_step = snap["step"]
            t_fetch = time.perf_counter() - t1
        t2 = time.perf_counter()
        mesh = jw.build_mesh(plan)
        self.loop = jw.TrainLoop(self.task, plan, self.process_id, self.seed, mesh, self.fsdp_min_size,
                                 self.batches, restore=blocks, scale_updates=self.scale_updates)
        return {
            "init_s": t_init,
            "snapshot_fetch_s": t_fetch,
            "state_s": time.perf_counter() - t2,
            "mesh_shape": dict(mesh.shape),
            "local_devices": len(mesh.local_devices),
            "row_range": self.loop.row_range,
            "sharded_params": self.loop.sharded_params,
        }

    def compile(self, step: int) -> float:
        return self.loop.compile(step)

    @ray.method(num_returns="streaming")
    def run_chunk(self, start_step: int, num_steps: int):
        """Run steps ``start_step ..``; stream what the controller needs.

        Snapshot-keeping processes yield, for every step: the snapshot (when due) and
        then the step's metrics. The others yield the chunk's metrics once at the end.
        """
        import jax

        streams = self.plan.takes_snapshots(self.process_id)
        done = []
        for step in range(start_step, start_step + num_steps):
            try:
                metrics = self.loop.step(step)
            except jax.errors.JaxRuntimeError as e:
                from pathwaysutils.elastic.elastic import is_error_due_to_slice_down

                if is_error_due_to_slice_down(e, log_traceback=False):
                    raise SliceDownError(str(e)) from e
                raise
            self.last_step = step
            if streams:
                if is_snapshot_step(step, self.snapshot_every):
                    yield {"step": step, "leaves": self.loop.snapshot()}
                yield metrics
            else:
                done.append(metrics)
        if not streams:
            yield done
