"""Pure decisions about a world: no Ray, no JAX, callable from tests without a cluster.

A *world* is one generation of the multi-process JAX program: an ordered list of
slices, one process per slice host. Everything that must agree between the
controller and every worker (process ids, mesh shape, which rows of the global
batch a process feeds, how parameters are split) is decided here, once.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

REPLICA_AXIS = "replica"
FSDP_AXIS = "fsdp"


@dataclasses.dataclass(frozen=True)
class WorldPlan:
    """The layout of one generation.

    Attributes:
        generation: 0 for the first world, +1 for every re-formation.
        slice_names: slices in replica order (replica i = slice_names[i]).
        hosts_per_slice: processes per slice.
        devices_per_host: JAX devices per process.
        global_batch_size: examples per step in this world.
    """

    generation: int
    slice_names: tuple[str, ...]
    hosts_per_slice: int
    devices_per_host: int
    global_batch_size: int

    @property
    def num_slices(self) -> int:
        return len(self.slice_names)

    @property
    def num_processes(self) -> int:
        return self.num_slices * self.hosts_per_slice

    @property
    def mesh_shape(self) -> dict[str, int]:
        """``replica`` across slices (data parallel over DCN), ``fsdp`` inside a slice (ICI)."""
        return {REPLICA_AXIS: self.num_slices, FSDP_AXIS: self.hosts_per_slice * self.devices_per_host}

    def process_id(self, slice_index: int, host_index: int) -> int:
        """Processes are numbered slice-major, so a slice's devices are contiguous in the mesh."""
        return slice_index * self.hosts_per_slice + host_index

    @property
    def rows_per_process(self) -> int:
        return self.global_batch_size // self.num_processes

    def process_rows(self, process_id: int) -> tuple[int, int]:
        """Half-open range of global-batch rows that ``process_id`` feeds every step.

        The batch is split over (replica, fsdp) in mesh order, and process p owns
        mesh columns [p * devices_per_host, (p + 1) * devices_per_host) of its slice,
        so its rows are one contiguous block.
        """
        n = self.rows_per_process
        return process_id * n, (process_id + 1) * n


def plan_world(
    generation: int,
    slice_names: Sequence[str],
    hosts_per_slice: int,
    devices_per_host: int,
    global_batch_size: int,
) -> WorldPlan:
    """Lay out a world, refusing layouts that cannot split the batch evenly."""
    if not slice_names:
        raise ValueError("a world needs at least one slice")
    plan = WorldPlan(generation, tuple(slice_names), hosts_per_slice, devices_per_host, global_batch_size)
    devices = plan.num_processes * devices_per_host
    if global_batch_size % devices:
        raise ValueError(
            f"global batch {global_batch_size} does not split over {plan.num_slices} slice(s) x "
            f"{hosts_per_slice * devices_per_host} device(s)"
        )
    return plan


def param_partition(shape: Sequence[int], fsdp_size: int, min_size: int) -> tuple:
    """FSDP rule: shard the largest dimension divisible by the slice's device count.

    Returns a PartitionSpec-like tuple of axis names (``None`` = replicated).
    Small arrays (fewer than ``min_size`` elements) stay replicated: sharding them
    costs more in collectives than it saves in memory. Replicas across slices
    always hold full copies, so any surviving slice can continue alone.
    """
    spec = [None] * len(shape)
    size = 1
    for d in shape:
        size *= d
    if fsdp_size <= 1 or size < min_size:
        return tuple(spec)
    for dim in sorted(range(len(shape)), key=lambda i: -shape[i]):
        if shape[dim] % fsdp_size == 0:
            spec[dim] = FSDP_AXIS
            break
    return tuple(spec)


def chunks(start_step: int, end_step: int, steps_per_chunk: int) -> list[tuple[int, int]]:
    """Split [start_step, end_step) into (first_step, num_steps) chunks."""
    out = []
    s = start_step
    while s < end_step:
        n = min(steps_per_chunk, end_step - s)
        out.append((s, n))
        s += n
    return out
