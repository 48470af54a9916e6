"""A process's part of a global array as one numpy block with its global index range: what a
snapshot holds and what a restore puts back where it belongs."""

from __future__ import annotations

import jax
import numpy as np


def index_range(index, shape) -> tuple:
    """A shard's index (slices, ``None`` ends meaning the whole dimension) as (start, stop) per dimension."""
    return tuple((sl.start or 0, dim if sl.stop is None else sl.stop) for sl, dim in zip(index, shape))


def block_range(indices, shape) -> tuple:
    """The global (start, stop) per dimension of the block a process's shards (``indices``: their
    index tuples) form; raises when they do not tile it (a block with holes cannot be restored)."""
    keys = {index_range(index, shape) for index in indices}
    rng = tuple((min(k[d][0] for k in keys), max(k[d][1] for k in keys)) for d in range(len(shape)))
    volume = lambda k: int(np.prod([b - a for a, b in k]))  # noqa: E731
    if sum(volume(k) for k in keys) != volume(rng):
        raise ValueError(f"this process's shards {sorted(keys)} do not form one block of an array of shape {shape}")
    return rng


def host_blocks(leaves: list[jax.Array], paths: tuple = ()) -> dict:
    """This process's block of every leaf, its global index range (see :func:`local_block`) and
    the leaves' paths in the state (a restore refuses a state whose arrays are named otherwise)."""
    blocks = [local_block(x) for x in leaves]
    return {"leaves": [b for b, _ in blocks], "ranges": [r for _, r in blocks], "paths": tuple(paths)}


def leaf_paths(tree) -> tuple[str, ...]:
    """Each leaf's path in ``tree`` (``jax.tree_util.keystr``), in the order of ``jax.tree.leaves``."""
    return tuple(jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0])


def local_block(arr: jax.Array) -> tuple[np.ndarray, tuple]:
    """This process's part of a global array, as one numpy block, and the block's global index range.

    A process's devices are whole rows of its slice's fsdp axis (the axes after fsdp fit in a
    host), so its shards of a sharded array are one contiguous slab, and of a replicated array the
    whole array. This is what ``make_array_from_process_local_data`` takes back; the
    range says where the block belongs, so a restore can refuse one that would land elsewhere.
    """
    if arr.ndim == 0:
        return np.asarray(arr.addressable_shards[0].data), ()
    if arr.is_fully_replicated:  # the whole array on each device: one shard is the block
        return np.array(arr.addressable_shards[0].data), tuple((0, d) for d in arr.shape)
    rng = block_range([sh.index for sh in arr.addressable_shards], arr.shape)
    block = np.empty([b - a for a, b in rng], dtype=arr.dtype)
    for sh in arr.addressable_shards:
        key = index_range(sh.index, arr.shape)
        block[tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(key, rng))] = np.asarray(sh.data)
    return block, rng
