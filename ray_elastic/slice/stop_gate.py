"""A stop at a step boundary that every process agrees to before any acts on it.

Chunks are queued ahead, so a stop asked for after they were sent (a grow-back, a warned slice, a
straggler) would otherwise wait for all of them. The controller proposes a step; a process
accepts only when it has not started that step, and then holds before it until the controller
decides: stop there (every process accepted) or go on (one had already started it: stopping the
others there would leave that one waiting in the step's collectives forever). So no process stops
before a step that another runs.
"""

from __future__ import annotations

import threading
import time

HOLD_LIMIT_S = 60.0  # a decision that never comes (the driver lost): go on, as if refused


class StopGate:
    """The step loop asks :meth:`stops_before` before each step; the health thread answers
    :meth:`propose` and :meth:`decide` (both never wait)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._started = -1  # the newest step this process has passed the gate for
        self._proposed: int | None = None
        self._stop_at: int | None = None

    def propose(self, step: int) -> dict:
        """Accept a stop before ``step`` unless it was started; until decided, hold before it."""
        with self._cv:
            accepted = self._started < step and self._stop_at is None
            self._proposed = step if accepted else None
            self._cv.notify_all()
            return {"accepted": accepted, "started": self._started}

    def decide(self, stop: bool) -> None:
        """Every process accepted (stop at the proposed step), or one refused (go on)."""
        with self._cv:
            if stop and self._proposed is not None:
                self._stop_at = self._proposed
            self._proposed = None
            self._cv.notify_all()

    def stops_before(self, step: int) -> bool:
        """True when the world stops before ``step``; otherwise the process may start it. Holds
        while a stop before it is proposed and not yet decided."""
        deadline = time.monotonic() + HOLD_LIMIT_S
        with self._cv:
            while self._proposed is not None and step >= self._proposed:
                if not self._cv.wait(max(0.0, deadline - time.monotonic())):
                    self._proposed = None  # no decision: go on
            if self._stop_at is not None and step >= self._stop_at:
                return True
            self._started = max(self._started, step)
            return False
