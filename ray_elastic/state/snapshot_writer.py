"""The slice process's side of a snapshot: the state after a step copied into the host keeper's ring.

One background thread, one snapshot at a time: the step itself packed its new state on the
device and the step loop goes on; this thread waits for it and copies it into a free slot of the ring the keeper owns
(:mod:`ray_elastic.state.snapshot_slots`), with no call to the keeper. A process whose keeper's
ring it cannot map (the keeper is not on its host) hands each snapshot over by a call instead.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import select
import threading
import time
from collections.abc import Callable

import numpy as np
import psutil
import ray

from ray_elastic.state.snapshot_slots import SlotLayout, SlotSegment

logger = logging.getLogger(__name__)
REFUSED = "refused by the keeper: a newer world has begun"


class KeeperGone(RuntimeError):
    """The host's keeper exited: the snapshots written for it are lost."""


class _ExitWatch:
    """A cheap check (no call, no /proc read) of whether process ``pid`` (the keeper, on this host)
    has exited: a pidfd turns readable when it does."""

    def __init__(self, pid: int):
        self.pid, self.fd = pid, None
        try:
            self.fd = os.pidfd_open(pid)
            self._poll = select.poll()
            self._poll.register(self.fd, select.POLLIN)
        except (AttributeError, OSError):  # no pidfd here (old kernel): ask psutil
            self.fd = None

    def __call__(self) -> bool:
        return bool(self._poll.poll(0)) if self.fd is not None else not psutil.pid_exists(self.pid)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class SnapshotWriter:
    """Copies snapshots into the host keeper's ring from a background thread, one at a time.

    ``submit`` returns at once, unless the previous snapshot is still being written: then it
    waits for it, so a snapshot is never skipped (skipping would leave a reported step without
    its snapshot). What a snapshot costs (``seconds``) is what it takes from the steps: the CPU
    time the writer thread spent on it (from the moment the packed state is ready until the
    keeper holds it; it competes with the steps for the host's cores) plus any wait of the step
    loop in ``submit``. The copy's wall time is not a cost: it runs beside the steps, and on
    busy cores it mostly measures waiting for one. ``streamed``: the newest step this process has streamed to
    the driver, whose slot is never overwritten (the driver may restore it before it acknowledges it).
    ``checked``: the steps fingerprinted (oldest first), whose slots are kept while the ring has room
    (the driver goes back to the newest one the replicas agreed on if they disagree later); with
    ``compared`` (fingerprints on) the ring has room for the agreed one and the next.
    """

    def __init__(
        self,
        keeper,
        generation: int,
        epoch: int | None,
        layout: SlotLayout,
        streamed: Callable[[], int] = lambda: -1,
        checked: Callable[[], tuple[int, ...]] = tuple,
        compared: bool = False,
    ):
        self.keeper, self.generation, self.epoch, self.layout = keeper, generation, epoch, layout
        self._streamed, self._checked, self._compared = streamed, checked, compared
        self._keeper_exit: _ExitWatch | None = None
        self._gone = ""  # why the ring was let go (its keeper exited)
        self.segment = self._open_ring()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="snapshot-writer")
        self._future: concurrent.futures.Future | None = None
        self._lock = threading.Lock()
        self._kept: list[int] = []
        self._not_kept: list[tuple[int, str]] = []  # (step, why): the driver reports them as events
        self._pending: int | None = None
        self._ready: Callable[[], None] = lambda: None  # waits for the state the snapshot in flight copies
        self.seconds: list[float] = []  # per snapshot: the thread's CPU time, and the wait in ``submit``

    def _open_ring(self) -> SlotSegment | None:
        """The keeper's ring for this world; None (snapshots go by call) when it refused or the
        ring is not on this host."""
        try:
            path = ray.get(
                self.keeper.open_segment.remote(self.generation, self.layout, self.epoch, compared=self._compared)
            )
            seg = SlotSegment.open(path, self.layout) if path else None
        except (OSError, ValueError) as e:
            logger.warning("snapshots go to the keeper by call: its ring cannot be mapped here (%r)", e)
            return None
        if seg is not None:
            self._keeper_exit = _ExitWatch(seg.keeper_pid)
        return seg

    def _write_ring(self, step: int, fill) -> bool:
        """Into the ring, while its keeper lives: a ring whose keeper is gone holds nothing anyone
        can read (the driver trusts nothing of a dead keeper), so it is removed and the step reported."""
        if self.segment is not None and self._keeper_exit is not None and self._keeper_exit():
            self._gone = f"the keeper (pid {self._keeper_exit.pid}) exited: its snapshots died with it"
            self.segment.close(unlink=True)
            self.segment = None
        if self.segment is None:
            raise KeeperGone(self._gone)
        return self.segment.write(self.generation, step, fill, keep=(self._streamed(), *self._checked()))

    @property
    def in_place(self) -> bool:
        """Snapshots are written into the keeper's ring (no call per step)."""
        return self.segment is not None

    def submit(
        self,
        step: int,
        fill: Callable[[list[np.ndarray]], None],
        host_copy: Callable[[], dict],
        ready: Callable[[], None] = lambda: None,
    ) -> None:
        """Keep the state after ``step``: ``fill`` writes its blocks into a slot's arrays,
        ``host_copy`` makes them (for a keeper reached by call), ``ready`` waits for the packed state."""
        if self._future is not None:
            self._ready()  # the step the snapshot in flight copies: the step's own time, not the snapshot's
        t0 = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - t0
        self._pending, self._ready = step, ready
        self._future = self._pool.submit(self._write, step, fill, host_copy, ready, waited)

    def _write(self, step: int, fill, host_copy, ready, waited: float) -> None:
        kept, why = False, REFUSED
        try:
            ready()
            t0 = time.thread_time()
            if self.segment is not None or self._gone:
                kept = self._write_ring(step, fill)
            else:
                kept = ray.get(self.keeper.keep.remote(self.generation, step, host_copy(), self.epoch))
        except Exception as e:  # noqa: BLE001 - the step goes on without this snapshot; recovery may rewind
            logger.warning("snapshot of step %d not kept: %r", step, e)
            why = repr(e)[:300]
            t0 = time.thread_time()
        with self._lock:
            if kept:
                self._kept.append(step)
            else:
                self._not_kept.append((step, why))
            self.seconds.append(time.thread_time() - t0 + waited)

    def wait(self) -> None:
        """Until the snapshot in flight is kept; raises what writing it raised."""
        if self._future is not None:
            future, self._future = self._future, None
            try:
                future.result()
            finally:
                self._pending = None

    def pending(self) -> int | None:
        """The step whose snapshot is being written (None: none)."""
        if self._future is not None and self._future.done():
            self.wait()
        return self._pending

    def take_kept(self) -> tuple[list[int], list[float], list[tuple[int, str]]]:
        """Steps kept, seconds spent and (step, why) of snapshots not kept, since the last call."""
        with self._lock:
            kept, self._kept = self._kept, []
            seconds, self.seconds = self.seconds, []
            not_kept, self._not_kept = self._not_kept, []
        return kept, seconds, not_kept

    def close(self) -> None:
        """The world is over: wait for the snapshot in flight and unmap the ring (the keeper keeps it)."""
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - reported with its step already
            pass
        self._pool.shutdown(wait=False)
        if self.segment is not None:
            self.segment.close()
        if self._keeper_exit is not None:
            self._keeper_exit.close()
