"""Errors shared by the controller and the slice actors (no Ray, no JAX imports)."""


class ElasticRuntimeError(RuntimeError):
    """Training could not go on; the message says why and what was tried."""


class SliceDownError(RuntimeError):
    """Raised inside a slice actor when JAX reports a slice-down error.

    The actor classifies ``jax.errors.JaxRuntimeError`` with pathwaysutils'
    ``is_error_due_to_slice_down`` (DATA_LOSS, DEADLINE_EXCEEDED, NOT_FOUND,
    INTERNAL) and raises this instead, so the controller can tell a lost peer
    from a bug in user code without importing JAX.
    """
