"""The benchmarks run end to end and print their JSON line (tiny sizes; figures come from full runs).

The chaos smoke is in the default suite (it is a test of recovery); the others are marked
``bench`` (``make test-all`` or ``-m bench``): they check that a bench still runs, which matters
when its figures are refreshed, and would cost the default suite three more clusters."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _last_json(args, timeout=600):
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])


@pytest.mark.bench
def test_overhead_bench_prints_ratio():
    out = _last_json(
        ["bench/overhead.py", "--steps", "40", "--large-steps", "8", "--llm-steps", "8", "--reps", "1"], timeout=900
    )
    assert out["overhead_ratio"] > 0 and out["overhead_ratio_large"] > 0 and out["overhead_ratio_no_snapshots"] > 0
    assert out["overhead_ratio_llm"] > 0
    assert out["snapshot_every_chosen"] >= 1
    assert out["state_bytes_per_process_large"] >= 50 * out["state_bytes_per_process"]
    assert len(out["cpu_probe_s"]) == 2 and min(out["cpu_probe_s"]) > 0


@pytest.mark.bench
def test_scale_bench_prints_the_curve(tmp_path):
    png = tmp_path / "scale.png"
    out = _last_json(
        [
            "bench/scale.py",
            "--slices",
            "2",
            "--multihost",
            "0",
            "--steps",
            "30",
            "--processes",
            "16",
            "--model-steps",
            "20",
            "--model-chunks",
            "10",
            "--plot",
            str(png),
        ],
        timeout=900,
    )
    (point,) = out["clusters"]
    assert point["processes"] == 2 and point["overhead_ratio"] > 0
    assert {r["kind"] for r in point["recoveries"]} == {"process", "node"}
    assert out["driver"][0]["processes"] == 16 and out["driver"][0]["driver_cpu_ms_per_step"] > 0
    assert png.stat().st_size > 10_000


@pytest.mark.bench
def test_recovery_bench_prints_recovery_times():
    out = _last_json(
        [
            "bench/recovery.py",
            "--repeats",
            "1",
            "--positions",
            "0",
            "--kinds",
            "process",
            "preempt",
            "--notice-s",
            "6",
            "--cascades",
            "0",
            "--cold",
            "0",
            "--multihost",
            "0",
            "--gap",
            "5",
            "--gap-s",
            "3",
        ]
    )
    assert out["steps_rewound_max"] == 0 and out["faults"] == 6  # both modes, and the modelled TPU start-up
    # A preemption notice: the slice leaves at a step boundary, and its kill at the deadline changes nothing.
    assert (out["preempt_failures"], out["preempt_rewound_max"], out["preempts_unseen"]) == (0, 0, 0)
    assert 0 < out["preempt_stall_s"] <= out["preempt_stall_worst_s"] < 60 and out["preempt_seconds_left_min"] > 0
    assert out["tpu_breaches"] == 0
    assert 0 < out["replica_resize_recovery_s"] <= out["replica_resize_worst_s"] < 60
    # Every new process waits the modelled start-up once, in parallel: a recovery pays it about once.
    assert out["replica_resize_tpu_model_median_s"] >= out["tpu_startup_s"]
    assert 0 < out["detection_worst_s"] < 60 and 0 < out["pause_resume_recovery_after_arrival_s"] < 60
    assert len(out["cpu_probe_s"]) == 2 and min(out["cpu_probe_s"]) > 0  # the hour's speed, at start and end


@pytest.mark.bench
def test_autoscaler_bench_prints_supply_times():
    out = _last_json(["bench/autoscaler.py", "--repeats", "1", "--multihost", "0"])
    for source in ("autoscaler", "thread"):
        assert 0 < out[f"{source}_demand_median_s"] <= out[f"{source}_demand_worst_s"] < 60
        assert 0 < out[f"{source}_replace_median_s"] < 60


@pytest.mark.bench
def test_checkpoint_bench_prints_save_and_restore_times():
    out = _last_json(["bench/checkpoint.py", "--steps", "20", "--every", "10", "--example", "mlp"])
    assert 0 < out["save_blocking_fraction"] < 1
    assert out["save_total_s"] > 0 and out["restore_s"] > 0 and out["local"]["saves"] == 2


def _chaos(args, timeout):
    out = _last_json(["bench/chaos.py", *args], timeout=timeout)
    assert out["unrecovered"] == 0 and out["faults"] == out["planned"], out
    # Rewound only when every holder of the newest snapshot was lost (or its process died in that step).
    assert out["unexplained_rewound"] == 0 and out["uncommitted_restored"] == 0, out
    assert out["final_checkpoint_committed"], out
    assert out["tpu_breaches"] == 0, out  # every world kept the TPU runtime's rules
    assert out["same_shape_max_diff"] == 0.0, out  # before the world first changed shape: bit for bit
    return out


def test_chaos_bench_recovers_every_fault():
    """A short chaos soak: four faults of the kinds that combine failures (two at once, a second
    during a recovery, one while a world forms, a replacement lost on arrival)."""
    out = _chaos(
        [
            "--faults",
            "4",
            "--multihost-faults",
            "0",
            "--steps",
            "100",
            "--gap",
            "20",
            "--no-noise",
            "--kinds",
            "two_at_once,during_recovery,while_forming,dies_on_arrival",
        ],
        timeout=900,
    )
    assert out["faults"] == 4 and out["max_rel_loss_diff"] <= 1e-4, out
    slowest = out["slowest_formation"]  # where the longest recovery's seconds went, and after what
    assert slowest["total_s"] >= slowest["compile_s"] > 0 and "chips_wait_s" in slowest, slowest
    # The driver's clock over joining and compiling holds the processes' own phases (the rest is waiting).
    assert slowest["total_s"] >= slowest["join_wall_s"] + slowest["compile_wall_s"], slowest
    assert slowest["join_wall_s"] >= slowest["jax_init_s"] and slowest["compile_wall_s"] >= slowest["compile_s"], (
        slowest
    )
    gp = out["goodput_breakdown"]  # where the badput went: the seconds add up to the run's wall time
    assert gp["goodput"] == out["goodput"] and gp["productive_s"] > 0, gp
    assert (
        abs(sum(v for k, v in gp.items() if k not in ("total_s", "goodput")) - gp["total_s"]) < 0.05 * gp["total_s"]
    ), gp


@pytest.mark.bench
def test_chaos_bench_handles_faults_that_kill_nothing():
    """A preemption notice, a slow data source and a stuck data source: each named for the right
    slice, none unrecovered."""
    out = _chaos(
        [
            "--faults", "3", "--multihost-faults", "0", "--steps", "400", "--gap", "100", "--no-noise",
            "--kinds", "preempt,slow_data,stuck_data",
        ],
        timeout=900,
    )  # fmt: skip
    assert (out["attributed"], out["misattributed"], out["not_named"]) == (2, 0, 0), out


@pytest.mark.bench
def test_chaos_bench_never_keeps_wrong_numbers():
    """A record that becomes inf (its step skipped, never kept) and a flipped bit (found for its
    slice): nothing unrecovered, no bad step kept."""
    out = _chaos(
        [
            "--faults", "2", "--multihost-faults", "0", "--steps", "300", "--gap", "100", "--no-noise",
            "--kinds", "poisoned_record,bit_flip",
        ],
        timeout=900,
    )  # fmt: skip
    assert (out["unrecovered"], out["bad_kept"], out["poison_kept"], out["flips_not_found"]) == (0, 0, [], 0), out
    assert out["poisoned"] == out["skipped"] + out["poison_unread"] == 1 and out["flips_misnamed"] == 0, out


@pytest.mark.soak
def test_chaos_bench_soak():
    """Every kind, one-host and two-host slices: what the README reports, at a tenth of the length."""
    out = _chaos(["--faults", "16", "--multihost-faults", "2"], timeout=3600)
    assert out["loss_diff_over_noise"] <= 2, out


@pytest.mark.bench
def test_recovery_bench_runs_the_llm_example():
    out = _last_json(
        [
            "bench/recovery.py",
            "--model",
            "llm",
            "--repeats",
            "1",
            "--positions",
            "1",
            "--kinds",
            "node",
            "--cascades",
            "0",
            "--cold",
            "0",
            "--multihost",
            "0",
            "--modes",
            "replica-resize",
            "--gap",
            "5",
            "--gap-s",
            "3",
            "--tpu-startup",
            "0",
            "0",
        ]
    )
    assert out["steps_rewound_max"] == 0 and out["faults"] == 1


@pytest.mark.bench
def test_memory_bench_keeps_per_device_memory_across_a_resize():
    out = _last_json(["bench/memory.py", "--d-model", "64", "--layers", "1", "--seq-len", "64"])
    assert out["resize_memory_ratio"] <= 1.05 < out["resize_memory_ratio_no_accumulation"]


@pytest.mark.bench
def test_prefetch_bench_prints_ratios():
    out = _last_json(["bench/prefetch.py", "--steps", "12"])
    assert out["prefetch_ratio"] > 0 and out["blocking_serial_ratio"] > 0


@pytest.mark.bench
def test_driver_loss_bench_resumes_from_memory_and_the_baseline_from_checkpoints():
    out = _last_json(["bench/driver_loss.py", "--steps", "60", "--every", "20", "--kill-at", "30"])
    assert out["steps_rewound_in_memory"] == 0 < out["steps_rewound_checkpoints_alone"] and out["losses_equal"], out


@pytest.mark.bench
@pytest.mark.skipif(not __import__("shutil").which("redis-server"), reason="needs redis-server")
def test_head_loss_bench_trains_through_a_gcs_restart():
    out = _last_json(["bench/head_loss.py", "--steps", "120", "--at", "30", "--down", "2"])
    alive, lost = out["rows"]
    assert alive["finished"] and alive["failures"] == 0 and lost["finished"] and lost["steps_rewound"] == 0, out
