"""Deterministic data by global step, whatever the size of the world.

Row ``r`` of step ``s``'s global batch is element ``s * B + r`` of the task's
dataset shuffled per epoch (grain's ``shuffle(seed).repeat()``). A process asks
for its own row range only, so no host reads data another host feeds.

The shuffled order comes from grain's shuffle of the indices (``MapDataset.range(n)``), and
each example is read from the task's dataset by its index: the same elements as
``MapDataset.source(dataset).shuffle(seed).repeat()``, without grain's per-read statistics on
the source, which cost more than the read on a plain sequence (a third of the data path's CPU).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable

import grain
import numpy as np


def _reader(dataset) -> Callable[[int], dict]:
    """Element ``i`` of ``dataset`` repeated: a MapDataset is read at ``i`` itself, as grain's
    shuffle and repeat read their parent (a random map then draws per epoch); a sequence at ``i`` modulo its length."""
    if isinstance(dataset, grain.MapDataset):
        return dataset.__getitem__
    n = len(dataset)
    return lambda i: dataset[i % n]


def _stack(examples: list) -> dict:
    return {k: np.stack([e[k] for e in examples]) for k in examples[0]}


class StepBatches:
    """Global batches of a task's dataset, addressable by (step, row range)."""

    def __init__(self, dataset, stride: int, seed: int, shuffle: bool = True):
        self._n = len(dataset)
        if self._n == 0:
            raise ValueError("the task's dataset is empty")
        self._read = _reader(dataset)
        self._order = grain.MapDataset.range(self._n).shuffle(seed=seed).repeat() if shuffle else None
        # Examples per step in the data order: the full-size global batch. A smaller
        # world under the "scale" policy reads the first rows of each step.
        self.stride = stride

    def _index(self, i: int) -> int:
        """Where element ``i`` of the shuffled, repeated data order is in the dataset (with its
        epoch's offset)."""
        return i if self._order is None else self._order[i] + i // self._n * self._n

    def rows(self, step: int, start: int, stop: int) -> dict:
        """Rows [start, stop) of step ``step``'s global batch, stacked into numpy arrays."""
        base = step * self.stride
        return _stack([self._read(self._index(base + r)) for r in range(start, stop)])

    def global_batch(self, step: int) -> dict:
        return self.rows(step, 0, self.stride)


class EvalBatches:
    """Held-out batches: batch ``i`` is examples ``i*E .. i*E+E-1`` of the eval dataset, in order,
    the same for every world (each process reads its own rows of it)."""

    def __init__(self, dataset, batch_size: int):
        self._n, self._read = len(dataset), _reader(dataset)
        self.batch_size = batch_size

    def __len__(self) -> int:
        return self._n

    def process_rows(self, process_id: int, num_processes: int) -> tuple[int, int]:
        n = self.batch_size // num_processes
        return process_id * n, (process_id + 1) * n

    def rows(self, i: int, start: int, stop: int) -> dict:
        base = i * self.batch_size
        return _stack([self._read(base + r) for r in range(start, stop)])


class BatchPrefetcher:
    """A reader thread prepares this process's rows of the next ``depth`` steps while the device
    computes, so a slow ``__getitem__`` costs max(compute, data) per step, not their sum."""

    def __init__(self, batches: StepBatches, start: int, stop: int, depth: int = 2):
        self.batches, self.start, self.stop, self.depth = batches, start, stop, depth
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="batch-reader") if depth else None
        self._ahead: dict[int, concurrent.futures.Future] = {}
        self._lock = threading.Lock()

    def _read(self, step: int) -> dict:
        return self.batches.rows(step, self.start, self.stop)

    def get(self, step: int) -> dict:
        """The rows of ``step`` (waiting for the reader if it has not finished them), and the next
        ``depth`` steps handed to the reader."""
        if self._pool is None:
            return self._read(step)
        with self._lock:
            for s in [s for s in self._ahead if s < step]:
                self._ahead.pop(s).cancel()  # a rewind or a jump: not needed any more
            future = self._ahead.pop(step, None)
            for s in range(step + 1, step + 1 + self.depth):
                if s not in self._ahead:
                    self._ahead[s] = self._pool.submit(self._read, s)
        return future.result() if future is not None else self._read(step)

    def close(self) -> None:
        if self._pool is not None:
            for f in self._ahead.values():
                f.cancel()
            self._pool.shutdown(wait=False)
