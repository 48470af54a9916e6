"""Orbax checkpoints on local disk and on the real GCS API (fake-gcs-server), on the simulated cluster."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import jax
import numpy as np
import pytest
import ray
from conftest import reference_run, restore_in_this_process
from faults import FaultPlan, ensure_slices, kill_process_of_slice, max_rel_err

from ray_elastic import ElasticConfig, ElasticTrainer, FailureConfig
from ray_elastic.examples.digits_mlp import DigitsMLPTask
from ray_elastic.state.checkpoints import latest_checkpoint

SIM_CLUSTER = {"num_slices": 4}
SHARE_CLUSTER = True  # conftest.py: one cluster for the modules of plain 1-host slices
BIN = os.path.join(os.path.dirname(sys.executable), "ray-elastic")
GBS, SEED = 48, 3
SLOW_SAVE_WATCHDOG_S = 1.0  # far above a step (~0.02 s)
SLOW_BUCKET_DELAY_S = 0.03  # per request; a save makes ~70 in sequence: ~4 s here, far over the watchdog


def _config(cluster, num_slices=2, **kw) -> ElasticConfig:
    """No warm standbys: nothing here measures recovery speed, and each would be one more process
    importing JAX and tracing steps on the machine's cores (a recovery here starts new processes).
    Two slices unless a test is about the world's size (a third is one more process and keeper
    per fit, and the suite's time is its number of process starts)."""
    return ElasticConfig(
        num_slices=num_slices,
        global_batch_size=GBS,
        slice=cluster.slice_spec,
        seed=SEED,
        steps_per_chunk=5,
        **{"standby_workers": 0, **kw},
    )


def _fit(cluster, directory: str, steps: int, num_slices: int = 2, every: int = 10):
    cfg = _config(cluster, num_slices=num_slices, checkpoint_dir=directory, checkpoint_every=every)
    return ElasticTrainer(DigitsMLPTask(), cfg, progress=False).fit(steps)


def _bucket(gcs) -> str:
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    gcs.create_bucket(name)
    return name


def _steps_in_bucket(gcs, bucket: str, prefix: str) -> dict[int, bool]:
    """step -> committed (has commit_success.txt), from a raw GCS listing."""
    out: dict[int, bool] = {}
    for name in gcs.list(bucket, prefix=prefix + "/"):
        parts = name[len(prefix) + 1 :].split("/")
        if parts[0].isdigit():
            step = int(parts[0])
            out[step] = out.get(step, False) or parts[1:] == ["commit_success.txt"]
    return out


@pytest.fixture(scope="module")
def reference():
    """Single-process losses for 40 steps and the train state after 20."""
    losses, _ = reference_run(DigitsMLPTask(), GBS, SEED, 40)
    _, state20 = reference_run(DigitsMLPTask(), GBS, SEED, 20)
    return losses, state20


@pytest.mark.parametrize("where, resume_on", [("local", 2), ("gcs", 4)])
def test_round_trip_values_equal_and_resume_on_another_world_size(
    where, resume_on, sim_cluster, local_gcs, tmp_path, reference
):
    """Saved by 3 slices, the values are the training state; a run resumes from them on fewer
    (local disk) or more (gs://) slices, resharded, and trains on with the reference's losses."""
    ensure_slices(sim_cluster, 4)
    ref_losses, ref_state20 = reference
    directory = str(tmp_path / "ckpt") if where == "local" else f"gs://{_bucket(local_gcs)}/run"
    result = _fit(sim_cluster, directory, 20, num_slices=3)
    assert result.summary["checkpoints_committed"] == 2
    info = latest_checkpoint(directory)
    assert info.step == 20 and info.metadata["data_position"] == 20 * GBS
    assert info.metadata["world"]["mesh"] == {"replica": 3, "fsdp": 2, "tensor": 1}

    # Saved values are the training state: equal to a single-process run of the same 20 steps.
    saved, meta = restore_in_this_process(directory, 20)
    assert meta["step"] == 20
    got, want = jax.tree.leaves(saved), jax.tree.leaves(ref_state20)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=1e-6)

    # And restored values are what training continues from, on another number of slices.
    resumed = _fit(sim_cluster, directory, 30, num_slices=resume_on)
    assert resumed.steps == list(range(20, 30))
    assert resumed.summary["resumed_from_checkpoint"] == 20
    assert resumed.summary["mesh"] == {"replica": resume_on, "fsdp": 2, "tensor": 1}
    restore = [e for e in resumed.events if e["kind"] == "checkpoint_restore"]
    assert restore and restore[0]["step"] == 20 and restore[0]["saved_by"]["world"]["num_slices"] == 3
    assert max_rel_err(resumed.losses, ref_losses[20:30]) <= 1e-4


def test_unfinished_step_is_ignored_and_cleaned(sim_cluster, local_gcs, reference):
    ensure_slices(sim_cluster, 4)
    ref_losses, _ = reference
    bucket = _bucket(local_gcs)
    directory = f"gs://{bucket}/run"
    _fit(sim_cluster, directory, 20)
    # What a crash between the shards and the commit marker leaves behind.
    from google.cloud import storage

    b = storage.Client().bucket(bucket)
    b.blob("run/20/commit_success.txt").delete()
    # And a later step of which only some shards landed (no run will write step 25 again).
    for blob in b.list_blobs(prefix="run/20/state/"):
        b.copy_blob(blob, b, "run/25/" + blob.name[len("run/20/") :])
    assert _steps_in_bucket(local_gcs, bucket, "run") == {10: True, 20: False, 25: False}
    assert latest_checkpoint(directory).step == 10

    result = _fit(sim_cluster, directory, 30)
    assert result.steps == list(range(10, 30))  # resumed from 10, never from an unfinished step
    assert max_rel_err(result.losses, ref_losses[10:30]) <= 1e-4
    # 20 was saved again; the unfinished 25 was deleted when the new world started.
    assert _steps_in_bucket(local_gcs, bucket, "run") == {10: True, 20: True, 30: True}


def test_slice_killed_during_a_save(sim_cluster, local_gcs, reference):
    """SIGKILL a slice while a checkpoint is being written: the previous committed step is restored,
    the unfinished one never is, and later saves land."""
    ensure_slices(sim_cluster, 4)
    ref_losses, _ = reference
    bucket = _bucket(local_gcs)
    cfg = _config(sim_cluster, num_slices=3, checkpoint_dir=f"gs://{bucket}/run", checkpoint_every=5, snapshot_every=0)
    trainer = ElasticTrainer(DigitsMLPTask(), cfg, progress=False)
    seen: dict = {}
    done = threading.Event()

    def kill_mid_save():
        while not done.is_set():
            steps = _steps_in_bucket(local_gcs, bucket, "run")
            unfinished = [s for s, ok in steps.items() if not ok and s >= 15]
            world = trainer.world
            if unfinished and world is not None:
                pid = world.host_infos[1]["pid"]  # slice 1's process: the commit waits for it
                os.kill(pid, signal.SIGSTOP)
                time.sleep(0.5)
                now = _steps_in_bucket(local_gcs, bucket, "run")
                if not now.get(unfinished[0], True):
                    seen.update(step=unfinished[0], committed=sorted(s for s, ok in now.items() if ok))
                    os.kill(pid, signal.SIGKILL)
                    return
                os.kill(pid, signal.SIGCONT)  # it got committed first: try the next save
            time.sleep(0.01)

    watcher = threading.Thread(target=kill_mid_save, daemon=True)
    watcher.start()
    try:
        result = trainer.fit(40)
    finally:
        done.set()
        watcher.join(timeout=10)
    assert seen, "no save was caught in flight"
    unfinished, previous = seen["step"], max(seen["committed"])
    rec = result.recoveries[0]
    assert rec.restore_source == "checkpoint"
    assert rec.restored_from_step + 1 == previous < unfinished
    restored = [e["step"] for e in result.events if e["kind"] == "checkpoint_restore"]
    assert unfinished not in restored
    # Later saves landed, the unfinished step among them (re-saved by the next world), and
    # nothing unfinished is left in the bucket (max_to_keep=3 keeps the last three).
    failed_at = next(i for i, e in enumerate(result.events) if e["kind"] == "failure")
    later = [e["step"] for e in result.events[failed_at:] if e["kind"] == "checkpoint_committed"]
    assert unfinished in later and later[-1] == 40, later
    final = _steps_in_bucket(local_gcs, bucket, "run")
    assert final == {30: True, 35: True, 40: True}, final
    assert result.steps == list(range(40))
    assert max_rel_err(result.losses, ref_losses) <= 1e-4


def test_the_final_checkpoint_survives_a_failure_while_it_is_written(sim_cluster, tmp_path, reference):
    """A process dies as the last step's save is in flight: the next world saves that step again,
    and ``fit`` returns only once it is committed."""
    ensure_slices(sim_cluster, 4)
    directory = str(tmp_path / "ckpt")
    plan = FaultPlan({29: lambda t: kill_process_of_slice(t, 1)})
    trainer = ElasticTrainer(
        DigitsMLPTask(),
        _config(sim_cluster, checkpoint_dir=directory, checkpoint_every=1000),
        progress=False,
        on_step=plan.on_step,
    )
    plan.trainer = trainer
    result = trainer.fit(30)
    assert not plan.faults and len(result.recoveries) == 1 and result.steps == list(range(30))
    assert latest_checkpoint(directory).step == 30
    assert [e["step"] for e in result.events if e["kind"] == "checkpoint_committed"][-1] == 30
    assert max_rel_err(result.losses, reference[0][:30]) <= 1e-4


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(sim_cluster, tmp_path, reference):
    ensure_slices(sim_cluster, 4)
    ref_losses, _ = reference
    directory = str(tmp_path / "ckpt")
    _fit(sim_cluster, directory, 20, every=10)  # commits 10 and 20
    damaged = 0
    for root, _, files in os.walk(os.path.join(directory, "20", "state")):
        if os.path.basename(root) == "d":  # OCDBT data files: the arrays; the metadata still reads
            for f in files:
                open(os.path.join(root, f), "r+b").truncate(0)
                damaged += 1
    assert damaged and latest_checkpoint(directory).step == 20
    result = _fit(sim_cluster, directory, 30, every=10)
    assert [e["step"] for e in result.events if e["kind"] == "checkpoint_unreadable"] == [20]
    assert [e["step"] for e in result.events if e["kind"] == "checkpoint_restore"] == [10]
    assert result.steps == list(range(10, 30)) and latest_checkpoint(directory).step == 30
    assert max_rel_err(result.losses, ref_losses[10:30]) <= 1e-4


def test_checkpoints_belong_to_their_task_and_another_runs_are_loaded_only_when_asked(sim_cluster, tmp_path, reference):
    @dataclasses.dataclass
    class OtherTask(DigitsMLPTask):
        """Another job: same shapes, another name."""

    ensure_slices(sim_cluster, 4)
    ref_losses, _ = reference
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _fit(sim_cluster, a, 20, every=10)
    assert latest_checkpoint(a).metadata["task"] == "DigitsMLPTask"
    cfg_a = _config(sim_cluster, checkpoint_dir=a, checkpoint_every=10)
    with pytest.raises(ValueError, match=r"holds checkpoints of task 'DigitsMLPTask'.*resume_from="):
        ElasticTrainer(OtherTask(), cfg_a, progress=False).fit(30)
    # Asked for: start from A's newest checkpoint, write to B; A is only read.
    cfg_b = _config(sim_cluster, checkpoint_dir=b, checkpoint_every=10)
    result = ElasticTrainer(OtherTask(), cfg_b, progress=False).fit(30, resume_from=a)
    assert [e["step"] for e in result.events if e["kind"] == "checkpoint_restore"] == [20]
    assert result.steps == list(range(20, 30)) and max_rel_err(result.losses, ref_losses[20:30]) <= 1e-4
    assert (latest_checkpoint(b).step, latest_checkpoint(b).metadata["task"]) == (30, "OtherTask")
    assert latest_checkpoint(a).step == 20
    # B now holds checkpoints, so resuming from A into it would save among them, and a
    # recovery without a snapshot would restore B's newest (another run's step): refused up front.
    with pytest.raises(ValueError, match=r"already holds checkpoints.*step 30.*empty checkpoint_dir"):
        ElasticTrainer(OtherTask(), cfg_b, progress=False).fit(40, resume_from=a)
    assert latest_checkpoint(b).step == 30


def test_a_slow_synchronous_save_is_not_a_hang(sim_cluster, local_gcs, monkeypatch):
    """Synchronous saves to a far-away bucket (every request held SLOW_BUCKET_DELAY_S) take longer
    than the watchdog allows a step: still no hang."""
    from ray_elastic.sim.local_gcs import FlakyEndpoint

    ensure_slices(sim_cluster, 4)
    slow = FlakyEndpoint(local_gcs, fail_every=0, delay_s=SLOW_BUCKET_DELAY_S)
    try:
        for k, v in slow.env.items():  # the slice processes get the driver's GCS environment
            monkeypatch.setenv(k, v)
        cfg = _config(
            sim_cluster,
            checkpoint_dir=f"gs://{_bucket(local_gcs)}/run",
            checkpoint_every=5,
            async_checkpointing=False,
            failure=FailureConfig(hang_timeout_min_s=SLOW_SAVE_WATCHDOG_S, hang_timeout_factor=1.0),
        )
        result = ElasticTrainer(DigitsMLPTask(), cfg, progress=False).fit(10)
    finally:
        monkeypatch.undo()
        slow.stop()
    saves = [e["blocking_s"] for e in result.events if e["kind"] == "checkpoint_save"]
    failures = [e for e in result.events if e["kind"] == "failure"]
    assert not failures and result.steps == list(range(10)) and len(saves) == 2, (saves, failures)
    assert min(saves) > SLOW_SAVE_WATCHDOG_S, saves  # the watchdog's limit was really passed, every time


def test_a_save_that_never_ends_is_a_failed_save_not_a_busy_world(sim_cluster, local_gcs, monkeypatch):
    """A process inside a save was "busy" for the watchdog however long the save took,
    so a hung write kept the world waiting forever. Past ``save_timeout_s`` it is a failed save; with
    ``max_save_failures_in_a_row=1`` the run then stops at once, naming the storage."""
    from ray_elastic.errors import StorageFailingError
    from ray_elastic.sim.local_gcs import FlakyEndpoint

    ensure_slices(sim_cluster, 4)
    stuck = FlakyEndpoint(local_gcs, fail_every=0)
    directory = f"gs://{_bucket(local_gcs)}/run"

    def hang_the_writes(metrics):  # after the world formed: its first save (checkpoint 5) never ends
        if metrics["step"] == 2:
            stuck.write_delay_s = 120.0

    try:
        for k, v in stuck.env.items():  # the slice processes get the driver's GCS environment
            monkeypatch.setenv(k, v)
        cfg = _config(
            sim_cluster,
            checkpoint_dir=directory,
            checkpoint_every=5,
            async_checkpointing=False,
            save_timeout_s=3.0,
            failure=FailureConfig(
                hang_timeout_min_s=SLOW_SAVE_WATCHDOG_S, hang_timeout_factor=1.0, max_save_failures_in_a_row=1
            ),
        )
        trainer = ElasticTrainer(DigitsMLPTask(), cfg, progress=False, on_step=hang_the_writes)
        t0 = time.monotonic()
        with pytest.raises(StorageFailingError, match=r"failed 1 times in a row.*save_timeout_s=3"):
            trainer.fit(20)
        assert time.monotonic() - t0 < 90
    finally:
        monkeypatch.undo()
        stuck.stop()
    failures = [e for e in trainer.events.events if e["kind"] == "failure"]
    # the failure that stopped the run is the hung save; one before it (a world starved of the
    # 2 cores past the 1 s watchdog) was recovered from, as any other: it must not name the storage
    *recovered, failure = failures
    assert set(failure["kinds"].values()) == {"storage"} and "over save_timeout_s=3" in failure["error"], failures
    assert all("storage" not in f["kinds"].values() for f in recovered), failures


def test_transient_storage_errors_are_retried_not_failures(sim_cluster, local_gcs, reference, monkeypatch):
    """Every 20th request to the bucket is a 503 while a run restores checkpoint 20 and saves 30
    (listings, reads, writes, commits): the GCS clients retry them with backoff, so no world
    fails and nothing is rewound. (Every 4th also passes, at four times the length: each refusal
    costs a backoff of about a second.)"""
    from ray_elastic.sim.local_gcs import FlakyEndpoint

    ensure_slices(sim_cluster, 3)
    bucket, ref_losses = _bucket(local_gcs), reference[0]
    _fit(sim_cluster, f"gs://{bucket}/run", 20)
    flaky = FlakyEndpoint(local_gcs, fail_every=20)
    try:
        for k, v in flaky.env.items():  # the slice processes get the driver's GCS environment
            monkeypatch.setenv(k, v)
        result = _fit(sim_cluster, f"gs://{bucket}/run", 30)
    finally:
        monkeypatch.undo()  # back to the emulator itself
        flaky.stop()
    assert sum(flaky.failed.values()) > 0, flaky.failed
    assert [e for e in result.events if e["kind"] in ("failure", "checkpoint_unreadable")] == []
    assert [e["step"] for e in result.events if e["kind"] == "checkpoint_restore"] == [20]
    assert result.steps == list(range(20, 30)) and max_rel_err(result.losses, ref_losses[20:30]) <= 1e-4
    assert _steps_in_bucket(local_gcs, bucket, "run") == {10: True, 20: True, 30: True}


def _train_cmd(address_env, directory, run_dir):
    return [
        BIN,
        "train",
        "--example",
        "mlp",
        "--num-slices",
        "2",
        "--topology",
        "2x2x1",
        "--devices-per-host",
        "2",
        "--steps",
        "80",
        "--global-batch",
        str(GBS),
        "--seed",
        str(SEED),
        "--steps-per-chunk",
        "5",
        "--standby-workers",
        "0",
        "--checkpoint-dir",
        directory,
        "--checkpoint-every",
        "10",
        "--snapshot-every",
        "0",  # checkpoints alone: a rerun resumes from the newest (test_driver_loss.py: from memory)
        "--run-dir",
        run_dir,
        "--json",
        "--no-progress",
    ]


def _run_losses(run_dir: str) -> list[dict]:
    """Per run start in the event log: {step: loss} (last value wins for a recomputed step)."""
    runs = []
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        for line in f:
            e = json.loads(line)
            if e["kind"] == "run_started":
                runs.append({"resume": e["resume_from_checkpoint"], "losses": {}})
            elif e["kind"] == "steps":
                runs[-1]["losses"].update(zip(e["steps"], e["losses"]))
    return runs


def test_driver_killed_and_rerun_resumes_with_the_same_losses(sim_cluster, local_gcs, tmp_path):
    ensure_slices(sim_cluster, 4)
    bucket = _bucket(local_gcs)
    directory, run_dir = f"gs://{bucket}/job", str(tmp_path / "run")
    env = {**os.environ, "RAY_ADDRESS": sim_cluster.address}
    log = open(tmp_path / "first.log", "w")
    first = subprocess.Popen(_train_cmd(env, directory, run_dir), env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and first.poll() is None:
        if any(ok and s >= 20 for s, ok in _steps_in_bucket(local_gcs, bucket, "job").items()):
            break
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)  # the driver itself dies mid-run
    assert first.wait(timeout=30) == -signal.SIGKILL
    log.close()
    killed_at = latest_checkpoint(directory).step
    assert 20 <= killed_at < 80

    second = subprocess.run(_train_cmd(env, directory, run_dir), env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    summary = json.loads([ln for ln in second.stdout.splitlines() if ln.startswith("{")][-1])
    assert summary["resumed_from_checkpoint"] == killed_at

    runs = _run_losses(run_dir)
    assert [r["resume"] for r in runs] == [None, killed_at]
    resumed = runs[1]["losses"]
    assert sorted(resumed) == list(range(killed_at, 80))

    # The same run uninterrupted, on the same world shape.
    whole = ElasticTrainer(DigitsMLPTask(), _config(sim_cluster), progress=False).fit(80)
    assert max_rel_err([resumed[s] for s in range(killed_at, 80)], whole.losses[killed_at:]) <= 1e-6


def test_bad_checkpoint_locations_fail_before_any_slice_is_taken(sim_cluster, local_gcs, tmp_path):
    ensure_slices(sim_cluster, 4)
    deadline = time.monotonic() + 60  # earlier runs' slices are given back asynchronously
    while ray.available_resources().get("TPU", 0) < ray.cluster_resources()["TPU"] and time.monotonic() < deadline:
        time.sleep(0.2)
    free = ray.available_resources().get("TPU", 0)
    assert free == ray.cluster_resources()["TPU"]
    pgs = len(ray.util.placement_group_table())
    with pytest.raises(ValueError, match="bucket 'no-such-bucket-x' does not exist"):
        ElasticTrainer(
            DigitsMLPTask(), _config(sim_cluster, checkpoint_dir="gs://no-such-bucket-x/run"), progress=False
        ).fit(5)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="is not writable"):
        ElasticTrainer(DigitsMLPTask(), _config(sim_cluster, checkpoint_dir=str(blocker / "ckpt")), progress=False).fit(
            5
        )
    assert len(ray.util.placement_group_table()) == pgs
    assert ray.available_resources().get("TPU", 0) == free

    env = {**os.environ, "RAY_ADDRESS": sim_cluster.address}
    proc = subprocess.run(
        _train_cmd(env, "gs://no-such-bucket-x/run", str(tmp_path / "r")),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr and "gcloud storage buckets create" in proc.stderr, proc.stderr[-2000:]


def test_a_newer_checkpoint_than_the_record_is_set_aside_when_a_snapshot_is_restored(sim_cluster, tmp_path, reference):
    """The world died after checkpoint 20 (the state after step 19) committed but before step 19's
    loss reached the driver; survivors hold a snapshot of step 18, the last step recorded. The run
    goes on from the snapshot (no hole in the losses), so steps 19.. run again and save 20 again,
    which orbax refuses while the old one is there (``StepAlreadyExistsError``: seen in
    ``bench/chaos.py``, one more failure, and the next world took the checkpoint after all). The
    newer checkpoint is set aside, kept, and named in the restore's evidence."""
    import types

    from ray_elastic.control.generations import Generations
    from ray_elastic.decide import RestoreSource

    ensure_slices(sim_cluster, 4)
    ref_losses, _ = reference
    directory = str(tmp_path / "ckpt")
    _fit(sim_cluster, directory, 20, every=10)  # commits 10 and 20
    cfg = _config(sim_cluster, checkpoint_dir=directory, checkpoint_every=10)
    gens = Generations(cfg, backend=types.SimpleNamespace(missing_snapshots=lambda refs, members=(): set()))
    for name in ("a", "b"):
        gens.store.add(name, 0, 18, f"{name}-18")
    members = [types.SimpleNamespace(slice_name=n) for n in ("a", "b")]
    plan = gens.restore_plan(members, last_step=18)
    assert (plan.source, plan.step) == (RestoreSource.SNAPSHOT, 18)
    (moved,) = plan.evidence["superseded_checkpoints"]
    assert os.path.basename(moved).startswith("20.superseded-") and os.path.isdir(moved)
    assert latest_checkpoint(directory).step == 10
    # The run saves step 20 again beside the one set aside.
    result = _fit(sim_cluster, directory, 20, every=10)
    assert result.steps == list(range(10, 20)) and latest_checkpoint(directory).step == 20
    assert os.path.isdir(moved) and max_rel_err(result.losses, ref_losses[10:20]) <= 1e-4
