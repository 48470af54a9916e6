"""An MLP classifier on scikit-learn's bundled 8x8 digits (1,797 images, no download)."""

from __future__ import annotations

import dataclasses

import numpy as np
import optax
from flax import nnx

from ray_elastic.task import TrainTask


class MLP(nnx.Module):
    def __init__(self, din: int, hidden: int, dout: int, *, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(din, hidden, rngs=rngs)
        self.l2 = nnx.Linear(hidden, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, dout, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.l1(x))
        x = nnx.relu(self.l2(x))
        return self.out(x)


@dataclasses.dataclass
class DigitsMLPTask(TrainTask):
    hidden: int = 64
    learning_rate: float = 1e-2

    def create_model(self, rngs):
        return MLP(64, self.hidden, 10, rngs=rngs)

    def create_optimizer(self):
        return optax.adam(self.learning_rate)

    def loss(self, model, batch):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    def dataset(self):
        from sklearn.datasets import load_digits

        d = load_digits()
        x = (d.data / 16.0).astype(np.float32)
        y = d.target.astype(np.int32)
        return [{"x": x[i], "y": y[i]} for i in range(len(y))]
