"""The layout of one world: process ids, slice and replica order, mesh, the batch each process
feeds, and how the batch and learning rate follow the world's size. Everything the controller and
every slice process must agree on is decided here, once."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ray_elastic.decide.layout import FSDP_AXIS, REPLICA_AXIS, resolve_slice_mesh


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
    data_stride: int = 0  # examples per step in the data order (the full-size batch); 0 = global_batch_size
    lr_scale: float = 1.0
    snapshot_slices: int = 0  # the first this many slices yield snapshots
    slice_axes: tuple[tuple[str, int], ...] = ()  # the slice's mesh axes (``layout.resolve_slice_mesh``); () = all fsdp
    microbatch_size: int = 0  # examples per device per microbatch (gradient accumulation); 0 = one batch per step

    @property
    def stride(self) -> int:
        return self.data_stride or self.global_batch_size

    def takes_snapshots(self, process_id: int) -> bool:
        return process_id // self.hosts_per_slice < self.snapshot_slices

    @property
    def num_slices(self) -> int:
        return len(self.slice_names)

    @property
    def num_processes(self) -> int:
        return self.num_slices * self.hosts_per_slice

    @property
    def mesh_shape(self) -> dict[str, int]:
        """``replica`` across slices (data parallel over DCN), then the slice's own axes (ICI)."""
        return {REPLICA_AXIS: self.num_slices, **dict(self.slice_axes or ((FSDP_AXIS, self.devices_per_slice),))}

    @property
    def devices_per_slice(self) -> int:
        return self.hosts_per_slice * self.devices_per_host

    @property
    def data_parallel(self) -> int:
        """Devices that each take their own rows of the batch: ``replica`` x ``fsdp``."""
        return self.num_slices * self.mesh_shape[FSDP_AXIS]

    @property
    def per_device_batch(self) -> int:
        return self.global_batch_size // self.data_parallel

    @property
    def num_microbatches(self) -> int:
        """Microbatches per step: more when a smaller world keeps the global batch, so each
        device's microbatch (and its activation memory) stays the same size."""
        return self.per_device_batch // self.microbatch_size if self.microbatch_size else 1

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
    data_stride: int = 0,
    lr_scale: float = 1.0,
    snapshot_slices: int = 0,
    slice_mesh: dict[Any, Any] | None = None,
    microbatch_size: int = 0,
) -> WorldPlan:
    """Lay out a world, refusing layouts that cannot split the batch evenly.

    ``slice_mesh``: the slice's axes and sizes (``-1``: the rest), default all ``fsdp``."""
    if not slice_names:
        raise ValueError("a world needs at least one slice")
    axes = resolve_slice_mesh(slice_mesh or {FSDP_AXIS: -1}, hosts_per_slice * devices_per_host, devices_per_host)
    plan = WorldPlan(
        generation,
        tuple(slice_names),
        hosts_per_slice,
        devices_per_host,
        global_batch_size,
        data_stride,
        lr_scale,
        min(snapshot_slices, len(slice_names)),
        axes,
        microbatch_size or 0,
    )
    fsdp = plan.mesh_shape[FSDP_AXIS]
    if global_batch_size % plan.data_parallel:
        raise ValueError(
            f"global batch {global_batch_size} does not split over {plan.num_slices} slice(s) x {fsdp} fsdp device(s)"
        )
    if microbatch_size and plan.per_device_batch % microbatch_size:
        raise ValueError(
            f"microbatch_size={microbatch_size} does not divide the per-device batch {plan.per_device_batch} of a "
            f"world of {plan.num_slices} slice(s) (global batch {global_batch_size} over {plan.data_parallel} "
            f"data-parallel devices)"
        )
    return plan


# --------------------------------------------------------------------------- batch policy
def batch_for_world(num_active: int, num_total: int, global_batch_size: int, policy: str) -> int:
    """Global batch of a world of ``num_active`` slices.

    ``constant``: unchanged, survivors take larger shares (the mathematics is the same).
    ``scale``: proportional to active slices, as pathwaysutils' ``scale_by_active_slices``
    (exact for ints: an error if it does not divide).
    """
    if policy == "constant":
        return global_batch_size
    scaled, rem = divmod(global_batch_size * num_active, num_total)
    if rem:
        raise ValueError(f"global batch {global_batch_size} x {num_active}/{num_total} is not an integer")
    return scaled


def lr_scale(num_active: int, num_total: int, rule: str | None) -> float:
    """Multiplier on the optimizer's updates under the ``scale`` policy (None: 1.0)."""
    if rule is None:
        return 1.0
    frac = num_active / num_total
    return frac if rule == "linear" else frac**0.5


@dataclasses.dataclass(frozen=True)
class WorldShapes:
    """How a run lays out a world of each size it may train on: what :func:`plan_world` takes
    besides the slices, and per world size its global batch and learning-rate scale. Computed once
    on the driver (``ElasticConfig.world_shapes``); the controller and the slice processes plan
    every world with it, so a step traced ahead fits the world formed later."""

    hosts_per_slice: int
    devices_per_host: int
    data_stride: int
    snapshot_slices: int
    slice_mesh: dict[Any, Any] | None
    microbatch_size: int
    by_size: dict[int, tuple[int, float]]  # world size -> (global batch, lr scale)

    def sizes(self) -> list[int]:
        return sorted(self.by_size)

    def plan(self, generation: int, slice_names: Sequence[str]) -> WorldPlan:
        if len(slice_names) not in self.by_size:
            raise ValueError(f"no layout for a world of {len(slice_names)} slices (this run's: {self.sizes()})")
        batch, scale = self.by_size[len(slice_names)]
        return plan_world(
            generation,
            slice_names,
            self.hosts_per_slice,
            self.devices_per_host,
            batch,
            data_stride=self.data_stride,
            lr_scale=scale,
            snapshot_slices=self.snapshot_slices,
            slice_mesh=self.slice_mesh,
            microbatch_size=self.microbatch_size,
        )
