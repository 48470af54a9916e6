"""The replicas' fingerprints, read from the same health-probe rounds as the step timings.

Each process keeps its newest few fingerprinted steps (:class:`~ray_elastic.slice.integrity.Fingerprints`);
once every process of the world has reported a step, :func:`~ray_elastic.decide.integrity.compare`
judges it (a step some process skipped, its programs still compiling, is never judged). The
newest step at which all agreed is trusted: with no majority the run goes back to
it, so the snapshot store and the holders' keepers keep a snapshot of it (or the newest before it).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import ray

from ray_elastic.decide.integrity import Mismatch, compare, trusted_at_start
from ray_elastic.state.snapshots import SnapshotStore

logger = logging.getLogger(__name__)


class IntegrityWatch:
    """Fingerprints of ``world``'s processes by step; a mismatch for the controller (:meth:`take`)."""

    def __init__(self, world: Any, every: int, store: SnapshotStore):
        self.every = every  # ``integrity_every``: 0, no process fingerprints anything
        self.store = store
        n, hosts = len(world.workers), world.plan.hosts_per_slice
        self._place = {p: (world.slice_of(p), p % hosts) for p in range(n)}
        self._seen: dict[int, dict[int, tuple[int, ...]]] = {}  # step -> process -> fingerprints
        self.agreed = -1  # the newest step every replica agreed on
        self._found: Mismatch | None = None
        self._over = False  # a mismatch was found: the world stops for it, nothing after it counts
        self._donors: dict[str, str] = {}  # slice -> whose snapshot it restored
        self._start = 0  # the world's first step

    def starts_at(self, step: int, donors: dict[str, str]) -> None:
        """The world's first step, and whose snapshot each slice restored (empty: not from snapshots;
        see :func:`trusted_at_start`). Until the restored state is compared, copies of a donor
        follow its vote (:func:`compare`)."""
        self.agreed = trusted_at_start(step, bool(donors), self.store.trusted)
        self._start, self._donors = step, donors
        self._trust()

    def trusted(self) -> int | None:
        """The step the holders' keepers are told to keep a snapshot of (None: fingerprints are off)."""
        return self.agreed if self.every else None

    def _trust(self) -> None:
        if self.every:
            self.store.trusted = self.agreed

    def add(self, answers: list[dict[str, Any]]) -> None:
        """One probe round's answers (process order)."""
        if self._over:
            return
        for p, a in enumerate(answers):
            for step, fp in (a.get("fingerprints") or {}).items():
                if step > self.agreed:
                    self._seen.setdefault(step, {})[p] = fp
        complete = sorted(s for s, got in self._seen.items() if len(got) == len(answers))
        logger.debug("fingerprints: %s complete of %s", complete, sorted(self._seen))
        for step in complete:
            # Until the state it restored is compared, the newest agreed step is before the world's start.
            unchecked = self.agreed < self._start - 1
            found = compare(step, self._seen.pop(step), self._place, self._donors if unchecked else None)
            if found is None:
                self.agreed = max(self.agreed, step)
                self._trust()
                self._seen = {s: got for s, got in self._seen.items() if s > self.agreed}  # (some skipped one)
                continue
            self._found, self._seen, self._over = dataclasses.replace(found, agreed_step=self.agreed), {}, True
            logger.warning("replicas disagree after step %d: %s", step, self._found)
            return

    def verify(self, workers: list[Any], timeout_s: float = 5.0) -> bool:
        """The world stopped at a planned step boundary or at the run's end, and every process
        fingerprinted that step (when fingerprints are on): compare them now, before the next world
        restores a replica of it or the run's last checkpoint is trusted. A bit flipped since the
        last check would otherwise travel on. True when the replicas were found to disagree in this
        world, now or by an earlier round (:meth:`take` says how, once)."""
        if not self.every:
            return False
        try:
            self.add(ray.get([w.probe.remote() for w in workers], timeout=timeout_s))
        except Exception as e:  # noqa: BLE001 - a process died: the failure path sees it
            logger.debug("integrity: the boundary's fingerprints were not read: %r", e)
        return self._over

    def take(self) -> Mismatch | None:
        """The replicas' first disagreement, once."""
        found, self._found = self._found, None
        return found
