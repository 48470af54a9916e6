"""Multi-host slices: one actor per slice host, hosts ordered by TPU worker id."""

import numpy as np
from conftest import reference_losses
from faults import FaultPlan, ensure_slices, in_thread, kill_process_of_slice, max_rel_err, slice_name

from ray_elastic import ElasticConfig, ElasticTrainer, FailureConfig
from ray_elastic.examples.digits_mlp import DigitsMLPTask

SIM_CLUSTER = {"num_slices": 2, "hosts_per_slice": 2}


def test_two_slices_of_two_hosts(sim_cluster):
    spec = sim_cluster.slice_spec
    assert (spec.topology, spec.pod_type, spec.num_hosts) == ("2x2x2", "v4-16", 2)
    # fsdp_min_size=1024: the MLP's 64x64 weights are sharded over the 4 devices of a slice.
    # No standbys: nothing fails here, and each would be one more process starting on the two cores.
    cfg = ElasticConfig(
        num_slices=2,
        global_batch_size=32,
        slice=spec,
        steps_per_chunk=10,
        seed=1,
        fsdp_min_size=1024,
        standby_workers=0,
    )
    trainer = ElasticTrainer(DigitsMLPTask(), cfg, progress=False)
    result = trainer.fit(30)

    ref = reference_losses(DigitsMLPTask(), global_batch_size=32, seed=1, num_steps=30)
    rel = np.abs(np.array(result.losses) - ref) / np.abs(ref)
    assert rel.max() <= 1e-4, rel.max()

    assert result.summary["mesh"] == {"replica": 2, "fsdp": 4, "tensor": 1}
    infos = trainer.world.host_infos  # process-id order
    assert len(infos) == 4
    slices = {s.name: s.node_ids for s in sim_cluster.alive_slices()}
    for pid, info in enumerate(infos):
        _slice_index, host = divmod(pid, 2)
        assert info["tpu_worker_id"] == str(host)
        assert info["node_id"] == slices[info["slice_name"]][host]
    assert infos[0]["slice_name"] == infos[1]["slice_name"] != infos[2]["slice_name"] == infos[3]["slice_name"]
    assert all(j["sharded_params"] > 0 for j in trainer.world.join_infos)
    assert [j["row_range"] for j in trainer.world.join_infos] == [(0, 8), (8, 16), (16, 24), (24, 32)]


def _two_host_run(sim_cluster, faults: dict, max_rewound: int = 0, cfg_kw=None, **trainer_kw):
    ensure_slices(sim_cluster, 2)
    # No warm standbys: a recovery here starts its four processes cold, and each fit starts four fewer
    # (the warm 2-host paths are the autoscaler test's and the recovery bench's).
    cfg = ElasticConfig(
        num_slices=2,
        global_batch_size=32,
        slice=sim_cluster.slice_spec,
        steps_per_chunk=10,
        seed=1,
        standby_workers=0,
        failure=FailureConfig(hang_timeout_min_s=3.0),
        replacement_timeout_s=60.0,
        snapshot_every=1,
        **(cfg_kw or {}),
    )
    plan = FaultPlan(faults)
    trainer = ElasticTrainer(DigitsMLPTask(), cfg, progress=False, on_step=plan.on_step, **trainer_kw)
    plan.trainer = trainer
    result = trainer.fit(30)
    assert not plan.faults and result.steps == list(range(30)) and result.summary["steps_rewound"] <= max_rewound
    ref = reference_losses(DigitsMLPTask(), global_batch_size=32, seed=1, num_steps=30)
    assert max_rel_err(result.losses, ref) <= 1e-4
    return trainer, result


def test_a_slice_that_lost_one_host_while_training_is_lost(sim_cluster):
    victim = {}

    def kill_one_host(t):
        victim["name"] = slice_name(t, 1)
        in_thread(sim_cluster.kill_host, victim["name"], 1)  # host 0 of that slice lives on

    trainer, result = _two_host_run(sim_cluster, {15: kill_one_host})
    (failure,) = [e for e in result.events if e["kind"] == "failure"]
    assert failure["lost_slices"] == [victim["name"]], failure
    # Seen by its process's liveness connection closing (with the lost host's raylet already
    # refusing connections: node_died; or just before it: process_died, and then no raylet vouched
    # for the host), or by the raylet refusing once the steps stalled; not when Ray's health checks
    # got round to marking the node dead (no call of ours fails before that, and the survivors wait
    # in their collective). A survivor's process may die in the aftermath (its collective with the
    # lost host broken): collateral, its slice stays.
    kinds = {k: v.value for k, v in failure["kinds"].items()}
    assert kinds.pop(victim["name"]) in ("node_died", "process_died"), failure
    assert set(kinds.values()) <= {"process_died"}, failure
    assert "refuses connections" in failure["error"] or "liveness connection" in failure["error"], failure
    assert victim["name"] not in failure["vouched_slices"], failure
    assert trainer.worlds[-1].slices == [slice_name(trainer, 0)] and result.summary["mesh"] == {
        "replica": 1,
        "fsdp": 4,
        "tensor": 1,
    }


def test_a_slice_that_lost_one_host_is_replaced_by_a_new_slice(sim_cluster):
    """Pause-and-resume: the lost slice's head host lives on, yet the replacement is a new
    slice, provisioned for the pending claim of a head host (the first step of a multi-host
    reservation, which has no ``TPU`` bundle of its own)."""
    victim = {}

    def kill_one_host(t):
        victim["name"], victim["survivor"] = slice_name(t, 0), slice_name(t, 1)
        in_thread(sim_cluster.kill_host, victim["name"], 1)

    prov = sim_cluster.provisioner(delay_s=1.0)
    try:
        trainer, result = _two_host_run(sim_cluster, {15: kill_one_host}, cfg_kw={"mode": "pause-and-resume"})
    finally:
        prov.stop()
    assert len(prov.added) == 1 and len(result.recoveries) == 1, (prov.added, result.recoveries)
    assert sorted(trainer.worlds[-1].slices) == sorted([victim["survivor"], prov.added[0]])
    assert result.summary["mesh"] == {"replica": 2, "fsdp": 4, "tensor": 1}
    sim_cluster.reap_dead_slices()


def test_a_slice_that_loses_one_host_while_a_world_forms_is_lost(sim_cluster):
    victim = {}

    def before_world():
        if trainer_box and len(trainer_box[0].worlds) == 1:  # forming the world after the crash
            victim["name"] = trainer_box[0].worlds[0].slices[1]
            sim_cluster.kill_host(victim["name"], 1)

    trainer_box = []
    faults = {15: lambda t: (trainer_box.append(t), kill_process_of_slice(t, 0))}
    # Slice 0's newest snapshot may lack the step its killed process was in; slice 1 had it, and is
    # lost before anything loads from it: at most that one step is run again.
    trainer, result = _two_host_run(sim_cluster, faults, max_rewound=1, pre_callback=before_world)
    lost = [s for e in result.events if e["kind"] == "failure" for s in e["lost_slices"]]
    assert lost == [victim["name"]], [e for e in result.events if e["kind"] == "failure"]
    assert victim["name"] not in trainer.worlds[-1].slices and len(trainer.worlds[-1].slices) == 1


def test_a_reservation_claims_only_a_whole_idle_slice(sim_cluster):
    """A slice that lost a host keeps a free head host (its survivors stay up), and so does a slice
    in use (its head marker is given back once its hosts are held). Ray's two-step reservation
    would claim either and then wait forever for hosts it cannot have; ours waits for the slice
    that arrives."""
    import threading
    import time

    import ray

    from ray_elastic.ray_backend.placement import SliceReservation

    ensure_slices(sim_cluster, 2)
    spec = sim_cluster.slice_spec
    busy = SliceReservation(spec, head_timeout_s=60)
    new, res = {}, None
    try:
        assert busy.wait(60)
        broken = next(s for s in sim_cluster.alive_slices() if s.name != busy.pinned_slice)
        sim_cluster.kill_host(broken.name, 1)  # its head host (worker 0) lives on
        deadline = time.monotonic() + 60
        while broken.node_ids[1] in {n["NodeID"] for n in ray.nodes() if n["Alive"]} and time.monotonic() < deadline:
            time.sleep(0.2)
        adder = threading.Timer(3.0, lambda: new.update(name=sim_cluster.add_slice().name))
        adder.start()
        res = SliceReservation(spec, head_timeout_s=120)  # blocks until a whole, idle slice's head is claimed
        adder.join(60)  # (the claim may win the slice before add_slice has returned its name)
        assert res.pinned_slice == new["name"], (res.pinned_slice, new, broken.name, busy.pinned_slice)
        assert res.wait(60)
    finally:
        for r in (busy, res):
            if r is not None:
                r.release()
        sim_cluster.reap_dead_slices()
