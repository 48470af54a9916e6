"""The controller's next move after a failure or when capacity returns (decided by the mode's
:class:`~ray_elastic.policy.scaling.ScalingPolicy`): form a world, wait for capacity, or fail."""

from __future__ import annotations

import dataclasses
import enum


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
