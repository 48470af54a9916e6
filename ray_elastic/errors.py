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


class FormingError(RuntimeError):
    """A world failed to form because of these slices' processes (``cause``: what they raised)."""

    def __init__(self, slices: list[str], cause: BaseException):
        super().__init__(f"forming a world failed on slice(s) {', '.join(slices)}: {cause}")
        self.slices = list(slices)
        self.cause = cause


class SliceDownError(RuntimeError):
    """Raised inside a slice actor when JAX reports a slice-down error.

    The actor classifies ``jax.errors.JaxRuntimeError`` with pathwaysutils'
    ``is_error_due_to_slice_down`` (DATA_LOSS, DEADLINE_EXCEEDED, NOT_FOUND,
    INTERNAL) and raises this instead, so the controller can tell a lost peer
    from a bug in user code without importing JAX.
    """
