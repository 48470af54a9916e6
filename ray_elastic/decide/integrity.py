"""Whether the replicas of the train state still agree, from their fingerprints.

The process at host ``h`` of every slice holds the same blocks of the state (each slice is one
replica), so their fingerprints (:mod:`~ray_elastic.slice.integrity`) must be equal. Per host
position, the slices whose fingerprints differ from those of more than half of the slices are
corrupt; with no such majority (two replicas, or a split vote) which replica is right cannot be
told, and the run has to go back to a step at which they agreed.
"""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """Replicas that disagree after ``step``: ``corrupt`` (out-voted slices; empty: no majority),
    the arrays (state leaf indices) that differ, and the newest step at which all agreed (-1: none
    was compared)."""

    step: int
    corrupt: tuple[str, ...]
    arrays: tuple[int, ...]
    agreed_step: int = -1


def compare(
    step: int,
    fingerprints: dict[int, tuple[int, ...]],
    place: dict[int, tuple[str, int]],
    donors: dict[str, str] | None = None,
) -> Mismatch | None:
    """``fingerprints`` per process of ``step``; ``place``: process -> (slice, host in slice).
    None when every replica agrees. ``donors`` (slice -> the slice whose snapshot it restored),
    while the state a world restored from snapshots is not yet compared: a copy follows its donor's
    vote instead of adding to it, or a corrupt donor's copies would out-vote the clean holders."""
    by_host: dict[int, dict[str, tuple[int, ...]]] = {}
    for p, fp in fingerprints.items():
        name, host = place[p]
        by_host.setdefault(host, {})[name] = tuple(fp)
    corrupt: set[str] = set()
    arrays: set[int] = set()
    split = False
    for fps in by_host.values():
        ballots = _ballots(fps, donors or {})
        best, votes = collections.Counter(ballots).most_common(1)[0]
        if all(fp == best for fp in fps.values()):
            continue
        arrays |= {i for fp in fps.values() for i, (a, b) in enumerate(zip(fp, best)) if a != b}
        if 2 * votes > len(ballots):
            corrupt |= {name for name, fp in fps.items() if fp != best}
        else:
            split = True
    if not arrays and not corrupt and not split:
        return None
    return Mismatch(step, () if split else tuple(sorted(corrupt)), tuple(sorted(arrays)))


def _ballots(fps: dict[str, tuple[int, ...]], donors: dict[str, str]) -> list[tuple[int, ...]]:
    """One vote per source of the state: each slice's own, except copies of a donor that is here
    (the donor votes for them)."""
    return [fp for name, fp in fps.items() if donors.get(name, name) == name or donors[name] not in fps]


def trusted_at_start(start_step: int, from_snapshot: bool, trusted_before: int | None) -> int:
    """The newest step a new world's replicas are known to agree on. Loaded from one checkpoint or
    fresh parameters, they agree on the state before its first step. Loaded from snapshots (each
    holder its own, the others a donor's, taken since the last check), only what was compared
    holds: the newest step the replicas agreed on before (``trusted_before``; None: none known,
    the run's first world), the boundary itself after a planned stop (compared there)."""
    if from_snapshot and trusted_before is not None:
        return min(trusted_before, start_step - 1)
    return start_step - 1
