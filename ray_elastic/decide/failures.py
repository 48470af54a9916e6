"""What a failure means: error kinds, which slices are lost or only crashed, and the limits on retrying."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence


class ErrorKind(enum.StrEnum):
    """What an error from a slice process says about its slice."""

    ACTOR_DIED = "actor_died"  # the process is gone (its node may or may not be)
    PROCESS_DIED = "process_died"  # Ray says the worker process died; its host was alive then
    NODE_DIED = "node_died"  # Ray says the process's node died
    UNAVAILABLE = "unavailable"  # maybe dead: node health decides
    SLICE_DOWN = "slice_down"  # JAX reported a lost peer (pathwaysutils' slice-down statuses)
    STORAGE = "storage"  # a checkpoint could not be read or written: the storage's fault, not the host's
    HANG = "hang"  # no step finished and the process did not answer a probe
    TASK_ERROR = "task_error"  # the task's own code raised


@dataclasses.dataclass(frozen=True)
class FailureVerdict:
    """What a failure means for the world.

    lost_slices leave the world (a host is dead or hung); crashed_slices lost a
    process but their hosts are healthy, so they can host the next generation.
    """

    lost_slices: tuple[str, ...]
    crashed_slices: tuple[str, ...]
    recoverable: bool
    reason: str
    training_code: bool = False  # the task's own code raised: a bug, never retried
    quarantined: tuple[str, ...] = ()  # lost slices whose hosts live but keep failing: held, never reused


def classify_failure(
    *,
    errors: dict[str, ErrorKind],
    dead_slices: set[str],
    world_slices: Sequence[str],
    error_text: str = "",
) -> FailureVerdict:
    """Decide which slices are lost from per-slice error kinds and node health.

    Args:
        errors: slice name -> kind of the worst error seen on it.
        dead_slices: slices with a host that Ray reports dead (or that was hung: SIGSTOPped
            hosts stop answering and are marked dead the same way). A ``node_died`` error
            counts too: Ray said so before its node table did.
        world_slices: the slices of the failed world.
        error_text: the first error's text, for the reason.

    A process that died while its node lives is collateral (for example killed when
    the coordination process died): its slice is healthy. A ``task_error`` is user
    code failing, not a slice: not recoverable by re-forming the world, unless
    something else died too (a lost slice, a dead or hung process, a slice-down
    error): then the peers' errors are collateral, whatever their text says.
    """
    dead_slices = set(dead_slices) | {s for s, k in errors.items() if k is ErrorKind.NODE_DIED}
    lost = tuple(s for s in world_slices if s in dead_slices)
    crashed = tuple(s for s in world_slices if s in errors and s not in dead_slices)
    deaths = lost or any(k is not ErrorKind.TASK_ERROR for k in errors.values())
    user = [] if deaths else [s for s, k in errors.items() if k is ErrorKind.TASK_ERROR]
    if user:
        return FailureVerdict(lost, crashed, False, f"training code failed on slice {user[0]}: {error_text}", True)
    if not errors and not lost:
        return FailureVerdict((), (), False, "no failure to recover from")
    what = f"lost slice(s) {', '.join(lost)}" if lost else f"process failure on {', '.join(crashed)}"
    return FailureVerdict(lost, crashed, True, what)


HOST_FAULTS = (ErrorKind.PROCESS_DIED, ErrorKind.ACTOR_DIED, ErrorKind.UNAVAILABLE, ErrorKind.HANG)


def drop_repeat_offender(
    verdict: FailureVerdict,
    *,
    origin: str | None,
    previous_origin: str | None,
    progressed: bool,
    origin_kind: ErrorKind | None = ErrorKind.PROCESS_DIED,
) -> FailureVerdict:
    """A slice whose process failed first in two failures in a row, with no step finished in between,
    is lost even though its host answers: a host that fails the same way in every generation would
    otherwise be re-formed forever. It is also quarantined: its reservation stays held, so the
    replacement asked for cannot be placed on the same hosts again."""
    if progressed or origin is None or origin != previous_origin or origin not in verdict.crashed_slices:
        return verdict
    if origin_kind not in HOST_FAULTS:  # storage or a peer's collective error: not this host's doing
        return verdict
    return dataclasses.replace(
        verdict,
        lost_slices=verdict.lost_slices + (origin,),
        quarantined=verdict.quarantined + (origin,),
        crashed_slices=tuple(s for s in verdict.crashed_slices if s != origin),
        reason=f"slice {origin} failed twice in a row without a step finished: dropped ({verdict.reason})",
    )


def failures_exceeded(failure_times: Sequence[float], now: float, max_failures: int, window_s: float) -> bool:
    """More than ``max_failures`` failures in the last ``window_s`` seconds."""
    return sum(1 for t in failure_times if now - t <= window_s) > max_failures
