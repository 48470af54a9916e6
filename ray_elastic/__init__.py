"""ray-elastic: multi-slice JAX training that survives lost TPU slices, driven by one Ray controller."""

from ray_elastic.config import ElasticConfig, SliceSpec
from ray_elastic.controller import ElasticTrainer
from ray_elastic.errors import (CapacityTimeoutError, ElasticRuntimeError, RetriesExhaustedError, StateLostError,
                                TrainingCodeError)
from ray_elastic.results import FitResult, RecoveryRecord
from ray_elastic.task import TrainTask

__all__ = ["ElasticConfig", "SliceSpec", "ElasticTrainer", "FitResult", "RecoveryRecord", "TrainTask",
           "ElasticRuntimeError", "TrainingCodeError", "RetriesExhaustedError", "CapacityTimeoutError",
           "StateLostError"]
__version__ = "0.1.0"
