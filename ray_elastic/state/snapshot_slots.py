"""A host's snapshots in shared memory: a ring of slots the keeper owns and its process writes in place.

Only the newest snapshot of a host matters, so the slice process needs no call per step: the
keeper creates one segment per world (a file in ``/dev/shm``, named after the keeper's pid), the
process maps it and copies the state after a step into a free slot. The segment outlives the
process (a killed process is the most common fault) and dies with the keeper, which dies with
its node. A keeper killed without unlinking leaves its file: the next keeper started on the host
removes the files of keepers that no longer run.

Each slot is guarded by a sequence number (odd while it is written): a reader takes a slot only
when the number is even and the same before and after it read, so a slot a dying process left
half-written, or one overwritten while it was read, is never taken. The segment's header holds
what the writer needs from the keeper without a call: whether the world was sealed (a newer world
began; its late writes do not count), the newest step the driver acknowledged (see
:func:`~ray_elastic.state.snapshot_keeper.evictable`), which the writer never overwrites, and the
newest step the replicas were seen to agree on (:mod:`~ray_elastic.decide.integrity`), whose slot
it keeps while it can: with no majority to tell a corrupt replica, the run goes back to it.
No Ray and no JAX here.
"""

from __future__ import annotations

import dataclasses
import functools
import mmap
import os
import tempfile
import uuid
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import psutil

ALIGN = 64
PREFIX = "ray-elastic-snap-"
# header words: magic, slots, slot bytes, sealed, acked generation, acked step, generation, keeper
# pid, trusted step
MAGIC = 0x72656C61_736E6170
H_MAGIC, H_SLOTS, H_SLOT_BYTES, H_SEALED, H_ACK_GEN, H_ACK_STEP, H_GEN, H_PID, H_TRUSTED = range(9)
HEADER_WORDS = 9
SLOT_WORDS = 4  # seq, generation, step, spare
SLOT_BUDGET_BYTES = 512 << 20  # per host: the ring takes at most this much, or its fewest slots
MIN_SLOTS, MAX_SLOTS = 4, 16  # the fewest: the newest, the acknowledged, the streamed, one to write
COMPARED_SLOTS = 2  # with integrity checks, besides: the step last agreed on, the next one compared


def shm_dir() -> str:
    """Where segments live: ``/dev/shm`` (memory) where the host has it, else the temp directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def aligned(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


class Piece(NamedTuple):
    """One shard of a leaf in a slot: in row ``row`` (a device's packed buffer) at byte ``offset``,
    of ``shape``, landing at ``within`` ((start, stop) per dimension) of the process's block."""

    leaf: int
    row: int
    offset: int
    shape: tuple[int, ...]
    within: tuple


@dataclasses.dataclass(frozen=True)
class SlotLayout:
    """What one slot holds: ``rows`` buffers of ``row_bytes`` (one per local device, as the
    device program packed them), the ``pieces`` they hold, and per state leaf this process's
    block (shape, dtype), its global index range and its path (a restore checks them)."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    ranges: tuple
    paths: tuple[str, ...]
    pieces: tuple[Piece, ...]
    rows: int
    row_bytes: int
    row_devices: tuple[int, ...] = ()  # the device id whose buffer each row holds

    @classmethod
    def of(cls, shapes, dtypes, ranges, paths) -> SlotLayout:
        """One row holding each leaf's block whole, one after the other."""
        pieces, at = [], 0
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
            pieces.append(Piece(i, 0, at, tuple(shape), tuple((0, d) for d in shape)))
            at += aligned(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize, 8)
        return cls(
            tuple(map(tuple, shapes)),
            tuple(map(str, dtypes)),
            tuple(ranges),
            tuple(paths),
            tuple(pieces),
            1,
            aligned(at),
        )

    @property
    def slot_bytes(self) -> int:
        return self.rows * self.row_bytes

    @functools.cached_property
    def rows_read(self) -> frozenset:
        """The rows a piece is read from: a device whose shards another local device also holds
        (replicated within the process) adds nothing, and its row need not be copied."""
        return frozenset(p.row for p in self.pieces)

    def slots(self, budget_bytes: int = SLOT_BUDGET_BYTES, compared: bool = False) -> int:
        """How many slots the ring gets: as many as fit ``budget_bytes``, within MIN_SLOTS..MAX_SLOTS.
        More slots cover a longer lag between a step kept and the driver's acknowledgement.
        ``compared`` (the replicas' fingerprints are compared): COMPARED_SLOTS more at least, so
        that whatever the state's size the step the replicas last agreed on (where two replicas
        that disagree go back to) and the next one fingerprinted (which the driver has yet to
        compare, and which becomes the agreed step) are never given up for newer steps."""
        fewest = MIN_SLOTS + (COMPARED_SLOTS if compared else 0)
        return int(min(max(MAX_SLOTS, fewest), max(fewest, budget_bytes // max(self.slot_bytes, 1))))


def unpack(layout: SlotLayout, rows: list[np.ndarray]) -> list[np.ndarray]:
    """The process's block of every leaf, copied out of a slot's (or a packing's) byte rows."""
    blocks = [np.empty(shape, np.dtype(dtype)) for shape, dtype in zip(layout.shapes, layout.dtypes)]
    for p in layout.pieces:
        dtype = np.dtype(layout.dtypes[p.leaf])
        count = int(np.prod(p.shape, dtype=np.int64))
        part = rows[p.row][p.offset : p.offset + count * dtype.itemsize].view(dtype).reshape(p.shape)
        blocks[p.leaf][tuple(slice(a, b) for a, b in p.within)] = part
    return blocks


class SlotSegment:
    """One world's ring of snapshot slots in a shared file: created by the keeper, opened by the writer."""

    def __init__(self, path: str, layout: SlotLayout, fd: int, created: bool):
        self.path, self.layout, self._created = path, layout, created
        size = os.fstat(fd).st_size
        self._mm = mmap.mmap(fd, size)
        os.close(fd)
        self.header = np.ndarray((HEADER_WORDS,), np.int64, self._mm, 0)
        self.nslots = int(self.header[H_SLOTS])
        self.slot_header = np.ndarray((self.nslots, SLOT_WORDS), np.int64, self._mm, HEADER_WORDS * 8)
        self._data_at = aligned((HEADER_WORDS + self.nslots * SLOT_WORDS) * 8)
        self.sealed_view: dict[int, tuple[int, int]] | None = None  # keeper side: step -> (slot, seq) at sealing

    # ------------------------------------------------------------------ keeper side
    @classmethod
    def create(cls, generation: int, layout: SlotLayout, nslots: int, directory: str | None = None) -> SlotSegment:
        d = directory or shm_dir()
        path = os.path.join(d, f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
        data_at = aligned((HEADER_WORDS + nslots * SLOT_WORDS) * 8)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        size = data_at + nslots * max(layout.slot_bytes, ALIGN)
        try:
            os.ftruncate(fd, size)
            # Its memory taken now, not page by page in the process's first writes (a first step's
            # snapshot would look costly, and AutoInterval would widen the interval for nothing).
            os.posix_fallocate(fd, 0, size)
        except OSError:
            os.close(fd)
            os.unlink(path)
            raise
        head = np.zeros(HEADER_WORDS, np.int64)
        head[[H_MAGIC, H_SLOTS, H_SLOT_BYTES, H_ACK_GEN, H_ACK_STEP, H_GEN, H_PID, H_TRUSTED]] = [
            MAGIC,
            nslots,
            layout.slot_bytes,
            -1,
            -1,
            generation,
            os.getpid(),
            -1,
        ]
        os.pwrite(fd, head.tobytes(), 0)
        seg = cls(path, layout, fd, created=True)
        seg.slot_header[:, 2] = -1  # no step
        return seg

    def seal(self, before_step: int | None = None) -> None:
        """No write from now on counts (a newer world began): what the slots hold now is frozen,
        less the steps from ``before_step`` on (the new world runs them again)."""
        if self.sealed_view is None:
            self.header[H_SEALED] = 1
            self.sealed_view = {step: (slot, seq) for slot, step, seq in self._complete()}
        if before_step is not None:
            self.sealed_view = {s: v for s, v in self.sealed_view.items() if s < before_step}

    def acknowledge(self, generation: int, step: int) -> None:
        """The driver has the newest step ``step`` of this host: the writer keeps its slot."""
        self.header[H_ACK_GEN], self.header[H_ACK_STEP] = generation, step

    def trust(self, step: int) -> None:
        """The replicas agreed on the state after ``step``: the writer keeps the newest slot at or before it."""
        self.header[H_TRUSTED] = step

    def steps(self) -> list[int]:
        """Steps whose slot is complete (and, once sealed, unchanged since)."""
        if self.sealed_view is None:
            return sorted(step for _, step, _ in self._complete())
        return sorted(s for s, (slot, seq) in self.sealed_view.items() if int(self.slot_header[slot, 0]) == seq)

    def drop(self, step: int) -> None:
        """A sealed segment lets go of ``step`` (evicted)."""
        if self.sealed_view is not None:
            self.sealed_view.pop(step, None)

    def read(self, step: int) -> dict:
        """A copy of the snapshot of ``step``: blocks, ranges, paths. KeyError when no slot holds it whole."""
        for slot, s, seq in self._complete():
            if s != step or (self.sealed_view is not None and self.sealed_view.get(s, (None, None))[1] != seq):
                continue
            leaves = unpack(self.layout, self.views(slot))
            if int(self.slot_header[slot, 0]) == seq:  # not overwritten while it was copied
                return {"leaves": leaves, "ranges": list(self.layout.ranges), "paths": self.layout.paths, "step": step}
        raise KeyError(step)

    def close(self, unlink: bool = False) -> None:
        """Unmap (and remove the file): no view of it may be used after this (they would read
        unmapped memory), so the header's are dropped first."""
        self.header = self.slot_header = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:  # a view still exported: the mapping goes with the process
            pass
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    # ------------------------------------------------------------------ writer side
    @classmethod
    def open(cls, path: str, layout: SlotLayout) -> SlotSegment:
        fd = os.open(path, os.O_RDWR)
        seg = cls(path, layout, fd, created=False)
        if int(seg.header[H_MAGIC]) != MAGIC or int(seg.header[H_SLOT_BYTES]) != layout.slot_bytes:
            seg.close()
            raise ValueError(f"{path} is not a snapshot segment of this layout")
        return seg

    @property
    def sealed(self) -> bool:
        return bool(self.header[H_SEALED])

    @property
    def keeper_pid(self) -> int:
        return int(self.header[H_PID])

    def write(self, generation: int, step: int, fill: Callable[[list[np.ndarray]], None], keep: tuple = ()) -> bool:
        """Copy the state after ``step`` into a free slot (``fill`` writes the device buffers into
        the slot's rows); False when the segment is sealed. See :meth:`_free_slot` for the slots
        never overwritten; ``keep``: steps whose newest slot at or before each is kept, in order of
        importance."""
        if self.sealed:
            return False
        slot = self._free_slot(keep)
        seq = int(self.slot_header[slot, 0])
        self.slot_header[slot, 0] = seq + 1  # odd: being written
        self.slot_header[slot, 1:3] = (generation, step)
        fill(self.views(slot))
        self.slot_header[slot, 0] = seq + 2
        return not self.sealed

    def _free_slot(self, keep: tuple) -> int:
        """A slot to write: an empty one, else one no step needs. Kept, most needed first: the newest
        complete slot, the newest at or before the acknowledged step, at or before the first step of
        ``keep`` (the newest streamed), at or before the trusted step, then at or before each of the
        rest of ``keep`` after the trusted step (fingerprinted steps not yet known to agree).
        A ring too small for all of them gives up the least needed: a zero-rewind restore needs the
        first three, a rollback to agreed replicas the others (else it restores a checkpoint); a
        ring sized for compared replicas (:meth:`SlotLayout.slots`) keeps the trusted step and the
        oldest fingerprinted step after it too."""
        complete = self._complete()
        if len(complete) < self.nslots:
            taken = {slot for slot, _, _ in complete}
            return next(i for i in range(self.nslots) if i not in taken)
        by_step = sorted(complete, key=lambda c: c[1])
        acked = int(self.header[H_ACK_STEP]) if int(self.header[H_ACK_GEN]) == int(self.header[H_GEN]) else -1
        trusted = int(self.header[H_TRUSTED])
        pins = [acked, *keep[:1], trusted, *(step for step in keep[1:] if step > trusted)]
        kept = [by_step[-1][0]]
        for pin in pins:
            held = [c[0] for c in by_step if c[1] <= pin]
            if held and held[-1] not in kept:
                kept.append(held[-1])
        free = [slot for slot, _, _ in by_step if slot not in kept]
        return free[0] if free else kept[-1]

    # ------------------------------------------------------------------ both
    def views(self, slot: int) -> list[np.ndarray]:
        """The slot's rows: one byte array per device buffer."""
        base = self._data_at + slot * self.layout.slot_bytes
        return [
            np.ndarray((self.layout.row_bytes,), np.uint8, self._mm, base + r * self.layout.row_bytes)
            for r in range(self.layout.rows)
        ]

    def _complete(self) -> list[tuple[int, int, int]]:
        """(slot, step, seq) of every slot not being written that holds a step."""
        h = np.array(self.slot_header)
        return [(i, int(h[i, 2]), int(h[i, 0])) for i in range(self.nslots) if h[i, 0] % 2 == 0 and h[i, 2] >= 0]


def remove_orphans(directory: str | None = None) -> int:
    """Remove the segments of keepers that no longer run on this host (killed without unlinking)."""
    d = directory or shm_dir()
    removed = 0
    for name in os.listdir(d):
        if not name.startswith(PREFIX):
            continue
        try:
            pid = int(name[len(PREFIX) :].split("-", 1)[0])
        except ValueError:
            continue
        if not psutil.pid_exists(pid):
            try:
                os.unlink(os.path.join(d, name))
                removed += 1
            except OSError:
                pass
    return removed
