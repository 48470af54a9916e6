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
import logging
import os
from collections.abc import Callable, Iterable, Iterator

from ray_elastic.observe.event_types import Event

logger = logging.getLogger(__name__)


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


def read_lines(path: str) -> Iterator[dict]:
    """The JSON lines of an event log; a torn line (a driver killed while writing it) is skipped
    with a warning: every rerun and report reads past it."""
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                logger.warning("%s line %d is torn (its writer was killed while writing it): skipped", path, n)


class EventLog:
    """The run's events, in memory and (``run_dir``) appended to ``events.jsonl``. ``fenced()`` True:
    this driver no longer owns the run (a rerun took it over): nothing more is written to the file,
    which is the new driver's now (listeners still hear every event)."""

    def __init__(
        self,
        run_dir: str | None = None,
        listeners: Iterable[EventListener] = (),
        fenced: Callable[[], bool] = lambda: False,
    ):
        self.events: list[Event] = []
        self.listeners = list(listeners)
        self.fenced = fenced
        self._file = None
        if run_dir:
            os.makedirs(run_dir, exist_ok=True)
            path = os.path.join(run_dir, "events.jsonl")
            self._file = open(path, "a+", buffering=1)
            self._file.seek(0, os.SEEK_END)
            if self._file.tell() > 0:
                self._file.seek(self._file.tell() - 1)
                if self._file.read(1) != "\n":  # a torn last line: this run's first starts on a line of its own
                    logger.warning("%s ends in a torn line (its driver was killed while writing it)", path)
                    self._file.write("\n")

    def emit(self, event: Event) -> Event:
        self.events.append(event)
        if self._file is not None and not self.fenced():
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
