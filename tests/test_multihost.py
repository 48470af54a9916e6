"""Multi-host slices: one actor per slice host, hosts ordered by TPU worker id."""

import numpy as np

from ray_elastic import ElasticConfig, ElasticTrainer
from ray_elastic.examples.digits_mlp import DigitsMLPTask

from conftest import reference_losses

SIM_CLUSTER = {"num_slices": 2, "hosts_per_slice": 2}


def test_two_slices_of_two_hosts(sim_cluster):
    spec = sim_cluster.slice_spec
    assert (spec.topology, spec.pod_type, spec.num_hosts) == ("2x2x2", "v4-16", 2)
    # fsdp_min_size=1024: the MLP's 64x64 weights are sharded over the 4 devices of a slice.
    cfg = ElasticConfig(num_slices=2, global_batch_size=32, slice=spec, steps_per_chunk=10, seed=1, fsdp_min_size=1024)
    trainer = ElasticTrainer(DigitsMLPTask(), cfg, progress=False)
    result = trainer.fit(30)

    ref = reference_losses(DigitsMLPTask(), global_batch_size=32, seed=1, num_steps=30)
    rel = np.abs(np.array(result.losses) - ref) / np.abs(ref)
    assert rel.max() <= 1e-4, rel.max()

    assert result.summary["mesh"] == {"replica": 2, "fsdp": 4}
    infos = trainer.world.host_infos  # process-id order
    assert len(infos) == 4
    slices = {s.name: s.node_ids for s in sim_cluster.alive_slices()}
    for pid, info in enumerate(infos):
        slice_index, host = divmod(pid, 2)
        assert info["tpu_worker_id"] == str(host)
        assert info["node_id"] == slices[info["slice_name"]][host]
    assert infos[0]["slice_name"] == infos[1]["slice_name"] != infos[2]["slice_name"] == infos[3]["slice_name"]
    assert all(j["sharded_params"] > 0 for j in trainer.world.join_infos)
    assert [j["row_range"] for j in trainer.world.join_infos] == [(0, 8), (8, 16), (16, 24), (24, 32)]
