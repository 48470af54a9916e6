"""Driving one world: chunks of steps in flight, finished steps streamed back.

Snapshot-keeping processes run chunks as Ray streaming generators and stream their
finished steps a few times a second, naming the steps whose snapshots their host's
keeper now holds; the others run chunks as plain tasks whose one small result (or
error) comes at the chunk's end, waited for by a thread of its own and read in one batch
with the others that are ready: at a thousand processes the driver's work per round and
per chunk is what limits a world's size.
The driver reads every item of every stream and every result (an error is an item:
reading them all is how a death is seen at once), but no snapshot passes through it. Two chunks are
kept queued, so workers never wait on the driver. The loop ends when the steps are
done, a process fails, the watchdog sees no progress, or (on request) at a step
boundary to grow.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Optional

import ray

from ray_elastic.config import ElasticConfig
from ray_elastic.control.states import OutcomeKind, RunOutcome
from ray_elastic.control.world import World
from ray_elastic.decide import (
    MAX_SNAPSHOT_EVERY,
    chunk_steps,
    is_eval_step,
    newest_due_snapshot,
    save_timeout,
    snapshot_cost_in_steps,
    snapshot_interval,
    watchdog_timeout,
)
from ray_elastic.detect import health
from ray_elastic.errors import ProcessGone, RayletGone, SaveTimedOut
from ray_elastic.state.snapshot_keeper import ask_keepers
from ray_elastic.state.snapshots import SnapshotRef, SnapshotStore

logger = logging.getLogger(__name__)
CHUNKS_IN_FLIGHT = 2
POLL_S = 0.25
# When one quiet chunk has ended, the rest of its batch (processes end a chunk together) is
# gathered for up to GATHER_S and read in one ``ray.get``.
GATHER_S = 0.005
WATCH_S = 1.0  # a FirstReady thread's longest single wait (it waits again on the same refs)
# A world whose steps stop for SUSPECT_FACTOR step times (at least SUSPECT_MIN_S, past the
# streams' FLUSH_S) has its hosts' raylets looked at: a refusing one is a lost node, seen before
# Ray's health checks mark it (until then no call of ours fails: the lost host's tasks wait on
# its node's death, its peers in a collective). Looked at again after NODE_CHECK_S, doubling up
# to NODE_CHECK_MAX_S while the stall lasts; a few loopback or LAN connects, no Ray call.
SUSPECT_FACTOR, SUSPECT_MIN_S = 1.5, 0.25
NODE_CHECK_S, NODE_CHECK_MAX_S = 0.05, 1.0

KEEPER_POLL_S = 0.05
STEP_COST_WINDOW = 10  # snapshot intervals of step times the auto interval reads
KEEPER_ANSWER_S = 0.3  # a live keeper answers in milliseconds; one on a lost node may never
OTHER_HOLDERS_S = 1.0  # once a slice whose keepers answer holds the newest step, how long the other holders
# get to hand it over too (a writer takes milliseconds; one stuck behind a
# step whose collective waits for the dead peer never does)
NOT_KEPT_LISTED = 5  # snapshots not kept listed per world in the event (all are counted)


class StepStreams:
    """Runs steps on ``world`` and feeds ``store`` and ``on_metrics``.

    ``on_interval(step, every)`` is told when the snapshot interval changes (``snapshot_every="auto"``).
    """

    def __init__(
        self,
        world: World,
        config: ElasticConfig,
        store: SnapshotStore,
        on_metrics: Callable[[dict], None],
        step_times: list[float],
        on_interval: Optional[Callable[[int, int], None]] = None,
        on_committed: Optional[Callable[[list], None]] = None,
        on_eval: Optional[Callable[[dict], bool]] = None,
        save_seconds: Optional[list] = None,
    ):
        self.world = world
        self.config = config
        self.store = store
        self.on_metrics = on_metrics
        self.on_interval = on_interval
        self.on_committed = on_committed
        self.on_eval = on_eval  # an eval's metrics; asked with {"step": s} alone, says whether s's eval is known
        self.step_times = step_times
        self.save_seconds = save_seconds if save_seconds is not None else []  # committed saves' durations (grows)
        self.steps_per_chunk = config.steps_per_chunk  # the last chunk's length (chunk_steps)
        # Per channel (World.channels: a process, or a relay's group of quiet ones): its chunks in flight.
        self.channels = world.channels
        self.queues: list[collections.deque] = [collections.deque() for _ in self.channels]
        self.streaming = [len(ch) == 1 and world.plan.takes_snapshots(ch[0]) for ch in self.channels]
        self._snapshot_steps: list[int] = []  # steps newly kept by some holder, not yet reported
        self.snapshot_seconds: list[float] = []  # what each snapshot cost its process (host copy + hand-over)
        self.not_kept: list[
            dict
        ] = []  # the first few snapshots a holder's keeper did not take: {"slice", "step", "why"}
        self.not_kept_count = 0  # and how many in all (a dead keeper misses every step)
        self._intervals: list[tuple[int, int]] = []  # (first step, snapshot interval) per change
        self._timed: list[tuple[int, float]] = []  # (step, seconds) of this world's steps, first run only
        self._step_cost: Optional[float] = None  # a snapshot's cost read from the step times (auto interval)
        self._reported = self._snapshot_reported = -1
        self._submitted = False  # a world's first chunk redoes an eval a failure lost
        self._raylets: Optional[dict] = None  # node id -> where its raylet listens (_learn_raylets)
        self._learning: Optional[threading.Thread] = None

    def take_snapshot_steps(self) -> list[int]:
        """Steps snapshotted since the last call (for the event log)."""
        out, self._snapshot_steps = self._snapshot_steps, []
        return out

    def _next_interval(self, step: int) -> int:
        c = self.config
        if c.snapshot_every != "auto":
            every = int(c.snapshot_every)
        else:
            current = self._intervals[-1][1] if self._intervals else 1
            if self._intervals:  # what the snapshots cost the steps run at the current interval
                since = self._intervals[-1][0]
                timed = [t for t in self._timed[-STEP_COST_WINDOW * current :] if t[0] >= since]
                measured = snapshot_cost_in_steps(timed, current)
                self._step_cost = self._step_cost if measured is None else measured  # held across a change
            every = snapshot_interval(
                self.snapshot_seconds[-20:],
                self.step_times[-20:],
                c.snapshot_budget,
                current,
                step_cost=self._step_cost,
            )
        if not self._intervals or self._intervals[-1][1] != every:
            self._intervals.append((step, every))
            if self.on_interval is not None:
                self.on_interval(step, every)
        return every

    def run(self, start_step: int, end_step: int, grow_requested: Callable[[], bool]) -> RunOutcome:
        if self._learning is None:
            self._learning = threading.Thread(target=self._learn_raylets, name="ray-elastic-raylets", daemon=True)
            self._learning.start()
        wake = threading.Event()
        waiters = FirstReady(wake), FirstReady(wake)  # snapshot holders' streams, the others' results
        self.world.deaths.notify(wake.set)
        try:
            return self._run(start_step, end_step, grow_requested, wake, *waiters)
        finally:
            self.world.deaths.notify(None)
            for w in waiters:
                w.stop()

    def _run(
        self,
        start_step: int,
        end_step: int,
        grow_requested: Callable[[], bool],
        wake: threading.Event,
        stream_waiter: "FirstReady",
        quiet_waiter: "FirstReady",
    ) -> RunOutcome:
        submitted = start_step
        self._reported = self._snapshot_reported = start_step - 1
        draining = stopped = False
        last_progress = time.monotonic()
        last_progress_wall = time.time()
        probed = -1  # the newest step a health probe found finished
        node_check_every, next_node_check = NODE_CHECK_S, 0.0
        holders = [c for c in range(len(self.queues)) if self.streaming[c]]
        quiet = [c for c in range(len(self.queues)) if not self.streaming[c]]
        while True:
            if not draining and grow_requested():
                draining = True  # finish what is queued, then stop at that step boundary
            heads_changed = False
            while not draining and submitted < end_step and max(map(len, self.queues)) < CHUNKS_IN_FLIGHT:
                self.steps_per_chunk = chunk_steps(
                    self.config.steps_per_chunk, len(self.world.workers), self.step_times[-20:]
                )
                n = min(self.steps_per_chunk, end_step - submitted)
                heads_changed |= not all(self.queues)
                self._submit(submitted, n, end_step - 1)
                submitted += n
            if draining and not stopped:
                heads_changed |= not all(self.queues)
                self._submit(submitted, 0, end_step - 1)  # no steps: the processes finish the one in flight
                stopped = True
            if heads_changed:
                stream_waiter.watch(self._heads(holders))
                quiet_waiter.watch(self._heads(quiet))
            if not any(self.queues):
                kind = OutcomeKind.GROW if draining and submitted < end_step else OutcomeKind.DONE
                if kind is OutcomeKind.GROW:
                    self.sync_with_keepers()  # the bigger world restores from what they hold
                return RunOutcome(kind, {}, last_progress_wall)
            limit = watchdog_timeout(self.step_times, self.config.hang_timeout_factor, self.config.hang_timeout_min_s)
            suspect = watchdog_timeout(self.step_times, SUSPECT_FACTOR, SUSPECT_MIN_S)
            check_at = max(last_progress + suspect, next_node_check)
            wake.wait(min(POLL_S, max(0.0, check_at - time.monotonic())))
            wake.clear()
            gone = self.world.deaths.dead()
            if gone:  # before Ray has said so (its signal comes through the GCS, late on a loaded host)
                return RunOutcome(OutcomeKind.FAILURE, self._gone(gone), last_progress_wall)
            if quiet_waiter.fired():
                # Quiet chunks ended (or one failed): every one that has, in one batch.
                heads = {self.queues[c][0]: c for c in quiet if self.queues[c]}
                done, _ = ray.wait(list(heads), num_returns=len(heads), timeout=GATHER_S)
                failed = self._consume_results([heads[r] for r in done])
                quiet_waiter.watch(self._heads(quiet))
                if failed:
                    return RunOutcome(OutcomeKind.FAILURE, failed, last_progress_wall)
            if stream_waiter.fired():
                heads = {self.queues[c][0]: c for c in holders if self.queues[c]}
                ready, _ = ray.wait(list(heads), num_returns=len(heads), timeout=0)
                for gen in ready:
                    c = heads[gen]
                    try:
                        progressed = self._consume(c)
                    except Exception as e:  # noqa: BLE001 - any error of a slice process is an event
                        return RunOutcome(OutcomeKind.FAILURE, {self.channels[c][0]: e}, last_progress_wall)
                    if progressed:
                        last_progress, last_progress_wall = time.monotonic(), time.time()
                        node_check_every, next_node_check = NODE_CHECK_S, 0.0
                stream_waiter.watch(self._heads(holders))
            now = time.monotonic()
            if now - last_progress > suspect and now >= next_node_check:
                lost = self._lost_hosts()
                if lost:
                    return RunOutcome(OutcomeKind.FAILURE, lost, last_progress_wall)
                next_node_check = now + node_check_every
                node_check_every = min(2 * node_check_every, NODE_CHECK_MAX_S)
            if time.monotonic() - last_progress > limit:
                answers = health.probe(self.world.workers, self.config.probe_timeout_s)
                save_limit = save_timeout(self.config.save_timeout_s, self.save_seconds)
                stuck = health.stuck_saves(answers, save_limit)
                if stuck:
                    return RunOutcome(
                        OutcomeKind.FAILURE,
                        {
                            p: SaveTimedOut(
                                f"a checkpoint save of process {p} has run {s:.0f}s, over save_timeout_s={save_limit:.0f}: "
                                f"the storage ({self.config.checkpoint_dir}) does not answer"
                            )
                            for p, s in stuck.items()
                        },
                        last_progress_wall,
                    )
                if not health.busy(answers, max(self._reported, probed)):
                    silent: dict[int, BaseException] = {
                        p: TimeoutError("no answer to the health probe") for p, a in enumerate(answers) if a is None
                    }
                    return RunOutcome(OutcomeKind.HANG, silent, last_progress_wall)
                probed = max(probed, health.newest_step(answers))
                last_progress = time.monotonic()  # slow, not hung: watch again from now

    def _learn_raylets(self) -> None:
        """Where the world's raylets listen, each connected to once (off the step loop, once per
        world: nodes do not move during a world): only a raylet this driver has reached can later
        prove its node dead by refusing (``health.refusing``), so reach them before any dies."""
        try:
            addresses = health.raylet_addresses({i["node_id"] for i in self.world.host_infos})
        except Exception as e:  # noqa: BLE001 - the GCS unreachable for a moment: no evidence this world
            logger.debug("raylet addresses: %r", e)
            addresses = {}
        health.answering(addresses)
        self._raylets = addresses

    def _gone(self, processes: set[int]) -> dict[int, BaseException]:
        """Processes whose liveness connection closed, by process: with its host (a refusing raylet:
        the node died, every process there is gone) or alone (the node check decides later)."""
        errors = self._lost_hosts(processes)  # every process of such a host, not only the closed ones
        for p in processes & set(errors):
            errors[p] = RayletGone(f"{errors[p]} (and the liveness connection of its process {p} closed)")
        for p in sorted(processes - set(errors)):
            errors[p] = ProcessGone(
                f"process {p} of slice {self.world.slice_of(p)} "
                f"(pid {self.world.host_infos[p]['pid']}) is gone: its liveness connection closed"
            )
        return errors

    def _lost_hosts(self, of: Optional[set[int]] = None) -> dict[int, BaseException]:
        """The processes (of ``of``, default all) whose host's raylet refuses connections (its Ray
        node is dead), by process: every process on such a host, not only those of ``of``."""
        if not self._raylets:  # not learnt yet (the world's first moments) or none reachable
            return {}
        nodes = None if of is None else {self.world.host_infos[p]["node_id"] for p in of}
        gone = health.refusing({n: a for n, a in self._raylets.items() if nodes is None or n in nodes})
        return {
            p: RayletGone(
                f"the raylet of host {p % self.world.plan.hosts_per_slice} of slice "
                f"{self.world.slice_of(p)} (node {info['node_id'][:12]}) refuses connections: its node is gone"
            )
            for p, info in enumerate(self.world.host_infos)
            if info["node_id"] in gone
        }

    def _heads(self, channels: list[int]) -> list:
        return [self.queues[c][0] for c in channels if self.queues[c]]

    def _submit(self, first: int, n: int, final_step: int) -> None:
        every = self._next_interval(first)
        eval_before = not self._submitted and self._eval_lost(first - 1, final_step)
        self._submitted = True
        for c, ref in enumerate(self.world.run_chunk(first, n, final_step, every, eval_before)):
            self.queues[c].append(ref)

    def _eval_lost(self, step: int, final_step: int) -> bool:
        """The eval due after ``step`` never reached the driver (a failure during it): redo it first."""
        c = self.config
        return (
            self.on_eval is not None
            and step >= 0
            and is_eval_step(step, c.eval_every, final_step)
            and not self.on_eval({"step": step})
        )

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
        if item["kept"]:  # the keeper holds on to what we know of until we say we know of newer
            self.world.keepers[p].ack.remote(plan.generation, max(item["kept"]))
        self.snapshot_seconds.extend(item["snapshot_s"])
        for step, why in item.get("not_kept", ()):
            self.not_kept_count += 1
            if len(self.not_kept) < NOT_KEPT_LISTED:
                self.not_kept.append({"slice": self.world.slice_of(p), "step": step, "why": why})
        if "eval" in item and self.on_eval is not None:
            self.on_eval(item["eval"])
        progressed = False
        for metrics in item["steps"]:
            if metrics["step"] > self._reported:
                self._reported = metrics["step"]
                self._timed.append((metrics["step"], metrics["step_time_s"]))
                if len(self._timed) > 2 * STEP_COST_WINDOW * MAX_SNAPSHOT_EVERY:  # more than any window reads
                    del self._timed[: STEP_COST_WINDOW * MAX_SNAPSHOT_EVERY]
                self.on_metrics(metrics)
                progressed = True
            elif metrics.get("checkpoints_committed") and self.on_committed is not None:
                # A step's metrics are kept from whichever holder reports it first, but a commit is
                # reported at the step each holder's own save finished: take it from every report.
                self.on_committed(metrics["checkpoints_committed"])
        return progressed

    def drain(self, timeout_s: float, errors: dict[int, BaseException], newest_s: float = 3.0) -> None:
        """After a failure, collect what surviving processes already streamed, then what their
        keepers hold.

        Reads streams until nothing more comes within ``timeout_s``. Then, until the keeper of
        every holder process that did not fail (and whose keeper answers) holds the snapshot
        of the newest reported step, asks them again, for up to ``newest_s``: a holder's writer
        thread hands it over even while the process's step loop is stuck in a collective with
        the dead peer, and that snapshot is what lets the next world lose no step. One holder
        is not enough: the world that restores it may fail while it forms and lose that holder
        too, and the processes of this world are torn down right after (seen in
        ``bench/chaos.py``: a second slice lost while the next world formed, 1 step rewound
        though a survivor had kept that step a moment after the first holder had). Steps a
        keeper holds beyond the newest reported one are not taken: the run has no metrics for
        them, so they are run again (never counted as kept).

        Once some slice whose keepers answer holds the newest step, the other holders get only
        ``OTHER_HOLDERS_S``: a survivor whose copy of that step has not reached its keeper by then
        most likely never will (its copy waits behind the next step, stuck in a collective with
        the dead peer). In ``bench/recovery.py`` a process kill reached the recovery 3.1 s after
        it, this whole bound, where every other kill took 0.1-0.6 s (``drain_s`` in the failure
        event tells). A keeper on a lost node does not answer and its slice does not count.
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
        lost = self._lost_hosts(set(errors))
        holders = [p for p in self._holder_processes() if p not in lost]
        newest = newest_due_snapshot(self._reported, self._intervals)
        deadline = time.monotonic() + newest_s
        while holders:
            dead: set[int] = set()
            answered = self.sync_with_keepers(holders, timeout_s=KEEPER_ANSWER_S, dead=dead)
            live = [p for p in answered if p not in errors and p not in dead]  # a failed process, or one
            # whose keeper died, keeps nothing more
            if newest < 0 or time.monotonic() >= deadline:
                return
            if self._holds(holders, newest) and all(self._has_part(p, newest) for p in live):
                return
            if self._holds_confirmed(holders, [p for p in answered if p not in dead], newest):
                deadline = min(deadline, time.monotonic() + OTHER_HOLDERS_S)
            time.sleep(KEEPER_POLL_S)

    def _holder_processes(self) -> list[int]:
        return [ch[0] for ch, streams in zip(self.channels, self.streaming) if streams]

    def _has_part(self, p: int, step: int) -> bool:
        """Process ``p``'s keeper holds its host's part of the snapshot of ``step``."""
        return self.store.has(self.world.slice_of(p), p % self.world.plan.hosts_per_slice, step)

    def _holds_confirmed(self, holders: list[int], answered: list[int], step: int) -> bool:
        """Some slice whose every holder's keeper answered just now has every host's part of
        ``step`` (a keeper on a lost node does not answer, and the store still lists what it held)."""
        silent = {self.world.slice_of(p) for p in holders if p not in answered}
        return any(self.store.complete(s, step) for s in {self.world.slice_of(p) for p in answered} - silent)

    def _holds(self, processes: list[int], step: int) -> bool:
        """Some slice of ``processes`` has every host's part of the snapshot of ``step``."""
        return any(self.store.complete(self.world.slice_of(p), step) for p in processes)

    def sync_with_keepers(
        self, processes: Optional[list[int]] = None, timeout_s: float = 1.0, dead: Optional[set] = None
    ) -> list[int]:
        """Make the store say what these processes' keepers really hold (all snapshot holders by
        default), up to the newest reported step (later ones have no metrics in the run: they are
        run again). A keeper that does not answer (its node is gone) is left as the store has it:
        the slice's loss is decided elsewhere; one Ray reports dead holds nothing (its process goes
        into ``dead``). Returns the processes whose keepers answered."""
        plan = self.world.plan
        processes = self._holder_processes() if processes is None else processes
        dead_keepers: set[int] = set()
        answers = ask_keepers([self.world.keepers[p] for p in processes], timeout_s, dead_keepers)
        if dead is not None:
            dead.update(processes[i] for i in dead_keepers)
        for i, held in answers.items():
            p = processes[i]
            keeper = self.world.keepers[p]
            self.store.hold_only(
                self.world.slice_of(p),
                p % plan.hosts_per_slice,
                {step: SnapshotRef(keeper, generation, step) for generation, step in held if step <= self._reported},
            )
        return [processes[i] for i in answers]


class FirstReady:
    """Waits on a thread of its own for the first of some refs (or streams) to be ready, then sets
    ``wake`` and stays idle until given the next refs to wait on.

    The driver's round then waits on an event, and ``ray.wait`` over a world's refs runs once per
    thing that happens instead of once per round: it costs ~1.4 us per ref, and over every
    process in every round it made the driver's work per step grow with the world (~4.5 ms per
    step at 1024 processes, most of the total). ``ray.wait`` lets go of the GIL while it blocks.
    """

    def __init__(self, wake: threading.Event):
        self._wake = wake
        self._cond = threading.Condition()
        self._refs: list = []
        self._fired = False
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="ray-elastic-first-ready", daemon=True)
        self._thread.start()

    def watch(self, refs: list) -> None:
        """From now on wait for the first of ``refs`` (what the queues now start with)."""
        with self._cond:
            self._refs, self._fired = list(refs), False
            self._cond.notify()

    def fired(self) -> bool:
        with self._cond:
            return self._fired

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (not self._refs or self._fired):
                    self._cond.wait()
                if self._stopped:
                    return
                refs = self._refs
            try:
                done, _ = ray.wait(refs, num_returns=1, timeout=WATCH_S)
            except Exception:  # noqa: BLE001 - shutting down, or a ref gone: the round finds out which
                done = refs
            with self._cond:
                if done and self._refs is refs and not self._stopped:
                    self._fired = True
                    self._wake.set()
