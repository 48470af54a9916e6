"""What a snapshot-keeping process streams: its finished steps, each only once its snapshot (when
one was due) is kept, and the steps its keeper now holds."""

from __future__ import annotations

import time


class StepReports:
    """Finished steps' metrics and kept snapshots of one process, until streamed."""

    def __init__(self):
        self._finished: list[dict] = []  # metrics of finished steps not yet streamed
        self._reported = -1  # the newest step streamed
        self._kept_early: list[int] = []  # steps kept whose metrics are not streamed yet

    def finished(self, metrics: dict) -> None:
        metrics["finished_at"] = time.time()  # streamed later: benchmarks time steps by this, not by arrival
        self._finished.append(metrics)

    @property
    def streamed(self) -> int:
        """The newest step streamed to the driver (-1: none)."""
        return self._reported

    @property
    def last(self) -> dict:
        """The newest finished step's metrics (not yet streamed)."""
        return self._finished[-1]

    def take(self, writer: object | None) -> dict:
        """Finished steps to stream (those before the step whose snapshot ``writer`` is still
        writing), and the steps kept since the last report with the seconds each snapshot cost."""
        pending = writer.pending() if writer is not None else None
        kept, seconds, not_kept = writer.take_kept() if writer is not None else ([], [], [])
        cut = len(self._finished) if pending is None else sum(m["step"] < pending for m in self._finished)
        ready, self._finished = self._finished[:cut], self._finished[cut:]
        if ready:
            self._reported = ready[-1]["step"]
        # A step is named kept only once its metrics are streamed too (its loss may be read later).
        kept = self._kept_early + kept
        self._kept_early = [k for k in kept if k > self._reported]
        kept = [k for k in kept if k <= self._reported]
        item: dict = {"steps": ready, "kept": kept, "snapshot_s": seconds}
        if not_kept:
            item["not_kept"] = not_kept
        return item if ready or kept or seconds or not_kept else {}
