"""Which slice a running world waits for, measured while it trains.

Every ``PROBE_EVERY_S`` the driver asks each process's health probe (its own thread: answered
during a step) for when its recent steps' calls returned and for its step counters
(:attr:`~ray_elastic.slice.jax_world.TrainLoop.released`, ``timing``), without waiting for the
answers (they are read at a later turn of the step loop). Once ``straggler_window_steps`` steps
that every process released have come in, the window is judged
(:func:`~ray_elastic.decide.stragglers.find_straggler`); a slice that makes the world wait more than
``straggler_factor`` x the others' own step time in two windows in a row is a straggler, handed to
the controller (:meth:`take`), which decides what to do.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray

from ray_elastic.config import ElasticConfig
from ray_elastic.decide.stragglers import Straggler, find_straggler

logger = logging.getLogger(__name__)
PROBE_EVERY_S = 1.0
ANSWER_WITHIN_S = 5.0  # a round not answered in this long is dropped (a dead process is the failure path's)


class StragglerWatch:
    """Step release times of ``world``'s processes over windows; a confirmed straggler for the controller."""

    def __init__(self, world: Any, config: ElasticConfig):
        self.world, self.config = world, config
        self._released: dict[int, dict[int, float]] = {}  # per process: step -> when its call returned
        self._data: dict[int, tuple[float, float]] = {}  # per process: (steps, data_s) when the window began
        self._judged = -1  # the newest step of the last window judged
        self._refs: list[Any] | None = None
        self._sent = 0.0
        self._next = time.monotonic() + PROBE_EVERY_S
        self._suspect: str | None = None
        self._found: Straggler | None = None

    def check(self) -> None:
        """Read a round of answers that is in; send the next one when due. Never waits."""
        now = time.monotonic()
        if self._refs is not None:
            ready, _ = ray.wait(self._refs, num_returns=len(self._refs), timeout=0)
            if len(ready) == len(self._refs):
                refs, self._refs = self._refs, None
                try:
                    self._add(ray.get(refs))
                except Exception as e:  # noqa: BLE001 - a process died: the failure path sees it
                    logger.debug("straggler watch: a probe failed: %r", e)
            elif now - self._sent > ANSWER_WITHIN_S:
                self._refs = None
        if self._refs is None and now >= self._next:
            self._refs, self._sent, self._next = (
                [w.probe.remote() for w in self.world.workers],
                now,
                now + PROBE_EVERY_S,
            )

    def take(self) -> Straggler | None:
        """The confirmed straggler since the last call (None: none)."""
        found, self._found = self._found, None
        return found

    def _add(self, answers: list[dict[str, Any]]) -> None:
        for p, a in enumerate(answers):
            self._released.setdefault(p, {}).update((s, t) for s, t in a.get("released", ()) if s > self._judged)
        common = set.intersection(*(set(r) for r in self._released.values())) if self._released else set()
        window = self.config.failure.straggler_window_steps
        if len(common) < window:
            return
        timing = {p: a.get("timing") or {} for p, a in enumerate(answers)}
        data = {
            p: (t.get("data_s", 0.0) - self._data.get(p, (0, 0.0))[1])
            / max(1.0, t.get("steps", 0) - self._data.get(p, (0, 0.0))[0])
            for p, t in timing.items()
        }
        released = {p: {s: r[s] for s in common} for p, r in self._released.items()}
        self._judged = max(common)
        self._released = {p: {s: t for s, t in r.items() if s > self._judged} for p, r in self._released.items()}
        self._data = {p: (t.get("steps", 0), t.get("data_s", 0.0)) for p, t in timing.items()}
        found = find_straggler(released, data, {p: self.world.slice_of(p) for p in released}, window)
        if found is None or found.ratio <= self.config.failure.straggler_factor:
            self._suspect = None
            return
        if self._suspect == found.slice_name:  # named twice in a row: handed to the controller
            self._found = found
        self._suspect = found.slice_name
