"""The single controller: a Ray driver that reserves slices, forms worlds, drives steps, recovers.

``ElasticTrainer(task, config).fit(num_steps)`` is the whole API. The controller
moves through explicit :class:`~ray_elastic.states.ControllerState` states. Its
decisions (which slices form the next world, the batch, what to restore from,
whether to retry) come from the pure functions of ``plan.py``; the Ray effects
live in ``placement.py``, ``world.py``, ``stepping.py`` and ``health.py``; JAX
runs only inside the slice actors.

A lost slice is an event, not the end: the failed generation is torn down, the
next one is formed from the survivors (replica-resize) or with a replacement
(pause-and-resume), and it loads the survivors' in-memory snapshots, so no
finished step is recomputed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Callable, Optional

import ray

from ray_elastic import checkpoints, goodput
from ray_elastic import plan as planner
from ray_elastic.config import ElasticConfig
from ray_elastic.errors import ElasticRuntimeError
from ray_elastic.events import EventLog
from ray_elastic.health import alive_nodes, dead_slices, error_kind, unresponsive
from ray_elastic.placement import ReplacementRequest, SliceReservation, reserve_slices
from ray_elastic.snapshots import SnapshotStore
from ray_elastic.states import ControllerState, check_transition
from ray_elastic.stepping import RunOutcome, StepStreams
from ray_elastic.task import TrainTask
from ray_elastic.world import World, WorkerPool

logger = logging.getLogger(__name__)

S = ControllerState
WAIT_POLL_S = 0.2
DRAIN_S = 0.3
TEARDOWN_CONFIRM_S = 3.0
GOODPUT_EVERY_S = 10.0
CHECKPOINT_FINISH_TIMEOUT_S = 600.0

__all__ = ["ElasticTrainer", "ElasticRuntimeError", "FitResult"]


@dataclasses.dataclass
class FitResult:
    """What ``fit`` returns: per-step metrics, recoveries and a summary of the run."""

    steps: list[int]
    losses: list[float]
    step_times_s: list[float]
    recoveries: list[dict]
    summary: dict
    events: list[dict]

    def __repr__(self) -> str:
        return (f"FitResult(steps={len(self.steps)}, final_loss={self.losses[-1] if self.losses else None}, "
                f"recoveries={len(self.recoveries)}, summary={self.summary})")


class ElasticTrainer:
    """Train ``task`` on ``config.num_slices`` TPU slices of a Ray cluster, surviving lost slices.

    Args:
        task: model, optimizer, loss and data (runs inside the slice actors).
        config: slices, batch and elastic settings; validated here, before Ray is touched.
        address: Ray cluster to connect to when this process is not connected yet
            (``None``: ``RAY_ADDRESS`` or the job's cluster, as ``ray.init`` decides).
        progress: show a tqdm progress bar (terminal or notebook).
        on_chunk: called with the metrics of finished steps as they arrive.
        retry_policy: ``(attempt, error) -> bool``, asked before every recovery (as in
            ``pathwaysutils.elastic.Manager.elastic_retry``); ``None`` retries within
            ``config.max_failures`` per ``config.failure_window_s``.
        pre_callback: called before every new world is formed after a failure or resize.
        on_elastic_event_callback: called with each elastic event (failure, recovered,
            resize, scale_up, waiting_for_capacity) as a dict.
        run_dir: where ``events.jsonl`` is written (``None``: events kept in memory only);
            ``ray-elastic report RUN_DIR`` draws it.
        name: the run's name in Ray metrics (default: the run directory's name, else ``ray-elastic``).
    """

    def __init__(
        self,
        task: TrainTask,
        config: ElasticConfig,
        *,
        address: Optional[str] = None,
        progress: bool = True,
        on_chunk: Optional[Callable[[list[dict]], None]] = None,
        retry_policy: Optional[Callable[[int, Exception], bool]] = None,
        pre_callback: Optional[Callable[[], None]] = None,
        on_elastic_event_callback: Optional[Callable[[dict], None]] = None,
        run_dir: Optional[str] = None,
        name: Optional[str] = None,
    ):
        if not isinstance(task, TrainTask):
            raise ValueError(f"task must be a ray_elastic.TrainTask, got {type(task).__name__}")
        if not isinstance(config, ElasticConfig):
            raise ValueError(f"config must be a ray_elastic.ElasticConfig, got {type(config).__name__}")
        for name, cb in (("retry_policy", retry_policy), ("pre_callback", pre_callback),
                         ("on_elastic_event_callback", on_elastic_event_callback), ("on_chunk", on_chunk)):
            if cb is not None and not callable(cb):
                raise ValueError(f"{name} must be callable, got {type(cb).__name__}")
        self.task = task
        self.config = config
        self.address = address
        self.progress = progress
        self.on_chunk = on_chunk
        self.retry_policy = retry_policy
        self.pre_callback = pre_callback
        self.on_elastic_event_callback = on_elastic_event_callback
        self.run_dir = run_dir
        self.name = name or (os.path.basename(os.path.normpath(run_dir)) if run_dir else "ray-elastic")
        self._ray_metrics = None
        self._goodput_at = 0.0
        self.state = S.INITIALIZING
        self.state_history: list[tuple[str, float]] = [(self.state.value, time.time())]
        self.world: Optional[World] = None
        self.worlds: list[dict] = []  # one entry per generation: slices, mesh, formation times
        self._members: list[SliceReservation] = []  # slices of the current/next world, plan order
        self._replacements: list[ReplacementRequest] = []
        self._pool: Optional[WorkerPool] = None
        self._replenish_pending = False
        self._bar = None

    # ------------------------------------------------------------------ states
    def _enter(self, new: ControllerState) -> None:
        check_transition(self.state, new)
        logger.info("controller: %s -> %s", self.state.value, new.value)
        self.state = new
        self.state_history.append((new.value, time.time()))
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(), refresh=True)

    def _event(self, kind: str, **fields) -> dict:
        event = self.events.emit(kind, **fields)
        if self.on_elastic_event_callback is not None and kind in (
            "failure", "recovered", "resize", "scale_up", "waiting_for_capacity"
        ):
            self.on_elastic_event_callback(dict(event))
        return event

    # --------------------------------------------------------------------- fit
    def fit(self, num_steps: int) -> FitResult:
        """Train steps ``0 .. num_steps-1``; returns per-step losses, recoveries and a summary."""
        if not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps must be a positive integer, got {num_steps!r}")
        t_start = time.perf_counter()
        cfg = self.config
        resume = None
        if cfg.checkpoint_dir:
            # Before any cluster resource is taken: a bad location fails now, not at the first save.
            checkpoints.check_location(cfg.checkpoint_dir)
            resume = checkpoints.latest_checkpoint(cfg.checkpoint_dir)
        self.events = EventLog(self.run_dir)
        self._event("run_started", num_steps=num_steps, num_slices=cfg.num_slices, mode=cfg.mode,
                    checkpoint_dir=cfg.checkpoint_dir, resume_from_checkpoint=resume.step if resume else None)
        if resume is not None:
            self._check_resume(resume)
            if resume.step >= num_steps:
                self.events.close()
                return self._already_done(resume, num_steps, time.perf_counter() - t_start)
        if not ray.is_initialized():
            ray.init(address=self.address, namespace="ray_elastic", log_to_driver=True)
        self._ray_metrics = _run_metrics(self.name)
        self._reset(resume)
        try:
            self._enter(S.SCHEDULING)
            self._pool = WorkerPool(ray.put(self.task), cfg, env=checkpoints.gcs_env())
            self._members = reserve_slices(cfg.slice, cfg.num_slices, cfg.slice_timeout_s)
            self._pool.replenish(self._members)  # processes start while the others reserve and join
            self._enter(S.FORMING_WORLD)
            first = planner.choose_restore([], {}, resume.restore_step if resume else None)
            self.world = self._form(first)
            startup_s = time.perf_counter() - t_start
            self._bar = self._progress_bar(num_steps, initial=self._first_step)
            self._enter(S.RUNNING)
            next_step = first.step + 1
            while True:
                outcome = self._run(next_step, num_steps)
                if outcome.kind == "done":
                    break
                if outcome.kind == "grow":
                    next_step = self._grow()
                else:
                    next_step = self._recover(outcome)
                self._enter(S.RUNNING)
            self._finish(time.perf_counter() - t_start)
        except BaseException as e:
            failed_in = self.state.value
            if not self.state.is_terminal:
                self._enter(S.ERRORED)
            self._event("errored", state=failed_in, error=repr(e))
            ours = isinstance(e, (ValueError, KeyboardInterrupt)) and not isinstance(e, ray.exceptions.RayError)
            if ours or isinstance(e, ElasticRuntimeError):
                raise
            raise ElasticRuntimeError(f"training stopped in state {failed_in}: {e}") from e
        finally:
            if self._bar is not None:
                self._bar.close()
                self._bar = None
            self._release()
            self.events.close()
        gp = goodput.account(self.events.events)
        if self._ray_metrics is not None:
            self._ray_metrics.on_goodput(gp.goodput)
        if self.progress:
            print(gp.table())
        return self._result(num_steps, startup_s, time.perf_counter() - t_start, gp)

    def _reset(self, resume: Optional[checkpoints.CheckpointInfo]) -> None:
        """Per-run bookkeeping (a trainer can ``fit`` more than once)."""
        self._metrics: dict[int, dict] = {}
        self._step_times: list[float] = []
        self._store = SnapshotStore(self.config.slice.num_hosts)
        self._failure_times: list[float] = []
        self._attempt = 0
        self.recoveries: list[dict] = []
        self._step_buffer: list[dict] = []
        self._streams: Optional[StepStreams] = None
        self._first_step = resume.step if resume else 0

    def _finish(self, wall_s: float) -> None:
        """All steps done: let the last checkpoint commit, then record the end everywhere."""
        self._finish_checkpoints()
        self._enter(S.FINISHED)
        self._event("run_finished", steps=len(self._metrics), wall_s=wall_s)
        if self._ray_metrics is not None and self._metrics:
            last = self._metrics[self._last_step()]
            self._ray_metrics.on_step(last["step"], last["loss"], force=True)

    # ----------------------------------------------------------------- running
    def _run(self, start: int, end: int) -> RunOutcome:
        streams = StepStreams(self.world, self.config, self._store, self._on_metrics, self._step_times)
        self._streams = streams
        t0 = time.perf_counter()
        outcome = streams.run(start, end, self._capacity_returned)
        self._flush_steps()
        self._event("chunk_run", generation=self.world.plan.generation, first_step=start,
                    last_step=self._last_step(), seconds=time.perf_counter() - t0, outcome=outcome.kind)
        return outcome

    def _on_metrics(self, m: dict) -> None:
        if self._replenish_pending:
            self._replenish_pending = False
            self._pool.replenish(self._members)
        self._metrics[m["step"]] = m
        self._step_times.append(m["step_time_s"])
        if "checkpoint_step" in m:
            self._event("checkpoint_save", step=m["checkpoint_step"], blocking_s=m["checkpoint_blocking_s"])
        self._saves_committed(m.get("checkpoints_committed", []))
        self._step_buffer.append(m)
        if len(self._step_buffer) >= self.config.steps_per_chunk:
            self._flush_steps()
        if self.on_chunk is not None:
            self.on_chunk([m])
        if self._ray_metrics is not None:
            self._ray_metrics.on_step(m["step"], m["loss"])
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix_str(self._postfix(loss=m["loss"]), refresh=False)

    def _flush_steps(self) -> None:
        """Finished steps into the event log, one line per chunk (a rewound step appears again later)."""
        buf, self._step_buffer = self._step_buffer, []
        snaps = self._streams.take_snapshot_steps() if self._streams is not None else []
        if buf:
            self._event("steps", generation=self.world.plan.generation, steps=[m["step"] for m in buf],
                        losses=[m["loss"] for m in buf], step_time_s=[m["step_time_s"] for m in buf],
                        snapshot_steps=snaps)
        if self._ray_metrics is not None and time.monotonic() - self._goodput_at > GOODPUT_EVERY_S:
            self._goodput_at = time.monotonic()
            self._ray_metrics.on_goodput(goodput.account(self.events.events).goodput)

    def _last_step(self) -> int:
        return max(self._metrics) if self._metrics else -1

    def _capacity_returned(self) -> bool:
        return planner.should_grow(self.config.mode, len(self._members), len(self._ready_replacements()),
                                   self.config.num_slices)

    def _ready_replacements(self) -> list[ReplacementRequest]:
        return [r for r in self._replacements if r.ready() is not None]

    def _take_replacements(self, n: int) -> list[SliceReservation]:
        """Up to ``n`` ready replacement slices, no longer pending."""
        taken = self._ready_replacements()[:n]
        for req in taken:
            self._replacements.remove(req)
        return [req.ready() for req in taken]

    # ----------------------------------------------------------------- forming
    def _form(self, restore: planner.RestorePlan) -> World:
        """Form the next generation on ``self._members``, loading the state ``restore`` names."""
        cfg = self.config
        generation = len(self.worlds)
        n = len(self._members)
        restore_step = restore.step
        batch = planner.batch_for_world(n, cfg.num_slices, cfg.global_batch_size, cfg.batch_policy)
        snap_steps = {s: st for s, st in self._store.latest_complete(self._store.slices()).items() if st == restore_step}

        donors: dict[str, str] = {}

        def from_snapshot(name: str):
            if restore.source != "snapshot":
                return None
            donors[name] = planner.choose_restore([name], snap_steps).donors[0]
            return self._store.refs(donors[name], restore_step)

        world = World.form(generation, self._members, self._pool, cfg, start_step=restore_step + 1,
                           global_batch_size=batch, lr_scale=planner.lr_scale(n, cfg.num_slices, cfg.lr_rule),
                           restore=from_snapshot,
                           checkpoint_step=restore_step + 1 if restore.source == "checkpoint" else None)
        self.worlds.append({"generation": generation, "slices": list(world.plan.slice_names),
                            "mesh": world.plan.mesh_shape, "global_batch_size": batch,
                            "times": dataclasses.asdict(world.times), "start_step": restore_step + 1})
        if self._ray_metrics is not None:
            self._ray_metrics.on_world(len(world.plan.slice_names))
        self._event("world_formed", generation=generation, slices=list(world.plan.slice_names),
                    mesh=world.plan.mesh_shape, global_batch_size=batch, restored_from_step=restore_step,
                    restore_source=restore.source, snapshot_donors=donors, **dataclasses.asdict(world.times))
        if restore.source == "checkpoint":
            self._event("checkpoint_restore", step=restore_step + 1, generation=generation,
                        seconds=world.times.state_load_s, saved_by=world.join_infos[0].get("checkpoint_metadata"))
        # New standbys start once the new world has finished a step: starting processes
        # competes for the CPUs the first steps need.
        self._replenish_pending = True
        return world

    # ---------------------------------------------------------------- recovery
    def _recover(self, outcome: RunOutcome) -> int:
        """A failure (or hang) in RUNNING or FORMING_WORLD: classify, tear down, form the next world."""
        cfg = self.config
        t_detect = time.time()
        self._enter(S.RECOVERING)
        world = self.world
        errors = dict(outcome.errors)
        if outcome.kind != "hang":
            self._streams.drain(DRAIN_S, errors)
        else:
            hung = unresponsive(world.workers, cfg.probe_timeout_s)
            # Nobody silent: the whole world is stuck (for example a collective that never completes).
            for p in hung or range(len(world.workers)):
                errors[p] = TimeoutError(f"no step finished for {t_detect - outcome.last_progress_at:.1f}s")
        return self._handle_failure(world, errors, t_detect, outcome.last_progress_at, outcome.kind)

    def _handle_failure(self, world: World, errors: dict[int, BaseException], t_detect: float,
                        last_progress_at: float, cause: str) -> int:
        cfg = self.config
        kinds = {}
        for p, e in errors.items():
            kind = "hang" if isinstance(e, TimeoutError) and cause == "hang" else error_kind(e)
            kinds.setdefault(world.slice_of(p), kind)
        first = next(iter(errors.values())) if errors else RuntimeError(cause)
        slice_nodes = world.slice_node_ids()
        dead = dead_slices(slice_nodes, set(kinds), cfg.node_death_grace_s)
        verdict = planner.classify_failure(kinds, dead, world.plan.slice_names, str(first).splitlines()[0][:300])
        t_classified = time.time()
        self._event("failure", generation=world.plan.generation, cause=cause, kinds=kinds,
                    lost_slices=list(verdict.lost_slices), crashed_slices=list(verdict.crashed_slices),
                    error=str(first)[:2000], last_step=self._last_step(),
                    since_last_progress_s=t_detect - last_progress_at, classify_s=t_classified - t_detect,
                    detection_latency_s=t_classified - last_progress_at)
        if self._ray_metrics is not None:
            self._ray_metrics.on_world(world.plan.num_slices - len(verdict.lost_slices))
        if not verdict.recoverable:
            world.teardown()
            raise ElasticRuntimeError(f"not recoverable: {verdict.reason}") from first
        if self._record_failure():
            world.teardown()
            raise ElasticRuntimeError(
                f"gave up after {len(self._failure_times)} failures within {cfg.failure_window_s:.0f}s "
                f"(max_failures={cfg.max_failures}); last: {verdict.reason}") from first
        if self.retry_policy is not None and not self.retry_policy(self._attempt, first):
            world.teardown()
            raise ElasticRuntimeError(f"retry_policy declined attempt {self._attempt} after {verdict.reason}") from first

        t0 = time.perf_counter()
        # With checkpoints, wait until the old processes are really gone: nothing of theirs may
        # land in the checkpoint directory once the next world reads and cleans it.
        world.teardown(confirm_s=TEARDOWN_CONFIRM_S if cfg.checkpoint_dir else 0.0)
        survivors = []
        for name, res in zip(world.plan.slice_names, world.reservations):
            if name in verdict.lost_slices:
                self._drop_slice(res)
            else:
                survivors.append((name, res))
        teardown_s = time.perf_counter() - t0
        return self._reform(survivors, t_detect, last_progress_at, teardown_s, verdict.reason,
                            classify_s=t_classified - t_detect)

    def _reform(self, survivors: list, t_detect: float, last_progress_at: float, teardown_s: float, reason: str,
                classify_s: float = 0.0) -> int:
        """Wait for capacity if needed, then form the next generation and load the newest snapshot."""
        cfg = self.config
        t_wait0 = time.perf_counter()
        waited = False
        while True:
            ready = self._ready_replacements()
            timed_out = time.perf_counter() - t_wait0 > cfg.replacement_timeout_s
            decision = planner.decide_next_world(cfg.mode, [n for n, _ in survivors], len(ready), cfg.num_slices,
                                                 cfg.min_slices, timed_out, cfg.fallback_to_resize)
            if decision.action == "fail":
                raise ElasticRuntimeError(
                    f"{reason}; {decision.reason} (replacement_timeout_s={cfg.replacement_timeout_s:.0f}, "
                    f"mode={cfg.mode}, min_slices={cfg.min_slices}). Add capacity, raise replacement_timeout_s, "
                    "or set fallback_to_resize=True")
            if decision.action == "wait":
                if not waited:
                    self._enter(S.WAITING_FOR_CAPACITY)
                    self._event("waiting_for_capacity", reason=decision.reason)
                    waited = True
                time.sleep(WAIT_POLL_S)
                continue
            break
        wait_s = time.perf_counter() - t_wait0 if waited else 0.0
        capacity_ready_at = time.time()
        added = self._take_replacements(decision.replacements)
        self._members = [res for _, res in survivors] + added
        if self.pre_callback is not None:
            self.pre_callback()
        alive_snapshots = self._store.latest_complete([n for n, _ in survivors])
        restore = planner.choose_restore([n for n, _ in survivors], alive_snapshots, self._checkpoint_restore_step())
        last = self._last_step()
        self._enter(S.FORMING_WORLD)
        try:
            self.world = self._form(restore)
        except Exception as e:  # noqa: BLE001 - a failure during recovery is another failure
            return self._failed_forming(e, t_detect)
        rewound = max(0, last - restore.step)
        for s in [s for s in self._metrics if s > restore.step]:
            del self._metrics[s]  # recomputed by the new world
        if self._bar is not None and rewound:
            self._bar.update(-rewound)
        times = self.world.times
        record = {
            "generation": self.world.plan.generation,
            "reason": reason,
            "mode": self.config.mode,
            "slices": len(self._members),
            "added_slices": len(added),
            "restored_from_step": restore.step,
            "restore_source": restore.source,
            "steps_rewound": rewound,
            "since_last_progress_s": t_detect - last_progress_at,
            "classify_s": classify_s,
            "teardown_s": teardown_s,
            "wait_for_capacity_s": wait_s,
            "world_formation_s": times.start_actors_s + times.jax_init_s,
            "state_load_s": times.state_load_s,
            "compile_s": times.compile_s,
            "recovery_s": time.time() - t_detect,
            "detected_at": t_detect,
            "capacity_ready_at": capacity_ready_at,
            "ready_at": time.time(),
        }
        self.recoveries.append(record)
        self._event("recovered", **record)
        before = len(self.worlds[-2]["slices"]) if len(self.worlds) > 1 else None
        if before is not None and before != len(self._members):
            self._event("resize", generation=record["generation"], from_slices=before, to_slices=len(self._members))
        if self._ray_metrics is not None:
            self._ray_metrics.on_recovery()
        return restore.step + 1

    def _failed_forming(self, error: Exception, t_detect: float) -> int:
        """The next world failed while forming (a second failure, a replacement dying on arrival)."""
        self._enter(S.RECOVERING)
        if error_kind(error) == "task_error":
            raise ElasticRuntimeError(f"not recoverable: forming a world failed in training code: {error}") from error
        time.sleep(self.config.node_death_grace_s)  # let Ray mark the dead hosts dead
        alive = alive_nodes()
        survivors, lost = [], []
        for i, res in enumerate(self._members):
            nodes = res.node_ids()
            if nodes and all(n in alive for n in nodes):
                survivors.append((res.slice_name or f"new-slice-{i}", res))
            else:
                lost.append(res.slice_name)
                self._drop_slice(res)
        self._event("failure", cause="forming", error=repr(error)[:2000], lost_slices=lost, last_step=self._last_step())
        if self._record_failure():
            raise ElasticRuntimeError(f"gave up after repeated failures while forming a world: {error}") from error
        return self._reform(survivors, t_detect, t_detect, 0.0, f"failure while forming a world: {error!r}"[:300])

    def _record_failure(self) -> bool:
        """Count a recovery attempt; True when there were too many within the failure window."""
        self._attempt += 1
        now = time.monotonic()
        self._failure_times.append(now)
        return planner.failures_exceeded(self._failure_times, now, self.config.max_failures,
                                         self.config.failure_window_s)

    def _drop_slice(self, res: SliceReservation) -> None:
        """A slice left for good: free it, forget its snapshots, ask for a replacement."""
        if res.slice_name:
            self._store.forget(res.slice_name)
        res.release()
        self._pool.discard(res)
        # A pending slice placement group is what makes the autoscaler provision a new slice.
        self._replacements.append(ReplacementRequest(self.config.slice, self.config.replacement_timeout_s))

    # ------------------------------------------------------------------ resize
    def _grow(self) -> int:
        """Capacity returned: at this step boundary, form a bigger world; newcomers load a peer's snapshot."""
        self._enter(S.RESIZING)
        t0 = time.time()
        old = self.world
        last = self._last_step()
        self._finish_checkpoints()  # a planned stop: let the in-flight save commit first
        old.teardown()
        added = self._take_replacements(self.config.num_slices - len(self._members))
        survivors = list(zip(old.plan.slice_names, old.reservations))
        self._members = [res for _, res in survivors] + added
        if self.pre_callback is not None:
            self.pre_callback()
        restore = planner.choose_restore(list(old.plan.slice_names), self._store.latest_complete(old.plan.slice_names),
                                         self._checkpoint_restore_step())
        self._enter(S.FORMING_WORLD)
        try:
            self.world = self._form(restore)
        except Exception as e:  # noqa: BLE001
            return self._failed_forming(e, t0)
        record = {"generation": self.world.plan.generation, "from_slices": len(survivors),
                  "to_slices": len(self._members), "restored_from_step": restore.step,
                  "steps_rewound": max(0, last - restore.step), "resize_s": time.time() - t0}
        self._event("scale_up", **record)
        return restore.step + 1

    # ------------------------------------------------------------- checkpoints
    def _checkpoint_restore_step(self) -> Optional[int]:
        """Step index held by the newest committed checkpoint (None: no checkpoints)."""
        if not self.config.checkpoint_dir:
            return None
        info = checkpoints.latest_checkpoint(self.config.checkpoint_dir)
        return info.restore_step if info else None

    def _saves_committed(self, finished: list) -> None:
        for step, total_s in finished:
            self._event("checkpoint_committed", step=step, total_s=total_s)

    def _finish_checkpoints(self) -> None:
        """Wait for the in-flight save of the current world to commit."""
        if not self.config.checkpoint_dir or self.world is None:
            return
        self._saves_committed(self.world.finish_checkpoints(CHECKPOINT_FINISH_TIMEOUT_S))

    def _check_resume(self, info: checkpoints.CheckpointInfo) -> None:
        """Resuming: say so, and warn when the data order of the checkpoint differs from this config."""
        meta, cfg = info.metadata, self.config
        self._event("resume", checkpoint_step=info.step, saved_world=meta.get("world"))
        logger.info("resuming from checkpoint %d in %s", info.step, cfg.checkpoint_dir)
        changed = {k: (meta.get(k), v) for k, v in (("seed", cfg.seed), ("data_stride", cfg.global_batch_size))
                   if meta.get(k) is not None and meta.get(k) != v}
        if changed:
            logger.warning("checkpoint %d was written with %s; this run uses %s: the data order differs from "
                           "the run that wrote it", info.step, {k: a for k, (a, _) in changed.items()},
                           {k: b for k, (_, b) in changed.items()})
            self._event("resume_config_changed", changed=changed)

    def _already_done(self, info: checkpoints.CheckpointInfo, num_steps: int, wall_s: float) -> FitResult:
        summary = {"steps": 0, "already_done": True, "resumed_from_checkpoint": info.step,
                   "num_steps": num_steps, "wall_s": round(wall_s, 3)}
        logger.warning("checkpoint %d in %s already covers num_steps=%d: nothing to train",
                       info.step, self.config.checkpoint_dir, num_steps)
        return FitResult([], [], [], [], summary, list(self.events.events))

    # ----------------------------------------------------------------- results
    def _result(self, num_steps: int, startup_s: float, wall_s: float, gp: goodput.Goodput) -> FitResult:
        steps = sorted(self._metrics)
        losses = [self._metrics[s]["loss"] for s in steps]
        times = [self._metrics[s]["step_time_s"] for s in steps]
        plan = self.world.plan
        steady = sorted(times[1:]) or times
        rec = self.recoveries
        summary = {
            "steps": len(steps),
            "goodput": round(gp.goodput, 4),
            "slices": plan.num_slices,
            "hosts_per_slice": plan.hosts_per_slice,
            "mesh": plan.mesh_shape,
            "global_batch_size": plan.global_batch_size,
            "first_loss": losses[0],
            "final_loss": losses[-1],
            "generations": len(self.worlds),
            "failures": len(self.events.of_kind("failure")),
            "recoveries": len(rec),
            "scale_ups": len(self.events.of_kind("scale_up")),
            "resumed_from_checkpoint": self._first_step or None,
            "checkpoints_saved": len(self.events.of_kind("checkpoint_save")),
            "checkpoints_committed": len(self.events.of_kind("checkpoint_committed")),
            "checkpoint_restores": len(self.events.of_kind("checkpoint_restore")),
            "steps_rewound": sum(r["steps_rewound"] for r in rec),
            "max_recovery_s": round(max((r["recovery_s"] for r in rec), default=0.0), 3),
            "startup_s": round(startup_s, 3),
            "compile_s": round(self.worlds[0]["times"]["compile_s"], 3),
            "median_step_s": steady[len(steady) // 2],
            "wall_s": round(wall_s, 3),
        }
        return FitResult(steps, losses, times, list(rec), summary, list(self.events.events))

    def _postfix(self, loss: Optional[float] = None) -> str:
        """Step, loss, slices training and the controller's state, for the progress bar."""
        parts = []
        if loss is not None:
            parts.append(f"loss={loss:.4f}")
        if self.world is not None:
            parts.append(f"slices={len(self._members)}/{self.config.num_slices}")
        parts.append(f"state={self.state.value}")
        return ", ".join(parts)

    def _progress_bar(self, total: int, initial: int = 0):
        if not self.progress:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=total, initial=initial, desc="ray-elastic", unit="step", dynamic_ncols=True)

    def _release(self) -> None:
        if self.world is not None:
            self.world.teardown()
        if self._pool is not None:
            self._pool.shutdown()
        for req in self._replacements:
            req.cancel()
        self._replacements = []
        for r in self._members:
            try:
                r.release()
            except Exception as e:  # noqa: BLE001
                logger.debug("release reservation: %s", e)


def _run_metrics(name: str):
    """Ray metrics for this run; a run goes on without them if they cannot be set up."""
    from ray_elastic.metrics import RunMetrics

    try:
        return RunMetrics(name)
    except Exception as e:  # noqa: BLE001
        logger.warning("Ray metrics disabled: %s", e)
        return None
