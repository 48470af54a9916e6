"""The run's event log, and the listeners that observe the controller through it.

Every chunk of steps, failure, recovery phase and resize is a typed event
(:mod:`ray_elastic.observe.event_types`), kept in memory for the summary and, when a run
directory is given, appended as JSON lines to ``events.jsonl`` there. Everything that only *observes* a
run (progress bar, Ray metrics, the user's callbacks, standby replenishing) is an
:class:`EventListener`, the way Ray Train's ``ControllerCallback`` hooks observe its
controller, so the controller itself only emits.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Optional

from ray_elastic.observe.event_types import Event


class EventListener:
    """Hooks called by :class:`EventLog`; override the ones you need. Errors propagate (a
    listener that raises stops the run, as a user callback that raises should)."""

    def on_event(self, event: Event) -> None:
        """A logged event (one of :mod:`~ray_elastic.observe.event_types`)."""

    def on_step(self, metrics: dict) -> None:
        """A step finished for the first time (not logged one by one: ``steps`` events batch them)."""

    def on_state(self, old, new) -> None:
        """The controller moved from state ``old`` to ``new``."""

    def close(self) -> None:
        """The run ended (successfully or not)."""


class EventLog:
    def __init__(self, run_dir: Optional[str] = None, listeners: Iterable[EventListener] = ()):
        self.events: list[Event] = []
        self.listeners = list(listeners)
        self._file = None
        if run_dir:
            os.makedirs(run_dir, exist_ok=True)
            self._file = open(os.path.join(run_dir, "events.jsonl"), "a", buffering=1)

    def emit(self, event: Event) -> Event:
        self.events.append(event)
        if self._file is not None:
            self._file.write(json.dumps(event.to_json(), default=str) + "\n")
        for listener in self.listeners:
            listener.on_event(event)
        return event

    def step(self, metrics: dict) -> None:
        for listener in self.listeners:
            listener.on_step(metrics)

    def state(self, old, new) -> None:
        for listener in self.listeners:
            listener.on_state(old, new)

    def close(self) -> None:
        for listener in self.listeners:
            listener.close()
        if self._file is not None:
            self._file.close()
            self._file = None
