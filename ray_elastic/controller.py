"""The single controller: a Ray driver that reserves slices, forms worlds, drives steps.

``ElasticTrainer(task, config).fit(num_steps)`` is the whole API. The controller
moves through explicit :class:`~ray_elastic.states.ControllerState` states; the
decisions it takes (world layout, batch rows, chunking) come from ``plan.py``;
the Ray effects live in ``placement.py`` and ``world.py``; JAX runs only inside
the slice actors.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Optional

import ray

from ray_elastic.config import ElasticConfig
from ray_elastic.placement import SliceReservation, reserve_slices
from ray_elastic.plan import chunks
from ray_elastic.states import ControllerState, check_transition
from ray_elastic.task import TrainTask
from ray_elastic.world import World

logger = logging.getLogger(__name__)

# Chunks in flight per worker: the next chunk is queued before the current one
# ends, so workers never wait for a driver round trip between chunks.
CHUNKS_IN_FLIGHT = 2


class ElasticRuntimeError(RuntimeError):
    """Training could not go on; the message says why and what was tried."""


@dataclasses.dataclass
class FitResult:
    """What ``fit`` returns: per-step metrics and a summary of the run."""

    steps: list[int]
    losses: list[float]
    step_times_s: list[float]
    summary: dict

    def __repr__(self) -> str:
        return f"FitResult(steps={len(self.steps)}, final_loss={self.losses[-1] if self.losses else None}, summary={self.summary})"


class ElasticTrainer:
    """Train ``task`` on ``config.num_slices`` TPU slices of a Ray cluster.

    Args:
        task: model, optimizer, loss and data (runs inside the slice actors).
        config: slices, batch and elastic settings; validated here, before Ray is touched.
        address: Ray cluster to connect to when this process is not connected yet
            (``None``: ``RAY_ADDRESS`` or a local cluster, as ``ray.init`` decides).
        progress: show a tqdm progress bar (terminal or notebook).
        on_chunk: called with each chunk's per-step metrics as they arrive.
    """

    def __init__(
        self,
        task: TrainTask,
        config: ElasticConfig,
        *,
        address: Optional[str] = None,
        progress: bool = True,
        on_chunk: Optional[Callable[[list[dict]], None]] = None,
    ):
        if not isinstance(task, TrainTask):
            raise ValueError(f"task must be a ray_elastic.TrainTask, got {type(task).__name__}")
        if not isinstance(config, ElasticConfig):
            raise ValueError(f"config must be a ray_elastic.ElasticConfig, got {type(config).__name__}")
        self.task = task
        self.config = config
        self.address = address
        self.progress = progress
        self.on_chunk = on_chunk
        self.state = ControllerState.INITIALIZING
        self.state_history: list[tuple[str, float]] = [(self.state.value, time.time())]
        self.world: Optional[World] = None
        self._reservations: list[SliceReservation] = []

    # ------------------------------------------------------------------ states
    def _enter(self, new: ControllerState) -> None:
        check_transition(self.state, new)
        logger.info("controller: %s -> %s", self.state.value, new.value)
        self.state = new
        self.state_history.append((new.value, time.time()))

    # --------------------------------------------------------------------- fit
    def fit(self, num_steps: int) -> FitResult:
        """Train steps ``0 .. num_steps-1``; returns per-step losses and a summary."""
        if not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps must be a positive integer, got {num_steps!r}")
        t_start = time.perf_counter()
        if not ray.is_initialized():
            ray.init(address=self.address, namespace="ray_elastic", log_to_driver=True)
        bar = None
        steps, losses, times = [], [], []
        try:
            self._enter(ControllerState.SCHEDULING)
            task_ref = ray.put(self.task)
            self._reservations = reserve_slices(self.config.slice, self.config.num_slices, self.config.slice_timeout_s)

            self._enter(ControllerState.FORMING_WORLD)
            self.world = World.form(0, self._reservations, task_ref, self.config, start_step=0)
            startup_s = time.perf_counter() - t_start

            self._enter(ControllerState.RUNNING)
            bar = self._progress_bar(num_steps)
            t_run = time.perf_counter()
            for metrics in self._drive(chunks(0, num_steps, self.config.steps_per_chunk)):
                for m in metrics:
                    steps.append(m["step"])
                    losses.append(m["loss"])
                    times.append(m["step_time_s"])
                if self.on_chunk is not None:
                    self.on_chunk(metrics)
                if bar is not None:
                    bar.update(len(metrics))
                    bar.set_postfix(loss=f"{metrics[-1]['loss']:.4f}", slices=self.world.plan.num_slices, state=self.state.value)
            run_s = time.perf_counter() - t_run
            self._enter(ControllerState.FINISHED)
        except BaseException as e:
            self._enter(ControllerState.ERRORED)
            if isinstance(e, (ValueError, KeyboardInterrupt)):
                raise
            raise ElasticRuntimeError(f"training stopped in state {self.state_history[-2][0]}: {e}") from e
        finally:
            if bar is not None:
                bar.close()
            self._release()

        plan = self.world.plan
        steady = sorted(times[1:]) or times
        summary = {
            "steps": len(steps),
            "slices": plan.num_slices,
            "hosts_per_slice": plan.hosts_per_slice,
            "mesh": plan.mesh_shape,
            "global_batch_size": plan.global_batch_size,
            "first_loss": losses[0],
            "final_loss": losses[-1],
            "startup_s": round(startup_s, 3),
            "world_formation_s": round(self.world.times.total_s, 3),
            "compile_s": round(self.world.times.compile_s, 3),
            "train_s": round(run_s, 3),
            "median_step_s": steady[len(steady) // 2],
            "wall_s": round(time.perf_counter() - t_start, 3),
        }
        return FitResult(steps=steps, losses=losses, step_times_s=times, summary=summary)

    def _drive(self, plan_chunks: list[tuple[int, int]]):
        """Keep ``CHUNKS_IN_FLIGHT`` chunks queued on every worker; yield process 0's metrics in order."""
        in_flight: list[list[ray.ObjectRef]] = []
        todo = list(plan_chunks)
        while todo or in_flight:
            while todo and len(in_flight) < CHUNKS_IN_FLIGHT:
                start, n = todo.pop(0)
                in_flight.append(self.world.run_chunk(start, n))
            refs = in_flight.pop(0)
            results = self._wait_all(refs)
            yield results[0]

    @staticmethod
    def _wait_all(refs: list[ray.ObjectRef]) -> list:
        """Wait for every ref, but surface the first failure at once (survivors may hang)."""
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            ray.get(done)  # raises the worker's error immediately
        return ray.get(refs)

    def _progress_bar(self, total: int):
        if not self.progress:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=total, desc="ray-elastic", unit="step", dynamic_ncols=True)

    def _release(self) -> None:
        if self.world is not None:
            self.world.teardown()
        for r in self._reservations:
            try:
                r.release()
            except Exception as e:
                logger.debug("release reservation: %s", e)
        self._reservations = []
