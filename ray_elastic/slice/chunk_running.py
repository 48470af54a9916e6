"""Running chunks of steps in a formed world: the part of the slice actor the step loop calls.

A base of :class:`~ray_elastic.slice.worker.SliceWorker` (whose ``join_world`` sets up what these
methods use: the world's step loop, its plan, the snapshot writer and the step reports). Apart so
each half reads alone: joining a world there, its steps, snapshots, evals and saves here.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import ray

from ray_elastic.decide import WorldPlan, is_checkpoint_step, is_eval_step, is_snapshot_step
from ray_elastic.slice.process import world_errors
from ray_elastic.slice.settings import SliceSettings
from ray_elastic.slice.stack import StepThread
from ray_elastic.slice.step_reports import StepReports
from ray_elastic.slice.stop_gate import StopGate
from ray_elastic.state.checkpoints import checkpoint_metadata
from ray_elastic.state.snapshot_writer import SnapshotWriter

IN_FLIGHT = 1  # steps dispatched beyond the one whose loss is being read
FLUSH_S = 0.2  # a snapshot-keeping process streams its finished steps at most this often (and at chunk ends)


class ChunkRunning:
    """Steps, snapshots, evals and checkpoint saves of one process in a formed world."""

    task: Any
    settings: SliceSettings
    plan: WorldPlan | None
    process_id: int | None
    loop: Any
    batches: Any
    writer: SnapshotWriter | None
    reports: StepReports
    last_step: int
    saving_since: float | None
    evaluating: bool
    _snapshots: Any
    _snapshot_step: int
    _compiled_ahead: bool
    gate: StopGate
    stepping: StepThread

    @ray.method(num_returns="streaming")
    def run_chunk(
        self,
        start_step: int,
        num_steps: int,
        final_step: int,
        snapshot_every: int | None = None,
        eval_before: bool = False,
    ):
        """Run steps ``start_step ..``; stream what the controller needs.

        One step stays in flight across chunks; the run's last step and a chunk of no steps (the
        controller's way to stop at a step boundary) finish every step; a stop the processes agreed on
        (:class:`~ray_elastic.slice.stop_gate.StopGate`) ends this and every later chunk before its step. Snapshot-keeping processes
        take a snapshot after every ``snapshot_every``-th step and stream their finished steps'
        metrics at most every ``FLUSH_S`` and at the chunk's end: a list of step metrics, the
        last item carrying the steps kept. A step is streamed only once its snapshot is kept, so
        the controller never knows of a step that no snapshot covers when one was due. The others
        stream their finished steps once, at the end. Checkpoints are started after every
        ``checkpoint_every`` steps and after ``final_step``, by every process (each writes its
        own shards). Before a checkpoint is saved, the steps in flight are finished: a step whose
        loss is not finite stops the run before its state is saved. After every ``eval_every``-th
        step (and ``final_step``) the steps are finished and streamed, then the eval runs and its
        metrics are streamed as ``{"eval": {...}}``: a failure during the eval rewinds no step
        (``eval_before`` redoes the eval of ``start_step - 1`` first, when a failure lost it).
        """
        c = self.settings
        self.stepping.enter()  # a stuck process is named with where this thread is
        every = snapshot_every if snapshot_every is not None else c.snapshot_every
        streams = self.plan.takes_snapshots(self.process_id)
        end = start_step + num_steps
        flush_at = time.monotonic()  # the first finished step goes out at once: progress is seen early
        if eval_before:
            yield from self._evaluate(start_step - 1, streams, every)
        for step in range(start_step, end):
            if self.gate.stops_before(step):  # the world stops here: the chunks queued beyond run nothing
                break
            self._step(step, final_step, every)
            if c.eval_every and is_eval_step(step, c.eval_every, final_step):
                yield from self._evaluate(step, streams, every)
            if streams and time.monotonic() >= flush_at:
                flush_at = time.monotonic() + FLUSH_S
                item = self.reports.take(self.writer)
                if item:
                    yield item
        if num_steps == 0 or end - 1 >= final_step:
            self._finish_all(end - 1, final_step, planned_stop=num_steps == 0 and start_step <= final_step)
        if num_steps and not self._compiled_ahead:
            self._compile_ahead()
        yield self.reports.take(self.writer)

    def _step(self, step: int, final_step: int, every: int) -> None:
        """Dispatch ``step``; after it, a checkpoint or a snapshot when due; keep ``IN_FLIGHT`` steps in flight."""
        c = self.settings
        with world_errors(f"step {step}"):
            self.loop.dispatch(step)
            if c.checkpoint_dir and is_checkpoint_step(step, c.checkpoint_every, final_step):
                while self.loop.in_flight():  # a non-finite loss stops the run before the save
                    self._finish_one()
                with self._saving():
                    metadata = checkpoint_metadata(self.task.name(), self.plan, c.seed, c.batch_policy, step + 1)
                    blocking = self.loop.save_checkpoint(step + 1, metadata)
                # The step has finished (above): its metrics, not yet streamed, carry the save.
                self.reports.last.update(checkpoint_step=step + 1, checkpoint_blocking_s=blocking)
            if self.writer is not None and is_snapshot_step(step, every):
                self._snapshot(step)
            while self.loop.in_flight() > IN_FLIGHT:
                self._finish_one()

    def _finish_all(self, step: int, final_step: int, planned_stop: bool) -> None:
        """Finish every step in flight and let the writer hand over what it holds. At a planned stop
        (the world grows at this boundary) the newest step is snapshotted too: the bigger world
        starts from this very step, not from the interval's last snapshot."""
        with world_errors(f"step {step}"):
            while self.loop.in_flight():
                self._finish_one()
            if planned_stop and self.writer is not None and self.last_step > self._snapshot_step:
                self._snapshot(self.last_step)
            if planned_stop or step >= final_step:  # the replicas are compared at the boundary (before the
                # next world restores one) and at the run's end (before its last checkpoint is trusted)
                self.loop.fingerprints.dispatched(self.last_step, self.loop.state, now=True)
                self.loop.fingerprints.finished(self.last_step)
            if self.writer is not None:
                self.writer.wait()

    def _evaluate(self, step: int, streams: bool, every: int):
        """Finish and stream the steps up to ``step`` (kept, when snapshots are due), then evaluate the
        state after ``step``; streaming processes yield ``{"eval": {"step": step, "eval/...": ...}}``."""
        with world_errors(f"step {step}"):
            while self.loop.in_flight():
                self._finish_one()
        if self.writer is not None:
            if every and self.last_step > self._snapshot_step and self.last_step == step:
                self._snapshot(step)  # the state the eval sees is kept before the eval can fail
            self.writer.wait()
        if streams:
            item = self.reports.take(self.writer)
            if item:
                yield item
        self.evaluating = True
        with world_errors(f"evaluating after step {step}"):
            metrics = self.loop.evaluate(self.settings.eval_steps)
        self.evaluating = False  # a failed eval ends the process's world: nothing reads it after
        if streams:
            yield {"steps": [], "kept": [], "snapshot_s": [], "eval": {"step": step, **metrics}}

    def _compile_ahead(self) -> None:
        """After this world's first chunk, process 0 compiles the step of the next smaller world
        the run may form into the persistent cache, and every process its speed check's program,
        in the background (once per world)."""
        from ray_elastic.slice.jax_world import compile_smaller_in_background

        self._compiled_ahead = True
        self.loop.speed.prepare_in_background()
        if self.process_id == 0:
            compile_smaller_in_background(self.task, self.settings, self.plan, self.batches)

    def _snapshot(self, step: int) -> None:
        """Hand the state after ``step`` (the newest dispatched) to the writer."""
        self._snapshots.submit(self.loop, step)
        self._snapshot_step = step

    def run_chunk_quiet(
        self,
        start_step: int,
        num_steps: int,
        final_step: int,
        snapshot_every: int | None = None,
        eval_before: bool = False,
    ) -> None:
        """:meth:`run_chunk` for a process that streams nothing (it keeps no snapshot): the driver
        reads one result, or the error, per chunk, with the other processes' in one batch."""
        for _ in self.run_chunk(start_step, num_steps, final_step, snapshot_every, eval_before):
            pass

    def _finish_one(self) -> None:
        metrics = self.loop.finish()
        if self.loop.checkpointer is not None:
            finished = self.loop.checkpointer.finished_saves()
            if finished:
                metrics["checkpoints_committed"] = finished
        self.last_step = metrics["step"]
        self.reports.finished(metrics)

    @contextlib.contextmanager
    def _saving(self):
        """Inside a checkpoint save or commit: the health probe says so, and the watchdog waits."""
        self.saving_since = time.monotonic()
        try:
            yield
        finally:
            self.saving_since = None

    def finish_checkpoints(self, save_step: int | None = None) -> list:
        """Wait until the in-flight save is committed (before a planned teardown or the end); with
        ``save_step``, save the current state as that checkpoint first (the run's last one, when the
        world that was saving it failed). The (step, total seconds) of saves that finished since they
        were last reported."""
        if self.loop is None or self.loop.checkpointer is None:
            return []
        with self._saving():
            if save_step is not None:
                self.loop.save_checkpoint(
                    save_step,
                    checkpoint_metadata(
                        self.task.name(), self.plan, self.settings.seed, self.settings.batch_policy, save_step
                    ),
                )
            self.loop.checkpointer.wait()
        return self.loop.checkpointer.finished_saves()
