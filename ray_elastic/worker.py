"""The slice actor: one Ray actor per slice host, a thin shell around ``jax_world``.

It owns one JAX process for the lifetime of one world generation. The
controller never sends it per-step work: it asks for chunks of steps and gets
per-step metrics back.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Optional

import ray

from ray_elastic.plan import WorldPlan


@ray.remote(max_restarts=0, max_task_retries=0)
class SliceWorker:
    """One process of the JAX world, pinned to one host of one slice."""

    def __init__(self, task, seed: int, cache_dir: Optional[str], fsdp_min_size: int):
        self.task = task
        self.seed = seed
        self.fsdp_min_size = fsdp_min_size
        self.plan: Optional[WorldPlan] = None
        self.process_id: Optional[int] = None
        self.loop = None
        from ray_elastic import jax_world  # JAX is imported inside the actor process only

        self._jax_world = jax_world
        jax_world.enable_compilation_cache(cache_dir)

    def host_info(self) -> dict:
        """Where this process really runs (for placement checks and event logs)."""
        ctx = ray.get_runtime_context()
        return {
            "node_id": ctx.get_node_id(),
            "slice_name": os.environ.get("TPU_NAME", ""),
            "tpu_worker_id": os.environ.get("TPU_WORKER_ID", ""),
            "pid": os.getpid(),
            "ip": ray.util.get_node_ip_address(),
        }

    def reserve_coordinator_port(self) -> str:
        """Process 0 hosts the JAX coordination service: pick a free port on its host."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def join_world(self, plan: WorldPlan, slice_index: int, host_index: int, coordinator_address: str, timeout_s: float) -> dict:
        """``jax.distributed.initialize``, mesh and sharded state for process (slice, host) of ``plan``."""
        self.plan = plan
        self.process_id = plan.process_id(slice_index, host_index)
        t0 = time.perf_counter()
        jw = self._jax_world
        jw.initialize(coordinator_address, self.plan, self.process_id, timeout_s)
        t_init = time.perf_counter() - t0
        mesh = jw.build_mesh(self.plan)
        self.loop = jw.TrainLoop(self.task, self.plan, self.process_id, self.seed, mesh, self.fsdp_min_size)
        t_state = time.perf_counter() - t0 - t_init
        return {
            "init_s": t_init,
            "state_s": t_state,
            "mesh_shape": dict(mesh.shape),
            "local_devices": len(mesh.local_devices),
            "row_range": self.loop.row_range,
            "sharded_params": self.loop.sharded_params,
        }

    def compile(self, step: int) -> float:
        return self.loop.compile(step)

    def run_chunk(self, start_step: int, num_steps: int) -> list[dict]:
        return self.loop.run(start_step, num_steps)
