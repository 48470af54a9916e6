"""How often a world snapshots: the run's :class:`~ray_elastic.policy.snapshots.SnapshotPolicy`
asked at every chunk with what snapshots have cost: their cost to their process, and their cost
read from the step times at the current interval (:func:`~ray_elastic.decide.snapshot_cost_in_steps`).
"""

from __future__ import annotations

from collections.abc import Callable

from ray_elastic.config import ElasticConfig
from ray_elastic.decide import MAX_SNAPSHOT_EVERY, newest_due_snapshot, snapshot_cost_in_steps
from ray_elastic.policy.snapshots import SnapshotCosts

STEP_COST_WINDOW = 10  # snapshot intervals of step times a snapshot's cost is read from


class SnapshotCadence:
    """The snapshot interval of one world, and the step times and snapshot costs it is chosen from.

    ``on_interval(step, every)`` is told when the interval changes."""

    def __init__(
        self,
        config: ElasticConfig,
        step_times: list[float],
        on_interval: Callable[[int, int], None] | None = None,
    ):
        self.policy = config.snapshot_policy
        self.step_times = step_times  # the run's, every step run
        self.on_interval = on_interval
        self.snapshot_seconds: list[float] = []  # what each snapshot cost its process (host copy + hand-over)
        self.intervals: list[tuple[int, int]] = []  # (first step, snapshot interval) per change
        self._timed: list[tuple[int, float]] = []  # (step, seconds) of this world's steps, first run only
        self._step_cost: float | None = None  # a snapshot's cost read from the step times

    def step_done(self, step: int, seconds: float) -> None:
        """A step finished for the first time in this world."""
        self._timed.append((step, seconds))
        if len(self._timed) > 2 * STEP_COST_WINDOW * MAX_SNAPSHOT_EVERY:  # more than any window reads
            del self._timed[: STEP_COST_WINDOW * MAX_SNAPSHOT_EVERY]

    def interval_from(self, step: int) -> int:
        """The interval for the chunk that starts at ``step``: the run's snapshot policy asked with
        what snapshots have cost so far."""
        current = self.intervals[-1][1] if self.intervals else 1
        if self.intervals and current:  # what the snapshots cost the steps run at the current interval
            since = self.intervals[-1][0]
            timed = [t for t in self._timed[-STEP_COST_WINDOW * current :] if t[0] >= since]
            measured = snapshot_cost_in_steps(timed, current)
            self._step_cost = self._step_cost if measured is None else measured  # held across a change
        every = self.policy.interval(
            SnapshotCosts(tuple(self.snapshot_seconds[-20:]), tuple(self.step_times[-20:]), current, self._step_cost)
        )
        if not self.intervals or self.intervals[-1][1] != every:
            self.intervals.append((step, every))
            if self.on_interval is not None:
                self.on_interval(step, every)
        return every

    def newest_due(self, reported: int) -> int:
        """The newest step up to ``reported`` whose snapshot was due (-1: none)."""
        return newest_due_snapshot(reported, self.intervals)
