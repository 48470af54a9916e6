"""Slices launched and replaced by Ray's own autoscaler (v2), not by a thread of ours.

The module's cluster starts its head with the v2 monitor and ``ray_elastic.sim.node_provider``: its
slices, and every replacement, are launched by the real reconciler for pending demand, and a dead
host's instance is retired by it. The provider's event file is the witness of what it did.
"""

import threading
import time

import pytest
import ray
from faults import FaultPlan, ensure_slices, in_thread, max_rel_err, slice_name

from ray_elastic import ElasticConfig, ElasticTrainer, FailureConfig
from ray_elastic.examples.digits_mlp import DigitsMLPTask
from ray_elastic.ray_backend.placement import reserve_slices

# Capacity for the three slices the runs need: a reservation made right after another run released
# its slices can look unsatisfiable to the autoscaler (its resource view lags), which would launch
# spare slices that a replacement then lands on (seen once in a few runs).
CAPACITY = 3
SIM_CLUSTER = {"num_slices": 2, "autoscaler": True, "max_slices": CAPACITY}
STEPS = 40
# After capacity returns: a launch round, the slice's start, then the newcomer's process starting
# beside the training (5-12 s on 2 busy cores) before the grow; 240 steps (~20 s) ended first once.
GROW_STEPS = 600
SAME_SHAPE, RESIZED = 1e-6, 1e-4


def config(cluster, **kw) -> ElasticConfig:
    base = dict(
        num_slices=3,
        global_batch_size=48,
        slice=cluster.slice_spec,
        steps_per_chunk=10,
        seed=0,
        failure=FailureConfig(hang_timeout_min_s=3.0),
        slice_timeout_s=60.0,
        replacement_timeout_s=90.0,
        standby_workers=1,
        snapshot_every=1,
    )
    return ElasticConfig(**{**base, **kw})


def creates(cluster, since: float = 0.0, at_least: int = 0) -> list[dict]:
    """The provider's node starts since ``since``; waits a little for ``at_least`` of them (a node's
    record is written just after it registers, so a placement on it may be seen first)."""
    deadline = time.monotonic() + 10
    while True:
        made = [e for e in cluster.autoscaler_events() if e["event"] == "create" and e["t"] >= since]
        if len(made) >= at_least or time.monotonic() > deadline:
            return made
        time.sleep(0.1)


@pytest.fixture(scope="module")
def baseline(sim_cluster):
    ensure_slices(sim_cluster, 3)
    return ElasticTrainer(DigitsMLPTask(), config(sim_cluster, standby_workers=0), progress=False).fit(STEPS).losses


def test_the_initial_slices_came_from_the_autoscaler(sim_cluster):
    """Nothing started a slice node but the autoscaler: one create per slice, each node carrying the
    TPU resources, labels and the instance id the autoscaler maps it by."""
    made = creates(sim_cluster, at_least=2)
    assert len(made) >= 2
    nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
    for e in made[:2]:
        node = nodes[e["node_id"]]
        assert node["Labels"]["ray.io/tpu-slice-name"] == e["slice"]
        assert node["Labels"]["ray.io/tpu-pod-type"] == "v4-8"
        assert node["Resources"]["TPU"] == 4 and node["Resources"]["TPU-v4-8-head"] == 1


def test_a_pending_slice_reservation_makes_the_autoscaler_launch_a_slice(sim_cluster):
    """Every slice is reserved; one more reservation is pending demand, and the autoscaler launches
    a slice for it."""
    ensure_slices(sim_cluster, 2)
    t0 = time.time()
    reservations = reserve_slices(sim_cluster.slice_spec, 3, timeout_s=60)
    try:
        (made,) = creates(sim_cluster, since=t0, at_least=1)
        names = {ray.util.placement_group_table(r.placement_group)["bundles_to_node_id"][0] for r in reservations}
        assert made["node_id"] in names
        print(f"pending slice reservation -> slice node up: {made['t'] - t0:.2f}s")
    finally:
        for r in reservations:
            r.release()


def test_a_lost_slice_is_replaced_by_the_autoscaler(sim_cluster, baseline):
    """Pause-and-resume: the controller's replacement reservation is the demand; the autoscaler retires
    the dead instance and launches the slice the run finishes on, with the failure-free losses."""
    ensure_slices(sim_cluster, 3)
    victim = {}

    def kill(t):
        victim["name"], victim["t"] = slice_name(t, 1), time.time()
        victim["instance"] = sim_cluster.slice_by_name(victim["name"]).hosts[0].instance_id
        in_thread(sim_cluster.kill_slice, victim["name"])

    plan = FaultPlan({20: kill})
    trainer = ElasticTrainer(
        DigitsMLPTask(), config(sim_cluster, mode="pause-and-resume"), progress=False, on_step=plan.on_step
    )
    plan.trainer = trainer
    result = trainer.fit(STEPS)
    assert result.steps == list(range(STEPS)) and result.summary["steps_rewound"] == 0
    (rec,) = result.recoveries
    assert rec.added_slices == 1 and result.summary["mesh"] == {"replica": 3, "fsdp": 2, "tensor": 1}
    events = sim_cluster.autoscaler_events()
    assert any(e["event"] == "terminate" and e["instance"] == victim["instance"] for e in events)
    new = creates(sim_cluster, since=victim["t"], at_least=1)
    assert len(new) == 1, (sim_cluster.autoscaler_events(), victim)
    (new,) = new
    assert new["slice"] in trainer.worlds[-1].slices and victim["name"] not in trainer.worlds[-1].slices
    assert max_rel_err(result.losses, baseline) <= SAME_SHAPE
    print(f"kill -> replacement node up: {new['t'] - victim['t']:.2f}s; recovery {rec.recovery_s:.2f}s")


def test_stock_out_resizes_then_the_world_grows_back_when_capacity_returns(sim_cluster, baseline):
    """Replica-resize: no capacity for a replacement (launches fail like a zone without TPUs), so the run
    goes on with two slices while its demand shows in the autoscaler's status; capacity returns and
    the world grows back at a step boundary."""
    from ray.autoscaler.v2.sdk import get_cluster_status

    ensure_slices(sim_cluster, 3)
    sim_cluster.set_capacity(2)
    seen = {}

    def kill(t):
        seen["t"] = time.time()
        in_thread(sim_cluster.kill_slice, slice_name(t, 2))

    def look_then_give_capacity(t):
        status = get_cluster_status(sim_cluster.address)
        seen["demand"] = [d for d in status.resource_demands.placement_group_demand]
        seen["stock_outs"] = [
            e for e in sim_cluster.autoscaler_events() if e["event"] == "stock_out" and e["t"] >= seen["t"]
        ]
        seen["slices_then"] = len(t.world.plan.slice_names)
        sim_cluster.set_capacity(CAPACITY)

    def at_30(t):  # a step past the shrink: keep looking until the replacement's demand was refused
        threading.Thread(
            target=lambda: (_wait_for_stock_out(sim_cluster, seen), look_then_give_capacity(t)), daemon=True
        ).start()

    plan = FaultPlan({15: kill, 30: at_30}, grow_by=31)
    trainer = ElasticTrainer(
        DigitsMLPTask(),
        config(sim_cluster, min_slices=2, replacement_timeout_s=120.0),
        progress=False,
        on_step=plan.on_step,
    )
    plan.trainer = trainer
    try:
        result = trainer.fit(GROW_STEPS)
    finally:
        sim_cluster.set_capacity(CAPACITY)
    assert result.steps == list(range(GROW_STEPS)) and result.summary["steps_rewound"] == 0
    assert seen["slices_then"] == 2 and seen["stock_outs"], seen
    assert seen["demand"], "the replacement's pending reservation is the demand the autoscaler reports"
    assert [w.mesh["replica"] for w in trainer.worlds][-1] == 3
    ups = [e for e in result.events if e["kind"] == "scale_up"]
    assert len(ups) == 1 and ups[0]["steps_rewound"] == 0
    assert max_rel_err(result.losses[:STEPS], baseline) <= RESIZED


def _wait_for_stock_out(cluster, seen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(e["event"] == "stock_out" and e["t"] >= seen["t"] for e in cluster.autoscaler_events()):
            return
        time.sleep(0.2)


def test_waiting_for_slices_says_what_is_missing(sim_cluster, capsys, caplog):
    """A run asking for more slices than there are says so every few seconds, in the progress line and
    the log, with the pending demand the autoscaler sees; it trains once capacity arrives."""
    import logging

    ensure_slices(sim_cluster, 2)
    sim_cluster.set_capacity(2)
    threading.Timer(7.0, sim_cluster.set_capacity, args=(CAPACITY,)).start()
    caplog.set_level(logging.WARNING, logger="ray_elastic")
    try:
        result = ElasticTrainer(DigitsMLPTask(), config(sim_cluster, standby_workers=0), progress=True).fit(10)
    finally:
        sim_cluster.set_capacity(CAPACITY)
    assert result.steps == list(range(10))
    waits = [e for e in result.events if e["kind"] == "waiting"]
    assert waits and waits[0]["ready"] == 2 and waits[0]["asked"] == 3 and waits[0]["state"] == "scheduling"
    assert "TPU" in waits[0]["demand"], waits[0]
    assert "reserving slices: 2/3 ready" in caplog.text and "pending slice demand" in caplog.text
    assert "slices ready 2/3" in capsys.readouterr().err


def test_a_hung_slice_is_declared_dead_and_its_instance_retired(sim_cluster):
    """SIGSTOP reaches an autoscaled host by the PIDs its provider recorded; GCS then declares the
    node dead and the autoscaler terminates the instance (its processes are gone)."""
    import psutil

    ensure_slices(sim_cluster, 3)
    victim = sim_cluster.alive_slices()[-1]
    raylet = next(p for p in victim.hosts[0].processes() if p.name() == "raylet")  # a recorded process
    sim_cluster.hang_slice(victim.name)
    deadline = time.monotonic() + 5
    while raylet.status() != psutil.STATUS_STOPPED:  # a group stop waits for every thread
        assert time.monotonic() < deadline, raylet.status()
        time.sleep(0.05)
    deadline = time.monotonic() + 60
    instance = victim.hosts[0].instance_id
    while not any(e["event"] == "terminate" and e["instance"] == instance for e in sim_cluster.autoscaler_events()):
        assert time.monotonic() < deadline, "the hung slice's instance was never terminated"
        time.sleep(0.2)
    while any(_status(p) not in (psutil.STATUS_ZOMBIE, None) for h in victim.hosts for p in h.processes()):
        assert time.monotonic() < deadline, [_status(p) for h in victim.hosts for p in h.processes()]
        time.sleep(0.2)
    assert victim.name not in {s.name for s in sim_cluster.alive_slices()}


def _status(p):
    """A process's status; None once it is gone."""
    import psutil

    try:
        return p.status()
    except psutil.NoSuchProcess:
        return None
