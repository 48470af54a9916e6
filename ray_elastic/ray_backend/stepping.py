"""Driving one world: chunks of steps in flight, finished steps streamed back.

Snapshot-keeping processes run chunks as Ray streaming generators and stream their finished
steps a few times a second, naming the steps whose snapshots their host's keeper now holds; the
others run chunks as plain tasks whose one small result (or error) comes at the chunk's end,
waited for by a thread of its own and read in one batch with the others that are ready: at a
thousand processes the driver's work per round and per chunk is what limits a world's size.
The driver reads every item of every stream and every result (an error is an item: reading them
all is how a death is seen at once), but no snapshot passes through it. Two chunks are kept
queued, so workers never wait on the driver. The loop ends when the steps are done, a process
fails, the watchdog sees no progress, or (on request) at a step boundary: to grow, or for warned
slices to leave.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

from ray_elastic.config import ElasticConfig
from ray_elastic.control.backend import StepSink
from ray_elastic.control.snapshot_cadence import SnapshotCadence
from ray_elastic.control.states import OutcomeKind, RunOutcome
from ray_elastic.decide import chunk_steps, is_eval_step, stop_lead_steps, watchdog_timeout
from ray_elastic.decide.device_checks import Handover
from ray_elastic.decide.integrity import Mismatch
from ray_elastic.decide.stragglers import Straggler
from ray_elastic.ray_backend.early_stop import agree_stop
from ray_elastic.ray_backend.first_ready import FirstReady
from ray_elastic.ray_backend.host_watch import HostWatch
from ray_elastic.ray_backend.integrity_watch import IntegrityWatch
from ray_elastic.ray_backend.keeper_sync import KeeperSync
from ray_elastic.ray_backend.straggler_watch import StragglerWatch
from ray_elastic.ray_backend.watchdog import Stall, Watchdog
from ray_elastic.ray_backend.world import World
from ray_elastic.slice.chunk_running import FLUSH_S
from ray_elastic.state.snapshots import SnapshotRef, SnapshotStore

logger = logging.getLogger(__name__)
CHUNKS_IN_FLIGHT = 2
POLL_S = 0.25
# When one quiet chunk has ended, the rest of its batch (processes end a chunk together) is
# gathered for up to GATHER_S and read in one ``ray.get``.
GATHER_S = 0.005
# A world whose steps stop for SUSPECT_FACTOR step times (at least SUSPECT_MIN_S) has its hosts'
# raylets looked at (HostWatch); again after NODE_CHECK_S, doubling up to NODE_CHECK_MAX_S while
# the stall lasts: a few connects, no Ray call.
SUSPECT_FACTOR, SUSPECT_MIN_S = 1.5, 0.25
NODE_CHECK_S, NODE_CHECK_MAX_S = 0.05, 1.0

ACK_EVERY_S = 1.0  # a holder's keeper hears what the driver has at most this often (a call costs its CPU)
NOT_KEPT_LISTED = 5  # snapshots not kept listed per world in the event (all are counted)


class StepStreams:
    """Runs steps on ``world``; what they snapshot goes into ``store``, what they report into ``sink``."""

    def __init__(
        self,
        world: World,
        config: ElasticConfig,
        store: SnapshotStore,
        sink: StepSink,
        before: Handover | None = None,  # what the world before's straggler watch left (its suspect goes on)
    ):
        self.world, self.config, self.store, self.sink = world, config, store, sink
        self.step_times = sink.step_times
        self.cadence = SnapshotCadence(config, sink.step_times, sink.snapshot_interval)
        self.steps_per_chunk = config.steps_per_chunk  # the last chunk's length (chunk_steps)
        # Per channel (World.channels: a process, or a relay's group of quiet ones): its chunks in flight.
        self.channels = world.channels
        self.queues: list[collections.deque[Any]] = [collections.deque() for _ in self.channels]
        self.streaming = [len(ch) == 1 and world.plan.takes_snapshots(ch[0]) for ch in self.channels]
        self._snapshot_steps: list[int] = []  # steps newly kept by some holder, not yet reported
        self.not_kept: list[dict[Any, Any]] = []  # the first few a keeper did not take: {"slice", "step", "why"}
        self.not_kept_count = 0  # and how many in all (a dead keeper misses every step)
        self._acked_at: dict[int, float] = {}  # process -> when its keeper was last told
        self._trusted_told: dict[int, int | None] = {}  # ... and the trusted step it was told
        self._reported = self._snapshot_reported = -1
        self._submitted = False  # a world's first chunk redoes an eval a failure lost
        self.hosts = HostWatch(world)
        self.watchdog = Watchdog(world, config, sink, world.times.total_s)
        self.integrity = IntegrityWatch(world, config.failure.integrity_every, store)
        self.stragglers = StragglerWatch(world, config, self.integrity.add, before)  # one probe round for both
        self.keepers = KeeperSync(world, store, [ch[0] for ch, on in zip(self.channels, self.streaming) if on])

    def take_straggler(self) -> Straggler | None:
        """A slice the world has been waiting for (confirmed over two windows), once."""
        return self.stragglers.take()

    def take_mismatch(self) -> Mismatch | None:
        """Replicas found to disagree (their fingerprints), once."""
        return self.integrity.take()

    def take_snapshot_steps(self) -> list[int]:
        """Steps snapshotted since the last call (for the event log)."""
        out, self._snapshot_steps = self._snapshot_steps, []
        return out

    def run(
        self,
        start_step: int,
        end_step: int,
        stop_requested: Callable[[], OutcomeKind | None],
        donors: dict[str, str] | None = None,
    ) -> RunOutcome:
        """Steps ``start_step .. end_step - 1``. ``stop_requested`` is asked between reads: a kind (``GROW``,
        ``LEAVE``) stops the world at the next step boundary. ``donors``: whose snapshot each slice restored."""
        self.integrity.starts_at(start_step, donors or {})
        self.hosts.start()
        wake = threading.Event()
        waiters = FirstReady(wake), FirstReady(wake)  # snapshot holders' streams, the others' results
        self.world.deaths.notify(wake.set)
        try:
            return self._run(start_step, end_step, stop_requested, wake, *waiters)
        finally:
            self.world.deaths.notify(None)
            for w in waiters:
                w.stop()

    def _run(
        self,
        start_step: int,
        end_step: int,
        stop_requested: Callable[[], OutcomeKind | None],
        wake: threading.Event,
        stream_waiter: FirstReady,
        quiet_waiter: FirstReady,
    ) -> RunOutcome:
        """Keep chunks queued and read what comes back until the steps are done, a check finds a
        failure, or a requested stop has drained the queues."""
        self._reported = self._snapshot_reported = start_step - 1
        run = _Progress(submitted=start_step)
        holders = [c for c in range(len(self.queues)) if self.streaming[c]]
        quiet = [c for c in range(len(self.queues)) if not self.streaming[c]]
        while True:
            if self._fill(run, end_step, stop_requested):
                stream_waiter.watch(self._heads(holders))
                quiet_waiter.watch(self._heads(quiet))
            if not any(self.queues):
                # A stop asked for once every step was queued changes nothing, unless the steps
                # after some point are not to be trusted (a rollback): then they run again.
                late = run.submitted >= end_step and run.draining is not OutcomeKind.ROLLBACK
                kind = run.draining if run.draining and not late else OutcomeKind.DONE
                # The replicas are compared before the next world restores one, or the last checkpoint counts.
                if self.integrity.verify(self.world.workers) and kind is OutcomeKind.DONE:
                    kind = OutcomeKind.LEAVE  # disagreeing replicas, found now or late: the out-voted go, or back
                if kind is not OutcomeKind.DONE:
                    self.sync_with_keepers()  # the next world restores from what they hold
                return RunOutcome(kind, {}, run.wall)
            suspect = watchdog_timeout(self.step_times, SUSPECT_FACTOR, SUSPECT_MIN_S)
            wake.wait(min(POLL_S, max(0.0, max(run.at + suspect, run.next_node_check) - time.monotonic())))
            wake.clear()
            checks: tuple[Callable[[], RunOutcome | None], ...] = (
                lambda: self._read(run, quiet, quiet_waiter, holders, stream_waiter),
                lambda: self._check_nodes(run, suspect),  # noqa: B023 - called in this iteration
                lambda: self.watchdog.check(run, self._reported),
            )
            for check in checks:
                outcome = check()
                if outcome is not None:
                    return outcome
            self.stragglers.check()

    def _fill(self, run: _Progress, end_step: int, stop_requested: Callable[[], OutcomeKind | None]) -> bool:
        """Queue chunks up to ``CHUNKS_IN_FLIGHT`` (or, once a stop is requested, the empty chunk
        that stops the processes at the next boundary); True when a queue's head changed."""
        if not run.draining:
            run.draining = stop_requested()  # finish what is queued, then stop at that step boundary
        # A world that starts at the end (its state is the last step's) runs only the eval a failure lost.
        heads_changed = (
            not self._submitted and run.submitted == end_step and self._eval_lost(end_step - 1, end_step - 1)
        )
        if heads_changed:
            self._submit(run.submitted, 0, end_step - 1)
        while not run.draining and run.submitted < end_step and max(map(len, self.queues)) < CHUNKS_IN_FLIGHT:
            self.steps_per_chunk = chunk_steps(
                self.config.steps_per_chunk,
                len(self.world.workers),
                self.step_times[-20:],
                suspect=self.stragglers.suspicious,
            )
            n = min(self.steps_per_chunk, end_step - run.submitted)
            heads_changed |= not all(self.queues)
            self._submit(run.submitted, n, end_step - 1)
            run.submitted += n
        if run.draining and not run.stopped:
            self._stop_early(run)
            heads_changed |= not all(self.queues)
            self._submit(run.submitted, 0, end_step - 1)  # no steps: the processes finish the one in flight
            run.stopped = True
        return heads_changed

    def _stop_early(self, run: _Progress) -> None:
        """A stop requested while chunks are queued: the processes agree on a sooner boundary
        (:func:`~ray_elastic.ray_backend.early_stop.agree_stop`), and the queued steps past it run nothing."""
        lead = stop_lead_steps(self.step_times[-10:], FLUSH_S)
        agreed = agree_stop(self.world.workers, self._reported + 1 + lead, lead, run.submitted)
        logger.debug("stop requested after step %d, %d queued: agreed %s", self._reported, run.submitted, agreed)
        if agreed is not None:
            run.submitted = agreed

    def _read(
        self,
        run: _Progress,
        quiet: list[int],
        quiet_waiter: FirstReady,
        holders: list[int],
        stream_waiter: FirstReady,
    ) -> RunOutcome | None:
        """Deaths the beacons saw, then the quiet chunks that ended, then the holders' streams."""
        gone = self.world.deaths.dead()
        if gone:  # before Ray has said so (its signal comes through the GCS, late on a loaded host)
            return RunOutcome(OutcomeKind.FAILURE, self.hosts.gone(gone), run.wall)
        if quiet_waiter.fired():
            # Quiet chunks ended (or one failed): every one that has, in one batch.
            heads = {self.queues[c][0]: c for c in quiet if self.queues[c]}
            done, _ = ray.wait(list(heads), num_returns=len(heads), timeout=GATHER_S)
            failed = self._consume_results([heads[r] for r in done])
            quiet_waiter.watch(self._heads(quiet))
            if failed:
                return RunOutcome(OutcomeKind.FAILURE, failed, run.wall)
        if stream_waiter.fired():
            heads = {self.queues[c][0]: c for c in holders if self.queues[c]}
            ready, _ = ray.wait(list(heads), num_returns=len(heads), timeout=0)
            for gen in ready:
                c = heads[gen]
                try:
                    progressed = self._consume(c)
                except Exception as e:  # noqa: BLE001 - any error of a slice process is an event
                    return RunOutcome(OutcomeKind.FAILURE, {self.channels[c][0]: e}, run.wall)
                if progressed:
                    run.progressed()
            stream_waiter.watch(self._heads(holders))
        return None

    def _check_nodes(self, run: _Progress, suspect: float) -> RunOutcome | None:
        """Steps stalled past ``suspect``: a host whose raylet refuses is a lost node (backing off)."""
        now = time.monotonic()
        if now - run.at <= suspect or now < run.next_node_check:
            return None
        lost = self.hosts.lost()
        if lost:
            return RunOutcome(OutcomeKind.FAILURE, lost, run.wall)
        run.next_node_check = now + run.node_check_every
        run.node_check_every = min(2 * run.node_check_every, NODE_CHECK_MAX_S)
        return None

    def _heads(self, channels: list[int]) -> list[Any]:
        return [self.queues[c][0] for c in channels if self.queues[c]]

    def _submit(self, first: int, n: int, final_step: int) -> None:
        every = self.cadence.interval_from(first)
        eval_before = not self._submitted and self._eval_lost(first - 1, final_step)
        self._submitted = True
        for c, ref in enumerate(self.world.run_chunk(first, n, final_step, every, eval_before)):
            self.queues[c].append(ref)

    def _eval_lost(self, step: int, final_step: int) -> bool:
        """The eval due after ``step`` never reached the driver (a failure during it): redo it first."""
        if step < 0 or not is_eval_step(step, self.config.eval_every, final_step):
            return False
        return not self.sink.add_eval({"step": step})

    def _consume_results(self, channels: list[int]) -> dict[int, BaseException]:
        """Take the finished chunks of non-streaming channels (ready ones): one ``ray.get`` for all,
        and only if that raises, one per channel to name whose error it was. Returns the errors by
        process (a relay answers with its group's)."""
        if not channels:
            return {}
        refs = [self.queues[c].popleft() for c in channels]
        failed: dict[int, BaseException] = {}
        try:
            answers = ray.get(refs)
        except Exception:  # noqa: BLE001 - which one(s)?
            answers = []
            for c, ref in zip(channels, refs):
                try:
                    answers.append(ray.get(ref, timeout=0))
                except Exception as e:  # noqa: BLE001 - any error of a slice process is an event
                    failed[self.channels[c][0]] = e  # a relay that died: the first of its group stands for it
        for answer in answers:
            failed.update(answer or {})
        return failed

    def _consume(self, c: int) -> bool:
        """Read one item of holder channel ``c``'s current stream; True when a step finished for the first time.

        Every streaming process reports every step (the loss is replicated, so all report the
        same value); the first report of a step is the one kept. Relying on process 0 alone
        would lose the steps that only a surviving snapshot holder reported when process 0's
        slice died, though their state is what the next world restores.
        """
        s = self.queues[c][0]
        try:
            ref = next(s)
        except StopIteration:
            self.queues[c].popleft()
            return False
        item = ray.get(ref)  # the process's error, when it failed
        if not self.streaming[c] or not item:
            return False
        (p,) = self.channels[c]
        plan = self.world.plan
        for step in item["kept"]:
            self.store.add(
                self.world.slice_of(p),
                p % plan.hosts_per_slice,
                step,
                SnapshotRef(self.world.keepers[p], plan.generation, step),
            )
            if step > self._snapshot_reported:
                self._snapshot_reported = step
                self._snapshot_steps.append(step)
        trusted = self.integrity.trusted()  # told at once: its slot is kept from then on
        due = time.monotonic() - self._acked_at.get(p, 0.0) >= ACK_EVERY_S or self._trusted_told.get(p) != trusted
        if item["kept"] and due:
            self._acked_at[p], self._trusted_told[p] = time.monotonic(), trusted  # held until we say newer
            acked = min(max(item["kept"]), self.sink.logged_step)  # keepers hear of a step once it is logged
            self.world.keepers[p].ack.remote(plan.generation, acked, self.world.epoch, trusted)
        self.cadence.snapshot_seconds.extend(item["snapshot_s"])
        for step, why in item.get("not_kept", ()):
            self.not_kept_count += 1
            if len(self.not_kept) < NOT_KEPT_LISTED:
                self.not_kept.append({"slice": self.world.slice_of(p), "step": step, "why": why})
        if "eval" in item:
            self.sink.add_eval(item["eval"])
        progressed = False
        for metrics in item["steps"]:
            if metrics["step"] > self._reported:
                self._reported = metrics["step"]
                self.cadence.step_done(metrics["step"], metrics["step_time_s"])
                self.sink.add(metrics)
                progressed = True
            elif metrics.get("checkpoints_committed"):
                # A step's metrics are kept from whichever holder reports it first, but a commit is
                # reported at the step each holder's own save finished: take it from every report.
                self.sink.saves_committed(metrics["checkpoints_committed"])
        return progressed

    def drain(self, timeout_s: float, errors: dict[int, BaseException], newest_s: float = 3.0) -> None:
        """After a failure, collect what surviving processes already streamed, then what their
        keepers hold.

        Reads streams until nothing more comes within ``timeout_s``. Then settles with the
        holders' keepers (:meth:`KeeperSync.settle`: up to ``newest_s`` for the newest reported
        step, then their rings sealed). Steps beyond the newest reported one have no metrics in the
        run and are run again. A keeper on a lost node does not answer and its slice does not count.
        """
        start = time.monotonic()
        while True:
            heads = {q[0]: c for c, q in enumerate(self.queues) if q and not any(p in errors for p in self.channels[c])}
            left = start + timeout_s - time.monotonic()
            if not heads or left <= 0:
                break
            ready, _ = ray.wait(list(heads), num_returns=len(heads), timeout=min(0.05, left))
            if not ready:
                break
            errors.update(self._consume_results([heads[r] for r in ready if not self.streaming[heads[r]]]))
            for gen in ready:
                c = heads[gen]
                if not self.streaming[c]:
                    continue
                try:
                    self._consume(c)
                except Exception as e:  # noqa: BLE001
                    errors[self.channels[c][0]] = e
        # Every holder's keeper, a failed process's too: its host may live, and its keeper with it;
        # not one on a host whose raylet refuses (its keeper died with it and would only be waited for).
        lost = self.hosts.lost(set(errors))
        holders = [p for p in self.keepers.holders if p not in lost]
        self.keepers.settle(holders, set(errors), self.cadence.newest_due(self._reported), self._reported, newest_s)

    def sync_with_keepers(self) -> None:
        """The store says what every holder's keeper holds now (before a planned stop: the next world restores it)."""
        self.keepers.sync(self._reported)


@dataclasses.dataclass
class _Progress(Stall):
    """The step loop's state for one run of a world."""

    submitted: int = 0  # the first step not yet queued
    draining: OutcomeKind | None = None  # a stop was requested (why): no more chunks
    stopped: bool = False  # the empty chunk that stops the processes is queued
    node_check_every: float = NODE_CHECK_S
    next_node_check: float = 0.0

    def progressed(self) -> None:
        self.at, self.wall = time.monotonic(), time.time()
        self.node_check_every, self.next_node_check = NODE_CHECK_S, 0.0
