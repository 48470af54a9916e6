"""A simulated multi-slice TPU Ray cluster on one machine (real Ray nodes that pass for TPU
hosts), its autoscaler node provider, and a local GCS emulator for ``gs://`` paths."""


def __getattr__(name: str):  # ``from ray_elastic.sim import SimulatedTPUCluster``, imported on first use
    if name == "SimulatedTPUCluster":
        from ray_elastic.sim.cluster import SimulatedTPUCluster

        return SimulatedTPUCluster
    raise AttributeError(f"module 'ray_elastic.sim' has no attribute {name!r}")
