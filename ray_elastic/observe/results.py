"""What a run produced, as typed records, and the pure functions that sum it up.

No Ray, no JAX: the records are filled by the controller and the summary is
computed from them, like :func:`ray_elastic.observe.goodput.account` from the event log.
Every ``*_at`` field is wall-clock time (``time.time()``), every ``*_s`` a duration.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from typing import Any

from ray_elastic.observe import event_types as ev
from ray_elastic.observe import goodput
from ray_elastic.observe.events import read_lines
from ray_elastic.observe.step_ledger import StepLedger, user_metrics

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WorldChange:
    """What the last world left for the next one: its surviving slices, and why it ended."""

    cause: str  # an OutcomeKind; DONE for the first world
    survivors: list
    reason: str
    detected_at: float  # the first failure's, through failures while forming
    last_progress_at: float
    classify_s: float = 0.0
    teardown_s: float = 0.0
    steps_kept: int | None = None  # a rollback: the steps it keeps (before it, the replicas agreed)


# The records a run keeps are the events it logs.
WorldRecord = ev.WorldFormed
RecoveryRecord = ev.Recovered
ScaleUpRecord = ev.ScaleUp


def recovery_record(
    change: WorldChange,
    world: WorldRecord,
    *,
    mode: str,
    added: int,
    rewound: int,
    wait_s: float,
    capacity_ready_at: float,
) -> RecoveryRecord:
    """The record of a recovery that ``change`` started and ``world`` ended (now)."""
    t, now = world.times, time.time()
    return RecoveryRecord(
        generation=world.generation,
        reason=change.reason,
        mode=mode,
        slices=len(world.slices),
        added_slices=added,
        restored_from_step=world.start_step - 1,
        restore_source=world.restore_source,
        steps_rewound=rewound,
        since_last_progress_s=change.detected_at - change.last_progress_at,
        classify_s=change.classify_s,
        teardown_s=change.teardown_s,
        wait_for_capacity_s=wait_s,
        world_formation_s=t["total_s"] - t["state_load_s"] - t["compile_s"],
        state_load_s=t["state_load_s"],
        compile_s=t["compile_s"],
        recovery_s=now - change.detected_at,
        detected_at=change.detected_at,
        capacity_ready_at=capacity_ready_at,
        ready_at=now,
    )


@dataclasses.dataclass(frozen=True)
class RunSummary:
    """The numbers of a finished run (``FitResult.summary`` is its dict view)."""

    steps: int
    num_steps: int
    wall_s: float
    resumed_from_checkpoint: int | None = None
    already_done: bool = False
    goodput: float | None = None
    slices: int | None = None
    hosts_per_slice: int | None = None
    mesh: dict | None = None
    global_batch_size: int | None = None
    first_loss: float | None = None
    final_loss: float | None = None
    generations: int = 0
    failures: int = 0
    recoveries: int = 0
    scale_ups: int = 0
    preemption_notices: int = 0  # slices that left on a drain notice (planned, not failures)
    steps_skipped: int = 0  # bad steps whose update was not applied (a non-finite loss, a spike)
    checkpoints_saved: int = 0
    checkpoints_committed: int = 0
    checkpoint_restores: int = 0
    steps_rewound: int = 0
    max_recovery_s: float = 0.0
    startup_s: float | None = None  # reserving, starting, jax.distributed, the first state (the goodput's startup)
    compile_s: float | None = None
    median_step_s: float | None = None
    snapshot_every: int | None = None  # the last snapshot interval (the snapshot policy picks it)
    max_rewind_steps: int | None = None  # the most a recovery could rewind with a holder alive (interval - 1)
    resumed_from_snapshot: int | None = None  # a rerun: the step a lost driver's keepers held
    steps_rewound_on_resume: int | None = None  # a rerun: the earlier driver's last step - the resumed one


@dataclasses.dataclass
class FitResult:
    """What ``fit`` returns: per-step metrics, recoveries and a summary of the run."""

    steps: list[int]
    losses: list[float]
    step_times_s: list[float]
    recoveries: list[RecoveryRecord]
    summary: dict[str, Any]
    events: list[ev.Event]
    metrics: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # what the loss returned, per step
    evals: dict[int, dict] = dataclasses.field(default_factory=dict)  # step -> its eval's ``eval/...`` metrics

    def __repr__(self) -> str:
        return (
            f"FitResult(steps={len(self.steps)}, final_loss={self.losses[-1] if self.losses else None}, "
            f"recoveries={len(self.recoveries)}, summary={self.summary})"
        )


def _resumed(events: list, first: WorldRecord, first_step: int) -> dict:
    """Where the run started from: a checkpoint, or (a rerun after a lost driver) the snapshots its
    keepers held, and how many of the earlier driver's steps that rewound."""
    rerun = next((e for e in events if isinstance(e, ev.Rerun)), None)
    at = first.start_step - 1  # the first world's state is the one after this step
    known = rerun is not None and rerun.previous_last_step is not None
    return {
        "resumed_from_checkpoint": first_step if first_step and first.restore_source == "checkpoint" else None,
        "resumed_from_snapshot": at if rerun is not None and first.restore_source == "snapshot" else None,
        "steps_rewound_on_resume": max(0, rerun.previous_last_step - at) if known else None,
    }


def summarize(
    *,
    ledger: StepLedger,
    worlds: list[WorldRecord],
    recoveries: list[RecoveryRecord],
    events: list[ev.Event],
    num_steps: int,
    first_step: int,
    wall_s: float,
    hosts_per_slice: int,
    gp: goodput.Goodput,
) -> FitResult:
    """The result of a finished run, from its records and events alone."""
    steps = sorted(ledger.metrics)
    losses = [ledger.metrics[s]["loss"] for s in steps]
    times = [ledger.metrics[s]["step_time_s"] for s in steps]
    steady, last = sorted(times[1:]) or times, worlds[-1]

    def count(kind: type, distinct=id) -> int:  # ``distinct``: what makes two events one (a replayed step)
        return len({distinct(e) for e in events if isinstance(e, kind)})

    intervals = [e.every for e in events if isinstance(e, ev.SnapshotInterval)]
    # Steps run twice, by recoveries and by grow-backs alike (a grow-back should rewind none).
    rewound = sum(r.steps_rewound for r in recoveries) + sum(
        e.steps_rewound for e in events if isinstance(e, ev.PlannedChange)
    )

    summary = RunSummary(
        steps=len(steps),
        num_steps=num_steps,
        wall_s=round(wall_s, 3),
        **_resumed(events, worlds[0], first_step),
        goodput=round(gp.goodput, 4),
        slices=len(last.slices),
        hosts_per_slice=hosts_per_slice,
        mesh=last.mesh,
        global_batch_size=last.global_batch_size,
        first_loss=losses[0] if losses else None,  # None: the run resumed at its last step
        final_loss=losses[-1] if losses else None,
        generations=len(worlds),
        failures=count(ev.FailureEvent),
        recoveries=len(recoveries),
        scale_ups=count(ev.ScaleUp),
        preemption_notices=count(ev.PreemptionNotice),
        steps_skipped=count(ev.StepSkipped, lambda e: e.step),
        checkpoints_saved=count(ev.CheckpointSave),
        checkpoints_committed=count(ev.CheckpointCommitted),
        checkpoint_restores=count(ev.CheckpointRestore),
        steps_rewound=rewound,
        max_recovery_s=round(max((r.recovery_s for r in recoveries), default=0.0), 3),
        startup_s=round(gp.badput_s.get("startup", 0.0), 3),  # as the goodput table counts it
        compile_s=round(worlds[0].times["compile_s"], 3),
        median_step_s=steady[len(steady) // 2] if steady else None,
        snapshot_every=intervals[-1] if intervals else None,
        max_rewind_steps=max(intervals) - 1 if intervals and min(intervals) > 0 else None,
    )
    return FitResult(
        steps,
        losses,
        times,
        list(recoveries),
        dataclasses.asdict(summary),
        list(events),
        user_metrics([ledger.metrics[s] for s in steps]),
        dict(sorted(ledger.evals.items())),
    )


def unexplained_rewinds(events: list, replicas: int) -> int:
    """Steps rewound although a snapshot holder of the newest step survived, read from a run's events
    (``replicas``: its ``snapshot_replicas``; the holders are the first slices of each world).

    A rewind is explained when every holder of the world that failed was lost or had its process
    die (a dead process's newest snapshot can lack the step it died in), counting every failure
    until the next world trained, or when each rewound step's snapshot failed on a survivor because
    the step itself failed there (``snapshot_not_kept`` with a collective error: a peer got the
    reduced loss, reported it and died before the survivor's all-reduce finished, so no living
    process ever had that state), or when replicas that disagreed with no majority were rolled back
    (``replica_mismatch``, action ``rollback``); a planned grow-back never rewinds."""
    holders, chain_holders, gone, in_chain, unexplained, rolled_back = [], [], set(), False, 0, False
    unfinished: set[int] = set()  # steps whose snapshot failed in the step's own collective
    for e in ev.parse_all(events):
        if isinstance(e, ev.WorldFormed):
            formed = e.slices[:replicas]
            if not in_chain:
                holders = formed
        elif isinstance(e, ev.SnapshotNotKept):
            unfinished |= {n["step"] for n in e.first if "JaxRuntimeError" in n["why"]}
        elif isinstance(e, ev.ReplicaMismatch) and e.action == "rollback":
            rolled_back = True
        elif isinstance(e, ev.FailureEvent):
            if not in_chain:
                chain_holders, gone, in_chain = holders, set(), True
            gone |= e.gone_slices
        elif isinstance(e, (ev.Recovered, ev.PlannedChange)):
            rewound = range(e.restored_from_step + 1, e.restored_from_step + 1 + e.steps_rewound)
            if (not in_chain or not set(chain_holders) <= gone) and not set(rewound) <= unfinished and not rolled_back:
                unexplained += e.steps_rewound
            holders, in_chain, unfinished, rolled_back = formed, False, set(), False
    return unexplained


def already_done(*, checkpoint_step: int, num_steps: int, wall_s: float, events: list[ev.Event]) -> FitResult:
    """The checkpoint already covers ``num_steps``: nothing was trained."""
    summary = RunSummary(
        steps=0,
        num_steps=num_steps,
        wall_s=round(wall_s, 3),
        resumed_from_checkpoint=checkpoint_step,
        already_done=True,
    )
    return FitResult([], [], [], [], dataclasses.asdict(summary), list(events))


def resume_changes(metadata: dict, *, seed: int, global_batch_size: int) -> dict[str, tuple]:
    """Settings that changed since the checkpoint was written and change the data order: name -> (then, now)."""
    now = {"seed": seed, "data_stride": global_batch_size}
    changed = {k: (metadata.get(k), v) for k, v in now.items() if metadata.get(k) is not None and metadata.get(k) != v}
    if changed:
        logger.warning(
            "the checkpoint was written with %s; this run uses %s: the data order differs",
            {k: a for k, (a, _) in changed.items()},
            {k: b for k, (_, b) in changed.items()},
        )
    return changed


@dataclasses.dataclass(frozen=True)
class PreviousRun:
    """What the run before this one in a run directory left in its log."""

    last_step: int | None  # the newest step it logged with a finite loss (and every loss before it)
    ended: bool  # it finished or stopped with an error (False: its driver was lost mid-run)


def previous_run(run_dir: str | None) -> PreviousRun:
    """The runs before this one in ``run_dir``'s log, read before this one trains (its
    ``run_started`` is written; a concurrent rerun's may follow); ``PreviousRun(None, True)``
    without one. Steps from a run's first non-finite loss on do not count."""
    path = os.path.join(run_dir, "events.jsonl") if run_dir else ""
    if not path or not os.path.exists(path):
        return PreviousRun(None, True)
    runs: list[tuple[list[int], list[bool]]] = [([], [True])]  # per run: steps, [ended, finite so far]
    for e in read_lines(path):
        kind = e.get("kind")
        steps, flags = runs[-1]
        if kind == "run_started":
            runs.append(([], [False, True]))
        elif kind in ("run_finished", "errored"):
            flags[0] = True
        elif kind == "steps" and flags[-1]:
            skipped = set(e.get("skipped") or ())  # a bad step not kept: the state after it is the one before
            for step, loss in zip(e.get("steps") or [], e.get("losses") or []):
                if step not in skipped and not (isinstance(loss, (int, float)) and math.isfinite(loss)):
                    flags[-1] = False  # a NaN step: neither it nor a later one may be restored
                    break
                steps.append(step)
    if len(runs) < 3:
        return PreviousRun(None, True)
    # The lost runs before this one (a lost driver, then reruns that were themselves lost or
    # superseded, a concurrent rerun's start among them), back to the last run that ended after
    # training (one that trained nothing, such as a refused rerun, changes nothing). This run has
    # logged no step yet: steps after its ``run_started`` are an older driver's, still running.
    lost: list[int] = list(runs[-1][0])
    any_lost = bool(lost)
    for steps, (ended, *_) in reversed(runs[1:-1]):
        if ended and steps:
            if not any_lost:
                return PreviousRun(max(steps), True)
            break
        if not ended:
            any_lost = True
            lost.extend(steps)
    return PreviousRun(max(lost, default=None), not any_lost)
