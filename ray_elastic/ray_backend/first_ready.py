"""Waiting for the first of a world's refs on a thread of its own (the driver's round waits on an event)."""

from __future__ import annotations

import threading
from typing import Any

import ray

WATCH_S = 1.0  # a thread's longest single wait (it waits again on the same refs)


class FirstReady:
    """Waits on a thread of its own for the first of some refs (or streams) to be ready, then sets
    ``wake`` and stays idle until given the next refs to wait on.

    The driver's round then waits on an event, and ``ray.wait`` over a world's refs runs once per
    thing that happens instead of once per round: it costs about a microsecond per ref, and over
    every process in every round it made the driver's work per step grow with the world.
    ``ray.wait`` lets go of the GIL while it blocks.
    """

    def __init__(self, wake: threading.Event):
        self._wake = wake
        self._cond = threading.Condition()
        self._refs: list[Any] = []
        self._fired = False
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="ray-elastic-first-ready", daemon=True)
        self._thread.start()

    def watch(self, refs: list[Any]) -> None:
        """From now on wait for the first of ``refs`` (what the queues now start with)."""
        with self._cond:
            self._refs, self._fired = list(refs), False
            self._cond.notify()

    def fired(self) -> bool:
        with self._cond:
            return self._fired

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (not self._refs or self._fired):
                    self._cond.wait()
                if self._stopped:
                    return
                refs = self._refs
            try:
                done, _ = ray.wait(refs, num_returns=1, timeout=WATCH_S)
            except Exception:  # noqa: BLE001 - shutting down, or a ref gone: the round finds out which
                done = refs
            with self._cond:
                if done and self._refs is refs and not self._stopped:
                    self._fired = True
                    self._wake.set()
