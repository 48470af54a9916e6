"""The ``ray-elastic`` entry point, run as a user runs it (a separate process)."""

import json
import os
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
    proc = _run(["demo", "--example", "mlp", "--num-slices", "3", "--steps", "40", "--global-batch", "24",
                 "--kill-at", "15", "--mode", "pause-and-resume", "--arrival-delay", "1", "--json", "--no-progress"])
    summary = _summary(proc)
    assert summary["steps"] == 40 and summary["slices"] == 3
    assert summary["mesh"] == {"replica": 3, "fsdp": 2}
    assert summary["recoveries"] == 1 and summary["steps_rewound"] == 0
    assert "after step 15" in summary["killed_slice"]
    assert 0 < summary["detection_s"] < summary["kill_to_training_again_s"]
    assert summary["final_loss"] < summary["first_loss"]


def test_train_connects_to_an_existing_cluster_via_ray_address(sim_cluster):
    env = {**os.environ, "RAY_ADDRESS": sim_cluster.address}
    proc = _run(
        ["train", "--example", "mlp", "--num-slices", "2", "--topology", "2x2x1", "--devices-per-host", "2",
         "--steps", "12", "--global-batch", "8", "--json", "--no-progress"],
        env=env,
    )
    summary = _summary(proc)
    assert summary["steps"] == 12 and summary["slices"] == 2


def test_train_reports_missing_capacity_clearly(sim_cluster):
    env = {**os.environ, "RAY_ADDRESS": sim_cluster.address}
    proc = subprocess.run(
        [BIN, "train", "--example", "mlp", "--num-slices", "2", "--topology", "2x2x2", "--devices-per-host", "2",
         "--steps", "5", "--global-batch", "8", "--slice-timeout", "3", "--no-progress"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert proc.returncode == 1
    assert "v4-16" in proc.stderr and "Add TPU capacity" in proc.stderr, proc.stderr[-2000:]
