"""Errors a caller can catch, shared by the controller and the slice actors (no Ray, no JAX imports).

Every error that ends a run is an :class:`ElasticRuntimeError`; the subclasses say
why, so a caller (a notebook cell, a job script, an outer retry loop) can decide
what to do without parsing the message.
"""


class ElasticRuntimeError(RuntimeError):
    """Training could not go on; the message says why and what was tried."""


class TrainingCodeError(ElasticRuntimeError):
    """The task's own code (model, loss, data, optimizer) raised: a bug, not a lost slice. Not retried."""


class RetriesExhaustedError(ElasticRuntimeError):
    """Recovery was given up: too many failures in the window, or the ``retry_policy`` declined."""


class CapacityTimeoutError(ElasticRuntimeError):
    """Not enough slices came back in ``replacement_timeout_s`` to form a world the config allows."""


class SupersededError(ElasticRuntimeError):
    """Another driver took this run over (a rerun while this one still lived): this one stopped."""


class StateLostError(ElasticRuntimeError):
    """Every slice holding a snapshot was lost and no checkpoint exists: going on would silently
    restart training from step 0. Raised unless ``allow_restart_from_scratch=True``."""


class FormingError(RuntimeError):
    """A world failed to form because of these slices' processes (``cause``: what they raised)."""

    def __init__(self, slices: list[str], cause: BaseException):
        super().__init__(f"forming a world failed on slice(s) {', '.join(slices)}: {cause}")
        self.slices = list(slices)
        self.cause = cause


class HostLost(RuntimeError):
    """A host of a slice lost its node while a world formed (seen from its placement group)."""


class RayletGone(HostLost):
    """A host's raylet refuses connections: its Ray node is dead, though Ray's health checks may
    not have said so yet (they decide on the same refusal, a few checks later)."""


class ProcessGone(RuntimeError):
    """A slice process's liveness connection closed: the process is dead (its host may be too;
    the node check decides). See :mod:`ray_elastic.detect.liveness`."""


class StuckProcess(TimeoutError):
    """A process alive and answering that never reached the step the rest of its world waits in (its
    data source blocked, say): the watchdog names it, and only its slice is blamed."""


class ProcessFailed(RuntimeError):
    """A call on every process of a world failed on process ``process`` (``cause``: what it raised)."""

    def __init__(self, process: int, cause: BaseException):
        super().__init__(f"process {process} failed: {cause}")
        self.process = process
        self.cause = cause


class SliceDownError(RuntimeError):
    """Raised inside a slice actor when the world failed, not the task's code.

    The actor classifies ``jax.errors.JaxRuntimeError`` with pathwaysutils'
    ``is_error_due_to_slice_down`` (DATA_LOSS, DEADLINE_EXCEEDED, NOT_FOUND,
    INTERNAL) and raises this instead, so the controller can tell a lost peer
    from a bug in user code without importing JAX. Errors of the steps of forming
    a world that run no task code (``jax.distributed.initialize``, fetching a
    snapshot from its donor) are raised as this too, whatever they are.
    """


class StorageError(SliceDownError):
    """Reading or writing a checkpoint failed in storage (a GCS 503, a timeout, a lost disk, a
    damaged step): recoverable by another world, never the task's fault. ``checkpoint_step``: the
    step that could not be read, when it was a restore."""

    def __init__(self, message: str, checkpoint_step: int | None = None):
        super().__init__(message)
        self.checkpoint_step = checkpoint_step

    def __reduce__(self):  # keep checkpoint_step across Ray's pickling
        return (type(self), (str(self), self.checkpoint_step))


class SaveTimedOut(StorageError):
    """A checkpoint save or commit kept its process busy longer than ``save_timeout_s`` (a hung
    write, a bucket that never answers): the world is recovered as after a failed save."""


class StorageFailingError(RetriesExhaustedError):
    """Checkpoint saves kept failing (``max_save_failures_in_a_row`` in a row, none committed in
    between): the storage, not a slice, is the problem. The message names the location and error."""


def storage_error(exc: BaseException | None) -> StorageError | None:
    """The :class:`StorageError` ``exc`` is or carries (looked for through the ``cause`` that
    FormingError, ProcessFailed and Ray's RayTaskError keep), else None."""
    while exc is not None:
        if isinstance(exc, StorageError):
            return exc
        exc = getattr(exc, "cause", None)
    return None


def unreadable_checkpoint(exc: BaseException | None) -> int | None:
    """The checkpoint step a world failed to restore, when that is what ``exc`` says."""
    found = storage_error(exc)
    return found.checkpoint_step if found is not None else None


def failed_save(exc: BaseException | None) -> bool:
    """``exc`` says a checkpoint save (not a restore) failed or timed out."""
    found = storage_error(exc)
    return found is not None and found.checkpoint_step is None
