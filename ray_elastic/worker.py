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
from ray_elastic.plan import WorldPlan, is_checkpoint_step, is_snapshot_step


@ray.remote(max_restarts=0, max_task_retries=0, concurrency_groups={"health": 1})
class SliceWorker:
    """One process of the JAX world, pinned to one host of one slice.

    Args:
        task: the user's TrainTask.
        config: the run's ElasticConfig (seed, data order, cache, snapshots, checkpoints).
    """

    def __init__(self, task, config):
        self.task = task
        self.config = config
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

        jax_world.enable_compilation_cache(self.config.compilation_cache_dir)
        self.batches = StepBatches(self.task.dataset(), self.config.global_batch_size, self.config.seed)
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

    def join_world(self, plan: WorldPlan, *, slice_index: int, host_index: int, coordinator_address: str,
                   timeout_s: float, snapshot: Optional[list] = None, checkpoint_step: Optional[int] = None) -> dict:
        """``jax.distributed.initialize``, mesh, and the state: fresh, from a snapshot or from a checkpoint.

        ``snapshot`` is ``[ref]`` of a snapshot from the same host position of an earlier
        world (wrapped in a list so Ray hands over the ref, and the load is timed here).
        ``checkpoint_step`` names a committed Orbax checkpoint (steps completed) to load.
        """
        from ray_elastic import jax_world as jw

        c = self.config
        if self.batches is None:
            self.prepare()
        self.plan = plan
        self.process_id = plan.process_id(slice_index, host_index)
        t0 = time.perf_counter()
        jw.initialize(coordinator_address, plan, self.process_id, timeout_s)
        t_init = time.perf_counter() - t0
        checkpointer = None
        if c.checkpoint_dir:
            from ray_elastic.checkpoints import Checkpointer

            checkpointer = Checkpointer(c.checkpoint_dir, c.max_to_keep, c.async_checkpointing)
        blocks, t_fetch = None, 0.0
        if snapshot is not None:
            t1 = time.perf_counter()
            snap = ray.get(snapshot[0])
            blocks = snap["leaves"]
            self.last_step = snap["step"]
            t_fetch = time.perf_counter() - t1
        t2 = time.perf_counter()
        mesh = jw.build_mesh(plan)
        self.loop = jw.TrainLoop(self.task, plan, self.process_id, c.seed, mesh, c.fsdp_min_size, self.batches,
                                 restore=blocks, scale_updates=c.lr_rule is not None,
                                 checkpointer=checkpointer, checkpoint_step=checkpoint_step)
        if checkpoint_step is not None:
            self.last_step = checkpoint_step - 1
        return {
            "init_s": t_init,
            "snapshot_fetch_s": t_fetch,
            "state_s": time.perf_counter() - t2,
            "checkpoint_metadata": self.loop.restored_metadata,
            "mesh_shape": dict(mesh.shape),
            "local_devices": len(mesh.local_devices),
            "row_range": self.loop.row_range,
            "sharded_params": self.loop.sharded_params,
        }

    def compile(self, step: int) -> float:
        return self.loop.compile(step)

    @ray.method(num_returns="streaming")
    def run_chunk(self, start_step: int, num_steps: int, final_step: int):
        """Run steps ``start_step ..``; stream what the controller needs.

        Snapshot-keeping processes yield, for every step: the snapshot (when due) and
        then the step's metrics. The others yield the chunk's metrics once at the end.
        Checkpoints are started after every ``checkpoint_every`` steps and after
        ``final_step``, by every process (each writes its own shards).
        """
        import jax

        c = self.config
        streams = self.plan.takes_snapshots(self.process_id)
        done = []
        for step in range(start_step, start_step + num_steps):
            try:
                metrics = self.loop.step(step)
                if c.checkpoint_dir and is_checkpoint_step(step, c.checkpoint_every, final_step):
                    metrics["checkpoint_step"] = step + 1
                    metrics["checkpoint_blocking_s"] = self.loop.save_checkpoint(step + 1, self._metadata(step + 1))
            except jax.errors.JaxRuntimeError as e:
                from pathwaysutils.elastic.elastic import is_error_due_to_slice_down

                if is_error_due_to_slice_down(e, log_traceback=False):
                    raise SliceDownError(str(e)) from e
                raise
            if self.loop.checkpointer is not None:
                finished = self.loop.checkpointer.finished_saves()
                if finished:
                    metrics["checkpoints_committed"] = finished
            self.last_step = step
            if streams:
                if is_snapshot_step(step, c.snapshot_every):
                    yield {"step": step, "leaves": self.loop.snapshot()}
                yield metrics
            else:
                done.append(metrics)
        if not streams:
            yield done

    def _metadata(self, steps_done: int) -> dict:
        """Saved with every checkpoint: where the data stands and the shape of the world that wrote it."""
        p, c = self.plan, self.config
        return {
            "step": steps_done,
            "data_position": steps_done * p.stride,
            "data_stride": p.stride,
            "seed": c.seed,
            "world": {"generation": p.generation, "slices": list(p.slice_names), "num_slices": p.num_slices,
                      "hosts_per_slice": p.hosts_per_slice, "mesh": p.mesh_shape,
                      "global_batch_size": p.global_batch_size, "batch_policy": c.batch_policy,
                      "lr_scale": p.lr_scale},
            "saved_at": time.time(),
        }

    def finish_checkpoints(self) -> list:
        """Wait until the in-flight save is committed (before a planned teardown or the end);
        the (step, total seconds) of saves that finished since they were last reported."""
        if self.loop is None or self.loop.checkpointer is None:
            return []
        self.loop.checkpointer.wait()
        return self.loop.checkpointer.finished_saves()
