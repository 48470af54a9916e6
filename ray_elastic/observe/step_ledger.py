"""The metrics of every kept step, and their way into the event log (the controller's
:class:`~ray_elastic.control.backend.StepSink`): one ``steps`` line per chunk, the evals, the
checkpoint saves and commits the workers report with their steps, and the snapshot interval."""

from __future__ import annotations

import time
from collections.abc import Callable

from ray_elastic.decide import save_timeout
from ray_elastic.observe import event_types as ev
from ray_elastic.task import RESERVED_METRICS

STEP_FIELDS = ("loss", *RESERVED_METRICS)
# Steps are logged a chunk at a time, and at least this often: a rerun after a lost driver resumes
# from the newest logged step its keepers hold, and they keep every step after it.
LOG_EVERY_S = 0.25


def user_metrics(steps: list[dict]) -> dict[str, list]:
    """The task's own metrics of ``steps`` (what its loss or train_step returned besides the loss),
    one list per name (None where a step lacks it)."""
    names = sorted({k for m in steps for k in m if k not in STEP_FIELDS})
    return {k: [m.get(k) for m in steps] for k in names}


class StepLedger:
    """The metrics of every kept step, and their way into the event log: one ``steps`` line per
    chunk, plus the checkpoint saves and commits the workers report with their steps."""

    def __init__(self, events, steps_per_chunk: int, save_timeout_s: float | None = None):
        self.events = events
        self.steps_per_chunk = steps_per_chunk
        self.save_timeout_s = save_timeout_s  # as configured (None: automatic)
        self.metrics: dict[int, dict] = {}
        self.step_times: list[float] = []  # every step run, for the watchdog (rewound ones too)
        self._buffer: list[dict] = []
        self._buffered_at = 0.0  # when the oldest buffered step arrived (monotonic)
        self.logged_step = -1  # the newest step written to the event log (what survives this driver)
        self._generation = 0
        self._snapshot_steps: Callable[[], list[int]] = list
        self.committed_step = -1  # the newest checkpoint a process reported committed in this run
        self.save_seconds: list[float] = []  # how long each committed save took (the automatic save_timeout_s)
        self._committed: set[int] = set()
        self.evals: dict[int, dict] = {}

    def add_eval(self, item: dict) -> bool:
        """An eval's metrics (``{"step": s, "eval/...": ...}``), recorded once; with ``step`` alone,
        only whether step ``s``'s eval is known."""
        step = item["step"]
        if len(item) == 1 or step in self.evals:
            return step in self.evals
        metrics = {k: v for k, v in item.items() if k != "step"}
        self.evals[step] = metrics
        self.events.emit(ev.Eval(step=step, metrics=metrics))
        return True

    def start_world(self, generation: int, snapshot_steps: Callable[[], list[int]]) -> None:
        """Steps from now on belong to ``generation``; ``snapshot_steps()`` says which were snapshotted."""
        self._generation, self._snapshot_steps = generation, snapshot_steps

    def add(self, m: dict) -> None:
        self.metrics[m["step"]] = m
        self.step_times.append(m["step_time_s"])
        if "checkpoint_step" in m:
            self.events.emit(ev.CheckpointSave(step=m["checkpoint_step"], blocking_s=m["checkpoint_blocking_s"]))
        self.saves_committed(m.get("checkpoints_committed", []))
        if m.get("skipped"):
            self.events.emit(ev.StepSkipped(step=m["step"], why=m["skipped"], loss=m["loss"]))
        if not self._buffer:
            self._buffered_at = time.monotonic()
        self._buffer.append(m)
        if len(self._buffer) >= self.steps_per_chunk or time.monotonic() - self._buffered_at >= LOG_EVERY_S:
            self.flush()
        self.events.step(m)

    def flush(self) -> None:
        """Buffered steps into the event log, one line (a rewound step appears again later)."""
        buf, self._buffer = self._buffer, []
        if buf:
            self.logged_step = max(self.logged_step, max(m["step"] for m in buf))
            self.events.emit(
                ev.Steps(
                    generation=self._generation,
                    steps=[m["step"] for m in buf],
                    losses=[m["loss"] for m in buf],
                    step_time_s=[m["step_time_s"] for m in buf],
                    finished_at=[m.get("finished_at") for m in buf],
                    snapshot_steps=self._snapshot_steps(),
                    metrics=user_metrics(buf),
                    skipped=[m["step"] for m in buf if m.get("skipped")],
                )
            )

    def saves_committed(self, finished: list) -> None:
        """Checkpoints a process reported committed: once each (every holder reports its own)."""
        for step, total_s in finished:
            if step in self._committed:
                continue
            self._committed.add(step)
            self.committed_step = max(self.committed_step, step)
            if total_s is not None:
                self.save_seconds.append(total_s)
            self.events.emit(ev.CheckpointCommitted(step=step, total_s=total_s))

    def set_aside(self, after: int) -> None:
        """The run's checkpoints newer than ``after`` were set aside: they no longer count as
        committed (the run's last one is saved again, not taken as done)."""
        self._committed = {s for s in self._committed if s <= after}
        self.committed_step = min(self.committed_step, after)

    def snapshot_interval(self, step: int, every: int) -> None:
        """The snapshot interval from ``step`` on (the snapshot policy picks it as the run goes)."""
        self.events.emit(ev.SnapshotInterval(step=step, every=every, max_rewind_steps=max(0, every - 1)))

    def save_limit_s(self) -> float:
        """How long a save may run before it counts as failed: ``save_timeout_s``, or the automatic
        bound from the saves committed so far (the step loop's watchdog and the commit waits)."""
        return save_timeout(self.save_timeout_s, self.save_seconds)

    @property
    def last_step(self) -> int:
        return max(self.metrics) if self.metrics else -1

    def rewind_to(self, step: int) -> int:
        """Forget steps after ``step`` (the next world recomputes them); returns how many."""
        later = [s for s in self.metrics if s > step]
        for s in later:
            del self.metrics[s]
        return len(later)
