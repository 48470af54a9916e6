"""Checks of the task against the config on the driver, before any slice is reserved.

The model is built abstractly (``nnx.eval_shape``: shapes, dtypes and annotations, no arrays)
and its layout resolved for the run's slice mesh and rules; the train step is traced on an
abstract mesh of the full-size world, so a loss of the wrong shape is reported now, not after
minutes of waiting for TPU slices. The eval dataset must hold the eval batches asked for.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ray_elastic.config import ElasticConfig
from ray_elastic.errors import TrainingCodeError
from ray_elastic.task import TrainTask

if TYPE_CHECKING:  # (Orbax is imported where a checkpoint is read, not with this module)
    from ray_elastic.state.checkpoints import CheckpointInfo

logger = logging.getLogger(__name__)


def check_task(task: TrainTask, config: ElasticConfig, resume: CheckpointInfo | None = None) -> None:
    """Raise ``ValueError`` (layout, data, a checkpoint of another model) or :class:`TrainingCodeError`
    (the step) with what to change. ``resume``: the checkpoint the run starts from
    (:class:`~ray_elastic.state.checkpoints.CheckpointInfo`), compared array by array with the model."""
    from jax.sharding import AbstractMesh

    from ray_elastic.ray_backend.slice_settings import slice_settings
    from ray_elastic.slice import jax_world
    from ray_elastic.slice import step_program as sp
    from ray_elastic.slice.data import StepBatches

    plan = config.world_plan(0, [f"s{i}" for i in range(config.num_slices)])
    mesh = AbstractMesh(tuple(plan.mesh_shape.values()), tuple(plan.mesh_shape))
    try:
        spec = sp.state_spec(task, config.seed, None)
    except Exception as e:
        raise TrainingCodeError(
            f"building the model abstractly (nnx.eval_shape of create_model and create_optimizer) failed: {e!r}"
        ) from e
    sp.state_shardings(spec, mesh, config.logical_axis_rules, config.fsdp_min_size)  # ValueError names the parameter
    if resume is not None and resume.directory:
        _check_checkpoint_matches(spec, resume.directory, resume.step)
    _check_eval_data(task, config)
    try:
        batches = StepBatches(task.dataset(), config.global_batch_size, config.seed, shuffle=False)
    except Exception as e:  # noqa: BLE001 - data that only the slice hosts can read
        logger.warning(
            "could not read the task's dataset on the driver (%r): the train step is checked on the slices instead", e
        )
        return
    try:
        jax_world.trace_for(task, slice_settings(config), plan, batches)
    except TrainingCodeError:
        raise
    except Exception as e:
        raise TrainingCodeError(f"tracing the train step on the driver failed in the task's code: {e!r}") from e


def _check_checkpoint_matches(spec: Any, directory: str, step: int) -> None:
    """The checkpoint holds arrays of this model's shapes: a rerun with a changed model must not
    train from step 0 while it says it resumed (nor call a loading error a storage fault)."""
    import collections

    import jax

    from ray_elastic.state.checkpoints import state_shapes

    ours = collections.Counter((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(spec.abstract))
    try:
        theirs = collections.Counter(state_shapes(directory, step))
    except Exception as e:  # noqa: BLE001 - a damaged checkpoint: the worlds find it unreadable and fall back
        logger.warning(
            "the arrays of checkpoint %d in %s cannot be listed (%r): not compared with the model",
            step,
            directory,
            e,
        )
        return
    if not theirs:  # its array metadata is gone (damaged data files): a storage fault, handled as one
        logger.warning("checkpoint %d in %s lists no arrays: not compared with the model", step, directory)
        return
    if ours == theirs:
        return

    def listed(c: collections.Counter[tuple[tuple[int, ...], str]]) -> str:
        return ", ".join(f"{n} x {dtype}{list(shape)}" for (shape, dtype), n in sorted(c.items())[:6]) or "none"

    raise ValueError(
        f"checkpoint {step} in {directory!r} was written by a model of another shape: it has "
        f"{listed(theirs - ours)} that this model lacks, and this model has {listed(ours - theirs)} that it lacks. "
        "Use another checkpoint_dir for the changed model (or the model that wrote it)"
    )


def _check_eval_data(task: TrainTask, config: ElasticConfig) -> None:
    if not config.eval_every:
        return
    data = task.eval_dataset()
    if data is None:
        raise ValueError(
            f"eval_every={config.eval_every} but {task.name()}.eval_dataset() returned None: define "
            "eval_dataset() or set eval_every=0"
        )
    need = config.eval_steps * config.eval_batch
    if len(data) < need:
        raise ValueError(
            f"{task.name()}.eval_dataset() has {len(data)} examples, fewer than eval_steps="
            f"{config.eval_steps} x eval_batch_size={config.eval_batch} = {need}: lower eval_steps or "
            "eval_batch_size, or give more held-out data"
        )


def snapshot_layout(task: TrainTask, config: ElasticConfig) -> tuple[Any, ...]:
    """What one host's snapshot depends on besides the run: the model's arrays (paths, shapes and
    dtypes, in order) and one slice's layout. A snapshot taken under another is never restored (a rerun with a
    changed model takes no snapshot of the old one)."""
    import jax

    from ray_elastic.slice import step_program as sp

    spec = sp.state_spec(task, config.seed, None)
    flat = jax.tree_util.tree_flatten_with_path(spec.abstract)[0]  # in restore order: a rename that swaps two
    arrays = [(jax.tree_util.keystr(p), tuple(x.shape), str(x.dtype)) for p, x in flat]  # leaves changes it
    c = config
    return (arrays, c.slice, sorted(c.slice_mesh.items()), tuple(c.logical_axis_rules), c.fsdp_min_size)


def run_settings(task: TrainTask, config: ElasticConfig) -> tuple[Any, ...]:
    """What makes two runs of one model different: the task's plain fields (a learning rate, a
    width) and the config's training settings. A snapshot of a run with other settings (a sweep
    trial reusing a crashed trial's run directory) is never restored."""
    plain = (int, float, str, bool, type(None))

    def is_plain(v: object) -> bool:
        return isinstance(v, plain) or (isinstance(v, (tuple, list)) and all(isinstance(x, plain) for x in v))

    found: dict[Any, Any] = {}
    for owner in [*reversed(type(task).__mro__[:-1]), task]:  # class defaults, then the instance's own
        found.update({k: v for k, v in vars(owner).items() if not k.startswith("_") and is_plain(v)})
    fields = sorted((k, repr(v)) for k, v in found.items())
    c = config
    return (fields, c.seed, c.global_batch_size, c.batch_policy, c.lr_rule, c.microbatch_size)
