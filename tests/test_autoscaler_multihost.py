"""A multi-host slice replaced as a whole by Ray's autoscaler, under the lost slice's name.

Multi-host slices come from a pool of pre-named slices (the autoscaler matches the slice-name label
that Ray's two-step slice reservation pins hosts to only against node types' static labels). The
pool here has exactly as many names as the run needs, so the replacement must reuse the lost one's.
"""

import time

from conftest import reference_losses
from faults import FaultPlan, in_thread, max_rel_err, slice_name

from ray_elastic import ElasticConfig, ElasticTrainer, FailureConfig
from ray_elastic.examples.digits_mlp import DigitsMLPTask
from ray_elastic.observe.results import unexplained_rewinds

SIM_CLUSTER = {"num_slices": 2, "hosts_per_slice": 2, "autoscaler": True, "pool_slices": 2}
STEPS = 30


def test_a_slice_that_lost_one_host_is_replaced_whole_under_its_name(sim_cluster):
    victim = {}

    def kill_one_host(t):
        victim["name"], victim["t"] = slice_name(t, 0), time.time()
        victim["nodes"] = sim_cluster.slice_by_name(victim["name"]).node_ids
        in_thread(sim_cluster.kill_host, victim["name"], 1)

    cfg = ElasticConfig(
        num_slices=2,
        global_batch_size=32,
        slice=sim_cluster.slice_spec,
        steps_per_chunk=10,
        seed=1,
        standby_workers=1,
        failure=FailureConfig(hang_timeout_min_s=3.0),
        replacement_timeout_s=90.0,
        snapshot_every=1,
        mode="pause-and-resume",
    )
    plan = FaultPlan({15: kill_one_host})
    trainer = ElasticTrainer(DigitsMLPTask(), cfg, progress=False, on_step=plan.on_step)
    plan.trainer = trainer
    result = trainer.fit(STEPS)
    # Nothing rewound that a survivor held: a host killed inside a step's all-reduce can leave that
    # step finished nowhere (its collective failed on every survivor), and then it runs again.
    assert result.steps == list(range(STEPS)) and unexplained_rewinds(result.events, cfg.snapshot_replicas) == 0
    assert result.summary["steps_rewound"] <= 1, result.summary
    ref = reference_losses(DigitsMLPTask(), global_batch_size=32, seed=1, num_steps=STEPS)
    assert max_rel_err(result.losses, ref) <= 1e-4

    events = [e for e in sim_cluster.autoscaler_events() if e["t"] >= victim["t"]]
    # The slice went as a whole: the dead host's instance and its live sibling were terminated ...
    gone = {e["instance"] for e in events if e["event"] == "terminate"}
    assert set(victim["nodes"]) <= gone, (victim, events)
    # ... and came back as a whole, under the same name, on new nodes.
    made = [e for e in events if e["event"] == "create"]
    assert sorted(e["worker"] for e in made) == [0, 1] and {e["slice"] for e in made} == {victim["name"]}
    assert result.summary["mesh"] == {"replica": 2, "fsdp": 4, "tensor": 1}
    assert victim["name"] in trainer.worlds[-1].slices
    new = sim_cluster.slice_by_name(victim["name"])
    assert new.alive and not set(new.node_ids) & set(victim["nodes"])
    # Hosts in process order are ordered by TPU worker id within each slice.
    infos = trainer.world.host_infos
    by_slice = {s.name: s.node_ids for s in sim_cluster.alive_slices()}
    for pid, info in enumerate(infos):
        assert info["tpu_worker_id"] == str(pid % 2)
        assert info["node_id"] == by_slice[info["slice_name"]][pid % 2]
    print(
        f"one host killed -> whole slice back: {max(e['t'] for e in made) - victim['t']:.2f}s; "
        f"recovery {result.recoveries[0].recovery_s:.2f}s"
    )
