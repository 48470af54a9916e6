"""Planned changes of the world at a step boundary: growing back, and warned slices leaving.

Neither is a failure: the world stopped itself at a step boundary (every holder snapshotted
that step), the in-flight checkpoint commits, the world is torn down, and the next world forms
through the one path every world takes. A warned slice (its hosts drained: a preemption notice)
leaves before it is taken, so its loss costs a grow-back's pause instead of a failure's detection
and rewind; when no staying slice holds snapshots, the boundary step is committed to a checkpoint
first (with a checkpoint directory).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ray_elastic.control.backend import ClusterHealth, WorldHandle
from ray_elastic.control.final_checkpoint import finish_checkpoints
from ray_elastic.control.run_checkpoints import RunCheckpoints
from ray_elastic.control.states import OutcomeKind, RunOutcome
from ray_elastic.decide import Notice, plan_exit, warned_slices
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


def stop_to_grow(
    checkpoints: RunCheckpoints, world: WorldHandle, ledger: StepLedger, members: list[Any], outcome: RunOutcome
) -> WorldChange | RunOutcome:
    """Capacity returned: the in-flight save commits, then the world is torn down. A process dying
    meanwhile turns the grow into a failure (returned as that outcome)."""
    now, t0 = time.time(), time.perf_counter()
    try:
        finish_checkpoints(checkpoints, world, ledger)
    except ProcessFailed as e:
        return RunOutcome(OutcomeKind.FAILURE, {e.process: e.cause}, outcome.last_progress_at)
    world.teardown()
    return WorldChange(
        OutcomeKind.GROW,
        list(members),
        "capacity returned",
        now,
        outcome.last_progress_at or now,
        teardown_s=time.perf_counter() - t0,
    )


def leave_warned(
    checkpoints: RunCheckpoints,
    world: WorldHandle,
    ledger: StepLedger,
    gens: Any,
    notices: dict[str, Notice],
    events: EventLog,
    outcome: RunOutcome,
) -> WorldChange | RunOutcome:
    """Warned slices leave at this step boundary: the state is made safe (the in-flight save
    commits; the boundary step is saved too when no staying slice holds snapshots), the world is
    torn down, each warned slice is dropped and a replacement asked for (the autoscaler's demand),
    and a ``preemption_notice`` event per slice says how much of its notice was left."""
    now, t0 = time.time(), time.perf_counter()
    names = list(world.plan.slice_names)
    plan = plan_exit(names, set(notices), names[: world.plan.snapshot_slices], bool(checkpoints.own))
    try:
        finish_checkpoints(
            checkpoints, world, ledger, save_step=ledger.last_step + 1 if plan.checkpoint_first else None
        )
    except ProcessFailed as e:
        return RunOutcome(OutcomeKind.FAILURE, {e.process: e.cause}, outcome.last_progress_at)
    world.teardown()
    out_at = time.time()
    for name in plan.leaving:
        notice = notices[name]
        events.emit(
            ev.PreemptionNotice(
                slice=name,
                hosts=list(notice.hosts),
                reason=notice.reason,
                deadline=notice.deadline,
                seconds_left=notice.seconds_left(out_at),
                step=ledger.last_step,
                state_kept_by=plan.state_kept_by,
            )
        )
    if plan.state_kept_by == "nothing":
        logger.warning(
            "slices %s were warned and no staying slice holds snapshots (and the run has no checkpoint_dir): "
            "the next world restores what it can",
            list(plan.leaving),
        )
    survivors = gens.split(set(plan.leaving))
    return WorldChange(
        OutcomeKind.PREEMPTED,
        survivors,
        f"preemption notice for {', '.join(plan.leaving)}",
        now,
        outcome.last_progress_at or now,
        teardown_s=time.perf_counter() - t0,
    )
