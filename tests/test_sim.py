"""The simulated TPU cluster: real Ray nodes with TPU conventions, and real faults."""

import ipaddress
import os
import time

import psutil
import pytest
import ray

from ray_elastic.ray_backend.placement import SliceReservation

SIM_CLUSTER = {"num_slices": 2}


@ray.remote(num_cpus=0)
class Probe:
    def env(self):
        return {k: os.environ.get(k) for k in ("TPU_NAME", "TPU_WORKER_ID", "XLA_FLAGS", "JAX_PLATFORMS")} | {
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
        }

    def sleep(self, s):
        time.sleep(s)
        return "done"


def _probe_on(sl):
    return Probe.options(
        scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(sl.node_ids[0], soft=False)
    ).remote()


def _gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _node(node_id):
    return next(n for n in ray.nodes() if n["NodeID"] == node_id)


def test_slice_hosts_carry_tpu_labels_resources_and_env(sim_cluster):
    sl = sim_cluster.alive_slices()[0]
    node = _node(sl.node_ids[0])
    labels = node["Labels"]
    assert labels["ray.io/tpu-slice-name"] == sl.name
    assert labels["ray.io/tpu-worker-id"] == "0"
    assert labels["ray.io/tpu-pod-type"] == "v4-8"
    assert labels["ray.io/tpu-topology"] == "2x2x1"
    assert labels["ray.io/accelerator-type"] == "TPU-V4"
    res = node["Resources"]
    assert res["TPU"] == 4 and res["TPU-v4-8-head"] == 1 and res["accelerator_type:TPU-V4"] == 1
    env = ray.get(_probe_on(sl).env.remote())
    assert env["TPU_NAME"] == sl.name and env["TPU_WORKER_ID"] == "0"
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
    assert env["node_id"] == sl.node_ids[0]
    # Ray's own TPU helpers recognise these hosts as one v4-8 slice each.
    assert ray.util.tpu.get_num_tpu_slices(topology="2x2x1", accelerator_type="v4") >= 2


def test_private_temp_dir(sim_cluster):
    assert os.environ["RAY_TMPDIR"] == sim_cluster.temp_dir
    assert os.path.exists(os.path.join(sim_cluster.temp_dir, "ray", "ray_current_cluster"))


def test_hang_and_resume_slice(sim_cluster):
    sl = sim_cluster.alive_slices()[0]
    probe = _probe_on(sl)
    ray.get(probe.env.remote())
    sim_cluster.hang_slice(sl.name)
    try:
        ref = probe.sleep.remote(0)
        ready, _ = ray.wait([ref], timeout=1.0)
        assert not ready, "a SIGSTOPped host must not answer"
    finally:
        sim_cluster.resume_slice(sl.name)
    assert ray.get(ref, timeout=30) == "done"
    ray.kill(probe)


def test_only_a_raylet_that_answers_vouches_for_its_host(sim_cluster):
    """A host vouches for a crashed process (no grace period spent on its node) only when its raylet
    answers a request: the port of a stopped, or killed and still exiting, raylet accepts
    connections all the same, which proves nothing."""
    import socket

    from ray_elastic.detect import health

    sl = sim_cluster.alive_slices()[0]
    address = health.raylet_addresses(sl.node_ids)[sl.node_ids[0]]
    assert health.raylets_answer(sl.node_ids)
    sim_cluster.hang_slice(sl.name)
    try:
        with socket.create_connection(address, timeout=1.0):
            pass  # the kernel still accepts
        t0 = time.monotonic()
        assert not health.raylets_answer(sl.node_ids)
        assert time.monotonic() - t0 < 2.0  # bounded by the answer timeout
    finally:
        sim_cluster.resume_slice(sl.name)
    assert health.raylets_answer(sl.node_ids)


def test_kill_slice_kills_its_processes_and_node(sim_cluster):
    sl = sim_cluster.alive_slices()[-1]
    probe = _probe_on(sl)
    pid = ray.get(probe.env.remote())["pid"]
    ref = probe.sleep.remote(60)
    t0 = time.monotonic()
    sim_cluster.kill_slice(sl.name)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(ref, timeout=30)
    assert time.monotonic() - t0 < 10
    assert _gone(pid), "the slice's actor process must be dead"
    deadline = time.monotonic() + 10
    while _node(sl.node_ids[0])["Alive"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _node(sl.node_ids[0])["Alive"]
    assert not sl.alive


def test_provisioner_adds_a_slice_for_a_pending_reservation(sim_cluster):
    before = {s.name for s in sim_cluster.alive_slices()}
    # Occupy every existing slice so a new reservation has to wait.
    held = [SliceReservation(sim_cluster.slice_spec) for _ in before]
    for r in held:
        assert r.wait(30)
    pending = SliceReservation(sim_cluster.slice_spec)
    assert not pending.wait(1.0), "no free slice: the reservation must stay pending"
    prov = sim_cluster.provisioner(delay_s=1.5)
    t0 = time.monotonic()
    try:
        assert pending.wait(60)
        waited = time.monotonic() - t0
    finally:
        prov.stop()
        for r in held + [pending]:
            r.release()
    assert waited >= 1.4, f"the provisioner must honour its delay (ready after {waited:.2f}s)"
    assert len(prov.added) == 1
    new = set(prov.added)
    assert new.isdisjoint(before) and new <= {s.name for s in sim_cluster.alive_slices()}


def test_a_failed_slice_launch_is_retried(sim_cluster, monkeypatch):
    """A node that fails to start (Ray's own error when a raylet does not register in time on loaded
    cores) costs one try, not the launch nor the provisioner: ``add_slice`` starts a new slice in its
    place (a test's ``ensure_slices`` and the demo call it too), and the pending reservation is served."""
    from ray.cluster_utils import Cluster

    real_add_node, calls = Cluster.add_node, []

    def add_node_failing_once(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise Exception("The current node timed out during startup.")  # Ray's text (ray/_private/node.py)
        return real_add_node(self, *args, **kwargs)

    monkeypatch.setattr(Cluster, "add_node", add_node_failing_once)
    before = {s.name for s in sim_cluster.alive_slices()}
    held = [SliceReservation(sim_cluster.slice_spec) for _ in before]
    for r in held:
        assert r.wait(30)
    pending = SliceReservation(sim_cluster.slice_spec)
    prov = sim_cluster.provisioner(delay_s=0.0)
    try:
        assert pending.wait(60), f"not served after a failed launch; provisioner alive: {prov._thread.is_alive()}"
    finally:
        prov.stop()
        for r in held + [pending]:
            r.release()
    assert prov.failed_launches == []
    # One node start failed and its slice was started again (a launch more is demand the provisioner
    # saw before it stopped).
    assert len(prov.added) >= 1 and len(calls) == len(prov.added) + 1


def test_add_slice_registers_new_node(sim_cluster):
    n = len(sim_cluster.alive_slices())
    sl = sim_cluster.add_slice()
    assert len(sim_cluster.alive_slices()) == n + 1
    assert _node(sl.node_ids[0])["Alive"]


def test_a_local_run_stays_on_loopback(sim_cluster):
    """Nothing of a simulated run (Ray, the slice processes, the JAX coordinator) listens on or
    talks to the machine's network address."""
    from ray_elastic import ElasticConfig, ElasticTrainer
    from ray_elastic.examples.digits_mlp import DigitsMLPTask

    sockets = []

    def on_step(m):
        if m["step"] == 2:  # a world is up: its JAX processes and coordinator exist
            for p in sim_cluster.processes():
                try:
                    sockets.extend((p.pid, c) for c in p.net_connections(kind="inet"))
                except psutil.NoSuchProcess:
                    pass

    cfg = ElasticConfig(
        num_slices=2, global_batch_size=32, slice=sim_cluster.slice_spec, steps_per_chunk=5, standby_workers=1
    )  # a standby's sockets are checked too
    ElasticTrainer(DigitsMLPTask(), cfg, progress=False, on_step=on_step).fit(4)
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
    listening = [(pid, c.laddr) for pid, c in sockets if c.status == psutil.CONN_LISTEN]
    remote = [(pid, c.raddr) for pid, c in sockets if c.raddr]
    assert len(listening) > 5 and len(remote) > 5
    assert [(pid, a) for pid, a in listening + remote if not _loopback(a.ip)] == []


def _loopback(ip: str) -> bool:
    a = ipaddress.ip_address(ip)
    return a.is_loopback or (a.version == 6 and a.ipv4_mapped is not None and a.ipv4_mapped.is_loopback)
