"""The per-run secret that a takeover of the run's snapshot keepers requires.

Kept where the run's owner keeps its outputs (the run directory, else the checkpoint directory;
a local path or ``gs://``), readable by whoever may rerun the run and by no other job of a
shared Ray cluster: a keeper's name can be listed by anyone, its snapshots taken over only with this.
"""

from __future__ import annotations

import os
import secrets

FILE = ".ray-elastic-secret"


def run_secret(directory: str | None) -> str | None:
    """The secret kept in ``directory`` (created there, owner-readable only, on the first run);
    None without a directory."""
    if not directory:
        return None
    from etils import epath

    path = epath.Path(directory) / FILE
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    value = secrets.token_hex(16)
    if str(path).startswith("gs://"):
        path.write_text(value)
    else:
        try:
            fd = os.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # a concurrent first run wrote it first
            return path.read_text().strip()
        with os.fdopen(fd, "w") as f:
            f.write(value)
    return path.read_text().strip()  # on GCS a concurrent first run may have written last: the one stored
