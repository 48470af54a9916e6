"""Which slice a running world waits for, measured while it trains.

Every ``PROBE_EVERY_S`` the driver asks each process's health probe (its own thread: answered
during a step) for when its recent steps' calls returned and for its step counters
(:attr:`~ray_elastic.slice.jax_world.TrainLoop.released`, ``timing``), without waiting for the
answers (they are read at a later turn of the step loop). Once ``straggler_window_steps`` steps
that every process released have come in, the window is judged
(:func:`~ray_elastic.decide.stragglers.find_straggler`); a slice that makes the world wait more than
``straggler_factor`` x the others' own step time in two windows in a row (the second half as long)
is a straggler, handed to the controller (:meth:`take`), which decides what to do. A world's
first window is not judged (it measures the world's start), nor does a window (or a speed check)
name a slice whose process compiled ahead beside its steps during it: it fell behind for that. The
others' devices are still timed meanwhile: process 0 compiles ahead after every world's first
chunk, for seconds on a busy host, and a slow device elsewhere would go unnamed all that while.

A slow device makes every process wait inside the step's collectives, so no process returns late:
:class:`~ray_elastic.decide.device_checks.DeviceChecks` decides when the probe asks every
process to time its devices, and names a slow one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import ray

from ray_elastic.config import ElasticConfig
from ray_elastic.decide.device_checks import QUICK_STEPS, DeviceChecks, Handover
from ray_elastic.decide.stragglers import Straggler, common_steps, find_straggler, window_period, window_steps
from ray_elastic.detect.health import background_started, worked_aside

logger = logging.getLogger(__name__)
PROBE_EVERY_S = 1.0
CHECK_PROBE_EVERY_S = 0.2  # while a speed check is asked for: its answers are read sooner
ANSWER_WITHIN_S = 5.0  # a round not answered in this long is dropped (a dead process is the failure path's)


class StragglerWatch:
    """Step release times of ``world``'s processes over windows; a confirmed straggler for the controller."""

    def __init__(
        self,
        world: Any,
        config: ElasticConfig,
        also: Callable[[list[dict[str, Any]]], None] | None = None,
        before: Handover | None = None,
    ):
        """``also``: handed every round's answers too; ``before``: what the world before's watch
        left (its suspect, if in this world, is suspected here too; slices not in it are newcomers)."""
        self.world, self.config, self._also = world, config, also
        self._released: dict[int, dict[int, float]] = {}  # per process: step -> when its call returned
        self._data: dict[int, tuple[float, float]] = {}  # per process: (steps, data_s) when the window began
        self._judged = -1  # the newest step of the last window judged
        self._refs: list[Any] | None = None
        self._sent = 0.0
        self._next = time.monotonic() + PROBE_EVERY_S
        self._suspect: str | None = None
        self._found: Straggler | None = None
        carried, newcomers = before.carried(world.plan.slice_names) if before is not None else (None, frozenset())
        self.devices = DeviceChecks(config.failure.straggler_factor, world.slice_of, carried, newcomers)
        self._handed: set[str] = set()  # slices handed to the controller (kept, when it only reports them)
        self._aside: set[int] = set()  # processes that worked beside their steps in this window
        self._started: list[int] | None = None  # ... the count of such jobs each had started, last round
        self._first = True  # the world's first window is not judged

    @property
    def suspicious(self) -> bool:
        """A slice was named once (a second window or check confirms it), or the world's steps
        slowed and its devices are being timed: the step loop queues short chunks meanwhile, so a
        confirmed straggler leaves within a few steps."""
        return bool({self._suspect, self.devices.suspect} - {None} - self._handed) or self.devices.slowed

    def handover(self) -> Handover:
        """What the next world's watch goes on from."""
        return Handover(frozenset(self.world.plan.slice_names), self.devices.suspicion())

    def check(self) -> None:
        """Read a round of answers that is in; send the next one when due. Never waits."""
        now = time.monotonic()
        if self._refs is not None:
            ready, _ = ray.wait(self._refs, num_returns=len(self._refs), timeout=0)
            if len(ready) == len(self._refs):
                refs, self._refs = self._refs, None
                try:
                    answers = ray.get(refs)
                    self._add(answers)
                    if self._also is not None:
                        self._also(answers)
                except Exception as e:  # noqa: BLE001 - a process died: the failure path sees it
                    logger.debug("straggler watch: a probe failed: %r", e)
            elif now - self._sent > ANSWER_WITHIN_S:
                self._refs = None
        if self._refs is None and (now >= self._next or self.devices.ask_pending):
            ask = self.devices.take_ask()
            every = CHECK_PROBE_EVERY_S if self.devices.check_at is not None else PROBE_EVERY_S
            self._refs, self._sent, self._next = ([w.probe.remote(ask) for w in self.world.workers], now, now + every)

    def take(self) -> Straggler | None:
        """The confirmed straggler since the last call (None: none)."""
        found, self._found = self._found, None
        if found is not None:
            self._handed.add(found.slice_name)
        return found

    def _add(self, answers: list[dict[str, Any]]) -> None:
        front = max(a.get("dispatched", -1) for a in answers)
        self._aside |= worked_aside(answers, self._started)  # since the last window
        self._started = background_started(answers)
        checks = [(a.get("timing") or {}).get("speed") or (-1, 0.0) for a in answers]
        slow = self.devices.answered(checks, frozenset(self._aside))
        self._found = slow or self._found
        for p, a in enumerate(answers):
            self._released.setdefault(p, {}).update((s, t) for s, t in a.get("released", ()) if s > self._judged)
        common = common_steps(self._released)
        if len(common) >= QUICK_STEPS and not self._aside:
            recent = common[-QUICK_STEPS:]
            self.devices.recent(window_period({p: {s: r[s] for s in recent} for p, r in self._released.items()}), front)
        window = window_steps(self.config.failure.straggler_window_steps, self._suspect is not None)
        if len(common) < window:
            return
        timing = {p: a.get("timing") or {} for p, a in enumerate(answers)}
        data = {
            p: (t.get("data_s", 0.0) - self._data.get(p, (0, 0.0))[1])
            / max(1.0, t.get("steps", 0) - self._data.get(p, (0, 0.0))[0])
            for p, t in timing.items()
        }
        released = {p: {s: r[s] for s in common} for p, r in self._released.items()}
        self._judged = common[-1]
        self._released = {p: {s: t for s, t in r.items() if s > self._judged} for p, r in self._released.items()}
        self._data = {p: (t.get("steps", 0), t.get("data_s", 0.0)) for p, t in timing.items()}
        found = find_straggler(released, data, {p: self.world.slice_of(p) for p in released}, window)
        aside, self._aside = self._aside, set()
        logger.debug("straggler window to step %d: %s (worked aside: %s)", self._judged, found, sorted(aside))
        first, self._first = self._first, False
        if first:  # the world's start: newcomers restoring copies, standbys replenished, programs loaded
            self.devices.start(window_period(released), front)  # timed at once: a world may last only seconds
            return
        if found is not None and any(self.world.slice_of(p) == found.slice_name for p in aside):
            return  # it compiled ahead meanwhile: behind for that, which says nothing of its host
        if found is None or found.ratio <= self.config.failure.straggler_factor:
            self._suspect = None
            self.devices.window(window_period(released), front, aside=bool(aside))
            return
        if self._suspect == found.slice_name:  # named twice in a row: handed to the controller
            self._found = found
        self._suspect = found.slice_name
