"""How often a world snapshots its state: a one-method Protocol and small dataclass policies (as
Orbax's ``SaveDecisionPolicy``). ``ElasticConfig.snapshot_every`` takes a policy, or an int n for
:class:`EveryNSteps` (n); the default is :class:`AutoInterval`. The controller asks the policy at
the start of every chunk (:class:`~ray_elastic.control.snapshot_cadence.SnapshotCadence`), with what
snapshots have cost so far; the interval it returns bounds what a recovery can rewind (interval - 1)."""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

from ray_elastic.decide import snapshot_interval


@dataclasses.dataclass(frozen=True)
class SnapshotCosts:
    """What a policy decides from: recent snapshots' cost to their process (``snapshot_s``), recent
    step times (``step_s``), the current interval, and a snapshot's cost read from the step times
    (``step_cost``; None while it cannot be told). Empty before the run's first chunk."""

    snapshot_s: tuple[float, ...] = ()
    step_s: tuple[float, ...] = ()
    current: int = 1
    step_cost: float | None = None


@runtime_checkable
class SnapshotPolicy(Protocol):
    def interval(self, costs: SnapshotCosts) -> int:
        """Steps between snapshots from the next chunk on (1: every step, zero rewind; 0: none)."""
        ...


@dataclasses.dataclass(frozen=True)
class EveryNSteps:
    """A snapshot after every ``steps``-th step, whatever it costs (0: none: a recovery restores
    the newest checkpoint)."""

    steps: int

    def interval(self, costs: SnapshotCosts) -> int:
        return self.steps


@dataclasses.dataclass(frozen=True)
class AutoInterval:
    """The smallest interval whose snapshots cost at most ``budget`` of the step time (every step
    wherever a copy fits it): see :func:`~ray_elastic.decide.snapshot_interval`. Starts at every
    step, before anything is measured."""

    budget: float = 0.02

    def interval(self, costs: SnapshotCosts) -> int:
        return snapshot_interval(
            list(costs.snapshot_s), list(costs.step_s), self.budget, costs.current, step_cost=costs.step_cost
        )


def as_policy(snapshot_every: int | SnapshotPolicy) -> SnapshotPolicy:
    """``ElasticConfig.snapshot_every`` as a policy (an int n: :class:`EveryNSteps` (n))."""
    return EveryNSteps(snapshot_every) if isinstance(snapshot_every, int) else snapshot_every


def takes_snapshots(policy: SnapshotPolicy) -> bool:
    """False only for a policy that never snapshots (``EveryNSteps(0)``): the step then packs nothing."""
    return policy != EveryNSteps(0)


def check_snapshot_every(every: object) -> None:
    """``ValueError`` saying what to change unless ``every`` is an int >= 0 or a snapshot policy."""
    if isinstance(every, int) and not isinstance(every, bool):
        if every < 0:
            raise ValueError(f"snapshot_every must be >= 0 (0 turns snapshots off), got {every}")
        return
    if every == "auto":
        raise ValueError("snapshot_every='auto' is AutoInterval() (from ray_elastic import AutoInterval), the default")
    if not isinstance(every, SnapshotPolicy):
        raise ValueError(
            f"snapshot_every must be an integer >= 0 or a SnapshotPolicy (AutoInterval(budget=...), "
            f"EveryNSteps(n)), got {every!r}"
        )
    if isinstance(every, AutoInterval) and (not isinstance(every.budget, (int, float)) or not 0 < every.budget < 1):
        raise ValueError(
            f"AutoInterval(budget=...) is the share of the step time snapshots may cost, between 0 and 1 "
            f"(0.02 = 2%), got {every.budget!r}"
        )
