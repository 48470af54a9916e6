"""The next world after a failure or when capacity returns: form it, wait for capacity, or fail."""

from __future__ import annotations

import dataclasses
import enum
from typing import Sequence


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


def decide_next_world(
    *,
    mode: str,
    survivors: Sequence[str],
    ready_replacements: int,
    num_slices: int,
    min_slices: int,
    timed_out: bool = False,
    fallback_to_resize: bool = False,
) -> NextWorld:
    """Which slices form the next world (survivors first, so replica order is stable)."""
    survivors = tuple(survivors)
    need = max(0, num_slices - len(survivors))
    add = min(need, ready_replacements)
    if len(survivors) + add >= num_slices:
        return NextWorld(Action.FORM, survivors[:num_slices], add, "full size")
    can_resize = mode == "replica-resize" or (timed_out and fallback_to_resize)
    if can_resize and len(survivors) + add >= min_slices:
        return NextWorld(Action.FORM, survivors, add, f"resize to {len(survivors) + add} of {num_slices} slices")
    if timed_out:  # never below min_slices forever: replica-resize waits as long as pause-and-resume
        have = f"only {len(survivors) + add} slice(s) available, fewer than min_slices={min_slices}"
        why = have if mode == "replica-resize" or fallback_to_resize else "fallback_to_resize is off"
        return NextWorld(Action.FAIL, survivors, add, f"no replacement slice arrived in time and {why}")
    return NextWorld(
        Action.WAIT,
        survivors,
        add,
        f"{len(survivors) + add} of {num_slices} slices, need "
        f"{num_slices if mode == 'pause-and-resume' else min_slices}",
    )


def should_grow(mode: str, world_size: int, ready_replacements: int, num_slices: int) -> bool:
    """Grow back at a step boundary as soon as a replacement is ready: replica-resize after a
    shrink, and pause-and-resume after a ``fallback_to_resize`` left it smaller."""
    return mode in ("replica-resize", "pause-and-resume") and world_size < num_slices and ready_replacements > 0
