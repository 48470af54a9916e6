"""Heavy work a slice process runs beside its steps, on threads: compiling the step of the next
smaller world ahead (seconds of tracing and compiling; the small programs warmed as a world
forms take milliseconds and are not counted).

While such work runs, the process's own steps get less of the CPU and the GIL (tracing is
Python), so it falls behind the others for a while: the driver's straggler windows and stuck
probe must not blame its slice for that. :func:`activity` goes into every health-probe answer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

_lock = threading.Lock()
_started = 0  # jobs started in this process so far
_running = 0  # ... and not finished yet


def run_in_background(target: Callable[..., Any], name: str, *args: Any) -> None:
    """Run ``target(*args)`` on a daemon thread, counted in :func:`activity` until it returns."""
    global _started, _running

    def run() -> None:
        global _running
        try:
            target(*args)
        finally:
            with _lock:
                _running -= 1

    with _lock:
        _started, _running = _started + 1, _running + 1
    threading.Thread(target=run, name=name, daemon=True).start()


def activity() -> tuple[int, int]:
    """(jobs started so far, jobs running now): a change in the first between two probes, or a
    second above 0, says the process worked beside its steps meanwhile."""
    with _lock:
        return _started, _running
