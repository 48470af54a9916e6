"""What a run did, as events: the controller says what happened, the recorder writes it down.

The controller decides and executes; every event it logs about a world, a failure or a
recovery is built here, from the controller's own records, so the loop reads as decisions.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ray_elastic.config import ElasticConfig
from ray_elastic.control.states import OutcomeKind, RunOutcome
from ray_elastic.decide import RestorePlan, RestoreSource
from ray_elastic.observe import event_types as ev
from ray_elastic.observe import goodput, results
from ray_elastic.observe.events import EventLog
from ray_elastic.observe.results import RecoveryRecord, WorldChange, WorldRecord
from ray_elastic.observe.step_ledger import StepLedger

logger = logging.getLogger(__name__)


class RunRecorder:
    """The event log, the step ledger and the recoveries of one run."""

    def __init__(self, events: EventLog, ledger: StepLedger):
        self.events, self.ledger = events, ledger
        self.recoveries: list[RecoveryRecord] = []

    def result(
        self,
        worlds: list[WorldRecord],
        num_steps: int,
        first_step: int,
        wall_s: float,
        config: ElasticConfig,
        *,
        show_goodput: bool,
    ) -> results.FitResult:
        """What ``fit`` returns: the steps, recoveries and summary, with the goodput table (printed
        too with ``show_goodput``)."""
        gp = goodput.account(self.events.events)
        if show_goodput:
            print(gp.table())
        return results.summarize(
            ledger=self.ledger,
            worlds=worlds,
            recoveries=self.recoveries,
            events=self.events.events,
            num_steps=num_steps,
            first_step=first_step,
            wall_s=wall_s,
            hosts_per_slice=config.slice.num_hosts,
            gp=gp,
        )

    def started(self, config: ElasticConfig, num_steps: int, resume: Any, resume_dir: str | None) -> None:
        """The run starts (from ``resume``, a checkpoint, when given)."""
        self.events.emit(
            ev.RunStarted(
                num_steps=num_steps,
                num_slices=config.num_slices,
                mode=config.mode,
                checkpoint_dir=config.checkpoint_dir,
                resume_from_checkpoint=resume.step if resume else None,
            )
        )
        if resume is None:
            return
        meta = resume.metadata
        self.events.emit(
            ev.Resume(
                checkpoint_step=resume.step, directory=resume_dir, task=meta.get("task"), saved_world=meta.get("world")
            )
        )
        changed = results.resume_changes(meta, seed=config.seed, global_batch_size=config.global_batch_size)
        if changed:
            self.events.emit(ev.ResumeConfigChanged(changed=changed))

    def taken_over(
        self,
        held: dict[Any, Any],
        snapshot_step: int,
        previous: int | None,
        *,
        refused: list[Any] | None = None,
        why: str = "",
        released: str = "",
        dropped: int = 0,
    ) -> None:
        """The run follows an earlier driver of it: what that one logged last, what its keepers hold
        and which of their snapshots this run refuses, and why (a rewind must be explainable)."""
        if held or previous is not None or released or dropped:
            self.events.emit(
                ev.Rerun(
                    previous_last_step=previous,
                    snapshot_step=snapshot_step,
                    held=held,
                    refused_steps=list(refused or []),
                    refused_why=why,
                    released=released,
                    dropped_snapshots=dropped,
                )
            )

    def waiting(self, state: str, what: str, *, ready: int, asked: int, waited_s: float, demand: str) -> None:
        """What the run waits for and what is missing: a job waiting minutes for TPU capacity must not
        look hung. A ``waiting`` event (the progress line shows it) and a log line."""
        self.events.emit(ev.Waiting(state=state, ready=ready, asked=asked, waited_s=waited_s, demand=demand))
        logger.warning("%s; pending slice demand (what the autoscaler sees): %s", what, demand)

    def failure(
        self,
        seen: Any,
        outcome: RunOutcome,
        decision: Any,
        first: BaseException,
        *,
        now: float,
        last_progress_at: float,
        classified_at: float,
    ) -> None:
        """A world failed: what was seen (``seen``: the world's evidence) and what the policy decided."""
        verdict = decision.verdict
        self.events.emit(
            ev.Failure(
                generation=seen.generation,
                cause=outcome.kind,
                kinds=seen.kinds,
                world_slices=len(seen.slices),
                vouched_slices=sorted(seen.vouched),
                lost_slices=list(verdict.lost_slices),
                crashed_slices=list(verdict.crashed_slices),
                quarantined_slices=list(verdict.quarantined),
                error=str(first)[:2000],
                last_step=self.ledger.last_step,
                origin=seen.origin,
                failures_in_a_row=decision.failures_in_a_row,
                since_last_progress_s=now - last_progress_at,
                drain_s=outcome.drain_s,
                classify_s=classified_at - now,
                detection_latency_s=classified_at - last_progress_at,
            )
        )

    def lost_while_waiting(self, generation: int, names: list[str]) -> None:
        """Survivors' hosts died while replacements were awaited."""
        self.events.emit(
            ev.LostWhileWaiting(
                generation=generation,
                lost_slices=names,
                kinds={n: "node_died" for n in names},
                last_step=self.ledger.last_step,
            )
        )

    def world_ran(self, world: Any, start: int, seconds: float, outcome: RunOutcome, streams: Any) -> None:
        """A world's steps ended: snapshots its holders did not keep, the last steps, how it ended."""
        if streams.not_kept:  # a holder's snapshots are not there: a later recovery may rewind (say why now)
            self.events.emit(
                ev.SnapshotNotKept(
                    generation=world.plan.generation, count=streams.not_kept_count, first=streams.not_kept
                )
            )
        self.ledger.flush()
        self.events.emit(
            ev.ChunkRun(
                generation=world.plan.generation,
                first_step=start,
                last_step=self.ledger.last_step,
                seconds=seconds,
                outcome=outcome.kind,
            )
        )

    def _planned_change(
        self, change: WorldChange, record: WorldRecord, restore: RestorePlan, rewound: int, before: WorldRecord | None
    ) -> None:
        """A world formed at a planned step boundary: a grow-back (``scale_up``), or warned slices
        gone (``slice_left``); neither is a recovery."""
        ready_at = time.time()
        common: dict[str, Any] = dict(
            generation=record.generation,
            to_slices=len(record.slices),
            restored_from_step=restore.step,
            steps_rewound=rewound,
            pause_s=ready_at - change.last_progress_at,
            ready_at=ready_at,
        )
        if change.cause is OutcomeKind.GROW:
            self.events.emit(
                ev.ScaleUp(from_slices=len(change.survivors), resize_s=ready_at - change.detected_at, **common)
            )
        else:
            self.events.emit(ev.SliceLeft(from_slices=len(before.slices) if before else len(record.slices), **common))

    def world_formed(
        self,
        change: WorldChange,
        record: WorldRecord,
        restore: RestorePlan,
        *,
        before: WorldRecord | None,
        added: int,
        wait_s: float,
        capacity_ready_at: float,
        mode: str,
        saved_by: dict[Any, Any] | None,
    ) -> None:
        """A world formed after ``change``: the world, where its state came from, and the recovery
        or grow-back it ends (the steps after the restored one are forgotten: they run again)."""
        self.events.emit(record)
        if restore.source is RestoreSource.CHECKPOINT:
            self.events.emit(
                ev.CheckpointRestore(
                    step=record.start_step,
                    generation=record.generation,
                    seconds=record.times["state_load_s"],
                    saved_by=saved_by,
                )
            )
        rewound = self.ledger.rewind_to(restore.step)
        size = len(record.slices)
        if change.cause in (OutcomeKind.GROW, OutcomeKind.LEAVE):
            self._planned_change(change, record, restore, rewound, before)
        elif change.cause is not OutcomeKind.DONE:  # not the first world: a recovery
            rec = results.recovery_record(
                change,
                record,
                mode=mode,
                added=added,
                rewound=rewound,
                wait_s=wait_s,
                capacity_ready_at=capacity_ready_at,
            )
            self.recoveries.append(rec)
            self.events.emit(rec)
            if before is not None and len(before.slices) != size:
                self.events.emit(ev.Resize(generation=rec.generation, from_slices=len(before.slices), to_slices=size))
