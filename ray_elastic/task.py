"""The user contract: what a training job gives ray-elastic.

A :class:`TrainTask` is built on the driver, shipped to every slice actor, and
used there only: model, optimizer, loss and data never touch the controller.
Flax NNX + Optax are first-class::

    class MyTask(TrainTask):
        def create_model(self, rngs):   return MyModel(rngs=rngs)
        def create_optimizer(self):     return optax.adamw(3e-4)
        def loss(self, model, batch):   return cross_entropy(model(batch["x"]), batch["y"])
        def dataset(self):              return grain.MapDataset.source(my_examples)

Optional: ``loss`` may return ``(loss, {"accuracy": ...})``; ``eval_dataset()`` gives held-out
data (see ``ElasticConfig.eval_every``); ``train_step`` and ``eval_step`` may be overridden.

Data is random access (a grain ``MapDataset`` or anything with ``__len__`` and
``__getitem__`` returning a dict of numpy arrays). ray-elastic shuffles it per
epoch with the run's seed and gives step ``s`` the examples ``s*B .. s*B+B-1`` of
that order, so the global batch of a step is the same whatever the number of live
slices; each process reads only its own rows.
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
from typing import Any

from ray_elastic.errors import TrainingCodeError

# What a step's metrics carry besides the task's own: a metric may not take these names.
RESERVED_METRICS = (
    "step",
    "step_time_s",
    "finished_at",
    "checkpoint_step",
    "checkpoint_blocking_s",
    "checkpoints_committed",
    "skipped",
)

_microbatches: contextvars.ContextVar[int] = contextvars.ContextVar("ray_elastic_microbatches", default=1)
_data_shards: contextvars.ContextVar[int] = contextvars.ContextVar("ray_elastic_data_shards", default=1)


@contextlib.contextmanager
def step_layout(num_microbatches: int, data_shards: int):
    """Inside, :meth:`TrainTask.value_and_grad` splits the batch into ``num_microbatches``, each taking
    its rows from every one of the ``data_shards`` data-parallel shards (the step program sets it
    from the world's plan while it traces the step)."""
    t1, t2 = _microbatches.set(num_microbatches), _data_shards.set(data_shards)
    try:
        yield
    finally:
        _microbatches.reset(t1)
        _data_shards.reset(t2)


def loss_and_metrics(out: Any) -> tuple[Any, dict]:
    """What ``loss`` returned as (scalar loss, dict of scalar metrics), or a clear error."""
    import jax.numpy as jnp

    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
        loss, metrics = out
    elif isinstance(out, (tuple, list, dict)):
        raise TrainingCodeError(
            f"loss returned {_describe(out)}; expected a scalar loss or (loss, metrics) with metrics a dict "
            "of scalars, e.g. return loss, {'accuracy': acc}"
        )
    else:
        loss, metrics = out, {}
    if jnp.ndim(loss) != 0:
        raise TrainingCodeError(
            f"loss returned a loss of shape {jnp.shape(loss)}; expected a scalar (take the mean over the batch)"
        )
    for name, value in metrics.items():
        if not isinstance(name, str) or jnp.ndim(value) != 0:
            raise TrainingCodeError(
                f"loss returned metric {name!r} of shape {jnp.shape(value)}; metrics must be a dict of str -> scalar"
            )
    clash = sorted(set(metrics) & set(RESERVED_METRICS))
    if clash:
        raise TrainingCodeError(
            f"loss returned metric(s) {clash}: those names are taken by ray-elastic's own step fields; rename them"
        )
    if "loss" in metrics:
        raise TrainingCodeError(
            "loss returned a metric named 'loss'; the loss itself is reported as 'loss': rename the metric"
        )
    return loss, dict(metrics)


def _describe(out: Any) -> str:
    def kind(x) -> str:
        return f"array{tuple(x.shape)}" if hasattr(x, "shape") and hasattr(x, "dtype") else type(x).__name__

    if isinstance(out, (tuple, list)):
        return f"a {type(out).__name__} of {len(out)} ({', '.join(kind(x) for x in out)})"
    return f"a {kind(out)}"


class TrainTask(abc.ABC):
    """Model, optimizer, loss and data of one training job (runs inside the slice actors)."""

    @abc.abstractmethod
    def create_model(self, rngs):
        """Return a fresh ``flax.nnx.Module``; called under ``jax.jit`` with sharded outputs.
        Parameters may carry sharding annotations (``nnx.with_partitioning``): see
        ``ElasticConfig.logical_axis_rules``."""

    @abc.abstractmethod
    def create_optimizer(self):
        """Return an ``optax.GradientTransformation``."""

    @abc.abstractmethod
    def loss(self, model, batch: dict) -> Any:
        """Mean loss of ``model`` on ``batch`` (a dict of arrays with a leading batch dimension),
        or ``(loss, metrics)`` with ``metrics`` a dict of scalars (means over the batch)."""

    @abc.abstractmethod
    def dataset(self) -> Any:
        """Random-access examples: a ``grain.MapDataset`` (or sequence) of dicts of numpy arrays."""

    def eval_dataset(self) -> Any | None:
        """Held-out examples, like :meth:`dataset`; ``None``: no evaluation. Eval batch ``i`` is
        its examples ``i*E .. i*E+E-1`` (``E``: ``ElasticConfig.eval_batch_size``), unshuffled."""
        return None

    def name(self) -> str:
        return type(self).__name__

    # ------------------------------------------------------------------ the step (overridable)
    def train_step(self, model, optimizer, batch: dict) -> dict:
        """One optimizer step; returns the step's metrics (a dict of scalars with ``loss``).

        Runs inside the compiled step. Override it for gradient clipping, EMA weights, a second
        loss...: whatever NNX state the model and optimizer carry is snapshotted, checkpointed
        and restored with the parameters. Use :meth:`value_and_grad` for the gradients, so that
        gradient accumulation (``ElasticConfig.microbatch_size``) applies."""
        metrics, grads = self.value_and_grad(model, batch)
        optimizer.update(model, grads)
        return metrics

    def eval_step(self, model, batch: dict) -> dict:
        """Metrics of ``model`` on one eval batch (default: the loss and what it returns)."""
        loss, metrics = loss_and_metrics(self.loss(model, batch))
        return {"loss": loss, **metrics}

    def value_and_grad(self, model, batch: dict) -> tuple[dict, Any]:
        """``({"loss": ..., **metrics}, grads)`` of :meth:`loss` over ``batch``, with the batch split
        into the world's microbatches (gradients and metrics averaged over them: each microbatch is
        the same size, so this is the mean over the whole batch)."""
        from flax import nnx

        n = _microbatches.get()

        def f(m, b):
            return loss_and_metrics(self.loss(m, b))

        if n <= 1:
            (loss, metrics), grads = nnx.value_and_grad(f, has_aux=True)(model, batch)
            return {"loss": loss, **metrics}, grads
        return _accumulate(f, model, batch, n)


def _accumulate(f, model, batch: dict, n: int):
    """Gradients of ``f`` summed over ``n`` microbatches in a ``lax.scan`` (one compiled loop:
    activation memory of one microbatch). Microbatch ``j`` takes rows ``j*m .. j*m+m-1`` of every
    data-parallel shard, so no row changes device."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    def split(x):
        shards = _data_shards.get()
        per = x.shape[0] // shards
        y = x.reshape((shards, n, per // n) + x.shape[1:]).swapaxes(0, 1)
        return y.reshape((n, shards * (per // n)) + x.shape[1:])

    micro = jax.tree.map(split, batch)
    grad_fn = nnx.value_and_grad(f, has_aux=True)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(carry, mb):
        model, gsum, msum = carry
        (loss, metrics), grads = grad_fn(model, mb)
        gsum = jax.tree.map(lambda a, g: a + g.astype(a.dtype), gsum, grads)
        msum = {k: v + jnp.asarray({"loss": loss, **metrics}[k], jnp.float32) for k, v in msum.items()}
        return model, gsum, msum

    _, names = nnx.eval_shape(f, model, jax.tree.map(lambda x: x[0], micro))
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), nnx.state(model, nnx.Param))
    mzeros = {k: jnp.zeros((), jnp.float32) for k in ("loss", *names)}
    _, gsum, msum = body((model, zeros, mzeros), micro)
    return {k: v / n for k, v in msum.items()}, jax.tree.map(
        lambda g, p: (g / n).astype(p.dtype), gsum, nnx.state(model, nnx.Param)
    )
