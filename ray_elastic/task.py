"""The user contract: what a training job gives ray-elastic.

A :class:`TrainTask` is built on the driver, shipped to every slice actor, and
used there only: model, optimizer, loss and data never touch the controller.
Flax NNX + Optax are first-class::

    class MyTask(TrainTask):
        def create_model(self, rngs):   return MyModel(rngs=rngs)
        def create_optimizer(self):     return optax.adamw(3e-4)
        def loss(self, model, batch):   return cross_entropy(model(batch["x"]), batch["y"])
        def dataset(self):              return grain.MapDataset.source(my_examples)

Data is random access (a grain ``MapDataset`` or anything with ``__len__`` and
``__getitem__`` returning a dict of numpy arrays). ray-elastic shuffles it per
epoch with the run's seed and gives step ``s`` the examples ``s*B .. s*B+B-1`` of
that order, so the global batch of a step is the same whatever the number of live
slices; each process reads only its own rows.
"""

from __future__ import annotations

import abc
from typing import Any


class TrainTask(abc.ABC):
    """Model, optimizer, loss and data of one training job (runs inside the slice actors)."""

    @abc.abstractmethod
    def create_model(self, rngs):
        """Return a fresh ``flax.nnx.Module``; called under ``jax.jit`` with sharded outputs."""

    @abc.abstractmethod
    def create_optimizer(self):
        """Return an ``optax.GradientTransformation``."""

    @abc.abstractmethod
    def loss(self, model, batch: dict) -> Any:
        """Mean loss of ``model`` on ``batch`` (a dict of arrays with a leading batch dimension)."""

    @abc.abstractmethod
    def dataset(self):
        """Random-access examples: a ``grain.MapDataset`` (or sequence) of dicts of numpy arrays."""

    def name(self) -> str:
        return type(self).__name__
