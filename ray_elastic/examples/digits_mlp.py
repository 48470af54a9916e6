"""An MLP classifier on scikit-learn's bundled 8x8 digits (1,797 images, no download)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os

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
        pixels, labels = load_digits()
        x = (pixels / 16.0).astype(np.float32)
        y = labels.astype(np.int32)
        return [{"x": x[i], "y": y[i]} for i in range(len(y))]


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits as (pixels, labels), what ``sklearn.datasets.load_digits``
    returns as ``data`` and ``target``. Read from its CSV without importing scikit-learn: that
    import costs ~1 s of CPU in every slice process, and the world a recovery forms from new
    processes waits for it."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without running it
    path = (
        os.path.join(os.path.dirname(spec.origin), "datasets", "data", "digits.csv.gz") if spec and spec.origin else ""
    )
    if os.path.exists(path):
        data = np.loadtxt(path, delimiter=",")
        return data[:, :-1], data[:, -1].astype(int)
    from sklearn.datasets import load_digits as sklearn_load_digits  # another layout: the slow way

    d = sklearn_load_digits()
    return d.data, d.target
