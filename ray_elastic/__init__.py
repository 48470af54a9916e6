"""ray-elastic: multi-slice JAX training that survives lost TPU slices, driven by one Ray controller.

The names below are imported on first use (PEP 562), not with the package: every slice and keeper
process imports ``ray_elastic`` to unpickle its actor class, and it needs none of the controller
(that import cost each new process ~0.1 CPU-s, paid again at every recovery).
"""

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "ElasticConfig": "ray_elastic.config",
    "FailureConfig": "ray_elastic.policy.failure",
    "SliceSpec": "ray_elastic.tpu",
    "AutoInterval": "ray_elastic.policy.snapshots",
    "EveryNSteps": "ray_elastic.policy.snapshots",
    "SnapshotPolicy": "ray_elastic.policy.snapshots",
    "ElasticTrainer": "ray_elastic.trainer",
    "FitResult": "ray_elastic.observe.results",
    "RecoveryRecord": "ray_elastic.observe.results",
    "TrainTask": "ray_elastic.task",
    "ElasticRuntimeError": "ray_elastic.errors",
    "TrainingCodeError": "ray_elastic.errors",
    "RetriesExhaustedError": "ray_elastic.errors",
    "CapacityTimeoutError": "ray_elastic.errors",
    "StateLostError": "ray_elastic.errors",
    "StorageFailingError": "ray_elastic.errors",
}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from ray_elastic.config import ElasticConfig
    from ray_elastic.errors import (
        CapacityTimeoutError,
        ElasticRuntimeError,
        RetriesExhaustedError,
        StateLostError,
        StorageFailingError,
        TrainingCodeError,
    )
    from ray_elastic.observe.results import FitResult, RecoveryRecord
    from ray_elastic.policy.failure import FailureConfig
    from ray_elastic.policy.snapshots import AutoInterval, EveryNSteps, SnapshotPolicy
    from ray_elastic.task import TrainTask
    from ray_elastic.tpu import SliceSpec
    from ray_elastic.trainer import ElasticTrainer


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ray_elastic' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))
