"""ray-elastic: multi-slice JAX training that survives lost TPU slices, driven by one Ray controller."""

from ray_elastic.config import ElasticConfig, SliceSpec
from ray_elastic.controller import ElasticTrainer, FitResult
from ray_elastic.errors import ElasticRuntimeError
from ray_elastic.task import TrainTask

__all__ = ["ElasticConfig", "SliceSpec", "ElasticTrainer", "ElasticRuntimeError", "FitResult", "TrainTask"]
__version__ = "0.1.0"
