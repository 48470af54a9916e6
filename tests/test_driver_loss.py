"""The driver is not the single point of failure: its snapshot keepers outlive it, a rerun of the
same run takes them over and resumes from memory, an older driver that still lives stops, and an
abandoned run's keepers free everything after ``orphan_timeout_s`` (the simulated cluster, the
driver a real ``ray-elastic train`` process killed with SIGKILL)."""

import functools
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import ray
from faults import cluster_state, ensure_slices, left_behind, max_rel_err

from ray_elastic import ElasticConfig, ElasticTrainer
from ray_elastic.examples.digits_mlp import DigitsMLPTask
from ray_elastic.ray_backend.keepers import NAMESPACE
from ray_elastic.state.snapshot_keeper import SnapshotKeeper

SHARE_CLUSTER = True
BIN = os.path.join(os.path.dirname(sys.executable), "ray-elastic")
GBS, SEED, STEPS = 48, 5, 80


def _cmd(run_dir: str, ckpt: str, *extra: str, steps: int = STEPS) -> list[str]:
    return [
        BIN,
        "train",
        "--example",
        "mlp",
        "--num-slices",
        "2",
        "--devices-per-host",
        "2",
        "--global-batch",
        str(GBS),
        "--seed",
        str(SEED),
        "--steps",
        str(steps),
        "--steps-per-chunk",
        "5",
        "--standby-workers",
        "0",
        "--snapshot-every",
        "1",
        "--checkpoint-dir",
        ckpt,
        "--checkpoint-every",
        "100",
        "--run-dir",
        run_dir,
        "--json",
        "--no-progress",
        *extra,
    ]


def _logged_steps(run_dir: str) -> list[list[int]]:
    """Per run in the log: the steps it reported."""
    runs: list[list[int]] = []
    path = os.path.join(run_dir, "events.jsonl")
    if not os.path.exists(path):
        return runs
    with open(path) as f:
        for line in f:
            e = json.loads(line)
            if e["kind"] == "run_started":
                runs.append([])
            elif e["kind"] == "steps" and runs:
                runs[-1].extend(e["steps"])
    return runs


def _start_and_kill_at(cmd: list[str], run_dir: str, step: int, log, address: str) -> int:
    """Start a driver, SIGKILL it once it has reported ``step``; returns the last step it reported."""
    env = {**os.environ, "RAY_ADDRESS": address}
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        runs = _logged_steps(run_dir)
        if runs and max(runs[-1], default=-1) >= step:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # the driver itself dies mid-run: no finally, no cleanup
    assert proc.wait(timeout=30) == -signal.SIGKILL, open(log.name).read()[-3000:]
    return max(_logged_steps(run_dir)[-1])


def _keepers() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a.get("namespace") == NAMESPACE]


def _summary(stdout: str) -> dict:
    return json.loads([ln for ln in stdout.splitlines() if ln.startswith("{")][-1])


def test_a_rerun_after_the_driver_is_killed_resumes_from_its_keepers_rewinding_nothing(sim_cluster, tmp_path):
    """The driver is SIGKILLed mid-run. A rerun asked for fewer steps than were run is refused
    (``fit(620)`` after a driver of ``fit(1000)`` was lost at 650 would save the state after 650 as
    checkpoint 620) with what to do, before any slice is taken, and the keepers are left for a
    rerun that asks for more: it resumes from them, rewinding nothing, with the losses of the run
    that was never interrupted."""
    ensure_slices(sim_cluster, 3)
    run_dir, ckpt = str(tmp_path / "run"), str(tmp_path / "ckpt")
    with open(tmp_path / "first.log", "w") as log:
        last = _start_and_kill_at(_cmd(run_dir, ckpt), run_dir, 30, log, sim_cluster.address)
    assert 30 <= last < STEPS - 5
    assert len(_keepers()) == 3, "the keepers (one per slice host, and the run's owner record) must outlive the driver"
    secret = os.path.join(run_dir, ".ray-elastic-secret")  # what a takeover needs: readable by the owner only
    assert os.stat(secret).st_mode & 0o777 == 0o600

    env = {**os.environ, "RAY_ADDRESS": sim_cluster.address}
    short = subprocess.run(_cmd(run_dir, ckpt, steps=20), env=env, capture_output=True, text=True, timeout=300)
    assert short.returncode != 0 and "already trained step" in short.stdout + short.stderr, short.stderr[-3000:]
    assert len(_keepers()) == 3 and not os.path.exists(os.path.join(ckpt, "20"))

    second = subprocess.run(_cmd(run_dir, ckpt), env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    summary = _summary(second.stdout)
    assert summary["resumed_from_snapshot"] == last and summary["steps_rewound_on_resume"] == 0, summary
    assert summary["resumed_from_checkpoint"] is None  # no checkpoint before step 80
    assert _logged_steps(run_dir)[-1] == list(range(last + 1, STEPS))
    assert _keepers() == []  # the rerun took them over and removed them at its end

    losses = {}
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        runs = sum(json.loads(line)["kind"] == "run_started" for line in f)
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        seen = 0
        for line in f:
            e = json.loads(line)
            seen += e["kind"] == "run_started"
            if seen == runs and e["kind"] == "steps":  # the last run's
                losses.update(zip(e["steps"], e["losses"]))
    cfg = ElasticConfig(
        num_slices=2,
        global_batch_size=GBS,
        slice=sim_cluster.slice_spec,
        seed=SEED,
        steps_per_chunk=5,
        standby_workers=0,
    )
    whole = ElasticTrainer(DigitsMLPTask(), cfg, progress=False).fit(STEPS)  # the same run, uninterrupted
    resumed = [losses[s] for s in range(last + 1, STEPS)]
    assert max_rel_err(resumed, whole.losses[last + 1 :]) <= 1e-6


def test_an_abandoned_run_s_keepers_free_everything_after_the_orphan_timeout(sim_cluster, tmp_path):
    ensure_slices(sim_cluster, 3)
    before = cluster_state()
    run_dir = str(tmp_path / "run")
    with open(tmp_path / "driver.log", "w") as log:
        cmd = _cmd(run_dir, str(tmp_path / "ckpt"), "--orphan-timeout", "5")
        _start_and_kill_at(cmd, run_dir, 10, log, sim_cluster.address)
    assert len(_keepers()) == 3
    # Never rerun: after the timeout no keeper, actor or placement group of the run is left.
    deadline = time.monotonic() + 60
    while _keepers() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _keepers() == []
    assert left_behind(before) == {}


def test_a_newer_driver_takes_the_run_over_and_the_older_one_stops(sim_cluster, tmp_path):
    """Two drivers of one run (a partition, a slow kill): the second takes the keepers over with a
    higher epoch; the first learns it at its next lease renewal, stops its processes and ends with
    SupersededError; the second trains to the end from what the keepers held."""
    ensure_slices(sim_cluster, 4)
    run_dir, ckpt = str(tmp_path / "run"), str(tmp_path / "ckpt")
    env = {**os.environ, "RAY_ADDRESS": sim_cluster.address}
    cmd = _cmd(run_dir, ckpt, "--orphan-timeout", "5", steps=400)
    first = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and first.poll() is None:
        runs = _logged_steps(run_dir)
        if runs and max(runs[-1], default=-1) >= 20:
            break
        time.sleep(0.05)
    second = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out_first, _ = first.communicate(timeout=120)
    assert first.returncode == 1 and "another driver took this run over" in out_first, out_first[-3000:]
    out_second, _ = second.communicate(timeout=400)
    assert second.returncode == 0, out_second[-3000:]
    summary = _summary(out_second)
    assert (
        summary["resumed_from_snapshot"] is not None and summary["steps"] == 400 - summary["resumed_from_snapshot"] - 1
    )
    assert _keepers() == []


def _wait_for(pred, timeout_s: float = 120.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _events(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "events.jsonl")
    return [json.loads(ln) for ln in open(path)] if os.path.exists(path) else []


def _assert_stopped_as_superseded(proc, run_dir: str) -> None:
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "another driver took this run over" in out, out[-3000:]
    logged = [e for e in _events(run_dir) if e["kind"] == "errored"]
    assert logged == [], f"a superseded driver wrote to the new driver's log: {logged}"


def test_a_driver_superseded_while_it_waits_for_slices_stops_before_it_trains(sim_cluster, tmp_path):
    """The first driver waits for a second slice (scheduling); a rerun of the run takes the run's
    owner record over: the first stops with SupersededError, writes no more events, and gives its
    slice back; the rerun trains the whole run once capacity comes."""
    ensure_slices(sim_cluster, 1)
    run_dir, ckpt = str(tmp_path / "run"), str(tmp_path / "ckpt")
    env = {**os.environ, "RAY_ADDRESS": sim_cluster.address}
    cmd = _cmd(run_dir, ckpt, "--orphan-timeout", "5", steps=20)
    first = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for(lambda: any(e["kind"] == "waiting" for e in _events(run_dir)), what="the first driver to wait")
    second = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _assert_stopped_as_superseded(first, run_dir)
    ensure_slices(sim_cluster, 2)
    out, _ = second.communicate(timeout=300)
    assert second.returncode == 0, out[-3000:]
    assert _summary(out)["steps"] == 20 and _logged_steps(run_dir)[-1] == list(range(20))
    assert _keepers() == []


def test_a_driver_superseded_while_it_waits_for_a_replacement_stops_and_the_rerun_resumes(sim_cluster, tmp_path):
    """Pause-and-resume with no spare slice: the first driver waits for a replacement when a rerun
    takes the run over; it stops (no world formed, no checkpoint, no event line, no keeper killed)
    and the rerun resumes from the surviving slice's snapshots once a slice arrives."""
    ensure_slices(sim_cluster, 2)
    run_dir, ckpt = str(tmp_path / "run"), str(tmp_path / "ckpt")
    env = {**os.environ, "RAY_ADDRESS": sim_cluster.address}
    cmd = _cmd(run_dir, ckpt, "--orphan-timeout", "5", "--mode", "pause-and-resume", steps=60)
    first = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for(lambda: max((s for r in _logged_steps(run_dir) for s in r), default=-1) >= 20, what="step 20")
    sim_cluster.kill_slice(sim_cluster.alive_slices()[0].name)
    _wait_for(lambda: any(e["kind"] == "waiting_for_capacity" for e in _events(run_dir)), what="the wait")
    second = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _assert_stopped_as_superseded(first, run_dir)
    ensure_slices(sim_cluster, 2)
    out, _ = second.communicate(timeout=300)
    assert second.returncode == 0, out[-3000:]
    summary = _summary(out)
    assert summary["resumed_from_snapshot"] is not None and summary["steps_rewound_on_resume"] == 0, summary
    assert _logged_steps(run_dir)[-1] == list(range(summary["resumed_from_snapshot"] + 1, 60))
    assert os.listdir(ckpt) == ["60"]  # the rerun's final one: the first driver saved none (every 100)
    assert _keepers() == []


def test_two_concurrent_reruns_one_takes_the_run_the_other_stops(sim_cluster, tmp_path):
    """A driver is SIGKILLed and two reruns start at once: the keepers are claimed, never killed,
    by either; exactly one trains on from the lost driver's snapshots, the other stops with
    SupersededError (neither restarts from step 0)."""
    ensure_slices(sim_cluster, 4)
    run_dir, ckpt = str(tmp_path / "run"), str(tmp_path / "ckpt")
    with open(tmp_path / "first.log", "w") as log:
        last = _start_and_kill_at(_cmd(run_dir, ckpt, "--orphan-timeout", "5"), run_dir, 30, log, sim_cluster.address)
    env = {**os.environ, "RAY_ADDRESS": sim_cluster.address}
    cmd = _cmd(run_dir, ckpt, "--orphan-timeout", "5")
    reruns = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    reruns.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=400)[0] for p in reruns]
    codes = sorted(p.returncode for p in reruns)
    assert codes == [0, 1], [o[-2000:] for o in outs]
    winner, loser = (outs[0], outs[1]) if reruns[0].returncode == 0 else (outs[1], outs[0])
    assert "another driver took this run over" in loser, loser[-3000:]
    summary = _summary(winner)
    assert summary["resumed_from_snapshot"] is not None and summary["resumed_from_snapshot"] >= 0, summary
    assert last >= 30 and summary["steps"] < STEPS
    # the winner removed its keepers; one the loser started before it learned it was superseded is
    # left alone by both (a superseded driver calls no keeper) and frees itself when its 5 s lease runs out
    deadline = time.monotonic() + 5 + 15
    while _keepers() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _keepers() == []


def test_an_explicit_resume_from_wins_over_a_lost_run_s_keepers(sim_cluster, tmp_path):
    """A run dir reused within the orphan timeout with ``resume_from``: the named checkpoint is
    restored (not the lost run's memory), the keepers are released and an event says why."""
    ensure_slices(sim_cluster, 3)
    env = {**os.environ, "RAY_ADDRESS": sim_cluster.address}
    other = str(tmp_path / "other-ckpt")
    made = subprocess.run(
        _cmd(str(tmp_path / "other"), other, steps=30), env=env, capture_output=True, text=True, timeout=300
    )
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    run_dir, ckpt = str(tmp_path / "run"), str(tmp_path / "ckpt")
    with open(tmp_path / "first.log", "w") as log:
        _start_and_kill_at(_cmd(run_dir, ckpt), run_dir, 50, log, sim_cluster.address)
    cmd = _cmd(run_dir, ckpt, "--resume-from", other, steps=40)
    rerun = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    summary = _summary(rerun.stdout)
    assert summary["resumed_from_checkpoint"] == 30 and summary["resumed_from_snapshot"] is None, summary
    assert summary["steps"] == 10 and _logged_steps(run_dir)[-1] == list(range(30, 40))
    (rerun_event,) = [e for e in _events(run_dir) if e["kind"] == "rerun"]
    assert "resume_from" in rerun_event["released"]
    assert _keepers() == []


def test_keepers_of_a_run_no_rerun_can_find_die_with_their_driver_and_an_unplaced_one_keeps(sim_cluster):
    """Without a run id, run or checkpoint directory the keepers are not detached (nothing could
    take them over); a keeper started for a host not placed yet takes the driver's snapshots."""
    from ray._private.state import actors

    from ray_elastic import ElasticConfig
    from ray_elastic.ray_backend.keepers import Keepers, RunIdentity
    from ray_elastic.ray_backend.placement import UNPLACED
    from ray_elastic.ray_backend.pool import WorkerPool

    keepers = Keepers(RunIdentity.of("random", "digits", (), findable=False), orphan_timeout_s=60)
    assert keepers.take_over() == []
    node = ray.get_runtime_context().get_node_id()
    keeper = keepers.keeper(node)

    class Unplaced:  # a slice reservation whose bundle Ray has not placed yet
        spec = sim_cluster.slice_spec

        def node_ids(self):
            return [UNPLACED]

        def host_strategy(self, host):
            return "DEFAULT"

    config = ElasticConfig(num_slices=1, global_batch_size=48, slice=sim_cluster.slice_spec)
    pool = WorkerPool(ray.put(None), config, keepers)
    bundle_keeper = pool.keeper(Unplaced(), 0)
    try:
        assert ray.get(keeper.renew.remote(keepers.epoch)) is True
        assert actors(keeper._actor_id.hex())["IsDetached"] is False
        snap = {"leaves": [], "ranges": []}
        assert ray.get(bundle_keeper.keep.remote(0, 3, snap, keepers.epoch)) is True
    finally:
        pool.shutdown()


def test_a_keeper_refuses_an_older_driver_and_is_taken_only_with_the_run_s_secret(sim_cluster):
    """Fencing, identity and the secret on a real keeper actor: a takeover needs a higher epoch and
    the run's secret; another identity takes it but drops what it held; afterwards the older
    driver's writes, acks, renewals and fetches are refused, and only the owner releases it."""
    keeper = SnapshotKeeper.options(num_cpus=0).remote(orphan_timeout_s=60, identity="model-a", epoch=1, secret="s")
    snap = {"leaves": [], "ranges": []}
    try:
        assert ray.get(keeper.begin.remote(0, 0, ("slice-0", 0), 1))
        assert ray.get([keeper.keep.remote(0, s, snap, 1) for s in (5, 6)]) == [True, True]
        assert ray.get(keeper.status.remote("guess")) is None  # another job cannot even read its epoch
        assert ray.get(keeper.take_over.remote(2, "model-a", "guess")) == {"taken": False, "why": "secret"}
        assert ray.get(keeper.take_over.remote(1, "model-a", "s")) == {"taken": False, "why": "newer"}
        taken = ray.get(keeper.take_over.remote(2, "model-a", "s"))
        assert taken == {"taken": True, "place": ("slice-0", 0), "held": [(-1, 5), (-1, 6)], "dropped": 0}
        assert ray.get(keeper.renew.remote(1)) is False  # the old driver learns it was superseded
        assert ray.get(keeper.keep.remote(0, 7, snap, 1)) is False  # and its processes' writes are refused
        assert ray.get(keeper.begin.remote(3, 0, ("slice-0", 0), 1)) is False
        assert ray.get(keeper.release.remote(1)) is False  # only the owner removes it
        assert ray.get(keeper.held.remote()) == [(-1, 5), (-1, 6)]
        assert ray.get(keeper.renew.remote(2)) is True
        assert ray.get(keeper.fetch.remote(-1, 6, 2))["step"] == 6
        with pytest.raises(ray.exceptions.RayTaskError, match="PermissionError"):
            ray.get(keeper.fetch.remote(-1, 6, 1))
        other = ray.get(keeper.take_over.remote(3, "model-b", "s"))  # another model: taken, emptied
        assert other["taken"] and other["dropped"] == 2 and other["held"] == []
        assert ray.get(keeper.release.remote(3)) is True
        assert ray.get(keeper.take_over.remote(4, "model-b", "s")) == {"taken": False, "why": "released"}
    finally:
        ray.kill(keeper)


def test_another_job_without_the_run_s_secret_neither_takes_nor_stops_its_keepers(sim_cluster):
    """A driver of another job that names the same run (same run id and task) but lacks the secret
    kept in the run's directory takes nothing over, learns nothing, and removes nothing."""
    from ray_elastic.ray_backend.keepers import Keepers, RunIdentity

    owner = Keepers(RunIdentity.of("shared-name", "digits", (), secret="the run's"), orphan_timeout_s=60)
    assert owner.take_over() == []
    keeper = owner.keeper(ray.get_runtime_context().get_node_id())
    try:
        assert ray.get(keeper.begin.remote(0, 0, ("slice-0", 0), owner.epoch))
        other = Keepers(RunIdentity.of("shared-name", "digits", (), secret="a guess"), orphan_timeout_s=60)
        assert other.take_over() == [] and not other.superseded.is_set()
        other.shutdown()
        assert ray.get(keeper.renew.remote(owner.epoch)) is True  # still the owner's, alive
        owner.confirm()  # and the owner was not superseded
    finally:
        owner.shutdown()


def test_a_keeper_renews_its_lease_while_it_copies_a_snapshot(sim_cluster):
    """Renewals run on the keeper's own lease thread: one never queues behind a ``keep`` copy (here
    one that takes 4 s; before, the renewal waited for it and a short lease lapsed)."""
    import numpy as np

    class SlowLeaf:  # copied in 4 s (a large snapshot on a busy host)
        def __array__(self, dtype=None, copy=None):
            time.sleep(4)
            return np.zeros(1)

    keeper = SnapshotKeeper.options(num_cpus=0).remote(orphan_timeout_s=60, epoch=1)
    try:
        assert ray.get(keeper.renew.remote(1)) is True  # started
        keeping = keeper.keep.remote(0, 1, {"leaves": [SlowLeaf()], "ranges": [()]}, 1)
        time.sleep(0.5)  # the copy has begun
        assert ray.get(keeper.renew.remote(1), timeout=30) is True
        assert ray.wait([keeping], timeout=0)[0] == [], "the renewal waited for the copy"
        assert ray.get(keeping) is True
    finally:
        ray.kill(keeper)


NOTEBOOK_CELL = """
import time
from ray_elastic import ElasticConfig, ElasticTrainer, SliceSpec
from ray_elastic.examples.digits_mlp import DigitsMLPTask
config = ElasticConfig(num_slices=2, global_batch_size={gbs}, slice=SliceSpec("v4", "2x2x1", 2), seed={seed},
                       steps_per_chunk=5, snapshot_every=1, standby_workers=0)
def say(m):
    print("step", m["step"], flush=True)
    if m["step"] == {hold}:
        time.sleep(3600)  # the kernel is killed here, whatever the steps' speed
result = ElasticTrainer(DigitsMLPTask(), config, progress=False, run_dir={run_dir!r}, on_step=say).fit({steps})
print("summary", result.summary["resumed_from_snapshot"], result.summary["steps_rewound_on_resume"], flush=True)
"""


def test_a_notebook_cell_rerun_after_the_kernel_died_resumes_from_its_keepers(sim_cluster, tmp_path):
    """The driver is a Jupyter kernel (the notebook path): the kernel process is SIGKILLed mid-fit (a
    kernel restart, an OOM), a new kernel runs the same cell, and the run resumes from memory."""
    import queue

    from test_notebook import Kernel

    ensure_slices(sim_cluster, 3)
    os.environ["RAY_ADDRESS"] = sim_cluster.address  # the kernels connect to this cluster
    run_dir = str(tmp_path / "run")
    cell = functools.partial(NOTEBOOK_CELL.format, gbs=GBS, seed=SEED, run_dir=run_dir, steps=STEPS)
    try:
        first = Kernel(str(tmp_path))
        first.kc.execute(cell(hold=30))
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            try:
                msg = first.kc.get_iopub_msg(timeout=1)
            except queue.Empty:
                continue
            if msg["msg_type"] == "stream" and "step 30" in msg["content"]["text"]:
                break
        os.kill(first.km.provisioner.process.pid, signal.SIGKILL)  # nothing of the driver runs its cleanup
        first.kc.stop_channels()
        last = max(_logged_steps(run_dir)[-1])
        second = Kernel(str(tmp_path))
        try:
            printed, reply = second.run(cell(hold=-1), timeout=300)
        finally:
            second.close()
    finally:
        os.environ.pop("RAY_ADDRESS", None)
    assert reply["status"] == "ok", printed[-3000:]
    assert f"summary {last} 0" in printed, printed[-2000:]
    assert _logged_steps(run_dir)[-1] == list(range(last + 1, STEPS))
