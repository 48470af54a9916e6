"""Which steps are not kept, and when skipping them has to stop the run.

A step whose loss (or the ``grad_norm`` its task reports) is not finite, or (with ``spike_factor``) whose loss is over
``spike_factor`` x the median loss of the recent kept steps, is a bad step: a batch that turns the
loss into NaN, a spike. The step program does not apply its update (:mod:`~ray_elastic.slice.step_guard`),
so the step is skipped and the run goes on. A model that diverges every step is a bug and not a
bad batch: past ``max_skipped_steps`` skips within ``skipped_steps_window`` steps the run stops.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

KEPT, NON_FINITE, SPIKE = 0, 1, 2  # a step's verdict, as the step program returns it
WHY = {NON_FINITE: "non_finite", SPIKE: "spike"}


@dataclasses.dataclass(frozen=True)
class BadSteps:
    """What the slice processes do with a bad step (from ``FailureConfig``)."""

    skip: bool = True  # False: a bad step stops the run (``on_bad_step="raise"``)
    spike_factor: float | None = None  # None: only a non-finite loss or state is bad
    max_skipped: int = 5
    window: int = 1000


DEFAULT_BAD_STEPS = BadSteps()


def too_many_skips(skipped: Sequence[int], step: int, bad: BadSteps) -> list[int] | None:
    """The steps skipped within the ``bad.window`` steps up to ``step``, when more than
    ``bad.max_skipped`` of them (the run stops); else None."""
    recent = [s for s in skipped if step - bad.window < s <= step]
    return recent if len(recent) > bad.max_skipped else None


def bad_step_message(step: int, loss: float, verdict: int, bad: BadSteps) -> str:
    """Why a bad step stops the run (``on_bad_step="raise"``), and what to change."""
    what = (
        f"the loss of step {step} is {loss}"
        if verdict == NON_FINITE
        else f"the loss of step {step} ({loss:.4g}) is over spike_factor={bad.spike_factor} x the recent median"
    )
    return (
        f"{what}: training stopped before that state was checkpointed or snapshotted (lower the learning "
        "rate, clip gradients, or check the data of that step; FailureConfig(on_bad_step='skip') skips such steps)"
    )


def too_many_message(steps: list[int], bad: BadSteps) -> str:
    return (
        f"steps {steps} were bad and skipped within {bad.window} steps, more than max_skipped_steps="
        f"{bad.max_skipped}: a model that diverges this often is not fixed by skipping batches (lower the "
        "learning rate, clip gradients, check the data), training stopped"
    )
