"""Planned changes of the world at a step boundary: growing back, and slices alive that should go leaving.

Neither is a failure: the world stopped itself at a step boundary (every holder snapshotted
that step), the in-flight checkpoint commits, the world is torn down, and the next world forms
through the one path every world takes. A warned slice (its hosts drained: a preemption notice)
leaves before it is taken, so its loss costs a grow-back's pause instead of a failure's detection
and rewind; a straggler (every step waits for it) leaves when the world is faster without it or a
spare can replace it. When no staying slice holds snapshots, the boundary step is committed to a
checkpoint first (with a checkpoint directory).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ray_elastic.config import ElasticConfig
from ray_elastic.control.backend import ClusterHealth, WorldHandle
from ray_elastic.control.final_checkpoint import finish_checkpoints
from ray_elastic.control.run_checkpoints import RunCheckpoints
from ray_elastic.control.states import OutcomeKind, RunOutcome
from ray_elastic.decide import Notice, plan_exit, warned_slices
from ray_elastic.decide.stragglers import Straggler, straggler_action
from ray_elastic.errors import ProcessFailed
from ray_elastic.observe import event_types as ev
from ray_elastic.observe.events import EventLog
from ray_elastic.observe.results import WorldChange
from ray_elastic.observe.step_ledger import StepLedger

logger = logging.getLogger(__name__)
NOTICE_POLL_S = 0.5  # how often a running world's hosts are checked for drain notices (one GCS call)


class NoticeWatch:
    """Drain notices for the current members' hosts, asked of the cluster at most every ``NOTICE_POLL_S``."""

    def __init__(self, health: ClusterHealth, member_nodes: Any):
        self.health, self.member_nodes = health, member_nodes
        self.notices: dict[str, Notice] = {}
        self._next = 0.0

    def poll(self) -> dict[str, Notice]:
        now = time.monotonic()
        if now < self._next:
            return self.notices
        self._next = now + NOTICE_POLL_S
        try:
            draining = self.health.draining()
        except Exception as e:  # noqa: BLE001 - a GCS hiccup: no notice this time; the failure path still holds
            logger.warning("could not read the cluster's drain notices: %r", e)
            return self.notices
        self.notices = warned_slices(self.member_nodes(), draining)
        return self.notices

    def forget(self) -> None:
        """The warned slices left: nothing of them may stop the next world; the next poll asks afresh."""
        self.notices, self._next = {}, 0.0


def _commit_and_tear_down(
    checkpoints: RunCheckpoints, world: WorldHandle, ledger: StepLedger, outcome: RunOutcome, save_step: int | None
) -> RunOutcome | None:
    """The in-flight save commits (``save_step`` saved first), then the world is torn down; a process
    dying meanwhile turns the planned change into a failure (returned as that outcome)."""
    try:
        finish_checkpoints(checkpoints, world, ledger, save_step=save_step)
    except ProcessFailed as e:
        return RunOutcome(OutcomeKind.FAILURE, {e.process: e.cause}, outcome.last_progress_at)
    world.teardown()
    return None


def stop_to_grow(
    checkpoints: RunCheckpoints, world: WorldHandle, ledger: StepLedger, members: list[Any], outcome: RunOutcome
) -> WorldChange | RunOutcome:
    """Capacity returned: the in-flight save commits, then the world is torn down. A process dying
    meanwhile turns the grow into a failure (returned as that outcome)."""
    now, t0 = time.time(), time.perf_counter()
    failed = _commit_and_tear_down(checkpoints, world, ledger, outcome, None)
    if failed is not None:
        return failed
    return WorldChange(
        OutcomeKind.GROW,
        list(members),
        "capacity returned",
        now,
        outcome.last_progress_at or now,
        teardown_s=time.perf_counter() - t0,
    )


def straggler_leaves(found: Straggler, gens: Any, config: ElasticConfig, events: EventLog) -> bool:
    """A straggler measured by the backend: a ``straggler`` event with what is decided
    (:func:`~ray_elastic.decide.stragglers.straggler_action`); True when it is to leave the world
    (replaced by a ready spare, or evicted because the world is faster without it)."""
    names = list(gens.world.plan.slice_names) if gens.world is not None else []
    if found.slice_name not in names:
        return False
    # Pause-and-resume trains at full size only: a straggler there is replaced, never evicted.
    floor = len(names) if config.mode == "pause-and-resume" else (config.min_slices or 1)
    action = straggler_action(found, len(names), floor, bool(gens.ready_replacements()), config.failure.on_straggler)
    events.emit(
        ev.Straggler(
            slice=found.slice_name,
            process=found.process,
            slowdown=round(found.slowdown, 3),
            ratio=round(found.ratio, 3),
            data_bound=found.data_bound,
            action=action,
            evidence=found.evidence(),
        )
    )
    return action != "report"


def leave(
    checkpoints: RunCheckpoints,
    world: WorldHandle,
    ledger: StepLedger,
    gens: Any,
    leaving: dict[str, Notice | Straggler],
    events: EventLog,
    outcome: RunOutcome,
) -> WorldChange | RunOutcome:
    """Slices alive that should go leave at this step boundary (warned ones, stragglers): the state
    is made safe (the in-flight save commits; the boundary step is saved too when no staying slice
    holds snapshots), the world is torn down, each leaving slice is dropped and a replacement asked
    for (the autoscaler's demand; a straggler's hosts stay held, so it is not placed there again),
    and a ``preemption_notice`` event per warned slice says how much of its notice was left."""
    now, t0 = time.time(), time.perf_counter()
    names = list(world.plan.slice_names)
    plan = plan_exit(names, set(leaving), names[: world.plan.snapshot_slices], bool(checkpoints.own))
    failed = _commit_and_tear_down(
        checkpoints, world, ledger, outcome, ledger.last_step + 1 if plan.checkpoint_first else None
    )
    if failed is not None:
        return failed
    out_at = time.time()
    for name in plan.leaving:
        why = leaving[name]
        if isinstance(why, Notice):
            events.emit(
                ev.PreemptionNotice(
                    slice=name,
                    hosts=list(why.hosts),
                    reason=why.reason,
                    deadline=why.deadline,
                    seconds_left=why.seconds_left(out_at),
                    step=ledger.last_step,
                    state_kept_by=plan.state_kept_by,
                )
            )
    if plan.state_kept_by == "nothing":
        logger.warning(
            "slices %s leave and no staying slice holds snapshots (and the run has no checkpoint_dir): "
            "the next world restores what it can",
            list(plan.leaving),
        )
    stragglers = {n for n in plan.leaving if isinstance(leaving[n], Straggler)}
    survivors = gens.split(set(plan.leaving), stragglers)
    what = ", ".join(f"{n} ({'straggler' if n in stragglers else 'preemption notice'})" for n in plan.leaving)
    return WorldChange(
        OutcomeKind.LEAVE,
        survivors,
        f"leaving: {what}",
        now,
        outcome.last_progress_at or now,
        teardown_s=time.perf_counter() - t0,
    )
