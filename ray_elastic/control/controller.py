"""The single controller: it reserves slices, forms worlds, drives steps and recovers, through a backend.

``ElasticTrainer(task, config).fit(num_steps)`` (:mod:`ray_elastic.trainer`: this controller on the Ray
backend) is the whole API. ``fit`` is one loop over typed :class:`~ray_elastic.control.states.RunOutcome` s:
a world runs until it is done, fails, hangs, or stops to grow or for slices to leave; every other
outcome is taken in (evidence, verdict, teardown) and handed to the one path to the next world,
which may itself fail while forming: another turn of the loop, never a recursive call. Decisions
are the policies' (``policy/``) and pure functions (``decide/``); membership and forming live in
``generations.py``; every Ray effect goes through the backend (:mod:`ray_elastic.ray_backend`); the
recorder (``recorder.py``) writes down what happened, and observers listen to it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

from ray_elastic.config import ElasticConfig
from ray_elastic.control.backend import Backend, BackendFactory, WorldHandle
from ray_elastic.control.final_checkpoint import final_checkpoint
from ray_elastic.control.generations import Generations
from ray_elastic.control.planned_exit import NoticeWatch, PlannedStop, leave, planned_stop, roll_back, stop_to_grow
from ray_elastic.control.recorder import RunRecorder
from ray_elastic.control.run_checkpoints import RunCheckpoints
from ray_elastic.control.states import ControllerState, OutcomeKind, RunOutcome, check_transition
from ray_elastic.control.takeover import take_over_run
from ray_elastic.decide import refuse_fresh_restart
from ray_elastic.errors import (
    CapacityTimeoutError,
    ElasticRuntimeError,
    StorageFailingError,
    SupersededError,
    failed_save,
)
from ray_elastic.observe import event_types as ev
from ray_elastic.observe import results
from ray_elastic.observe.events import EventLog
from ray_elastic.observe.observers import UserCallbacks
from ray_elastic.observe.results import FitResult, RecoveryRecord, WorldChange
from ray_elastic.observe.run_observers import run_observers
from ray_elastic.observe.step_ledger import StepLedger
from ray_elastic.observe.tensorboard import tensorboard_location
from ray_elastic.policy.failure import FailurePolicy
from ray_elastic.policy.scaling import Action, NextWorld
from ray_elastic.state import checkpoints
from ray_elastic.task import TrainTask

logger = logging.getLogger(__name__)

S = ControllerState
DRAIN_S = 0.3
TEARDOWN_CONFIRM_S = 3.0

__all__ = ["Controller"]


class Controller:
    """The run's controller: its states, decisions and records, driving whatever backend
    ``backend_cls`` makes (:class:`~ray_elastic.control.backend.Backend`). It imports no Ray:
    :class:`~ray_elastic.trainer.ElasticTrainer` gives it the Ray backend, tests a scripted one.
    The arguments are :class:`~ray_elastic.trainer.ElasticTrainer`'s."""

    backend_cls: BackendFactory  # the backend's class (as Ray Train's ``worker_group_cls``); tests replace it
    gens: Generations  # the current run's members, replacements, snapshots and worlds (set by fit)
    backend: Backend

    def __init__(
        self,
        task: TrainTask,
        config: ElasticConfig,
        *,
        address: str | None = None,
        progress: bool = True,
        on_step: Callable[[dict[Any, Any]], None] | None = None,
        retry_policy: Callable[[int, Exception], bool] | None = None,
        pre_callback: Callable[[], None] | None = None,
        on_event: Callable[[ev.Event], None] | None = None,
        run_dir: str | None = None,
        name: str | None = None,
        run_id: str | None = None,
        tensorboard_dir: str | bool | None = None,
    ) -> None:
        if not isinstance(task, TrainTask):
            raise ValueError(f"task must be a ray_elastic.TrainTask, got {type(task).__name__}")
        if not isinstance(config, ElasticConfig):
            raise ValueError(f"config must be a ray_elastic.ElasticConfig, got {type(config).__name__}")
        for arg, cb in (("retry_policy", retry_policy), ("pre_callback", pre_callback)):
            if cb is not None and not callable(cb):
                raise ValueError(f"{arg} must be callable, got {type(cb).__name__}")
        self.callbacks = UserCallbacks(on_step, on_event)
        self.task = task
        self.config = config
        self.address = address
        self.progress = progress
        self.retry_policy = retry_policy
        self.pre_callback = pre_callback
        self.run_dir = run_dir
        self.name = name or (os.path.basename(os.path.normpath(run_dir)) if run_dir else "ray-elastic")
        self.tensorboard_dir = tensorboard_location(tensorboard_dir, run_dir)
        self.run_id = run_id or (os.path.abspath(run_dir) if run_dir else config.checkpoint_dir) or uuid.uuid4().hex
        self._findable = bool(run_id or run_dir or config.checkpoint_dir)  # a rerun can find it: keepers outlive us
        self.state = S.INITIALIZING

    @property
    def world(self) -> WorldHandle | None:
        """The current generation's :class:`~ray_elastic.ray_backend.world.World` (None before the first)."""
        gens = getattr(self, "gens", None)  # set by each fit
        return gens.world if gens else None

    def _formed(self) -> WorldHandle:
        """The current world, in a state that has one."""
        if (world := self.world) is None:
            raise RuntimeError(f"no world in state {self.state}")
        return world

    @property
    def recoveries(self) -> list[RecoveryRecord]:
        return self.record.recoveries if getattr(self, "record", None) else []

    @property
    def worlds(self) -> list[results.WorldRecord]:
        gens = getattr(self, "gens", None)
        return gens.worlds if gens else []

    def _enter(self, new: ControllerState) -> None:
        if not new.is_terminal:
            self._check_owner()
        check_transition(self.state, new)
        logger.info("controller: %s -> %s", self.state.value, new.value)
        old, self.state = self.state, new
        self.events.state(old, new)

    def _check_owner(self) -> None:
        """Stop before the next effect once a newer driver owns the run (learned from any refusal)."""
        if self.backend.ownership.superseded:
            raise SupersededError("another driver took this run over (a rerun of it): this driver stopped")

    def _waiting_for_slices(self, ready: int, asked: int) -> None:
        waited = time.perf_counter() - self._scheduling_since
        what = f"reserving slices: {ready}/{asked} ready after {waited:.0f}s of slice_timeout_s={self.config.slice_timeout_s:.0f}"
        self._report_waiting(what, ready=ready, asked=asked, waited_s=waited)

    def _report_waiting(self, what: str, *, ready: int, asked: int, waited_s: float) -> None:
        self._check_owner()
        demand = self.backend.pending_demand()
        self.record.waiting(self.state.value, what, ready=ready, asked=asked, waited_s=waited_s, demand=demand)

    # --------------------------------------------------------------------- fit
    def fit(self, num_steps: int, *, resume_from: str | None = None) -> FitResult:
        """Train steps ``0 .. num_steps-1``; returns per-step losses, recoveries and a summary.

        With ``checkpoint_dir`` the run resumes from its newest committed checkpoint, if that was
        written by the same task (another task's checkpoints are refused). ``resume_from``: start
        from the newest committed checkpoint of this directory instead, whoever wrote it (another
        run's, or ``checkpoint_dir`` itself to accept another task's); new checkpoints go to
        ``checkpoint_dir``, which must then hold none yet (or be ``resume_from`` itself)."""
        if not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps must be a positive integer, got {num_steps!r}")
        t_start, cfg = time.perf_counter(), self.config
        run_checkpoints, resume = RunCheckpoints.open(cfg, self.task.name(), resume_from)
        self.backend_cls.check_task(self.task, cfg, resume)  # before any cluster resource is taken
        self._new_run(num_steps, resume, run_checkpoints)
        if resume is not None and resume.step >= num_steps:
            logger.warning(
                "checkpoint %d in %s already covers num_steps=%d: nothing to train",
                resume.step,
                cfg.checkpoint_dir,
                num_steps,
            )
            self.events.close()
            return results.already_done(
                checkpoint_step=resume.step,
                num_steps=num_steps,
                wall_s=time.perf_counter() - t_start,
                events=self.events.events,
            )
        try:
            self._loop(num_steps, resume, t_start, resume_from)
        except BaseException as e:
            failed_in = self.state.value
            if not self.state.is_terminal:
                self._enter(S.ERRORED)
            self.events.emit(ev.Errored(state=failed_in, error=repr(e)))
            if isinstance(e, (ElasticRuntimeError, ValueError)) or not isinstance(e, Exception):
                raise  # ours (a refused rerun: ValueError), or KeyboardInterrupt/SystemExit: as they are
            raise ElasticRuntimeError(f"training stopped in state {failed_in}: {e!r}") from e
        finally:
            self.gens.release()
            self.events.close()
        wall_s = time.perf_counter() - t_start
        return self.record.result(self.worlds, num_steps, self._first_step, wall_s, cfg, show_goodput=self.progress)

    def _loop(
        self, num_steps: int, resume: checkpoints.CheckpointInfo | None, t_start: float, resume_from: str | None
    ) -> None:
        """Take over what a lost driver of the run left, reserve, form the first world, then run and
        take in outcomes until the steps are done."""
        self.backend.connect(self.run_id, home=self.run_dir or self.config.checkpoint_dir, findable=self._findable)
        previous = take_over_run(self.backend, self.gens, self.record, self.run_dir, num_steps, resume, resume_from)
        self._lost_steps = previous.last_step + 1 if previous.last_step is not None and not previous.ended else 0
        self._add_observers(num_steps)
        self._enter(S.SCHEDULING)
        self._scheduling_since = time.perf_counter()
        first = self.gens.reserve(on_wait=self._waiting_for_slices)
        change = WorldChange(OutcomeKind.DONE, first, "first world", time.time(), time.time())
        outcome = self._next_world(change, resume) or self._run(num_steps)
        while outcome.kind is not OutcomeKind.DONE:
            change = self._intake(outcome, change)
            outcome = self._next_world(change) or self._run(num_steps)
        self.backend.ownership.confirm()  # a driver superseded at the very end does not return success
        self._enter(S.FINISHED)
        self.events.emit(ev.RunFinished(steps=len(self.ledger.metrics), wall_s=time.perf_counter() - t_start))

    def _new_run(
        self, num_steps: int, resume: checkpoints.CheckpointInfo | None, run_checkpoints: RunCheckpoints
    ) -> None:
        """Everything one run owns starts fresh, so a trainer can ``fit`` again."""
        cfg = self.config
        self.state = S.INITIALIZING
        self.backend = self.backend_cls(self.task, cfg, self.address)
        self.checkpoints = run_checkpoints
        self.gens = Generations(cfg, self.backend, run_checkpoints)
        self.failures = FailurePolicy(cfg.failure, self.retry_policy)
        self._first_step = resume.step if resume else 0
        self.events = EventLog(self.run_dir, [self.callbacks], fenced=lambda: self.backend.ownership.superseded)
        self.ledger = StepLedger(self.events, cfg.steps_per_chunk, cfg.save_timeout_s)
        self.record = RunRecorder(self.events, self.ledger)
        self.record.started(cfg, num_steps, resume, run_checkpoints.start_dir)
        self.notices = NoticeWatch(self.backend.health, self.gens.member_nodes)
        self._stop = PlannedStop({})  # what the running world's stop requests found

    def _add_observers(self, num_steps: int) -> None:
        self.events.listeners += run_observers(
            self.events.events,
            replenish=self.gens.replenish,
            donors_released=self.gens.donors_released,
            metrics=self.backend.run_metrics(self.name),
            progress=(num_steps, self._first_step, self.config) if self.progress else None,
            tensorboard_dir=self.tensorboard_dir,
        )

    # ----------------------------------------------------------------- running
    def _run(self, num_steps: int) -> RunOutcome:
        self._enter(S.RUNNING)
        world, start = self._formed(), self.worlds[-1].start_step
        streams = self._streams = self.backend.drive(world, self.gens.store, self.ledger)
        self.ledger.start_world(world.plan.generation, streams.take_snapshot_steps)
        t0 = time.perf_counter()
        outcome = streams.run(start, num_steps, self._stop_request, self.worlds[-1].snapshot_donors)
        if outcome.kind in (OutcomeKind.FAILURE, OutcomeKind.HANG):  # what survivors streamed, and their keepers hold
            t_drain = time.perf_counter()
            streams.drain(DRAIN_S, outcome.errors)
            outcome = dataclasses.replace(outcome, drain_s=time.perf_counter() - t_drain)
        self.record.world_ran(world, start, time.perf_counter() - t0, outcome, streams)
        if outcome.kind is OutcomeKind.DONE:  # the last checkpoint commits before the run is finished
            self.backend.ownership.confirm()  # asked now, not at the next renewal: no checkpoint of a superseded driver
            outcome = final_checkpoint(self.checkpoints, self.world, self.ledger, num_steps)
        return outcome

    def _stop_request(self) -> OutcomeKind | None:
        """Asked between a running world's reads: stop at the next step boundary, and why (``planned_stop``; or to grow)."""
        self._stop = planned_stop(self.notices.poll(), self._streams, self.gens, self.config, self.events)
        return self._stop.kind or (OutcomeKind.GROW if self.gens.capacity_returned() else None)

    def _planned(self, outcome: RunOutcome) -> WorldChange | RunOutcome:
        """The world stopped itself at a step boundary: roll back, grow, or let slices leave (what was
        found while it stopped counts too, rather than once the next world finds it again)."""
        self._stop.update(planned_stop({}, self._streams, self.gens, self.config, self.events))
        kind, world = self._stop.kind or outcome.kind, self._formed()
        if kind is OutcomeKind.ROLLBACK and self._stop.rollback is not None:
            self._enter(S.RECOVERING)
            wait = TEARDOWN_CONFIRM_S if self.config.checkpoint_dir else 0.0  # its processes gone first
            return roll_back(self.checkpoints, world, self.gens, self.ledger, self._stop.rollback, outcome, wait)
        self._enter(S.RESIZING)
        self._check_owner()
        if kind is OutcomeKind.GROW:
            return stop_to_grow(self.checkpoints, world, self.ledger, self.gens.members, outcome)
        self.notices.forget()  # a cached notice of a slice gone must not stop the next world
        return leave(self.checkpoints, world, self.ledger, self.gens, self._stop.leaving, self.events, outcome)

    def _intake(self, outcome: RunOutcome, previous: WorldChange) -> WorldChange:
        """A world ended early: read the evidence, decide what is lost (the failure policy), then
        execute: tear down, set aside unreadable checkpoints, keep the survivors."""
        now = time.time()
        self._check_owner()
        if outcome.kind in (OutcomeKind.GROW, OutcomeKind.LEAVE, OutcomeKind.ROLLBACK):
            planned = self._planned(outcome)
            if isinstance(planned, WorldChange):
                return planned
            outcome = planned  # a process died while the in-flight save committed: a failure, not a planned change
        self._enter(S.RECOVERING)
        chained = outcome.kind is OutcomeKind.FORMING_FAILED and previous.cause is not OutcomeKind.DONE
        detected_at = previous.detected_at if chained else now
        last_progress_at = previous.last_progress_at if chained else outcome.last_progress_at
        seen = self.gens.evidence(outcome, now)
        first = next(iter(outcome.errors.values()), None) or RuntimeError(outcome.kind.value)
        saves = [e for e in outcome.errors.values() if failed_save(e)]
        evidence = self.gens.failure_evidence(seen, outcome, first, saves, self.ledger)
        decision = self.failures.decide(evidence, time.monotonic(), first)
        classified_at = time.time()
        self.record.failure(
            seen, outcome, decision, first, now=now, last_progress_at=last_progress_at, classified_at=classified_at
        )
        if decision.stop is not None:
            raise decision.stop from (saves[0] if isinstance(decision.stop, StorageFailingError) else first)
        t0 = time.perf_counter()
        if self.world is not None:
            # With checkpoints, wait until the old processes are really gone: nothing of theirs may
            # land in the checkpoint directory once the next world reads and cleans it.
            self.world.teardown(confirm_s=TEARDOWN_CONFIRM_S if self.config.checkpoint_dir else 0.0)
        for step in sorted(seen.unreadable_checkpoints - self.checkpoints.unreadable):  # its readers are gone
            aside = self.checkpoints.failed_to_read(
                step, self.gens.last_restore.directory if self.gens.last_restore else None
            )
            self.events.emit(ev.CheckpointUnreadable(step=step, error=str(first)[:2000], set_aside_to=aside))
        verdict = decision.verdict
        self._check_owner()  # before asking for a replacement slice
        going = self._stop.going()  # out-voted replicas and stragglers whose leave a failure overtook
        survivors = self.gens.split(set(verdict.lost_slices) | going, set(verdict.quarantined) | going)
        reason = verdict.reason if not chained else f"failure while forming a world: {first!r}"[:300]
        return WorldChange(
            outcome.kind,
            survivors,
            reason,
            detected_at,
            last_progress_at,
            classify_s=classified_at - now,
            teardown_s=time.perf_counter() - t0,
        )

    def _next_world(self, change: WorldChange, resume: checkpoints.CheckpointInfo | None = None) -> RunOutcome | None:
        """The one path to the next world: wait for the capacity the mode needs, take the survivors and
        ready replacements, form. Returns None when formed, else the forming failure as an outcome."""
        change, decision, wait_s = self._await_capacity(change)
        capacity_ready_at = time.time()
        members, added = self.gens.take(change.survivors, decision)
        if self.pre_callback is not None:
            self.pre_callback()
        restore = self.gens.restore_plan(change.survivors, resume, last_step=self.ledger.last_step)
        # Trained, resumed, or trained by a lost driver of this run (its keepers did not answer).
        done = max(self.ledger.last_step + 1, self._first_step, self.gens.taken_over_step + 1, self._lost_steps)
        done = done if change.steps_kept is None else min(done, change.steps_kept)  # a rollback drops the rest
        refuse_fresh_restart(restore, done, self.config.allow_restart_from_scratch, change.reason)
        before = self.worlds[-1] if self.worlds else None
        self._enter(S.FORMING_WORLD)
        self._check_owner()  # (the real world's keepers also refuse a superseded driver's begin)
        try:
            record = self.gens.form(members, restore)
        except Exception as e:  # noqa: BLE001 - a failure while forming is another failure
            return RunOutcome(OutcomeKind.FORMING_FAILED, {0: e}, change.last_progress_at)
        self.record.world_formed(
            change,
            record,
            restore,
            before=before,
            added=len(added),
            wait_s=wait_s,
            capacity_ready_at=capacity_ready_at,
            mode=self.config.mode,
            saved_by=self._formed().join_infos[0].get("checkpoint_metadata"),
        )
        return None

    def _await_capacity(self, change: WorldChange) -> tuple[WorldChange, NextWorld, float]:
        """Wait until the mode's policy says form (state ``waiting_for_capacity`` meanwhile, reported
        every few seconds); raise :class:`CapacityTimeoutError` when it says fail. Returns the change
        with the survivors still alive, the decision and the seconds waited."""
        cfg = self.config

        def on_wait(reason: str, waited_s: float) -> None:
            if not waited_s:
                self._enter(S.WAITING_FOR_CAPACITY)
                self.events.emit(ev.WaitingForCapacity(reason=reason))
                return
            self._report_waiting(
                f"{reason}; waited {waited_s:.0f}s of replacement_timeout_s={cfg.replacement_timeout_s:.0f}",
                ready=len(change.survivors),
                asked=cfg.num_slices,
                waited_s=waited_s,
            )

        def on_lost(names: list[str]) -> None:  # a survivor's host died while replacements were awaited
            self.record.lost_while_waiting(len(self.worlds), names)

        decision, wait_s, survivors = self.gens.await_capacity(
            change.survivors, grow=change.cause is OutcomeKind.GROW, on_wait=on_wait, on_lost=on_lost
        )
        change = dataclasses.replace(change, survivors=survivors)
        if decision.action is Action.FAIL:
            raise CapacityTimeoutError(
                f"{change.reason}; {decision.reason} (replacement_timeout_s={cfg.replacement_timeout_s:.0f}, "
                f"mode={cfg.mode}, min_slices={cfg.min_slices}). Add capacity, raise replacement_timeout_s, "
                + self.gens.scaling.advice
            )
        return change, decision, wait_s
