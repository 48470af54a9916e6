"""A process's part of the train state packed into one byte buffer per device, by one device program.

A snapshot after every step must cost the step almost nothing, and what costs is not the bytes
(kilobytes to megabytes: microseconds to copy) but the work per array: a copy program with one
output per leaf, a host transfer, a wait and a numpy copy for each of them. Packing makes it one
output per device: the program (a ``shard_map``, no collective) bit-casts each of the device's
shards to 32-bit words and concatenates them; the host side then moves one buffer per device into the
keeper's slot. The slot's :class:`~ray_elastic.state.snapshot_slots.SlotLayout` records where each
shard sits in the buffer and in the process's block of its leaf, so a keeper unpacks a snapshot
into the blocks a restore takes (:func:`~ray_elastic.state.snapshot_slots.unpack`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ray_elastic.slice.host_blocks import block_range, index_range
from ray_elastic.state.snapshot_slots import ALIGN, Piece, SlotLayout, aligned

WORD = 8  # each shard starts at a multiple of this many bytes in its device's buffer


def _as_words(x: jax.Array) -> jax.Array:
    """``x``'s bytes as 32-bit words (XLA's CPU backend concatenates words about twice as fast as
    bytes), padded with zeros to a multiple of ``WORD`` bytes: the same bytes, in memory order."""
    flat = x.reshape(-1)
    if flat.dtype == jnp.bool_:
        flat = flat.astype(jnp.uint8)
    per = 4 // flat.dtype.itemsize  # elements per word (0: an element spans words)
    if per > 1:
        if flat.size % per:
            flat = jnp.concatenate([flat, jnp.zeros(-flat.size % per, flat.dtype)])
        flat = flat.reshape(-1, per)
    out = jax.lax.bitcast_convert_type(flat, jnp.uint32).reshape(-1)
    pad = -out.size % (WORD // 4)
    return jnp.concatenate([out, jnp.zeros(pad, jnp.uint32)]) if pad else out


def pack_body(specs: tuple, mesh) -> Callable[..., jax.Array]:
    """Per device, its shards of the leaves (sharded by ``specs`` on ``mesh``) as one row of words:
    a ``(devices, words)`` uint32 array, row-sharded over every mesh axis. No collective: usable
    inside the train step (the snapshot then costs no program of its own) or on its own."""
    axes = tuple(mesh.axis_names)

    def pack(*local):
        return jnp.concatenate([_as_words(x) for x in local])[None, :]

    return jax.shard_map(pack, mesh=mesh, in_specs=tuple(specs), out_specs=PartitionSpec(axes), check_vma=False)


def packed_sharding(mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))


def packer(leaves: list[jax.Array]) -> Callable[[list[jax.Array]], jax.Array]:
    """A program of its own packing ``leaves`` (with their shardings), as the train step does."""
    mesh = leaves[0].sharding.mesh
    body = pack_body(tuple(x.sharding.spec for x in leaves), mesh)
    return jax.jit(lambda leaves: body(*leaves), out_shardings=packed_sharding(mesh))


def layout(leaves: list[jax.Array], paths: tuple = ()) -> SlotLayout:
    """Where each shard of ``leaves`` sits in the packed rows of this process's devices (a row per
    local device, by device id), and where in its block of the leaf it goes. A region several
    local devices hold (replicated within the process) is read from the first. From the
    shardings alone: nothing runs."""
    me = jax.process_index()
    devices = sorted((d for d in leaves[0].sharding.mesh.devices.flat if d.process_index == me), key=lambda d: d.id)
    pieces, shapes, ranges = [], [], []
    offset = 0
    for leaf_index, x in enumerate(leaves):
        where = x.sharding.devices_indices_map(x.shape)
        indices = [where[d] for d in devices]
        keys = [index_range(index, x.shape) for index in indices]
        rng = block_range(indices, x.shape) if x.ndim else ()
        shapes.append(tuple(b - a for a, b in rng))
        ranges.append(rng)
        shard_shape = tuple(b - a for a, b in keys[0])
        nbytes = int(np.prod(shard_shape, dtype=np.int64)) * x.dtype.itemsize
        seen = set()
        for row, key in enumerate(keys):
            if key not in seen:
                seen.add(key)
                within = tuple((a - lo, b - lo) for (a, b), (lo, _) in zip(key, rng))
                pieces.append(Piece(leaf_index, row, offset, shard_shape, within))
        offset += nbytes + (-nbytes % WORD)
    return SlotLayout(
        shapes=tuple(shapes),
        dtypes=tuple(str(x.dtype) for x in leaves),
        ranges=tuple(ranges),
        paths=tuple(paths),
        pieces=tuple(pieces),
        rows=len(devices),
        row_bytes=aligned(offset, ALIGN),
        row_devices=tuple(d.id for d in devices),
    )


def host_rows(packed: jax.Array, layout: SlotLayout) -> list[np.ndarray | None]:
    """This process's rows of ``packed`` that a piece is read from, as bytes in the layout's order
    (host arrays; waits for it); None for a row whose shards another local device holds too."""
    row = {d: i for i, d in enumerate(layout.row_devices)}
    out: list = [None] * layout.rows
    for sh in packed.addressable_shards:
        if row[sh.device.id] in layout.rows_read:
            out[row[sh.device.id]] = np.asarray(sh.data).reshape(-1).view(np.uint8)
    return out


def fill(packed: jax.Array, layout: SlotLayout, views: list[np.ndarray]) -> None:
    """Copy this process's rows of ``packed`` that hold a piece into a slot's row views."""
    for view, host in zip(views, host_rows(packed, layout)):
        if host is None:
            continue
        if host.size > view.size:
            raise ValueError(f"a packed row of {host.size} bytes does not fit the slot's {view.size}")
        view[: host.size] = host
