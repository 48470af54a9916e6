"""The events of planned changes at a step boundary (no failure): a grow-back, and slices alive that
should go (a preemption notice, a straggler) leaving. Re-exported by
:mod:`~ray_elastic.observe.event_types`, where every kind is read back."""

from __future__ import annotations

import dataclasses
from typing import Any

from ray_elastic.observe.event_base import Event


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlannedChange(Event):
    """A world formed after a planned stop at a step boundary (not a failure): its fields."""

    generation: int
    from_slices: int
    to_slices: int
    restored_from_step: int
    steps_rewound: int
    pause_s: float  # the last step before the stop -> the next world ready: training paused this long
    ready_at: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScaleUp(PlannedChange):
    """Capacity returned and the world grew at a step boundary."""

    kind = "scale_up"
    resize_s: float  # the smaller world stopped -> the bigger one is ready


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreemptionNotice(Event):
    """A slice's hosts were drained (a preemption notice): it left the world at a step boundary.
    ``seconds_left``: of its notice when it was out; ``state_kept_by``: snapshots, checkpoint or nothing."""

    kind = "preemption_notice"
    slice: str
    hosts: list[str]
    reason: str
    deadline: float | None
    seconds_left: float | None
    step: int  # the last step it trained
    state_kept_by: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class SliceLeft(PlannedChange):
    """Warned slices left; the next world formed without them."""

    kind = "slice_left"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Straggler(Event):
    """A slice every step waited for (measured over two windows): how much, what was decided
    (``action``: replace, evict or report) and the evidence (the window's figures)."""

    kind = "straggler"
    slice: str
    process: int
    slowdown: float  # how many times faster the others would step without it
    ratio: float  # the wait for it over the others' own step time (straggler_factor is compared with it)
    data_bound: bool  # it waited for its own rows (a slow data source) more than for the world
    action: str
    evidence: dict[Any, Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicaMismatch(Event):
    """Replicas of the state disagreed after ``step`` (their fingerprints): ``slices`` out-voted by
    the others (empty: no majority), the state ``arrays`` (leaf indices) that differ, the newest
    step all agreed on, and what was done (``evict``: the odd slices left, their snapshots
    discarded; ``stop``: no majority, the run stopped)."""

    kind = "replica_mismatch"
    step: int
    slices: list[str]
    arrays: list[int]
    agreed_step: int
    action: str
