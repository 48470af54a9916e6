"""The TPU runtime's rules on the simulated hosts (``ray_elastic.sim.tpu_runtime``): each rule
catches a process that breaks it, and every world ray-elastic forms (first, shrunk, grown back)
keeps them: ``MEGASCALE_*`` fresh and consistent for the world, one chip owner per host."""

from __future__ import annotations

import os
import time

import psutil
import pytest
import ray
from faults import FaultPlan, ensure_slices, in_thread, kill_process_of_slice, slice_name
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_elastic import ElasticConfig, ElasticTrainer
from ray_elastic.examples.digits_mlp import DigitsMLPTask
from ray_elastic.sim import tpu_runtime
from ray_elastic.sim.hosts import free_port

SIM_CLUSTER = {"num_slices": 3}
SHARE_CLUSTER = True
STEPS = 300  # a grow-back needs the new slice's process warm: seconds of these short steps


@ray.remote(num_cpus=0, max_restarts=0)
class Process:
    """A bare process on a simulated TPU host, doing what a slice process may (or must not) do."""

    def open(self, env: dict, coordinator=None, num_processes: int = 1, process_id: int = 0) -> str:
        os.environ.update(env)
        import jax

        if coordinator:
            jax.distributed.initialize(coordinator, num_processes, process_id, initialization_timeout=60)
        try:
            return f"opened {len(jax.devices())} devices"
        except RuntimeError as e:
            return f"refused: {e}"

    def pid(self) -> int:
        return os.getpid()


def on(cluster, name: str, host: int = 0):
    node = cluster.slice_by_name(name).hosts[host].node_id
    return Process.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()


def megascale(coordinator_ip: str, num_slices: int, slice_id: int) -> dict:
    return {
        "MEGASCALE_COORDINATOR_ADDRESS": coordinator_ip,
        "MEGASCALE_NUM_SLICES": str(num_slices),
        "MEGASCALE_SLICE_ID": str(slice_id),
        "MEGASCALE_PORT": "8081",
    }


def stop(*procs) -> None:
    """Kill the processes and wait until they are gone: a killed process holds its host's chips
    until it has exited, and the next test opens them."""
    pids = ray.get([p.pid.remote() for p in procs])
    for p in procs:
        ray.kill(p)
    running = []
    for pid in pids:
        try:
            running.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(running, timeout=10)
    for proc in alive:  # still exiting (or stuck in JAX's shutdown): ours to end
        proc.kill()
    psutil.wait_procs(alive, timeout=10)


@pytest.fixture
def cluster(sim_cluster):
    ensure_slices(sim_cluster, 3)
    return sim_cluster


def test_a_process_that_opens_the_chips_outside_a_world_is_refused(cluster, tpu_breaches):
    """What a standby that initialised its backend early would do: no world, no MEGASCALE_*."""
    p = on(cluster, cluster.alive_slices()[0].name)
    try:
        assert ray.get(p.open.remote({})).startswith("refused")
    finally:
        stop(p)
    (b,) = tpu_breaches.take()
    assert b["rule"] == "megascale" and "outside a JAX world" in b["message"]


def test_a_stale_slice_count_after_a_resize_is_refused(cluster, tpu_breaches):
    """Two slices form a world, but keep MEGASCALE_NUM_SLICES=3 from the world before."""
    names = [s.name for s in cluster.alive_slices()[:2]]
    procs = [on(cluster, n) for n in names]
    try:
        ip = "127.0.0.1"
        coordinator = f"{ip}:{free_port()}"
        answers = ray.get([p.open.remote(megascale(ip, 3, i), coordinator, 2, i) for i, p in enumerate(procs)])
    finally:
        stop(*procs)
    assert all(a.startswith("refused") for a in answers), answers
    found = tpu_breaches.take()
    assert found and all(b["rule"] == "megascale" for b in found)
    assert "MEGASCALE_NUM_SLICES=3 but the world has 2 slices" in found[0]["message"]


def test_two_live_processes_on_one_host_the_second_is_refused(cluster, tpu_breaches):
    name = cluster.alive_slices()[0].name
    first, second = on(cluster, name), on(cluster, name)
    try:
        ip = "127.0.0.1"
        assert ray.get(first.open.remote(megascale(ip, 1, 0), f"{ip}:{free_port()}")).startswith("opened")
        answer = ray.get(second.open.remote(megascale(ip, 1, 0), f"{ip}:{free_port()}"))
        owner = ray.get(first.pid.remote())
    finally:
        stop(first, second)
    assert answer.startswith("refused") and f"already in use by process with pid {owner}" in answer
    (b,) = tpu_breaches.take()
    assert b["rule"] == "one-owner"


def test_check_world_names_what_is_wrong():
    def rec(slice_, sid, n=2, coordinator="10.0.0.1", ip="10.0.0.1"):
        return {"coordinator": coordinator, "port": "8081", "num_slices": n, "slice_id": sid, "slice": slice_, "ip": ip}

    assert tpu_runtime.check_world([rec("a", 0), rec("b", 1, ip="10.0.0.2")]) is None
    assert "number 0 in the world's replica order" in tpu_runtime.check_world([rec("a", 1), rec("b", 0)])
    assert "process 1 has MEGASCALE_NUM_SLICES=3" in tpu_runtime.check_world([rec("a", 0), rec("b", 1, n=3)])
    assert "not slice 0's first host" in tpu_runtime.check_world([rec("a", 0, ip="10.0.0.9"), rec("b", 1)])


def test_every_world_of_a_resize_and_grow_back_opens_its_chips_by_the_rules(cluster, tpu_breaches):
    """A process killed (a new world on the same hosts: each new process opens its host's chips
    only once the old owner is gone), then a slice lost (a 2-slice world) and capacity back (3
    again): every process of every world opened its chips with that world's slice count and its
    own slice's id (else the stand-in refuses it: a breach, and this test fails)."""
    before = len(tpu_runtime.openings())
    cfg = ElasticConfig(
        num_slices=3,
        min_slices=2,
        global_batch_size=48,
        slice=cluster.slice_spec,
        snapshot_every=1,
        slice_timeout_s=120.0,
    )
    plan = FaultPlan(
        {
            10: lambda tr: kill_process_of_slice(tr, 1),
            25: lambda tr: in_thread(cluster.kill_slice, slice_name(tr, 2)),
            35: lambda tr: cluster.add_slice(),  # in the driver's thread: capacity is back from here on
        },
        grow_by=36,  # the run's end waits for the grow-back however long the newcomer takes to start
    )
    trainer = ElasticTrainer(DigitsMLPTask(), cfg, progress=False, on_step=plan.on_step)
    plan.trainer = trainer
    result = trainer.fit(STEPS)
    assert result.steps == list(range(STEPS)) and not plan.faults
    sizes = [len(e["slices"]) for e in result.events if e["kind"] == "world_formed"]
    assert sizes[:2] == [3, 3] and 2 in sizes and sizes[-1] == 3, sizes
    opened = tpu_runtime.openings()[before:]
    assert len(opened) == sum(sizes)  # every process of every world went through the stand-in
    assert sorted({o["num_slices"] for o in opened}) == [2, 3]
    broken = tpu_breaches.take()
    hosts = {b["host"] for b in broken}
    assert not broken, "\n".join(map(str, broken + [o for o in opened if o["host"] in hosts]))


def test_a_new_owner_waits_for_the_old_one_then_clears_a_lock_file_it_left(tmp_path):
    """A hard-killed owner can leave libtpu's lock file: removed once the previous owners are gone,
    and only then (a host without known previous owners is left alone)."""
    import subprocess
    import sys

    from ray_elastic.slice.tpu_env import clear_stale_lock, wait_until_gone

    old = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    lock = tmp_path / "libtpu_lockfile"
    lock.write_text(str(old.pid))
    t0 = time.monotonic()
    waited = wait_until_gone([old.pid], timeout_s=30)
    old.wait()
    assert waited >= 0.2 and time.monotonic() - t0 >= 0.2 and old.returncode == 0
    assert not clear_stale_lock([], str(lock)) and lock.exists()
    assert clear_stale_lock([old.pid], str(lock)) and not lock.exists()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(TimeoutError, match=str(live.pid)):
            wait_until_gone([live.pid], timeout_s=0.2)
    finally:
        live.kill()
        live.wait()
