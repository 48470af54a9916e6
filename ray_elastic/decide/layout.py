"""Pure layout decisions: the axes of a slice's mesh and where each parameter's dimensions go.

No JAX, no Ray: the driver checks a run's layout with these before any slice is reserved, and
the slice processes build their shardings from the same answers.

A world's mesh is ``(replica, *slice axes)``. ``replica`` runs across slices (data parallel over
DCN); the slice axes (``fsdp``, ``tensor``, ...) divide one slice's devices (ICI). A parameter
annotated with names (``nnx.with_partitioning(init, ("embed", "mlp"))``) has each name mapped
to mesh axes by the run's logical axis rules, as Flax's ``logical_axis_rules`` and MaxText's
do; a name that is itself a slice axis maps to that axis. Arrays with no annotation, or whose
names all lack a rule, take the automatic FSDP rule (:func:`fsdp_partition`). Parameters are
never split over ``replica``: every slice holds a whole copy, so any survivor can go on alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

REPLICA_AXIS = "replica"
FSDP_AXIS = "fsdp"
TENSOR_AXIS = "tensor"
DEFAULT_SLICE_MESH = {FSDP_AXIS: -1, TENSOR_AXIS: 1}

Rules = tuple[tuple[str, tuple[str, ...] | None], ...]


def resolve_slice_mesh(
    slice_mesh: Mapping[str, int], devices_per_slice: int, devices_per_host: int
) -> tuple[tuple[str, int], ...]:
    """The slice axes with ``-1`` filled in: their sizes multiply to the slice's device count.

    ``fsdp`` is required (the batch is split over ``replica`` x ``fsdp``). The axes after
    ``fsdp`` must fit inside one host (their product divides ``devices_per_host``), so that each
    process feeds whole rows of the batch and holds one contiguous block of every array."""
    axes = dict(slice_mesh)
    if FSDP_AXIS not in axes:
        raise ValueError(f"slice_mesh {axes} has no {FSDP_AXIS!r} axis: add {FSDP_AXIS!r}: -1")
    if REPLICA_AXIS in axes:
        raise ValueError(f"slice_mesh must not name {REPLICA_AXIS!r}: it runs across slices, one per slice")
    if next(iter(axes)) != FSDP_AXIS:
        raise ValueError(f"slice_mesh {axes}: put {FSDP_AXIS!r} first (the axes after it must fit in one host)")
    for name, size in axes.items():
        if (
            not isinstance(name, str)
            or isinstance(size, bool)
            or not isinstance(size, int)
            or (size < 1 and size != -1)
        ):
            raise ValueError(f"slice_mesh axis {name!r}: size must be a positive integer or -1, got {size!r}")
    free = [n for n, s in axes.items() if s == -1]
    if len(free) > 1:
        raise ValueError(f"slice_mesh {axes}: at most one axis may be -1, got {free}")
    fixed = math.prod(s for s in axes.values() if s != -1)
    if devices_per_slice % fixed:
        raise ValueError(
            f"slice_mesh {axes} needs a multiple of {fixed} devices per slice; a slice has "
            f"{devices_per_slice}: change the axis sizes"
        )
    if free:
        axes[free[0]] = devices_per_slice // fixed
    if math.prod(axes.values()) != devices_per_slice:
        raise ValueError(
            f"slice_mesh {axes} multiplies to {math.prod(axes.values())} devices; a slice has "
            f"{devices_per_slice}: make them multiply to it, or set one axis to -1"
        )
    inner = math.prod(s for n, s in axes.items() if n != FSDP_AXIS)
    if devices_per_host % inner:
        raise ValueError(
            f"slice_mesh {axes}: the axes after {FSDP_AXIS!r} span {inner} devices, more than fit "
            f"evenly in one host ({devices_per_host} devices): make their product divide "
            f"{devices_per_host}"
        )
    return tuple(axes.items())


def normalize_rules(rules: Any, mesh_axes: Sequence[str]) -> Rules:
    """``[(logical name, mesh axis | (axes...) | None), ...]`` as a tuple of (name, axes or None),
    refusing a rule that names a mesh axis the slice does not have (or ``replica``)."""
    out = []
    for rule in rules or ():
        if not isinstance(rule, (tuple, list)) or len(rule) != 2 or not isinstance(rule[0], str):
            raise ValueError(
                f"logical_axis_rules: each rule is (logical name, mesh axis or axes or None), got {rule!r}"
            )
        name, target = rule
        axes = None if target is None else ((target,) if isinstance(target, str) else tuple(target))
        for axis in axes or ():
            if axis == REPLICA_AXIS:
                raise ValueError(
                    f"logical_axis_rules: rule {name!r} -> {axis!r}: parameters are never split "
                    f"across slices (every slice holds a whole copy); use one of {list(mesh_axes)}"
                )
            if axis not in mesh_axes:
                raise ValueError(
                    f"logical_axis_rules: rule {name!r} -> {axis!r} names no axis of the slice mesh "
                    f"{list(mesh_axes)}: fix the rule or add the axis to slice_mesh"
                )
        out.append((name, axes))
    return tuple(out)


def fsdp_partition(shape: Sequence[int], fsdp_size: int, min_size: int) -> tuple[Any, ...]:
    """Automatic FSDP rule: shard the largest dimension divisible by the slice's ``fsdp`` size.

    Small arrays (fewer than ``min_size`` elements) stay replicated: sharding them costs more in
    collectives than it saves in memory."""
    spec: list[Any] = [None] * len(shape)
    if fsdp_size <= 1 or math.prod(shape) < min_size:
        return tuple(spec)
    for dim in sorted(range(len(shape)), key=lambda i: -shape[i]):
        if shape[dim] % fsdp_size == 0:
            spec[dim] = FSDP_AXIS
            break
    return tuple(spec)


def partition(
    path: str,
    shape: Sequence[int],
    names: Sequence[Any] | None,
    rules: Rules,
    mesh_shape: Mapping[str, int],
    min_size: int,
) -> tuple[Any, ...]:
    """Where the dimensions of the array at ``path`` go: one entry per dimension, ``None``
    (replicated), an axis name, or a tuple of axis names.

    ``names``: the array's annotation (logical or mesh-axis names per dimension; ``None``: not
    annotated). Raises ``ValueError`` naming the parameter when an annotation does not fit."""
    fsdp = mesh_shape.get(FSDP_AXIS, 1)
    if names is None or not any(n is not None for n in names):
        return fsdp_partition(shape, fsdp, min_size)
    if len(names) != len(shape):
        raise ValueError(
            f"parameter {path} of shape {tuple(shape)} is annotated with {len(names)} names "
            f"{tuple(names)}: give one name (or None) per dimension"
        )
    table = dict(rules)
    spec: list[Any] = []
    resolved = False
    for dim, name in zip(shape, names):
        if name is None:
            spec.append(None)
            continue
        if isinstance(name, (tuple, list)):
            axes = tuple(name)
        elif name in mesh_shape and name != REPLICA_AXIS:
            axes = (name,)
        elif name in table:
            target = table[name]
            axes = (target,) if isinstance(target, str) else tuple(target or ())
        else:
            spec.append(None)  # no rule for this name: not sharded by its annotation
            continue
        resolved = True
        size = math.prod(mesh_shape[a] for a in axes) if axes else 1
        if any(a not in mesh_shape or a == REPLICA_AXIS for a in axes):
            raise ValueError(
                f"parameter {path}: {name!r} maps to {axes}, which is not a slice axis "
                f"{[a for a in mesh_shape if a != REPLICA_AXIS]}"
            )
        if dim % size:
            raise ValueError(
                f"parameter {path} of shape {tuple(shape)}: dimension {name!r} ({dim}) does not "
                f"divide over mesh axes {axes} of size {size}: change the model's size, the rule "
                f"for {name!r} or slice_mesh"
            )
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    used = [a for s in spec if s is not None for a in ((s,) if isinstance(s, str) else s)]
    if len(used) != len(set(used)):
        raise ValueError(
            f"parameter {path} of shape {tuple(shape)}: names {tuple(names)} use mesh axes {used}, "
            "one of them twice: change the rules so each axis shards one dimension"
        )
    if not resolved:
        return fsdp_partition(shape, fsdp, min_size)
    return tuple(spec)


def spec_sizes(spec: Sequence[str | tuple[Any, ...] | None], mesh_shape: Mapping[str, int]) -> list[int]:
    """How many ways each dimension is split by ``spec``."""
    return [1 if s is None else math.prod(mesh_shape[a] for a in ((s,) if isinstance(s, str) else s)) for s in spec]
