"""What a slice process sets up about itself, and how its errors are told apart: the world's
fault (a peer died mid-collective: the controller recovers) or the task's (a bug: it stops)."""

from __future__ import annotations

import contextlib
import logging
import os

from ray_elastic.errors import SliceDownError

logger = logging.getLogger(__name__)


def set_niceness(niceness: int | None) -> None:
    """Give every thread of this process ``niceness`` (``ElasticConfig.worker_niceness``; None: leave
    Ray's ``RAY_worker_niceness``, 15 by default). On Linux niceness is per thread, and threads
    started later inherit their creator's. Lowering it needs root or CAP_SYS_NICE."""
    if niceness is None or not os.path.isdir("/proc/self/task"):
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), niceness)
        except OSError as e:
            logger.warning("could not set niceness %d: %r", niceness, e)
            return


@contextlib.contextmanager
def world_errors(what: str, everything: bool = False):
    """Raise what fails here as :class:`SliceDownError` when it is the world's fault, not the task's:
    JAX's slice-down errors (a peer died mid-collective) always; any error with ``everything``
    (steps that run no task code). The controller then recovers instead of calling it a bug."""
    import jax

    try:
        yield
    except SliceDownError:
        raise
    except jax.errors.JaxRuntimeError as e:
        from pathwaysutils.elastic.elastic import is_error_due_to_slice_down

        if everything or is_error_due_to_slice_down(e, log_traceback=False):
            raise SliceDownError(f"{what}: {e}") from e
        raise
    except Exception as e:
        if everything:
            raise SliceDownError(f"{what}: {e!r}") from e
        raise
