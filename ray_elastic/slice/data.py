"""Deterministic data by global step, whatever the size of the world.

Row ``r`` of step ``s``'s global batch is element ``s * B + r`` of the task's
dataset shuffled per epoch (grain's ``shuffle(seed).repeat()``). A process asks
for its own row range only, so no host reads data another host feeds.
"""

from __future__ import annotations

import concurrent.futures
import threading

import grain
import numpy as np


def _as_map_dataset(dataset) -> grain.MapDataset:
    return dataset if isinstance(dataset, grain.MapDataset) else grain.MapDataset.source(dataset)


def _stack(examples: list) -> dict:
    return {k: np.stack([e[k] for e in examples]) for k in examples[0]}


class StepBatches:
    """Global batches of a task's dataset, addressable by (step, row range)."""

    def __init__(self, dataset, stride: int, seed: int, shuffle: bool = True):
        ds = _as_map_dataset(dataset)
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
        return _stack([self._ds[base + r] for r in range(start, stop)])

    def global_batch(self, step: int) -> dict:
        return self.rows(step, 0, self.stride)


class EvalBatches:
    """Held-out batches: batch ``i`` is examples ``i*E .. i*E+E-1`` of the eval dataset, in order,
    the same for every world (each process reads its own rows of it)."""

    def __init__(self, dataset, batch_size: int):
        self._ds = _as_map_dataset(dataset)
        self.batch_size = batch_size

    def __len__(self) -> int:
        return len(self._ds)

    def process_rows(self, process_id: int, num_processes: int) -> tuple[int, int]:
        n = self.batch_size // num_processes
        return process_id * n, (process_id + 1) * n

    def rows(self, i: int, start: int, stop: int) -> dict:
        base = i * self.batch_size
        return _stack([self._ds[base + r] for r in range(start, stop)])


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
