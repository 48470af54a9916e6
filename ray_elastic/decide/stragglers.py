"""The straggler: which slice a synchronous world waits for, by how much, and what to do about it.

A process's call of step N blocks until step N-1 released the state, which happens at one moment
for the whole world: every process's call returns then, but a process whose rows were late, or
whose host was stopped or slowed, returns later, and the world's next collectives wait for it.
So per step, how late each process's call returned after the earliest one (wall clocks: the same
host in the simulation, NTP-synchronised hosts on a cluster) is the time the world waited for it;
over a window, the process latest on average is the candidate, and how much later than the other
slices' median (``excess``) is the wait for it each step. Without it the others would take the
period less the excess: ``excess / (period - excess)`` is how many times the others' own step time
the world waits for it, compared with ``straggler_factor``.
"""

from __future__ import annotations

import dataclasses
import statistics


@dataclasses.dataclass(frozen=True)
class Straggler:
    """The slice every step waits for: ``process`` (the slowest of it), the period of the world's
    step, how long each step waits for it (``excess_s``), and ``ratio``: that wait over the others'
    own step time (``straggler_factor`` is compared with it)."""

    slice_name: str
    process: int
    period_s: float
    excess_s: float
    ratio: float
    data_bound: bool  # it waited for its own rows for most of the excess (a slow data source)
    steps: int
    seen_by: str = "release"  # "release": its calls returned late; "speed_check": its devices computed slowly
    timings: tuple[dict[int, float], ...] = ()  # a speed check's: each process's seconds, per check that named it

    @property
    def slowdown(self) -> float:
        """How many times faster the others would step without it."""
        return self.period_s / _own_step(self.period_s, self.excess_s)

    def evidence(self) -> dict[str, object]:
        out = {k: round(v, 4) if isinstance(v, float) else v for k, v in dataclasses.asdict(self).items()}
        out["timings"] = [{str(p): round(s, 5) for p, s in t.items()} for t in self.timings]
        return out


def find_straggler(
    released: dict[int, dict[int, float]], data_s: dict[int, float], slice_of: dict[int, str], min_steps: int
) -> Straggler | None:
    """The process the others waited for over the steps every process released (``released``: per
    process, step -> wall clock when its call of that step returned; ``data_s``: per process, seconds
    per step it waited for its own rows). None with fewer than ``min_steps`` such steps, or one slice."""
    steps = common_steps(released)
    if len(steps) < max(min_steps, 2):
        return None
    first = _world_released(released, steps)
    late = {p: statistics.mean(r[s] - first[s] for s in steps) for p, r in released.items()}
    p = max(late, key=lambda q: late[q])
    others = [x for q, x in late.items() if slice_of[q] != slice_of[p]]
    if not others:
        return None
    period = _period(first, steps)
    excess = max(0.0, late[p] - statistics.median(others))
    ratio = excess / _own_step(period, excess)
    return Straggler(slice_of[p], p, period, excess, ratio, data_s.get(p, 0.0) > excess / 2, len(steps))


CONFIRM_MIN_STEPS = 4  # the shortest window that confirms a suspect


def window_steps(window: int, suspected: bool) -> int:
    """Steps a window needs before it is judged: ``straggler_window_steps``, or half of it (at least
    ``CONFIRM_MIN_STEPS``) to confirm the slice the previous window named, which then leaves a
    window's worth of slow steps sooner (the first window still needs every step)."""
    return max(CONFIRM_MIN_STEPS, window // 2) if suspected else window


MAX_SLOWDOWN = 100.0  # a process late by about a whole period (stuck for part of the window) reads as this


def _own_step(period_s: float, excess_s: float) -> float:
    """The others' own step: the period less the wait for the straggler (at least 1/MAX_SLOWDOWN of it)."""
    return max(period_s - excess_s, period_s / MAX_SLOWDOWN, 1e-9)


def common_steps(released: dict[int, dict[int, float]]) -> list[int]:
    """The steps every process released, in order."""
    return sorted(set.intersection(*(set(r) for r in released.values()))) if released else []


def _world_released(released: dict[int, dict[int, float]], steps: list[int]) -> dict[int, float]:
    """When the world released each step: its earliest process's return."""
    return {s: min(r[s] for r in released.values()) for s in steps}


def window_period(released: dict[int, dict[int, float]]) -> float:
    """The world's step period over the steps every process released (0.0: fewer than two)."""
    steps = common_steps(released)
    if len(steps) < 2:
        return 0.0
    return _period(_world_released(released, steps), steps)


def _period(first: dict[int, float], steps: list[int]) -> float:
    """The mean interval between the world's releases of ``steps`` (sorted, at least two)."""
    return (first[steps[-1]] - first[steps[0]]) / (len(steps) - 1)


def speed_check_due(period_s: float, usual_period_s: float, factor: float) -> bool:
    """The world's steps have slowed (its period over ``1 + factor / 4`` x its usual one) while no
    process returned late: every process may be waiting inside the step for a slow device, so the
    processes' devices are timed (:mod:`ray_elastic.slice.speed_check`). A quarter of the factor: a
    device ``1 + factor`` times slower slows a step that is not all compute by less (and where
    every process shares one machine's cores, the others take the cores it leaves: a 5x slower
    simulated host slowed its world 1.3-1.4x), and a check is cheap."""
    return usual_period_s > 0 and period_s > (1 + factor / 4) * usual_period_s


def find_slow_device(
    seconds: dict[int, float], slice_of: dict[int, str], period_s: float, factor: float
) -> Straggler | None:
    """The process whose devices took longest on the fixed program (``seconds``: per process), when
    over ``1 + factor`` x the slowest of the other slices (so over their median too): where two
    slices are both that slow, the processes were sharing starved CPUs (every process of a
    simulated cluster shares one machine's cores), not one slow device. Its slowdown is measured
    against the others' median: the world steps at its pace, so without it the others' step would
    be that many times shorter (for a world bound by its compute)."""
    p, others = _slowest(seconds, slice_of)
    if not others:
        return None
    if seconds[p] / max(max(others), 1e-9) - 1 <= factor:
        return None
    slowdown = seconds[p] / max(statistics.median(others), 1e-9)
    excess = period_s * (1 - 1 / slowdown)
    return Straggler(slice_of[p], p, period_s, excess, slowdown - 1, False, 0, "speed_check")


def two_slices_slow(seconds: dict[int, float], slice_of: dict[int, str], factor: float) -> bool:
    """The slowest process is over ``1 + factor`` x the other slices' median, but another slice is
    about as slow (:func:`find_slow_device` names neither): cores starved for a moment (a process
    starting beside them), which says nothing either way of a slow device."""
    p, others = _slowest(seconds, slice_of)
    over = seconds[p] / max(statistics.median(others), 1e-9) - 1 > factor if len(others) >= 2 else False
    return over and seconds[p] / max(max(others), 1e-9) - 1 <= factor


def _slowest(seconds: dict[int, float], slice_of: dict[int, str]) -> tuple[int, list[float]]:
    """The slowest process, and the other slices' processes' seconds (none when ``seconds`` is empty)."""
    if not seconds:
        return -1, []
    p = max(seconds, key=lambda q: seconds[q])
    return p, [x for q, x in seconds.items() if slice_of[q] != slice_of[p]]


def straggler_action(found: Straggler, num_slices: int, min_slices: int, spare_ready: bool, on_straggler: str) -> str:
    """What to do about a straggler: ``replace`` it when a spare slice is ready; ``evict`` it when
    the world is faster without it (N-1 slices taking its rows step faster than N at its pace: the
    others' step grows by N/(N-1)) and ``min_slices`` allows; else ``report`` (``on_straggler="report"``
    only ever reports)."""
    if on_straggler == "report":
        return "report"
    if spare_ready:
        return "replace"
    if num_slices - 1 >= max(min_slices, 1) and num_slices / (num_slices - 1) < found.slowdown:
        return "evict"
    return "report"
