"""The ``ray-elastic`` entry point, run as a user runs it (a separate process)."""

import json
import os
import re
import subprocess
import sys

SIM_CLUSTER = {"num_slices": 2}
BIN = os.path.join(os.path.dirname(sys.executable), "ray-elastic")


def _run(args, env=None, timeout=300):
    proc = subprocess.run([BIN, *args], capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _summary(proc):
    """The ``--json`` summary line (worker logs forwarded by Ray may interleave)."""
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1])


def test_demo_kills_a_slice_and_recovers():
    proc = _run(
        [
            "demo",
            "--example",
            "mlp",
            "--num-slices",
            "3",
            "--steps",
            "40",
            "--global-batch",
            "24",
            "--kill-at",
            "15",
            "--mode",
            "pause-and-resume",
            "--arrival-delay",
            "1",
            "--json",
            "--no-progress",
        ]
    )
    summary = _summary(proc)
    assert summary["steps"] == 40 and summary["slices"] == 3
    assert summary["mesh"] == {"replica": 3, "fsdp": 2, "tensor": 1}
    # The default snapshot policy (AutoInterval) bounds the rewind by the interval it chose.
    assert summary["recoveries"] == 1 and summary["steps_rewound"] <= summary["max_rewind_steps"]
    assert "after step 15" in summary["killed_slice"]
    assert 0 < summary["detection_s"] < summary["kill_to_training_again_s"]
    assert summary["final_loss"] < summary["first_loss"]


def _slice_processes_started() -> int:
    """Slice actors the cluster has ever had, dead ones included (Ray's actor table; the state API
    needs the dashboard, which the test cluster does not run)."""
    from ray._private.state import actors

    return sum(a["ActorClassName"].endswith("SliceWorker") for a in actors().values())


def test_train_connects_to_an_existing_cluster_via_ray_address(sim_cluster):
    env = {**os.environ, "RAY_ADDRESS": sim_cluster.address}
    before = _slice_processes_started()
    proc = _run(
        [
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
            "12",
            "--global-batch",
            "8",
            "--standby-workers",
            "0",
            "--json",
            "--no-progress",
        ],
        env=env,
    )
    summary = _summary(proc)
    assert summary["steps"] == 12 and summary["slices"] == 2
    assert _slice_processes_started() - before == 2  # --standby-workers 0: one process per slice, no spare


def test_train_refuses_a_bad_standby_count_before_taking_anything():
    proc = subprocess.run(
        [BIN, "train", "--example", "mlp", "--standby-workers", "-1", "--address", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "standby_workers must be an integer >= 0" in proc.stderr, proc.stderr[-2000:]


def test_train_reports_missing_capacity_clearly(sim_cluster):
    env = {**os.environ, "RAY_ADDRESS": sim_cluster.address}
    proc = subprocess.run(
        [
            BIN,
            "train",
            "--example",
            "mlp",
            "--num-slices",
            "2",
            "--topology",
            "2x2x2",
            "--devices-per-host",
            "2",
            "--steps",
            "5",
            "--global-batch",
            "8",
            "--slice-timeout",
            "3",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 1
    assert "v4-16" in proc.stderr and "Add TPU capacity" in proc.stderr, proc.stderr[-2000:]


def test_sim_command_serves_ray_job_submit_and_kills_a_slice_on_request(tmp_path):
    """``ray-elastic sim`` in the foreground; a job submitted to it survives ``kill`` typed on stdin, and
    grows back onto the slice Ray's autoscaler launches for the replacement it asks for."""
    import queue
    import threading
    import time

    from ray.job_submission import JobStatus, JobSubmissionClient

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    sim = subprocess.Popen(
        [BIN, "sim", "--num-slices", "3"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in sim.stdout], daemon=True).start()

    seen = []

    def wait_line(prefix, timeout=180):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                ln = lines.get(timeout=1).strip()
            except queue.Empty:
                continue
            seen.append(ln)
            if ln.startswith(prefix):
                return ln
        raise TimeoutError(f"no line starting with {prefix!r}; the sim printed:\n" + "\n".join(seen[-30:]))

    try:
        submit_cmd = wait_line("ray job submit").split()
        address = submit_cmd[submit_cmd.index("--address") + 1]
        run_dir = str(tmp_path / "job")
        train = submit_cmd[submit_cmd.index("--") + 1 :]
        # The printed job's 800 steps: long enough that the grow-back (the autoscaler's launch, then the
        # newcomer's process starting while the smaller world trains) comes before the end on a loaded
        # 2-core machine; with 300 the run ended first in CI, 20 s after the kill.
        steps = int(train[train.index("--steps") + 1])
        train[train.index("--run-dir") + 1] = run_dir
        job_id = f"sim-{int(time.time())}"
        proc = subprocess.run(
            [
                os.path.join(os.path.dirname(BIN), "ray"),
                "job",
                "submit",
                "--address",
                address,
                "--submission-id",
                job_id,
                "--no-wait",
                "--",
                *train,
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        client = JobSubmissionClient(address)
        events = os.path.join(run_dir, "events.jsonl")
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if os.path.exists(events) and '"kind": "steps"' in open(events).read():
                break
            assert client.get_job_status(job_id) not in (JobStatus.FAILED, JobStatus.STOPPED), client.get_job_logs(
                job_id
            )[-3000:]
            time.sleep(0.5)
        sim.stdin.write("kill\n")
        sim.stdin.flush()
        # The slice's name (Ray's own log lines may be glued onto the sim's line: "...-2\x1b[33m(raylet)").
        killed = re.match(r"killed (sim-[a-z0-9]+-\d+-\d+)", wait_line("killed ")).group(1)
        while (
            client.get_job_status(job_id) not in (JobStatus.SUCCEEDED, JobStatus.FAILED)
            and time.monotonic() < deadline + 120
        ):
            time.sleep(1)
        logs = client.get_job_logs(job_id)
        assert client.get_job_status(job_id) == JobStatus.SUCCEEDED, logs[-3000:]
        summary = json.loads([ln for ln in logs.splitlines() if ln.startswith("{")][-1])
        assert summary["steps"] == steps and summary["recoveries"] == 1, summary
        assert summary["slices"] == 3 and summary["scale_ups"] == 1, (
            summary,
            [ln for ln in open(events) if '"failure"' in ln or '"recovered"' in ln],
        )
        assert killed in open(events).read()
        sim.stdin.write("list\n")
        sim.stdin.flush()
        assert killed not in wait_line("slices:")
        sim.stdin.write("quit\n")
        sim.stdin.flush()
        assert sim.wait(timeout=120) == 0
    finally:
        if sim.poll() is None:  # stop it the way a user does, so it stops its nodes
            try:
                sim.stdin.write("quit\n")
                sim.stdin.flush()
                sim.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                sim.kill()
                sim.wait(timeout=30)
