"""The replicas' fingerprints, read from the same health-probe rounds as the step timings.

Each process keeps its newest few fingerprinted steps (:class:`~ray_elastic.slice.integrity.Fingerprints`);
once every process of the world has reported a step, :func:`~ray_elastic.decide.integrity.compare`
judges it. The newest step at which all agreed is trusted: with no majority the run goes back to
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

    def starts_at(self, step: int, from_snapshot: bool) -> None:
        """The world's first step, and whether it restored snapshots (see :func:`trusted_at_start`)."""
        self.agreed = trusted_at_start(step, from_snapshot, self.store.trusted)
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
            found = compare(step, self._seen.pop(step), self._place)
            if found is None:
                self.agreed = max(self.agreed, step)
                self._trust()
                continue
            self._found, self._seen, self._over = dataclasses.replace(found, agreed_step=self.agreed), {}, True
            logger.warning("replicas disagree after step %d: %s", step, self._found)
            return

    def verify(self, workers: list[Any], timeout_s: float = 5.0) -> None:
        """The world stopped at a planned step boundary, every process fingerprinted that step (when
        fingerprints are on): compare them now, before the next world restores a replica of it. A
        bit flipped since the last check would otherwise travel on in the snapshot of a corrupt slice."""
        if not self.every:
            return
        try:
            self.add(ray.get([w.probe.remote() for w in workers], timeout=timeout_s))
        except Exception as e:  # noqa: BLE001 - a process died: the failure path sees it
            logger.debug("integrity: the boundary's fingerprints were not read: %r", e)

    def take(self) -> Mismatch | None:
        """The replicas' first disagreement, once."""
        found, self._found = self._found, None
        return found
