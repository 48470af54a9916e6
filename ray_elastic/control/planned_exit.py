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

import dataclasses
import logging
import time
from typing import Any

from ray_elastic.config import ElasticConfig
from ray_elastic.control.backend import ClusterHealth, WorldHandle
from ray_elastic.control.final_checkpoint import finish_checkpoints
from ray_elastic.control.run_checkpoints import RunCheckpoints
from ray_elastic.control.states import OutcomeKind, RunOutcome
from ray_elastic.decide import Notice, leave_now, plan_exit, warned_slices
from ray_elastic.decide.integrity import Mismatch
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


@dataclasses.dataclass
class PlannedStop:
    """Why a running world should stop at its next step boundary: slices alive that should go
    (warned, a straggler, a replica out-voted), or replicas that disagree with no majority."""

    leaving: dict[str, Notice | Straggler | Mismatch]
    rollback: Mismatch | None = None

    def update(self, other: PlannedStop) -> None:
        self.leaving.update(other.leaving)
        self.rollback = self.rollback or other.rollback

    def going(self) -> set[str]:
        """The slices that go even when a failure overtakes the stop: those out-voted by the other
        replicas, and stragglers (a warned slice's notice is read again by the next world)."""
        return {name for name, why in self.leaving.items() if isinstance(why, Mismatch | Straggler)}

    @property
    def kind(self) -> OutcomeKind | None:
        return OutcomeKind.ROLLBACK if self.rollback else OutcomeKind.LEAVE if self.leaving else None


def planned_stop(
    warned: dict[str, Notice], streams: Any, gens: Any, config: ElasticConfig, events: EventLog
) -> PlannedStop:
    """What should stop the world now: the ``warned`` slices (once the staying slices' standbys have
    started, or their deadline is near: :func:`~ray_elastic.decide.notices.leave_now`), a straggler
    the backend confirmed that is to leave, and replicas found to disagree (a ``replica_mismatch``
    event: the out-voted slices leave; with no majority, a rollback)."""
    if warned:
        staying = [r for r in gens.members if r.slice_name not in warned]
        if not leave_now(list(warned.values()), time.time(), gens.backend.warm(staying, every=True)):
            warned = {}  # the world trains on while they start; asked again at the next read
    stop = PlannedStop(dict(warned))
    found = streams.take_straggler()
    if found is not None and straggler_leaves(found, gens, config, events):
        stop.leaving[found.slice_name] = found
    mismatch = streams.take_mismatch()
    if mismatch is not None:
        action = "evict" if mismatch.corrupt else "rollback"
        events.emit(
            ev.ReplicaMismatch(
                step=mismatch.step,
                slices=list(mismatch.corrupt),
                arrays=list(mismatch.arrays),
                agreed_step=mismatch.agreed_step,
                action=action,
            )
        )
        stop.leaving.update(dict.fromkeys(mismatch.corrupt, mismatch))
        stop.rollback = None if mismatch.corrupt else mismatch
    return stop


def roll_back(
    checkpoints: RunCheckpoints,
    world: WorldHandle,
    gens: Any,
    ledger: StepLedger,
    mismatch: Mismatch,
    outcome: RunOutcome,
    confirm_s: float,
) -> WorldChange:
    """Replicas disagree and none can be told corrupt (two of them): nothing after the newest step
    they agreed on is trusted. The world is torn down without committing its in-flight save (once
    its processes are gone: ``confirm_s``), the snapshots after that step are forgotten and the
    run's own checkpoints after it set aside, and the same slices form the next world from what is
    left of that step or before (the steps after it run again)."""
    now, t0 = time.time(), time.perf_counter()
    world.teardown(confirm_s=confirm_s)
    gens.store.drop_after(mismatch.agreed_step)
    _set_aside_suspect(checkpoints, ledger, [mismatch.agreed_step])
    return WorldChange(
        OutcomeKind.ROLLBACK,
        list(gens.members),
        f"replicas disagree after step {mismatch.step} with no majority: back to step {mismatch.agreed_step}",
        now,
        outcome.last_progress_at or now,
        teardown_s=time.perf_counter() - t0,
        steps_kept=mismatch.agreed_step + 1,
    )


def leave(
    checkpoints: RunCheckpoints,
    world: WorldHandle,
    ledger: StepLedger,
    gens: Any,
    leaving: dict[str, Notice | Straggler | Mismatch],
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
    _set_aside_suspect(checkpoints, ledger, [r.agreed_step for r in leaving.values() if isinstance(r, Mismatch)])
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
    held = {n for n in plan.leaving if not isinstance(leaving[n], Notice)}  # its hosts are not to be used again
    warned = frozenset(plan.leaving) - held  # alive until the deadline: freed after the next world's first step
    survivors = gens.split(set(plan.leaving), held, warned)  # and its snapshots forgotten
    what = ", ".join(f"{n} ({_why(leaving[n])})" for n in plan.leaving)
    return WorldChange(
        OutcomeKind.LEAVE,
        survivors,
        f"leaving: {what}",
        now,
        outcome.last_progress_at or now,
        teardown_s=time.perf_counter() - t0,
    )


def _set_aside_suspect(checkpoints: RunCheckpoints, ledger: StepLedger, agreed: list[int]) -> None:
    """The run's own checkpoints saved since the replicas last agreed may hold a corrupt replica's
    blocks (a replicated array is written from one replica): set aside (kept, never restored)."""
    if agreed:
        directory, step = checkpoints.newest()
        checkpoints.set_aside_newer(directory, step, min(agreed), why="suspect")
        ledger.set_aside(min(agreed) + 1)  # checkpoint n holds the state after step n - 1


def _why(reason: Notice | Straggler | Mismatch) -> str:
    return {Notice: "preemption notice", Straggler: "straggler", Mismatch: "corrupt replica"}[type(reason)]
