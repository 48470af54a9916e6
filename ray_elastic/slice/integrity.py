"""Fingerprints of a process's blocks of the train state: every replica must hold the same bits.

Each slice holds a full replica of the state (the mesh's ``replica`` axis), and the process at
host ``h`` of every slice holds the same blocks. A chip that computes wrong numbers (silent data
corruption) makes its replica drift while every process keeps running. Every ``integrity_every``
steps each process reduces each of its blocks (one per distinct index range, in index order) to
the wrapping sum of its raw bits as uint32 words, on its device (no collective; only the sums are
copied to the host), and folds them into one number per array; a flipped bit changes it. The
driver compares them across replicas (:mod:`~ray_elastic.decide.integrity`).
"""

from __future__ import annotations

import collections
import threading

import jax
import jax.numpy as jnp
import numpy as np

from ray_elastic.decide.schedule import is_fingerprint_step

KEEP = 4  # fingerprinted steps a process keeps until the driver's probe has read them


@jax.jit
def _bits_sum(x: jax.Array) -> jax.Array:
    """The wrapping uint32 sum of ``x``'s raw bits (one device's block)."""
    if x.dtype == jnp.bool_:
        words = x.astype(jnp.uint32)
    elif x.dtype.itemsize >= 4:
        words = jax.lax.bitcast_convert_type(x, jnp.uint32)
    else:
        words = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}")).astype(jnp.uint32)
    return jnp.sum(words, dtype=jnp.uint32)


def _key(shard) -> tuple:
    return tuple((s.start or 0, s.stop or 0) for s in shard.index)


def _blocks(x: jax.Array) -> list[jax.Array]:
    """This process's distinct blocks of ``x``, in index order (the same order on every replica):
    of blocks on several of its devices, the first in device order."""
    by_index: dict[tuple, jax.Array] = {}
    for shard in x.addressable_shards:
        by_index.setdefault(_key(shard), shard.data)
    return [by_index[k] for k in sorted(by_index)]


class Fingerprints:
    """The fingerprints of the state after every ``every``-th step (0: none), started on the devices
    when the step is dispatched and read when it is finished: ``done`` (step -> one per array)."""

    def __init__(self, every: int):
        self.every = every
        self._started: dict[int, list[list[jax.Array]]] = {}
        self.done: collections.OrderedDict[int, tuple[int, ...]] = collections.OrderedDict()
        self.recent: tuple[int, ...] = ()  # the steps in ``done``, oldest first (for the snapshot writer's thread)
        self._warming: threading.Thread | None = None

    def warm(self, state) -> None:
        """Compile the program for this process's blocks now, on a thread, as the world forms: a
        process that compiled it at its first check would fall behind the others for a second or
        more (one program per block shape and device), which the watchdog takes for a stuck one
        (a check due before they are ready is skipped: :meth:`dispatched`)."""
        if self.every:  # zeros like each block: no reference to the state, which the next step donates
            like = [(b.shape, b.dtype, b.sharding) for x in jax.tree.leaves(state) for b in _blocks(x)]
            self._warming = threading.Thread(target=_compile, args=(like,), name="fingerprint-compile", daemon=True)
            self._warming.start()

    @property
    def warming(self) -> bool:
        """The programs are still compiling (:meth:`warm`)."""
        return self._warming is not None and self._warming.is_alive()

    def dispatched(self, step: int, state, now: bool = False) -> None:
        """``state``: the state after ``step``, fingerprinted when due (``now``: whenever fingerprints
        are on, as at a planned stop, where it waits for the programs). A periodic one due while
        the programs still compile is skipped: it would compile them again in the step loop (seconds
        on a loaded host, the whole world waiting, and the watchdog naming this process stuck); that
        step is never compared, the next due one is."""
        if not self.every or not (now or is_fingerprint_step(step, self.every)):
            return
        if self.warming and not now:
            return
        self._started[step] = [[_bits_sum(b) for b in _blocks(x)] for x in jax.tree.leaves(state)]

    def finished(self, step: int) -> None:
        started = self._started.pop(step, None)
        if started is None:
            return
        sums = jax.device_get(started)
        self.done[step] = tuple(_fold(int(v) for v in leaf) for leaf in sums)
        while len(self.done) > KEEP:
            self.done.popitem(last=False)
        self.recent = tuple(self.done)


def _compile(like: list) -> None:
    jax.block_until_ready([_bits_sum(jax.device_put(np.zeros(shape, dtype), where)) for shape, dtype, where in like])


def _fold(values) -> int:
    h = 0
    for v in values:
        h = (h * 1_000_003 + v) & 0xFFFFFFFF
    return h


def flip_one_bit(state, leaf: int, bit: int):
    """``state`` with one bit of the first element of this process's first block of array ``leaf``
    flipped (on the device :func:`_blocks` reads it from), on this process only: the simulated
    cluster's silent data corruption."""
    leaves, treedef = jax.tree.flatten(state)
    x = leaves[leaf]
    target, shards = min(_key(shard) for shard in x.addressable_shards), []
    for shard in x.addressable_shards:
        data = shard.data
        if target is not None and _key(shard) == target:
            host = np.array(data)
            raw = host.view(np.dtype(f"u{host.dtype.itemsize}")).reshape(-1)
            raw[0] ^= np.array(1 << (bit % (8 * host.dtype.itemsize))).astype(raw.dtype)
            data, target = jax.device_put(host, shard.device), None
        shards.append(data)
    leaves[leaf] = jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)
    return jax.tree.unflatten(treedef, leaves)
