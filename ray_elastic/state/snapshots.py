"""Which in-memory snapshots exist, per slice and step (driver-side bookkeeping).

A snapshot is the state of one process after a step, held by the keeper actor of
that process's host (:mod:`ray_elastic.state.snapshot_keeper`): it outlives the slice
process and dies only with the node. A slice's snapshot of a step is *complete*
when every host of the slice has its part.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ray_elastic.decide.schedule import is_fingerprint_step


class SnapshotRef(NamedTuple):
    """Where one host's part of a snapshot is: its keeper, and the (generation, step) it is kept under."""

    keeper: Any
    generation: int
    step: int


class SnapshotStore:
    """Object refs of snapshots, keyed by slice, step and host; keeps the newest few steps, the
    newest complete one at or before ``trusted`` (the newest step the replicas agreed on), and
    with ``checked_every`` the fingerprinted steps after it: one probe round may find a step
    agreed and a later one disagreeing together, and the run then goes back to the former."""

    def __init__(self, hosts_per_slice: int, keep_steps: int = 2, checked_every: int = 0):
        self.hosts_per_slice = hosts_per_slice
        self.keep_steps = keep_steps
        self.checked_every = checked_every  # ``integrity_every``: 0, nothing is fingerprinted
        self.trusted: int | None = None  # None: the replicas were never compared
        self._refs: dict[str, dict[int, dict[int, Any]]] = {}

    def add(self, slice_name: str, host: int, step: int, ref: Any) -> None:
        steps = self._refs.setdefault(slice_name, {})
        steps.setdefault(step, {})[host] = ref
        # Drop old steps (their objects are freed when the last ref goes).
        complete = sorted(s for s, h in steps.items() if len(h) == self.hosts_per_slice)
        if len(complete) >= self.keep_steps:
            cutoff = complete[-self.keep_steps]
            trusted = -1 if self.trusted is None else self.trusted
            agreed = max((s for s in complete if s <= trusted), default=None)
            for s in [s for s in steps if s < cutoff and s != agreed and not self._unchecked(s, trusted)]:
                del steps[s]

    def _unchecked(self, step: int, trusted: int) -> bool:
        """``step`` was fingerprinted and not yet compared: it may become the agreed step."""
        return step > trusted and is_fingerprint_step(step, self.checked_every)

    def latest_complete(self, slices) -> dict[str, int]:
        """slice -> newest step with all hosts present, for the given slices that have one."""
        out = {}
        for name in slices:
            done = [s for s, h in self._refs.get(name, {}).items() if len(h) == self.hosts_per_slice]
            if done:
                out[name] = max(done)
        return out

    def hold_only(self, slice_name: str, host: int, held: dict[int, Any]) -> None:
        """What one host's keeper really holds (step -> ref), replacing what the reports said: the
        reports of a slice's hosts arrive at their own pace, and a keeper may have let go of a step
        that one of them still names."""
        steps = self._refs.setdefault(slice_name, {})
        for s in list(steps):
            if s not in held:
                steps[s].pop(host, None)
                if not steps[s]:
                    del steps[s]
        for s, ref in held.items():
            steps.setdefault(s, {})[host] = ref

    def entries(self, slices) -> list[tuple[str, int, int, Any]]:
        """(slice, host, step, ref) of every part held for these slices."""
        return [
            (name, h, s, ref)
            for name in slices
            for s, hosts in self._refs.get(name, {}).items()
            for h, ref in hosts.items()
        ]

    def drop(self, slice_name: str, host: int, step: int) -> None:
        """Forget one host's part of a step (its keeper let go of it)."""
        hosts = self._refs.get(slice_name, {}).get(step, {})
        hosts.pop(host, None)
        if not hosts:
            self._refs.get(slice_name, {}).pop(step, None)

    def has(self, slice_name: str, host: int, step: int) -> bool:
        """One host's part of the snapshot of ``step`` is held."""
        return host in self._refs.get(slice_name, {}).get(step, {})

    def complete(self, slice_name: str, step: int) -> bool:
        """Every host of the slice has its part of the snapshot of ``step``."""
        return len(self._refs.get(slice_name, {}).get(step, {})) == self.hosts_per_slice

    def refs(self, slice_name: str, step: int) -> list:
        """Per-host refs of a complete snapshot, host order."""
        hosts = self._refs[slice_name][step]
        return [hosts[h] for h in range(self.hosts_per_slice)]

    def drop_after(self, step: int) -> None:
        """A new world restarts after ``step``: forget every part of later steps. A step an old world
        half delivered (one host's part) must never combine with the new world's rerun of it into
        a "complete" snapshot: after a resize the two are not the same numbers."""
        for steps in self._refs.values():
            for s in [s for s in steps if s > step]:
                del steps[s]

    def slices(self) -> list[str]:
        return list(self._refs)

    def forget(self, slice_name: str) -> None:
        """The slice's node is gone: so are its objects."""
        self._refs.pop(slice_name, None)
