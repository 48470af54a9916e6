"""The controller's explicit states, the outcomes that move it, and the transitions allowed.

Modelled on Ray Train v2's controller states: the controller is always in exactly
one state and every change goes through :func:`check_transition`. Driving a world
ends in one :class:`RunOutcome`; the controller's loop turns each outcome into the
next world (or the end of the run).
"""

from __future__ import annotations

import dataclasses
import enum


class ControllerState(enum.Enum):
    INITIALIZING = "initializing"  # validating, connecting to Ray
    SCHEDULING = "scheduling"  # reserving slices with placement groups
    FORMING_WORLD = "forming_world"  # starting actors, jax.distributed, state, compile
    RUNNING = "running"  # driving steps
    RECOVERING = "recovering"  # a slice or process failed: classify, tear down, choose the next world
    WAITING_FOR_CAPACITY = "waiting_for_capacity"  # too few slices: waiting for replacements
    RESIZING = "resizing"  # capacity returned, or warned slices leave: a new world at a step boundary
    FINISHED = "finished"  # all requested steps done
    ERRORED = "errored"  # gave up; the error says why

    @property
    def is_terminal(self) -> bool:
        return self in (ControllerState.FINISHED, ControllerState.ERRORED)


class OutcomeKind(enum.StrEnum):
    """Why a world stopped: the controller's loop has one branch per kind."""

    DONE = "done"  # every requested step finished
    FAILURE = "failure"  # a process of the world raised or died
    HANG = "hang"  # the watchdog saw no finished step for too long
    GROW = "grow"  # capacity returned: stopped at a step boundary to form a bigger world
    # Slices alive that should go (a preemption notice, a straggler): stopped at a step boundary for them to leave.
    LEAVE = "leave"
    # Replicas of the state disagree with no majority: torn down, back to the newest step they agreed on.
    ROLLBACK = "rollback"
    FORMING_FAILED = "forming_failed"  # the next world failed before its first step


@dataclasses.dataclass
class RunOutcome:
    """How driving (or forming) a world ended."""

    kind: OutcomeKind
    errors: dict[int, BaseException] = dataclasses.field(default_factory=dict)  # process id -> error
    last_progress_at: float = 0.0  # wall clock of the last finished step
    drain_s: float = 0.0  # after a failure: collecting what the survivors streamed and their keepers hold


S = ControllerState
_ALLOWED: dict[ControllerState, set[ControllerState]] = {
    S.INITIALIZING: {S.SCHEDULING},
    S.SCHEDULING: {S.FORMING_WORLD},
    # Forming can fail too (a second failure during recovery, a replacement dying on arrival).
    S.FORMING_WORLD: {S.RUNNING, S.RECOVERING},
    S.RUNNING: {S.FINISHED, S.RECOVERING, S.RESIZING},
    S.RECOVERING: {S.FORMING_WORLD, S.WAITING_FOR_CAPACITY},
    S.WAITING_FOR_CAPACITY: {S.FORMING_WORLD},
    # Growing back can fail too: a process dying while the in-flight save commits is a failure.
    # Warned slices leaving may leave too few for the mode: wait for their replacements.
    S.RESIZING: {S.FORMING_WORLD, S.RECOVERING, S.WAITING_FOR_CAPACITY},
    S.FINISHED: set(),
    S.ERRORED: set(),
}


class InvalidTransition(RuntimeError):
    pass


def check_transition(old: ControllerState, new: ControllerState) -> None:
    """Raise :class:`InvalidTransition` unless ``old -> new`` is allowed (any live state may error)."""
    if new is ControllerState.ERRORED and not old.is_terminal:
        return
    if new not in _ALLOWED[old]:
        raise InvalidTransition(f"controller cannot go from {old.value} to {new.value}")
