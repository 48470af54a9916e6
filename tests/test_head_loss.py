"""The head's GCS killed and started again (GCS fault tolerance: its tables in a private Redis, the
Debian ``redis-server``): training goes on through the outage, and a driver lost with it is
resumed from its keepers (``bench/head_loss.py`` measures both)."""

import shutil
import threading
import time

import pytest
import ray

from ray_elastic import ElasticConfig, ElasticTrainer
from ray_elastic.examples.digits_mlp import DigitsMLPTask

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server (apt-get)")
SIM_CLUSTER = {"num_slices": 2, "gcs_fault_tolerance": True}


def test_training_goes_on_while_the_gcs_is_restarted(sim_cluster):
    """Steps are actor calls between processes that are already there: with the GCS down for 3 s
    the world keeps training, nothing is taken for a failure, and the run ends normally."""
    cfg = ElasticConfig(
        num_slices=2, global_batch_size=48, slice=sim_cluster.slice_spec, steps_per_chunk=5, standby_workers=0
    )
    arrivals, outage = [], {}
    restart = threading.Thread(target=lambda: outage.update(zip(("down", "up"), sim_cluster.restart_gcs(3.0))))

    def on_step(m):
        arrivals.append(time.time())
        if m["step"] == 30:
            restart.start()

    result = ElasticTrainer(DigitsMLPTask(), cfg, progress=False, on_step=on_step).fit(150)
    restart.join()
    assert result.steps == list(range(150)) and result.summary["failures"] == 0
    assert sum(outage["down"] <= t <= outage["up"] for t in arrivals) > 0  # steps while the GCS was down
    assert all(n["Alive"] for n in ray.nodes()) and len(ray.nodes()) == 3  # the head and the two hosts
