"""A slice that is alive but will be taken: which slices a drain notice concerns, and how they leave.

A TPU host about to be preempted (a spot VM, a GKE node, a maintenance event) is drained in Ray
first: the node is marked draining with a deadline (``ray start``'s SIGTERM handler and the
autoscaler both do this through the GCS). A warned slice leaves the world at the next step
boundary through the planned path, as a grow-back does, instead of failing at the deadline.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Notice:
    """One slice's warning: its hosts being drained, why, and by when (wall clock; None: no deadline)."""

    slice_name: str
    hosts: tuple[str, ...]
    reason: str
    deadline: float | None

    def seconds_left(self, now: float) -> float | None:
        return None if self.deadline is None else round(self.deadline - now, 3)


def warned_slices(
    slice_nodes: dict[str, list[str]], draining: dict[str, tuple[float | None, str]]
) -> dict[str, Notice]:
    """The slices with a host in ``draining`` (node id -> (deadline, reason)): any host of a
    slice warned makes the whole slice go (its processes form one replica). The earliest deadline
    of its hosts is the slice's."""
    out = {}
    for name, nodes in slice_nodes.items():
        hosts = tuple(n for n in nodes if n in draining)
        if not hosts:
            continue
        deadlines = [d for d in (draining[n][0] for n in hosts) if d is not None]
        out[name] = Notice(name, hosts, draining[hosts[0]][1], min(deadlines) if deadlines else None)
    return out


# A warned slice waiting for the staying slices' standbys leaves at the latest this long before its deadline.
LEAVE_MARGIN_S = 5.0


def leave_now(notices: list[Notice], now: float, standbys_idle: bool, margin_s: float = LEAVE_MARGIN_S) -> bool:
    """Whether warned slices leave at this step boundary. While a standby process of the staying
    slices is still starting (right after a recovery, say) the world trains on: the start-up would
    compete with the next world's forming for the hosts' CPUs (as a grow-back, which waits for its
    standbys too), and the slices still train until then, so waiting costs no step. Never past
    ``margin_s`` before the earliest deadline; a notice with no deadline does not wait."""
    if standbys_idle:
        return True
    return any(left is None or left <= margin_s for left in (n.seconds_left(now) for n in notices))


@dataclasses.dataclass(frozen=True)
class ExitPlan:
    """How warned slices leave: ``leaving`` (replica order kept for the rest), and whether the
    state must be committed to a checkpoint first because no staying slice holds snapshots."""

    leaving: tuple[str, ...]
    staying: tuple[str, ...]
    checkpoint_first: bool
    state_kept_by: str  # "snapshots" (staying holders), "checkpoint", or "nothing" (a recovery may rewind)


def plan_exit(members: list[str], warned: set[str], holders: list[str], has_checkpoint_dir: bool) -> ExitPlan:
    """Warned ``members`` leave; the staying ones keep training. The state survives in the staying
    snapshot ``holders`` (every holder snapshots the boundary step); when none stays (every slice
    warned, or every holder), it is committed to a checkpoint before the slices go, when the run
    has a checkpoint directory."""
    leaving = tuple(m for m in members if m in warned)
    staying = tuple(m for m in members if m not in warned)
    if any(h in staying for h in holders):
        return ExitPlan(leaving, staying, False, "snapshots")
    if has_checkpoint_dir:
        return ExitPlan(leaving, staying, True, "checkpoint")
    return ExitPlan(leaving, staying, False, "nothing")
