"""When a running world's processes are asked to time their devices, and what the answers say.

A slow device makes every process wait inside the step's collectives, so no process returns late
(:mod:`~ray_elastic.decide.stragglers`). A check (:mod:`~ray_elastic.slice.speed_check`) is asked
for at the world's first window (a slow device from the start, or one the world before suspected
where its checks alone could name it: they go on from there, :class:`Suspicion`; under many faults a
world lasts only seconds), when the world's steps slowed
(:func:`~ray_elastic.decide.stragglers.speed_check_due` against its median window, over a whole
window or its newest ``QUICK_STEPS`` steps), and at least every ``MAX_BACKOFF_WINDOWS`` windows (a
slow device does not always slow the world: on a host whose cores every process shares, the others
take the cores it leaves). A check that finds nothing holds the next ones back for twice as many
windows each time (up to ``MAX_BACKOFF_WINDOWS``): on a noisy host the step period wanders, and
every check costs each process its program's time; but not a world slowed past the period at which
that check found nothing, or past a faster window since (a check at a slow moment, a world's start,
vouches for no slower pace once the world sped up): a device that turned slow during a hold is timed
at once. A process slower than the other slices (their median and their slowest) by
``1 + straggler_factor / 2`` in one check and by ``1 + straggler_factor`` in the next one (asked at
once), or the other way round, is a straggler: a duty-cycled host's timings wander around its
slowdown, so either check may be the one under the whole factor. A check that finds two slices about
as slow (cores starved for a moment) is asked again at once, up to ``MAX_MUDDLED`` times, the
suspect kept. In a world of two slices there is no third slice to show that the cores were not
simply starved for a moment (every process of a simulated cluster shares one machine's cores; a
starting neighbour takes them for seconds): a third check ``SECOND_LOOK_S`` later (at the world's
pace now: the slow device slows it) must name it too. So must it for a slice new to its world (not
in the world before): twice a chaos run named a newcomer whose process was starved in its world's
first seconds.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from collections.abc import Callable

from ray_elastic.decide.stragglers import Straggler, find_slow_device, speed_check_due, two_slices_slow

logger = logging.getLogger(__name__)
QUICK_STEPS = 4
MAX_BACKOFF_WINDOWS = 8
SECOND_LOOK_S = 5.0
MAX_MUDDLED = 2  # checks in a row asked again at once when two slices were slow at once


@dataclasses.dataclass(frozen=True)
class Suspicion:
    """A slice one or two checks found slow, not confirmed yet when its world ended: the next world's
    checks go on from it (a world that lasts less than a pair of checks would never name it)."""

    slice_name: str
    full: bool  # one of the checks found it slower by the whole factor
    timings: tuple[dict[int, float], ...]  # each check's seconds per process (of the world that timed it)

    def within(self, slice_names: tuple[str, ...] | list[str]) -> Suspicion | None:
        """Itself if the next world has the slice (else nothing is left to suspect)."""
        return self if self.slice_name in slice_names else None


@dataclasses.dataclass(frozen=True)
class Handover:
    """What a world's speed checks leave the next world: its slices (the others are newcomers
    there) and the slice it suspected (:meth:`DeviceChecks.suspicion`)."""

    slice_names: frozenset[str]
    suspicion: Suspicion | None

    def carried(self, slice_names: tuple[str, ...] | list[str]) -> tuple[Suspicion | None, frozenset[str]]:
        """For a world of ``slice_names``: the suspicion that goes on in it, and its newcomers."""
        suspicion = self.suspicion.within(slice_names) if self.suspicion is not None else None
        return suspicion, frozenset(slice_names) - self.slice_names


class DeviceChecks:
    """The speed checks of one world, fed by :class:`~ray_elastic.ray_backend.straggler_watch.StragglerWatch`."""

    def __init__(
        self,
        factor: float,
        slice_of: Callable[[int], str],
        carried: Suspicion | None = None,
        newcomers: frozenset[str] = frozenset(),
    ):
        """``carried``: what the world before suspected (:meth:`Handover.carried`); ``newcomers``:
        the slices new to this world, named only after a later look."""
        self.factor, self.slice_of = factor, slice_of
        self.check_at: int | None = None  # the step at which every process is asked to time its devices
        self.suspect: str | None = None  # the slowest by half the factor in one check: the next one confirms it
        self._suspect_full = False  # ... and by the whole factor in it
        self._suspect_timings: tuple[dict[int, float], ...] = ()  # ... the seconds of the checks that named it
        self._suspect_weak = False  # ... in a world of two slices, or new to its world: not carried to the next
        self.slowed = False  # the world's steps slowed and its devices are being timed
        self._periods: list[float] = []  # the world's window periods
        self._period = 0.0  # the period that asked for the check
        self._clean_period = 0.0  # ... of the last check that found nothing: a hold yields to a world slower than it
        self._latest = 0.0  # the newest period measured (a window's, or the newest steps'): the world's pace now
        self._sent = False  # the ask went out in a probe round
        self._quick_done = False  # one quick check per window
        self._hold, self._backoff = 0, 1  # windows to skip before the next check; the next hold
        self._judged = False  # a check was judged in this world
        self._muddled = 0  # checks in a row that found two slices slow at once
        self._since_check = 0  # windows judged since the last check was asked
        self.newcomers = newcomers
        if carried is not None:
            self.suspect, self._suspect_full, self._suspect_timings = carried.slice_name, carried.full, carried.timings

    def suspicion(self) -> Suspicion | None:
        """The slice suspected and not confirmed yet, for the next world; not where this world's
        checks alone could not name it without a later look (two slices, or a newcomer): starved
        cores at two moments would name it at the next world's start (a chaos run named one so)."""
        if self.suspect is None or self._suspect_weak:
            return None
        return Suspicion(self.suspect, self._suspect_full, self._suspect_timings)

    def start(self, period: float, front: int) -> None:
        """The world's first window (not judged: it measures the world's start): its devices are timed."""
        if period > 0:
            self._latest = period
            self._ask(period, front)

    def window(self, period: float, front: int, aside: bool = False) -> None:
        """A window was judged with no process late (``front``: the newest step any process
        dispatched). ``aside``: a process worked beside its steps in it (compiling ahead): its
        period measures that work too and joins no median, but checks go on (:meth:`answered`
        drops one whose slowest process is that one)."""
        first = not self._judged  # the world's first check (asked again while none was judged)
        slowed = bool(self._periods) and speed_check_due(period, statistics.median(self._periods), self.factor)
        if not aside:
            self._periods.append(period)
        if period > 0:
            self._latest = period
            if self._hold:  # a window faster than the clean check: it no longer vouches for a slower one
                self._clean_period = min(self._clean_period, period)
        self._quick_done = False
        self._since_check += 1
        held = self._held(period)
        self._hold = max(0, self._hold - 1)
        if not held and (first or slowed or self._since_check >= MAX_BACKOFF_WINDOWS) and period > 0:
            self.slowed = slowed
            self._ask(period, front)

    def recent(self, period: float, front: int) -> None:
        """The world's newest ``QUICK_STEPS`` steps took ``period`` each: slowed, a check now."""
        if period > 0:
            self._latest = period
        if self._quick_done or self._held(period) or not self._periods:
            return
        if speed_check_due(period, statistics.median(self._periods), self.factor):
            self._quick_done = self.slowed = True
            self._ask(period, front)

    def _held(self, period: float) -> bool:
        """Checks are held back, and the world is no slower than when the last one found nothing."""
        return self._hold > 0 and not speed_check_due(period, self._clean_period, self.factor)

    def _ask(self, period: float, front: int) -> None:
        if self.check_at is None:
            self.check_at, self._period, self._sent, self._since_check = front + 1, period, False, 0

    @property
    def ask_pending(self) -> bool:
        """A check is asked for and not sent yet: the next probe round goes out at once."""
        return self.check_at is not None and not self._sent

    def take_ask(self) -> int | None:
        """The step to send in the next probe round, once per check."""
        if self.check_at is None or self._sent:
            return None
        self._sent = True
        return self.check_at

    def answered(self, done: list[tuple[int, float | None]], aside: frozenset[int] = frozenset()) -> Straggler | None:
        """Every process's newest check (step, seconds; None: its program was not compiled yet, the
        round is dropped); a confirmed straggler, once all have checked. ``aside``: processes that
        worked beside their steps meanwhile (compiling ahead): the slowest among them timed its
        devices sharing its CPUs with that work, so the round is dropped too."""
        if self.check_at is None or not all(step >= self.check_at for step, _ in done):
            return None
        if any(s is None for _, s in done):
            logger.debug(
                "speed check at step %d: not compiled on %s",
                self.check_at,
                [p for p, (_, s) in enumerate(done) if s is None],
            )
            self.check_at, self.slowed = None, False
            return None
        seconds = {p: float(s) for p, (_, s) in enumerate(done) if s is not None}
        self._judged = True
        slices = {p: self.slice_of(p) for p in seconds}
        found = find_slow_device(seconds, slices, self._period, self.factor / 2)
        logger.debug("speed check at step %d: %s -> %s (worked aside: %s)", self.check_at, seconds, found, aside)
        if found is not None and found.process in aside:
            self.check_at, self.slowed = None, False
            return None
        front, self.check_at = max(step for step, _ in done), None
        if found is None and self._muddled < MAX_MUDDLED and two_slices_slow(seconds, slices, self.factor / 2):
            self._muddled += 1
            self._ask(self._period, front)  # starved cores: asked again at once, the suspect kept
            return None
        self._muddled = 0
        full = found is not None and found.ratio > self.factor
        if found is not None and self.suspect == found.slice_name and (full or self._suspect_full):
            self._suspect_timings += (seconds,)
            no_third = len({self.slice_of(p) for p in seconds}) < 3
            if (no_third or found.slice_name in self.newcomers) and len(self._suspect_timings) < 3:
                self._ask(self._period, front + later_steps(self._latest or self._period))  # a later look
                return None
            logger.info("speed check: %s's devices %.1fx slower than the others'", found.slice_name, found.slowdown)
            self.suspect, self.slowed, self._hold = None, False, MAX_BACKOFF_WINDOWS  # no checks while it leaves
            return dataclasses.replace(found, timings=self._suspect_timings)
        if found is None or self.suspect is not None:  # clean, another slice now, or twice only half as slow
            self.suspect, self.slowed, self._clean_period = None, False, self._period
            self._hold, self._backoff = self._backoff, min(2 * self._backoff, MAX_BACKOFF_WINDOWS)
            return None
        self.suspect, self._suspect_full, self._suspect_timings = found.slice_name, full, (seconds,)
        self._suspect_weak = len(set(slices.values())) < 3 or found.slice_name in self.newcomers
        self._ask(self._period, front)  # confirmed, or not, by a second check at once
        return None


def later_steps(period_s: float) -> int:
    """Steps from now to a check ``SECOND_LOOK_S`` later, at the world's period."""
    return max(0, math.ceil(SECOND_LOOK_S / max(period_s, 1e-3)) - 1)
