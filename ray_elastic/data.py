"""Deterministic data by global step, whatever the size of the world.

Row ``r`` of step ``s``'s global batch is element ``s * B + r`` of the task's
dataset shuffled per epoch (grain's ``shuffle(seed).repeat()``). A process asks
for its own row range only, so no host reads data another host feeds.
"""

from __future__ import annotations

import grain
import numpy as np


class StepBatches:
    """Global batches of a task's dataset, addressable by (step, row range)."""

    def __init__(self, dataset, stride: int, seed: int, shuffle: bool = True):
        ds = dataset if isinstance(dataset, grain.MapDataset) else grain.MapDataset.source(dataset)
        if len(ds) == 0:
            raise ValueError("the task's dataset is empty")
        if shuffle:
            ds = ds.shuffle(seed=seed)
        self._ds = ds.repeat()
        # Examples per step in the data order: the full-size global batch. A smaller
        # world under the "scale" policy reads the first rows of each step.
        self.stride = stride

    def rows(self, step: int, start: int, stop: int) -> dict:
        """Rows [start, stop) of step ``step``'s global batch, stacked into numpy arrays."""
        base = step * self.stride
        examples = [self._ds[base + r] for r in range(start, stop)]
        return {k: np.stack([e[k] for e in examples]) for k in examples[0]}

    def global_batch(self, step: int) -> dict:
        return self.rows(step, 0, self.stride)
