"""Where a process's step loop is, read from its thread's stack: what a stuck process is named with.

A process the others wait for, alive and answering its health probe, is named stuck; the line
that says so also says where its step loop was (its innermost frame and the package's frames
around it), so a blocked data source, a snapshot copy or a compile is told apart without a debugger.
"""

from __future__ import annotations

import os
import sys
import threading

PACKAGE = os.sep + "ray_elastic" + os.sep


class StepThread:
    """The thread that runs the step loop, noted as each chunk starts (a Ray actor's method thread)."""

    def __init__(self) -> None:
        self.ident: int | None = None

    def enter(self) -> None:
        self.ident = threading.get_ident()

    def where(self, depth: int = 4) -> str | None:
        """Its innermost frame, then the package's frames outward, up to ``depth`` in all (None: not started)."""
        frame = sys._current_frames().get(self.ident) if self.ident is not None else None
        out: list[str] = []
        while frame is not None and len(out) < depth:
            code = frame.f_code
            if not out or PACKAGE in code.co_filename:
                out.append(f"{code.co_name} ({os.path.basename(code.co_filename)}:{frame.f_lineno})")
            frame = frame.f_back
        return " <- ".join(out) or None
