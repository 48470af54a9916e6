"""A snapshot of the state after a step: packed by the step itself (one buffer per device, see
:mod:`~ray_elastic.slice.snapshot_pack`), copied into the host keeper's ring in the writer's
thread (:class:`~ray_elastic.state.snapshot_writer.SnapshotWriter`)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from ray_elastic.slice import snapshot_pack
from ray_elastic.state.snapshot_slots import SlotLayout, unpack
from ray_elastic.state.snapshot_writer import SnapshotWriter


class Snapshots:
    """One world's snapshots of one process: where its packed state's bytes go, and the writer."""

    def __init__(self, keeper, generation: int, epoch: int | None, loop, streamed: Callable[[], int]):
        self.layout = snapshot_pack.layout(jax.tree.leaves(loop.state), loop.leaf_paths)
        self.writer = SnapshotWriter(
            keeper,
            generation,
            epoch,
            self.layout,
            streamed,
            lambda: loop.fingerprints.recent,
            compared=bool(loop.fingerprints.every),
        )
        self._packer: Callable | None = None

    def submit(self, loop, step: int) -> None:
        """Keep the state after ``step`` (the newest dispatched, which packed it): the step loop
        goes on at once. A world that has run no step yet (it stops at once to grow) packs the
        state it restored with a program of its own."""
        packed = loop.packed
        if packed is None:
            leaves = jax.tree.leaves(loop.state)
            self._packer = self._packer or snapshot_pack.packer(leaves)
            packed = self._packer(leaves)
        packed.copy_to_host_async()
        self.writer.submit(
            step,
            functools.partial(snapshot_pack.fill, packed, self.layout),
            functools.partial(_blocks, self.layout, packed),
            packed.block_until_ready,
        )


def _blocks(layout: SlotLayout, packed: jax.Array) -> dict:
    """The snapshot as blocks, for a keeper reached by call."""
    rows = snapshot_pack.host_rows(packed, layout)
    return {"leaves": unpack(layout, rows), "ranges": list(layout.ranges), "paths": layout.paths}
