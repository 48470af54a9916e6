"""The run's event log: every chunk, failure, recovery phase and resize, with timestamps.

Kept in memory for the summary and, when a run directory is given, appended as
JSON lines to ``events.jsonl`` there.
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable, Optional


class EventLog:
    def __init__(self, run_dir: Optional[str] = None, listener: Optional[Callable[[dict], None]] = None):
        self.events: list[dict] = []
        self.listener = listener
        self._file = None
        if run_dir:
            os.makedirs(run_dir, exist_ok=True)
            self._file = open(os.path.join(run_dir, "events.jsonl"), "a", buffering=1)

    def emit(self, kind: str, **fields) -> dict:
        event = {"ts": time.time(), "kind": kind, **fields}
        self.events.append(event)
        if self._file is not None:
            self._file.write(json.dumps(event, default=str) + "\n")
        return event

    def of_kind(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["kind"] == kind]

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
