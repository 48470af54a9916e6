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

    @property
    def slowdown(self) -> float:
        """How many times faster the others would step without it."""
        return self.period_s / max(self.period_s - self.excess_s, 1e-9)

    def evidence(self) -> dict[str, object]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in dataclasses.asdict(self).items()}


def find_straggler(
    released: dict[int, dict[int, float]], data_s: dict[int, float], slice_of: dict[int, str], min_steps: int
) -> Straggler | None:
    """The process the others waited for over the steps every process released (``released``: per
    process, step -> wall clock when its call of that step returned; ``data_s``: per process, seconds
    per step it waited for its own rows). None with fewer than ``min_steps`` such steps, or one slice."""
    steps = sorted(set.intersection(*(set(r) for r in released.values()))) if released else []
    if len(steps) < max(min_steps, 2):
        return None
    first = {s: min(r[s] for r in released.values()) for s in steps}  # when the world released step s
    late = {p: statistics.mean(r[s] - first[s] for s in steps) for p, r in released.items()}
    p = max(late, key=lambda q: late[q])
    others = [x for q, x in late.items() if slice_of[q] != slice_of[p]]
    if not others:
        return None
    period = (first[steps[-1]] - first[steps[0]]) / (len(steps) - 1)
    excess = max(0.0, late[p] - statistics.median(others))
    ratio = excess / max(period - excess, 1e-9)
    return Straggler(slice_of[p], p, period, excess, ratio, data_s.get(p, 0.0) > excess / 2, len(steps))


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
