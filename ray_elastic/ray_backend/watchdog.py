"""The step loop's watchdog: a world whose steps stopped is probed; a stuck process is named early.

Two bounds, both from the run's step times (:func:`~ray_elastic.decide.watchdog_timeout`):

- the hang bound (``failure.hang_timeout_factor`` x the median step, at least
  ``hang_timeout_min_s``): every process is probed; a save past its bound is a failed save,
  silence with nothing busy a hang, a slow but busy world is watched again;
- the stuck bound (``STUCK_FACTOR`` x the median step, at least ``STUCK_MIN_S``: a few steps on a
  fast step, not the hang bound's floor): every process is probed, and one that is behind the step
  the others wait in, at the same step two probes in a row, is stuck (its data source blocked,
  say): named, and its slice alone blamed. A save, an eval or a speed check (a process timing its
  devices on the driver's request, slowly on a starved host) is never this (the probe says so),
  nor a world's first step: until one of its steps is back, processes still compiling (a slow
  host compiles slowly) are behind the others, so only the hang bound judges it. While a process
  compiles ahead beside its steps, only a process waiting for its own rows is.

Until a world's first step is back, the hang bound is longer by the time the world took to form:
a first step runs its programs for the first time (buffers allocated, the collectives' peers
connected), as slowly as the machine is loaded (a node being killed, a standby starting beside
it): past a bound of a few fast steps, a whole world that was only slow would be restarted.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from ray_elastic.config import ElasticConfig
from ray_elastic.control.backend import StepSink
from ray_elastic.control.states import OutcomeKind, RunOutcome
from ray_elastic.decide import watchdog_timeout
from ray_elastic.detect import health
from ray_elastic.errors import SaveTimedOut, StuckProcess

STUCK_FACTOR, STUCK_MIN_S = 5.0, 1.0
STUCK_PROBE_EVERY_S = 0.5  # probes for a stuck process, while the steps stay stopped


@dataclasses.dataclass
class Stall:
    """What the watchdog reads of the step loop: when steps last progressed, and the newest step seen."""

    at: float = dataclasses.field(default_factory=time.monotonic)  # the last progress
    wall: float = dataclasses.field(default_factory=time.time)  # the same, wall clock (for the outcome)
    probed: int = -1  # the newest step a health probe found finished


class Watchdog:
    """Probes ``world``'s processes once its steps stopped for longer than a bound."""

    def __init__(self, world: Any, config: ElasticConfig, sink: StepSink, formed_in_s: float = 0.0):
        self.world, self.config, self.sink = world, config, sink
        self._formed_in_s = formed_in_s  # how long the world took to form: its first step may take as long again
        # process -> (the step it was at, behind the others; the world's newest finished step) at the last probe
        self._behind: dict[int, tuple[int, int]] = {}
        self._next_stuck_probe = 0.0
        self._started_after: int | None = None  # the newest step read when this world began

    def check(self, stall: Stall, reported: int) -> RunOutcome | None:
        idle, f = time.monotonic() - stall.at, self.config.failure
        bound = watchdog_timeout(self.sink.step_times, f.hang_timeout_factor, f.hang_timeout_min_s)
        if self._started_after is None or reported <= self._started_after:
            bound += self._formed_in_s  # no step of this world back yet (see the module's docstring)
        if idle > bound:
            return self._hang(stall, reported)
        if self._started_after is None:
            self._started_after = reported
        if idle <= watchdog_timeout(self.sink.step_times, STUCK_FACTOR, STUCK_MIN_S) or reported <= self._started_after:
            self._behind = {}  # steps progress (or none of this world's came back yet): nobody is stuck
            return None
        if time.monotonic() < self._next_stuck_probe:
            return None
        self._next_stuck_probe = time.monotonic() + STUCK_PROBE_EVERY_S
        answers = health.probe(self.world.workers, f.probe_timeout_s, where=True)
        if any(a is None or a.get("saving") or a.get("evaluating") or a.get("checking") for a in answers):
            self._behind = {}
            return None  # silence is the hang bound's to judge; a save, an eval or a speed check is not stuck
        # Stuck: behind the others at the same step as at the last probe, while no process of the
        # world finished a step in between (steps still reaching the driver do not count).
        newest, behind = health.newest_step(answers), health.stuck_early(answers)
        still = {p: a for p, a in behind.items() if self._behind.get(p) == (a["dispatched"], newest)}
        self._behind = {p: (a["dispatched"], newest) for p, a in behind.items()}
        return RunOutcome(OutcomeKind.HANG, self._named(answers, still), stall.wall) if still else None

    def _hang(self, stall: Stall, reported: int) -> RunOutcome | None:
        """Past the hang bound: a save past its bound is a failed save, silence with nothing busy a
        hang (the processes behind the others named); a slow but busy world is watched again."""
        answers = health.probe(self.world.workers, self.config.failure.probe_timeout_s, where=True)
        save_limit = self.sink.save_limit_s()
        saves = health.stuck_saves(answers, save_limit)
        if saves:
            return RunOutcome(
                OutcomeKind.FAILURE,
                {
                    p: SaveTimedOut(
                        f"a checkpoint save of process {p} has run {s:.0f}s, over save_timeout_s={save_limit:.0f}: "
                        f"the storage ({self.config.checkpoint_dir}) does not answer"
                    )
                    for p, s in saves.items()
                },
                stall.wall,
            )
        if not health.busy(answers, max(reported, stall.probed)):
            silent: dict[int, BaseException] = {
                p: TimeoutError("no answer to the health probe") for p, a in enumerate(answers) if a is None
            }
            named = self._named(answers, health.stuck_processes(answers)) if not silent else {}
            return RunOutcome(OutcomeKind.HANG, silent or named, stall.wall)
        stall.probed = max(stall.probed, health.newest_step(answers))
        stall.at = time.monotonic()  # slow, not hung: watch again from now
        return None

    def _named(self, answers: list[dict[str, Any]], stuck: dict[int, dict[str, Any]]) -> dict[int, BaseException]:
        """The stuck processes, each named with its slice and where it is."""
        front = max(a.get("dispatched", -1) for a in answers)
        return {
            p: StuckProcess(
                f"process {p} (slice {self.world.slice_of(p)}) never reached step {front}, which the others wait "
                f"in: it is at step {a['dispatched']}"
                + (f", waiting for its rows of step {a['reading']}" if a.get("reading") is not None else "")
                + (f"; its step loop is in {a['where']}" if a.get("where") else "")
            )
            for p, a in stuck.items()
        }
