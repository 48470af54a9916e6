"""Driving one world: chunks of steps in flight, streamed metrics and snapshots back.

Each process runs chunks as Ray streaming generators. Snapshot-keeping processes
stream, for every step, the snapshot (when due) and the step's metrics; the others
return their chunk's metrics at its end. Two chunks are kept queued, so workers
never wait on the driver. The loop ends when the steps are done, a process fails,
the watchdog sees no progress, or (on request) at a chunk boundary to grow.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable

import ray

from ray_elastic import health
from ray_elastic.config import ElasticConfig
from ray_elastic.plan import is_snapshot_step, newest_snapshot_step, watchdog_timeout
from ray_elastic.snapshots import SnapshotStore
from ray_elastic.states import OutcomeKind, RunOutcome
from ray_elastic.world import World

CHUNKS_IN_FLIGHT = 2
POLL_S = 0.25


@dataclasses.dataclass
class _Stream:
    gen: object
    cursor: int  # the step whose items come next
    snapshot: object = None  # this step's snapshot ref, until the step's metrics confirm it


class StepStreams:
    """Runs steps on ``world`` and feeds ``store`` and ``on_metrics``."""

    def __init__(self, world: World, config: ElasticConfig, store: SnapshotStore,
                 on_metrics: Callable[[dict], None], step_times: list[float]):
        self.world = world
        self.config = config
        self.store = store
        self.on_metrics = on_metrics
        self.step_times = step_times
        n = len(world.workers)
        self.queues: list[collections.deque] = [collections.deque() for _ in range(n)]
        self.streaming = [world.plan.takes_snapshots(p) for p in range(n)]
        self._snapshot_steps: list[int] = []  # steps whose snapshot process 0 delivered, not yet reported

    def take_snapshot_steps(self) -> list[int]:
        """Steps snapshotted since the last call (for the event log)."""
        out, self._snapshot_steps = self._snapshot_steps, []
        return out

    def run(self, start_step: int, end_step: int, grow_requested: Callable[[], bool]) -> RunOutcome:
        submitted = start_step
        self._reported = self._snapshot_reported = start_step - 1
        draining = False
        last_progress = time.monotonic()
        last_progress_wall = time.time()
        while True:
            if not draining and grow_requested():
                draining = True  # finish what is queued, then stop at that step boundary
            while not draining and submitted < end_step and max(map(len, self.queues)) < CHUNKS_IN_FLIGHT:
                n = min(self.config.steps_per_chunk, end_step - submitted)
                for p, gen in enumerate(self.world.run_chunk(submitted, n, end_step - 1)):
                    self.queues[p].append(_Stream(gen, submitted))
                submitted += n
            heads = {q[0].gen: p for p, q in enumerate(self.queues) if q}
            if not heads:
                kind = OutcomeKind.GROW if draining and submitted < end_step else OutcomeKind.DONE
                return RunOutcome(kind, {}, last_progress_wall)
            limit = watchdog_timeout(self.step_times, self.config.hang_timeout_factor, self.config.hang_timeout_min_s)
            ready, _ = ray.wait(list(heads), num_returns=1, timeout=POLL_S)
            for gen in ready:
                p = heads[gen]
                try:
                    progressed = self._consume(p)
                except Exception as e:  # noqa: BLE001 - any error of a slice process is an event
                    return RunOutcome(OutcomeKind.FAILURE, {p: e}, last_progress_wall)
                if progressed:
                    last_progress, last_progress_wall = time.monotonic(), time.time()
            if time.monotonic() - last_progress > limit:
                answers = health.probe(self.world.workers, self.config.probe_timeout_s)
                if not health.busy(answers, self._reported):
                    silent = {p: TimeoutError("no answer to the health probe")
                              for p, a in enumerate(answers) if a is None}
                    return RunOutcome(OutcomeKind.HANG, silent, last_progress_wall)
                last_progress = time.monotonic()  # slow, not hung: watch again from now

    def _consume(self, p: int) -> bool:
        """Take one item of process ``p``'s current stream; True when a step finished for the first time.

        Every streaming process reports every step (the loss is replicated, so all report the
        same value); the first report of a step is the one kept. Relying on process 0 alone
        would lose the metrics of steps that only a surviving snapshot holder finished when
        process 0's slice died, though their state is what the next world restores.
        """
        s = self.queues[p][0]
        try:
            ref = next(s.gen)
        except StopIteration:
            self.queues[p].popleft()
            dangling, s.snapshot = s.snapshot, None
            if dangling is not None:
                # A snapshot is always followed by its step's metrics, so a stream that ends on one
                # ended on its process's error: read it now (unread, only the watchdog would notice).
                ray.get(dangling)
                raise RuntimeError(f"process {p}'s stream ended after a snapshot without its step's metrics")
            return False
        if not self.streaming[p]:
            ray.get(ref)  # the chunk's metrics; raises the process's error
            return False
        plan = self.world.plan
        if is_snapshot_step(s.cursor, self.config.snapshot_every) and s.snapshot is None:
            # A driver-owned ref to an object in this slice's own node's object store. It is
            # only trusted once the step's metrics arrive: an item of a dying actor is an error.
            s.snapshot = ref
            return False
        metrics = ray.get(ref)
        step = s.cursor
        if s.snapshot is not None:
            self.store.add(self.world.slice_of(p), p % plan.hosts_per_slice, step, s.snapshot)
            if step > self._snapshot_reported:
                self._snapshot_reported = step
                self._snapshot_steps.append(step)
            s.snapshot = None
        s.cursor += 1
        if step > self._reported:
            self._reported = step
            self.on_metrics(metrics)
            return True
        return False

    def drain(self, timeout_s: float, errors: dict[int, BaseException], newest_s: float = 3.0) -> None:
        """After a failure, collect what surviving processes already streamed (their last snapshots).

        Reads until nothing more comes within ``timeout_s``; but while a surviving snapshot holder
        has not yet delivered the snapshot of the newest finished step, keeps reading for up to
        ``newest_s``: that snapshot is what lets the next world lose no step, and on busy CPUs it
        can arrive later than the first pause of the stream (a dead process's items are errors
        at once; only a hung holder makes this wait the whole ``newest_s``).
        """
        start = time.monotonic()
        newest = newest_snapshot_step(self._reported, self.config.snapshot_every)
        while True:
            behind = any(self.streaming[p] and q and q[0].cursor <= newest
                         for p, q in enumerate(self.queues) if p not in errors)
            left = start + (max(newest_s, timeout_s) if behind else timeout_s) - time.monotonic()
            heads = {q[0].gen: p for p, q in enumerate(self.queues) if q and p not in errors}
            if not heads or left <= 0:
                return
            ready, _ = ray.wait(list(heads), num_returns=len(heads), timeout=min(0.05, left))
            if not ready and not behind:
                return
            for gen in ready:
                p = heads[gen]
                try:
                    self._consume(p)
                except Exception as e:  # noqa: BLE001
                    errors[p] = e
