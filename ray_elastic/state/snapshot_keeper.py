"""In-memory snapshots off the step's critical path: a keeper per slice host, its process writing in place.

A snapshot must outlive the process that took it (a killed process is the most
common fault) and die with its node (a snapshot on a lost host must never be
trusted). Ray 2.56 removed ``ray.put(..., _owner=...)``, so an object a process
puts dies with that process; instead a small :class:`SnapshotKeeper` actor per
slice host, started in the slice's placement group and living as long as the
reservation, owns the newest snapshots of that host's process: a shared-memory ring
(:mod:`ray_elastic.state.snapshot_slots`) the process's
:class:`~ray_elastic.state.snapshot_writer.SnapshotWriter` copies each step's state into
from a background thread (the step itself packed it on the device, so the step loop goes on),
and no call crosses to the keeper per step.

The keeper answers which (generation, step) snapshots it holds; the driver asks at
recovery and learns the rest from the steps the writer reports as kept, piggy-backed
on the metrics the process streams anyway. A keeper holds a step only once the whole
state after it was copied to host, which needs the step's collectives to have
finished on every process: a held step is a finished step.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import threading
import time

import numpy as np
import ray

from ray_elastic.state.snapshot_slots import SlotLayout, SlotSegment, remove_orphans

logger = logging.getLogger(__name__)
KEEP_STEPS = 3  # per host: the newest three, so the hosts of one slice (in lockstep, but handing over
# in the background) always share one step
MAX_UNACKED = 64  # per host: at most this many snapshots newer than the driver's last word are held
# (a stream goes out every FLUSH_S: more than that many fast steps)


def evictable(
    keys: list[tuple[int, int]],
    keep_steps: int,
    acked: tuple[int, int],
    max_unacked: int = MAX_UNACKED,
    trusted: int = -1,
) -> list[tuple[int, int]]:
    """Which of the held (generation, step) keys to let go: all but the newest ``keep_steps``, the
    newest key at or before ``acked`` (the newest step of this host the driver has said it
    received), every key after it (up to ``max_unacked``), and the newest key of a step at or
    before ``trusted`` (the newest step the replicas agreed on: with no majority, the run goes back to it).

    The driver restores only a step it has the metrics of, and it takes a step's metrics from
    whichever snapshot holder streams them first, each on its own clock: when one holder dies, the
    driver may know of a step the others have not streamed yet while they kept several more, so
    every step after the driver's last word may be the one it restores. The pin is what the driver
    acknowledged, not what the process streamed: a streamed item may never reach the driver (the
    process killed with it in flight, or the world torn down before it was read).
    """
    newest = set(sorted(keys)[-keep_steps:] if keep_steps > 0 else [])
    pinned = max((k for k in keys if k <= acked), default=None)
    unacked = set(sorted(k for k in keys if k > acked)[-max_unacked:])
    agreed = max((k for k in keys if k[1] <= trusted), default=None)
    return [k for k in keys if k not in newest and k != pinned and k not in unacked and k != agreed]


PREVIOUS_DRIVER = -1  # the generation a taken-over keeper files its snapshots under (the new run's start at 0)


def _digest(secret: str | None) -> str | None:
    return None if secret is None else hashlib.sha256(secret.encode()).hexdigest()


# Lease calls run on their own thread: a renewal never queues behind a multi-second ``keep`` copy.
@ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0, concurrency_groups={"lease": 1})
class SnapshotKeeper:
    """The newest snapshots of one slice host's process, by (generation, step).

    Its process writes them in place into a shared-memory ring the keeper owns, one per world
    (:meth:`open_segment`, :mod:`ray_elastic.state.snapshot_slots`): no call per step. A process
    that cannot map it (not on the keeper's host) hands them over by :meth:`keep` instead.

    It outlives the driver for ``orphan_timeout_s`` (see :mod:`ray_elastic.ray_backend.keepers`): the
    driver renews its lease, a new driver of the same run takes it over with a higher ``epoch``
    (and the run's ``secret``: another job cannot), and one whose lease runs out frees its
    snapshots and exits. Calls of an older epoch are refused; only the owning epoch releases it.
    """

    def __init__(
        self,
        keep_steps: int = KEEP_STEPS,
        orphan_timeout_s: float | None = None,
        identity=None,
        epoch: int = 0,
        secret: str | None = None,
    ):
        self.keep_steps = keep_steps
        self._entries: dict[tuple[int, int], dict] = {}  # handed over by call
        self._segments: list[tuple[int, SlotSegment]] = []  # (generation it is filed under, its ring)
        self._generation, self._start = -1, 0
        self._acked = (-1, -1)  # the newest (generation, step) of this host the driver has received
        self._trusted = -1  # the newest step the driver saw the replicas agree on
        self.identity, self.epoch = identity, epoch  # whose snapshots these are; the driver that owns them
        self._secret = _digest(secret)  # who may take it over (None: anyone who finds it)
        self._released = False
        self.place: tuple[str, int] | None = None  # (slice name, host index) of the process it keeps for
        self._renewed = time.monotonic()
        remove_orphans()  # rings of keepers killed on this host before they could remove them
        atexit.register(self._free)
        if orphan_timeout_s is not None:
            threading.Thread(target=self._expire, args=(orphan_timeout_s,), name="lease", daemon=True).start()

    def _expire(self, timeout_s: float) -> None:
        """No driver has renewed the lease for ``timeout_s``: the run was abandoned; free everything."""
        while time.monotonic() - self._renewed < timeout_s:
            time.sleep(min(1.0, timeout_s / 10))
        logger.warning("no driver renewed this keeper's lease for %.0fs: freeing its snapshots and exiting", timeout_s)
        try:
            self._free()
        finally:  # whatever freeing raised, an abandoned keeper must not outlive its lease
            os._exit(0)

    def _free(self) -> None:
        self._entries.clear()
        for _, seg in self._segments:
            seg.close(unlink=True)
        self._segments = []

    @ray.method(concurrency_group="lease")
    def status(self, secret: str | None = None) -> dict | None:
        """What a new driver decides from: the owning driver's epoch, the node. None without the
        run's secret (the epoch is what the owner's calls carry)."""
        if _digest(secret) != self._secret or self._released:
            return None
        return {"epoch": self.epoch, "node_id": ray.get_runtime_context().get_node_id()}

    @ray.method(concurrency_group="lease")
    def renew(self, epoch: int) -> bool:
        """The driver of ``epoch`` is alive; False when a newer driver has taken the run over."""
        if epoch < self.epoch:
            return False
        self._renewed = time.monotonic()
        return True

    def take_over(self, epoch: int, identity, secret: str | None = None) -> dict:
        """A new driver of the run (``epoch`` above the keeper's) takes the keeper and what it holds.

        ``taken`` False (``why``): an equal or newer driver has it (the caller was superseded), or
        the secret is not the run's, or it was released. With another ``identity`` (another task,
        model or training settings) it is taken, but what it held is dropped: it cannot be
        restored. What it held is filed under :data:`PREVIOUS_DRIVER`, below the new run's first
        world, and the lost driver's processes can write no more.
        """
        if _digest(secret) != self._secret or self._released:
            return {"taken": False, "why": "released" if self._released else "secret"}
        if epoch <= self.epoch:
            return {"taken": False, "why": "newer"}
        self.epoch, self._renewed = epoch, time.monotonic()
        for _, seg in self._segments:
            seg.seal()
        dropped = 0
        if identity != self.identity:
            dropped, self.identity = len(self.held()), identity
            self._free()
        self._entries = {(PREVIOUS_DRIVER, step): v for (_, step), v in self._entries.items()}
        self._segments = [(PREVIOUS_DRIVER, seg) for _, seg in self._segments]
        self._generation, self._acked = (
            PREVIOUS_DRIVER,
            (PREVIOUS_DRIVER, max((k[1] for k in self.held()), default=-1)),
        )
        return {"taken": True, "place": self.place, "held": self.held(), "dropped": dropped}

    def release(self, epoch: int) -> bool:
        """The owning driver lets go (its run ended, or nothing it holds is wanted): everything is
        freed and no one can take it over; the caller then kills it. False (kept) for any other epoch."""
        if epoch != self.epoch:
            return False
        self._released = True
        self._free()
        return True

    def begin(self, generation: int, start_step: int, place: tuple[str, int] | None = None, epoch: int = 0) -> bool:
        """A world of ``generation`` starts after ``start_step - 1``: steps from ``start_step`` on are
        run again by it, so what earlier worlds kept of them (after a resize, other numbers) is dropped,
        and a late write from an earlier world is refused. ``place``: the (slice, host) it keeps for.
        False when a newer driver has the keeper."""
        if epoch < self.epoch:
            return False
        self._generation, self._start = generation, start_step
        self.place = tuple(place) if place is not None else self.place
        for key in [k for k in self._entries if k[1] >= start_step]:
            del self._entries[key]
        for gen, seg in self._segments:
            if gen < generation:
                seg.seal(before_step=start_step)
        self._evict()
        return True

    def seal(self, generation: int, epoch: int = 0) -> list[tuple[int, int]]:
        """``generation``'s world failed: what its process writes from now on does not count, so the
        steps its ring holds now (the ones the driver read the metrics of among them) are not
        overwritten while the driver decides and tears down, however long the survivors go on
        stepping. Returns :meth:`held`, as it stands sealed (unsealed for a superseded ``epoch``)."""
        if epoch >= self.epoch:
            for gen, seg in self._segments:
                if gen <= generation:
                    seg.seal()
        return self.held()

    def open_segment(
        self, generation: int, layout: SlotLayout, epoch: int | None = None, compared: bool = False
    ) -> str | None:
        """A ring for ``generation``'s process to write its snapshots into (the file's path); None
        when refused (a late world, or a driver that was taken over). ``compared``: the replicas'
        fingerprints are compared, and the ring keeps room for the agreed step (``SlotLayout.slots``)."""
        if generation < self._generation or (epoch is not None and epoch != self.epoch):
            return None
        for _gen, seg in [x for x in self._segments if x[0] == generation]:
            seg.close(unlink=True)
        self._segments = [x for x in self._segments if x[0] != generation]
        seg = SlotSegment.create(generation, layout, layout.slots(compared=compared))
        self._segments.append((generation, seg))
        return seg.path

    def keep(self, generation: int, step: int, snapshot: dict, epoch: int | None = None) -> bool:
        """Hold ``snapshot`` (blocks and ranges, copied out of the call's arguments); False when
        refused (a late write of an earlier world, or of a driver that was taken over)."""
        if generation < self._generation or (epoch is not None and epoch != self.epoch):
            return False
        self._entries[(generation, step)] = {
            "leaves": [np.array(b, copy=True) for b in snapshot["leaves"]],
            "ranges": snapshot["ranges"],
            "paths": snapshot.get("paths"),
            "step": step,
        }
        self._evict()
        return True

    def ack(self, generation: int, step: int, epoch: int = 0, trusted: int | None = None) -> None:
        """The driver has received the report that this host kept ``step``, and (``trusted``) saw
        the replicas agree on the state after that step (see :func:`evictable`). The driver's word
        on ``trusted`` replaces the keeper's: a rollback goes back to an earlier step."""
        if epoch < self.epoch:
            return
        self._acked = max(self._acked, (generation, step))
        self._trusted = self._trusted if trusted is None else trusted
        for gen, seg in self._segments:
            if gen == generation:
                seg.acknowledge(*self._acked)
                seg.trust(self._trusted)
        self._evict()

    def _evict(self) -> None:
        """What :func:`evictable` lets go, from calls' entries and sealed rings (a live ring's
        writer overwrites its own slots); a sealed ring left empty is removed."""
        for key in evictable(self.held(), self.keep_steps, self._acked, trusted=self._trusted):
            self._entries.pop(key, None)
            for gen, seg in self._segments:
                if gen == key[0]:
                    seg.drop(key[1])
        for gen, seg in [x for x in self._segments if x[1].sealed_view is not None and not x[1].steps()]:
            seg.close(unlink=True)
            self._segments.remove((gen, seg))

    def held(self) -> list[tuple[int, int]]:
        """(generation, step) of every snapshot held."""
        return sorted(set(self._entries) | {(gen, step) for gen, seg in self._segments for step in seg.steps()})

    def fetch(self, generation: int, step: int, epoch: int = 0) -> dict:
        """The snapshot of ``step`` kept by ``generation``'s process, for the owning driver's
        processes (KeyError when it is gone; PermissionError for another epoch)."""
        if epoch != self.epoch:
            raise PermissionError(f"snapshot keeper: epoch {epoch} does not own it")
        if (generation, step) in self._entries:
            return self._entries[(generation, step)]
        for gen, seg in reversed(self._segments):  # the newest ring first
            if gen == generation and step in seg.steps():
                try:
                    return seg.read(step)
                except KeyError:
                    continue
        raise KeyError((generation, step))


def ask_keepers(
    keepers: list,
    timeout_s: float,
    dead: set | None = None,
    starting: frozenset = frozenset(),
    sealing: tuple[int, int] | None = None,
) -> dict[int, list[tuple[int, int]]]:
    """Index -> (generation, step) held, for each of ``keepers`` (None skipped) that answers within
    ``timeout_s``. A keeper Ray reports dead holds nothing (``[]``; its snapshots died with it) and
    its index goes into ``dead``; one that does not answer (a lost or hung node) is left out.

    ``starting``: indices of keepers that have never answered (their process may still be starting,
    and they hold nothing yet): asked, but not waited for. Every fit's first world waited the whole
    ``timeout_s`` for its new keepers' processes to start. ``sealing``: (generation, epoch) of a
    failed world whose rings each keeper seals before it answers (:meth:`SnapshotKeeper.seal`)."""
    asks = {
        (k.seal.remote(*sealing) if sealing is not None else k.held.remote()): i
        for i, k in enumerate(keepers)
        if k is not None
    }
    awaited = [ref for ref, i in asks.items() if i not in starting]
    if awaited:
        ray.wait(awaited, num_returns=len(awaited), timeout=timeout_s)
    ready, _ = ray.wait(list(asks), num_returns=len(asks), timeout=0)  # and what the new ones said by now
    out = {}
    for ref in ready:
        try:
            out[asks[ref]] = ray.get(ref)
        except ray.exceptions.ActorDiedError:
            out[asks[ref]] = []
            if dead is not None:
                dead.add(asks[ref])
        except Exception:  # noqa: BLE001 - no answer we can read: as if it had not answered
            continue
    return out
