"""The controller's explicit states and the transitions allowed between them.

Modelled on Ray Train v2's controller states: the controller is always in
exactly one state, every change goes through :func:`check_transition`, and the
history is kept so a run can say where its time went.
"""

from __future__ import annotations

import enum


class ControllerState(enum.Enum):
    INITIALIZING = "initializing"  # validating, connecting to Ray
    SCHEDULING = "scheduling"  # reserving slices with placement groups
    FORMING_WORLD = "forming_world"  # starting actors, jax.distributed, state, compile
    RUNNING = "running"  # driving chunks of steps
    RECOVERING = "recovering"  # a slice or process failed: classify, tear down, choose the next world
    WAITING_FOR_CAPACITY = "waiting_for_capacity"  # too few slices: waiting for replacements
    RESIZING = "resizing"  # capacity returned: growing the world at a step boundary
    FINISHED = "finished"  # all requested steps done
    ERRORED = "errored"  # gave up; the error says why

    @property
    def is_terminal(self) -> bool:
        return self in (ControllerState.FINISHED, ControllerState.ERRORED)


S = ControllerState
_ALLOWED: dict[ControllerState, set[ControllerState]] = {
    S.INITIALIZING: {S.SCHEDULING},
    S.SCHEDULING: {S.FORMING_WORLD},
    # Forming can fail too (a second failure during recovery, a replacement dying on arrival).
    S.FORMING_WORLD: {S.RUNNING, S.RECOVERING},
    S.RUNNING: {S.FINISHED, S.RECOVERING, S.RESIZING},
    S.RECOVERING: {S.FORMING_WORLD, S.WAITING_FOR_CAPACITY},
    S.WAITING_FOR_CAPACITY: {S.FORMING_WORLD},
    S.RESIZING: {S.FORMING_WORLD},
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
