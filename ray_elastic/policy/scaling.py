"""Scaling policies: what the next world is after a failure, when to grow back, which sizes a run
may train on. One class per mode, chosen from the config by :func:`scaling_policy`.

A policy is pure (no Ray): the controller asks it with the survivors and the ready replacements,
the config asks it which world sizes to validate the batch for, and the slice processes which
sizes to trace their step ahead for.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from collections.abc import Sequence
from typing import ClassVar


class Action(enum.StrEnum):
    """The controller's next move after a failure or when capacity returns."""

    FORM = "form"
    WAIT = "wait"
    FAIL = "fail"


@dataclasses.dataclass(frozen=True)
class NextWorld:
    """The controller's next move after a failure: form a world, wait for capacity, or fail."""

    action: Action
    survivors: tuple[str, ...] = ()  # the slices that stay, in replica order
    replacements: int = 0  # ready replacement slices to add
    reason: str = ""

    @property
    def size(self) -> int:
        return len(self.survivors) + self.replacements


class ScalingPolicy(abc.ABC):
    """One mode. ``num_slices``: full size; ``min_slices``: the fewest a world may have."""

    mode: ClassVar[str]
    advice: ClassVar[str]  # what to change when the run gives up waiting

    def __init__(self, num_slices: int, min_slices: int, fallback_to_resize: bool = False):
        self.num_slices, self.min_slices, self.fallback_to_resize = num_slices, min_slices, fallback_to_resize

    def next_world(self, survivors: Sequence[str], ready_replacements: int, *, timed_out: bool = False) -> NextWorld:
        """Which slices form the next world: survivors first (so replica order is stable), then up
        to ``ready_replacements`` new ones; or wait for more, or fail once ``timed_out``."""
        survivors = tuple(survivors)
        add = min(max(0, self.num_slices - len(survivors)), ready_replacements)
        size = len(survivors) + add
        if size >= self.num_slices:
            return NextWorld(Action.FORM, survivors[: self.num_slices], add, "full size")
        if self.may_resize(timed_out) and size >= self.min_slices:
            return NextWorld(Action.FORM, survivors, add, f"resize to {size} of {self.num_slices} slices")
        if timed_out:
            return NextWorld(
                Action.FAIL, survivors, add, f"no replacement slice arrived in time and {self.why_not(size)}"
            )
        return NextWorld(Action.WAIT, survivors, add, f"{size} of {self.num_slices} slices, need {self.needed()}")

    def next_world_warm_first(self, survivors: Sequence[str], warm: int, cold: int, *, timed_out: bool) -> NextWorld:
        """:meth:`next_world` with the ``warm`` ready replacements (their processes started), and
        the ``cold`` ones too only where no world forms without them: a cold process keeps the
        whole recovery waiting for Python and JAX to start (tens of seconds on a loaded host),
        while the survivors could train and take it later through a grow-back, which waits for
        its processes beside the running world."""
        decision = self.next_world(survivors, warm, timed_out=timed_out)
        if decision.action is Action.FORM:
            return decision
        return self.next_world(survivors, warm + cold, timed_out=timed_out)

    def should_grow(self, world_size: int, ready_replacements: int) -> bool:
        """Stop the running world at a step boundary to form a bigger one."""
        return world_size < self.num_slices and ready_replacements > 0

    def world_sizes(self) -> list[int]:
        """Slice counts the run may train on (the batch must split over each)."""
        return list(range(self.min_slices, self.num_slices + 1))

    @abc.abstractmethod
    def may_resize(self, timed_out: bool) -> bool:
        """Whether a world smaller than full size (but at least ``min_slices``) may form now."""

    def needed(self) -> int:
        """Slices the run waits for while it waits."""
        return self.min_slices

    def why_not(self, size: int) -> str:
        return f"only {size} slice(s) available, fewer than min_slices={self.min_slices}"


class ReplicaResize(ScalingPolicy):
    """Continue at once on the survivors with a smaller ``replica`` axis, down to ``min_slices``;
    grow back at a step boundary as soon as a replacement is ready."""

    mode = "replica-resize"
    advice = "or lower min_slices"

    def may_resize(self, timed_out: bool) -> bool:
        return True


class PauseAndResume(ScalingPolicy):
    """Wait for a replacement and continue at full size; with ``fallback_to_resize``, continue on
    the survivors once the wait times out (and grow back when a replacement comes)."""

    mode = "pause-and-resume"
    advice = "or set fallback_to_resize=True"

    def may_resize(self, timed_out: bool) -> bool:
        return timed_out and self.fallback_to_resize

    def needed(self) -> int:
        return self.num_slices

    def why_not(self, size: int) -> str:
        return super().why_not(size) if self.fallback_to_resize else "fallback_to_resize is off"

    def world_sizes(self) -> list[int]:
        return super().world_sizes() if self.fallback_to_resize else [self.num_slices]


class ResizeUntilFull(ReplicaResize):
    """Continue at once on the survivors, like replica-resize, but grow back only when the ready
    replacements restore full size at once: slices that return one by one cost one pause, not
    one per slice."""

    mode = "resize-until-full"

    def should_grow(self, world_size: int, ready_replacements: int) -> bool:
        return world_size < self.num_slices and world_size + ready_replacements >= self.num_slices


POLICIES: dict[str, type[ScalingPolicy]] = {p.mode: p for p in (ReplicaResize, PauseAndResume, ResizeUntilFull)}
MODES = tuple(POLICIES)


def scaling_policy(mode: str, num_slices: int, min_slices: int, fallback_to_resize: bool = False) -> ScalingPolicy:
    """The policy of ``mode`` (one of :data:`MODES`)."""
    if mode not in POLICIES:
        raise ValueError(f"unknown mode {mode!r}: use one of {', '.join(MODES)}")
    return POLICIES[mode](num_slices, min_slices, fallback_to_resize)
