"""The compiled programs of a world, built from the user's task: train state, shardings, steps.

The train state is ``nnx.state((model, optimizer))``: parameters, optimizer state and whatever
other NNX state the model carries (EMA copies, dropout RNG streams, counters). Typed PRNG keys in
it are held as their raw ``uint32`` data (:func:`to_raw` / :func:`from_raw`), so snapshots, Orbax
and restores see plain arrays only. Each array is placed by its sharding annotation and the run's
logical axis rules, or by the automatic FSDP rule (:mod:`ray_elastic.decide.layout`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ray_elastic.decide.bad_steps import DEFAULT_BAD_STEPS, BadSteps
from ray_elastic.decide.layout import FSDP_AXIS, REPLICA_AXIS, partition
from ray_elastic.errors import TrainingCodeError
from ray_elastic.slice.snapshot_pack import pack_body, packed_sharding
from ray_elastic.slice.step_guard import guard
from ray_elastic.task import RESERVED_METRICS, TrainTask, step_layout

BATCH_SPEC = P((REPLICA_AXIS, FSDP_AXIS))


@dataclasses.dataclass
class StateSpec:
    """The train state's structure before any array exists."""

    make: Callable[[], tuple]  # builds (model, optimizer)
    graphdef: Any
    abstract: Any  # raw state of ShapeDtypeStructs (keys as their uint32 data)
    keys: Any  # per raw leaf: the PRNG key implementation, or None
    names: list  # per raw leaf: its annotation (names per dimension) or None
    paths: list  # per raw leaf: where it is, for error messages


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def to_raw(state):
    """Typed PRNG keys as their uint32 data."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, state)


def from_raw(raw, keys):
    """Back from :func:`to_raw` (``keys``: per leaf the key implementation or None)."""
    return jax.tree.map(lambda x, k: x if k is None else jax.random.wrap_key_data(x, impl=k), raw, keys)


def state_spec(task: TrainTask, seed: int, update_scale: float | None) -> StateSpec:
    """Build the model and optimizer abstractly: shapes, dtypes and annotations, no arrays."""

    def make():
        model = task.create_model(nnx.Rngs(seed))
        tx = task.create_optimizer()
        if update_scale is not None:
            # Scale policy with an lr rule: the world's factor on every update.
            tx = optax.chain(tx, optax.scale(update_scale))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    with nnx.use_eager_sharding(False):  # placed by out_shardings, with the run's rules, not eagerly
        graphdef, state = nnx.split(nnx.eval_shape(make))
    variables = jax.tree.leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    names = [
        (v.get_metadata() or {}).get("out_sharding") if isinstance(v, nnx.Variable) else None for _, v in variables
    ]
    paths = [jax.tree_util.keystr(p) for p, _ in variables]
    leaves, treedef = jax.tree.flatten(state)
    if len(leaves) != len(names):  # a Variable holding more than one array: no annotation applies
        names, paths = [None] * len(leaves), [jax.tree_util.keystr(p) for p, _ in jax.tree.leaves_with_path(state)]
    keys = [x.dtype._impl.name if _is_key(x) else None for x in leaves]  # the implementation, by name
    abstract = [
        jax.ShapeDtypeStruct(jax.eval_shape(jax.random.key_data, x).shape, jnp.uint32)
        if _is_key(x)
        else jax.ShapeDtypeStruct(x.shape, x.dtype)
        for x in leaves
    ]
    return StateSpec(
        make,
        graphdef,
        treedef.unflatten(abstract),
        treedef.unflatten(keys),
        [None if k is not None else n for n, k in zip(names, keys)],
        paths,
    )


def state_shardings(spec: StateSpec, mesh, rules, min_size: int):
    """Where every leaf of the state goes on ``mesh`` (concrete or abstract)."""
    shape = dict(mesh.shape)
    leaves, treedef = jax.tree.flatten(spec.abstract)
    out = []
    for path, names, x, key in zip(
        spec.paths, spec.names, leaves, jax.tree.leaves(spec.keys, is_leaf=lambda k: k is None)
    ):
        if x.ndim == 0 or key is not None:  # scalars and PRNG keys: on every device
            out.append(NamedSharding(mesh, P()))
            continue
        out.append(
            NamedSharding(mesh, P(*partition(path.removesuffix(".value"), x.shape, names, rules, shape, min_size)))
        )
    return treedef.unflatten(out)


def init_program(spec: StateSpec, shardings):
    """Fresh parameters, created directly in their shards."""

    def init():
        with nnx.use_eager_sharding(False):
            return to_raw(nnx.split(spec.make())[1])

    return jax.jit(init, out_shardings=shardings)


def _mesh_context(mesh):
    """The world's mesh while the task's code is traced: ``jax.lax.with_sharding_constraint(x, P(...))``
    with mesh axis names (activation sharding, as MaxText constrains its activations) works in it."""
    return jax.sharding.use_abstract_mesh(mesh if isinstance(mesh, jax.sharding.AbstractMesh) else mesh.abstract_mesh)


def _check_metrics(metrics, what: str) -> dict:
    if not isinstance(metrics, dict) or "loss" not in metrics:
        raise TrainingCodeError(
            f"{what} returned {type(metrics).__name__}; expected a dict of scalar metrics with 'loss'"
        )
    for k, v in metrics.items():
        if k in RESERVED_METRICS or not isinstance(k, str):
            raise TrainingCodeError(
                f"{what} returned metric {k!r}: a metric name must be a str other than {list(RESERVED_METRICS)}"
            )
        if jnp.ndim(v) != 0:
            raise TrainingCodeError(f"{what} returned metric {k!r} of shape {jnp.shape(v)}; expected scalars")
    return {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}


def train_program(
    task: TrainTask,
    spec: StateSpec,
    shardings,
    mesh,
    num_microbatches: int,
    data_shards: int,
    pack: bool = False,
    bad: BadSteps = DEFAULT_BAD_STEPS,
):
    """The jitted train step ``(raw state, batch, guard history) -> (raw state, metrics, guard
    history)`` for ``mesh``, whose update a bad step does not apply (:mod:`~ray_elastic.slice.step_guard`;
    its verdict is the ``skipped`` metric); with ``pack``, also the new state packed for a snapshot
    (see :mod:`~ray_elastic.slice.snapshot_pack`): one more output of the step, no program of its own."""
    batch_sharding = NamedSharding(mesh, BATCH_SPEC)
    packing = pack_body(tuple(sh.spec for sh in jax.tree.leaves(shardings)), mesh) if pack else None

    def train_step(raw, batch, history):
        model, optimizer = nnx.merge(spec.graphdef, from_raw(raw, spec.keys))
        with step_layout(num_microbatches, data_shards), _mesh_context(mesh):
            metrics = _check_metrics(task.train_step(model, optimizer, batch), "train_step")
        new, history, verdict = guard(
            to_raw(nnx.state((model, optimizer))), raw, metrics["loss"], history, bad, metrics.get("grad_norm")
        )
        out = (new, {**metrics, "skipped": verdict.astype(jnp.float32)}, history)
        return out if packing is None else (*out, packing(*jax.tree.leaves(new)))

    replicated = NamedSharding(mesh, P())
    outs = (shardings, replicated, replicated) + ((packed_sharding(mesh),) if pack else ())
    step = jax.jit(
        train_step, in_shardings=(shardings, batch_sharding, replicated), out_shardings=outs, donate_argnums=(0, 2)
    )
    return batch_sharding, step


def eval_program(task: TrainTask, spec: StateSpec, shardings, mesh):
    """The jitted eval step ``(raw state, batch) -> metrics`` (the state is not changed)."""

    def eval_step(raw, batch):
        model, _ = nnx.merge(spec.graphdef, from_raw(raw, spec.keys))
        model.eval()
        with _mesh_context(mesh):
            return _check_metrics(task.eval_step(model, batch), "eval_step")

    return jax.jit(
        eval_step, in_shardings=(shardings, NamedSharding(mesh, BATCH_SPEC)), out_shardings=NamedSharding(mesh, P())
    )
