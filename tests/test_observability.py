"""What a user sees of a run with a lost slice: event log, goodput, report PNG, live progress, Ray metrics."""

import contextlib
import io
import os
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import ray

from ray_elastic import ElasticConfig, ElasticTrainer
from ray_elastic.examples.digits_mlp import DigitsMLPTask
from ray_elastic.observe.goodput import BADPUT, account
from ray_elastic.observe.report import load_events, render, timeline

SIM_CLUSTER = {"num_slices": 3}
SHARE_CLUSTER = True  # conftest.py: one cluster for the modules of plain 1-host slices
BIN = os.path.join(os.path.dirname(sys.executable), "ray-elastic")
STEPS, KILL_AT = 40, 15
RUN_NAME = "obs-metrics"  # given to ElasticTrainer(name=...): the Ray metrics' run tag


@pytest.fixture(scope="module")
def run(sim_cluster, tmp_path_factory):
    """40 steps on 3 slices, one slice's host removed after step 15 (replica-resize to 2)."""
    run_dir = str(tmp_path_factory.mktemp("run") / "obs-run")
    killed = {}
    box = {}

    def on_step(metrics):
        if not killed and metrics["step"] >= KILL_AT:
            victim = box["t"].world.plan.slice_names[-1]
            killed.update(name=victim, at=time.time())
            threading.Thread(target=sim_cluster.kill_slice, args=(victim,), daemon=True).start()

    # One warm standby per host (the default is 2): the recovery is still warm, three fewer processes start.
    cfg = ElasticConfig(
        num_slices=3,
        global_batch_size=48,
        slice=sim_cluster.slice_spec,
        steps_per_chunk=5,
        seed=1,
        snapshot_every=1,
        standby_workers=1,
    )
    trainer = ElasticTrainer(DigitsMLPTask(), cfg, progress=True, on_step=on_step, run_dir=run_dir, name=RUN_NAME)
    box["t"] = trainer
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        result = trainer.fit(STEPS)
    return {
        "result": result,
        "run_dir": run_dir,
        "killed": killed,
        "stderr": err.getvalue(),
        "stdout": out.getvalue(),
        "trainer": trainer,
    }


def test_event_log_records_chunks_failure_phases_and_resize(run):
    events = load_events(run["run_dir"])
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "run_started" and kinds[-1] == "run_finished"
    steps = [s for e in events if e["kind"] == "steps" for s in e["steps"]]
    assert sorted(set(steps)) == list(range(STEPS))
    assert any(e.get("snapshot_steps") for e in events if e["kind"] == "steps")
    (failure,) = [e for e in events if e["kind"] == "failure"]
    assert failure["lost_slices"] == [run["killed"]["name"]]
    assert failure["error"] and 0 < failure["detection_latency_s"] < 30
    (rec,) = [e for e in events if e["kind"] == "recovered"]
    for phase in (
        "classify_s",
        "teardown_s",
        "wait_for_capacity_s",
        "world_formation_s",
        "state_load_s",
        "compile_s",
        "recovery_s",
    ):
        assert rec[phase] >= 0, phase
    assert rec["steps_rewound"] == 0 and rec["restore_source"] == "snapshot"
    (resize,) = [e for e in events if e["kind"] == "resize"]
    assert (resize["from_slices"], resize["to_slices"]) == (3, 2)


def test_goodput_accounts_for_every_second(run):
    events = load_events(run["run_dir"])
    gp = account(events)
    parts = gp.productive_s + sum(gp.badput_s.values())
    assert abs(parts - gp.total_s) <= 0.01 * gp.total_s
    assert set(gp.badput_s) == set(BADPUT)
    assert gp.productive_s > 0 and gp.badput_s["startup"] > 0 and gp.badput_s["compilation"] > 0
    assert gp.badput_s["failure_detection"] > 0 and gp.badput_s["world_reformation"] > 0
    assert gp.badput_s["rewound_work"] == 0
    assert 0 < gp.goodput < 1
    assert run["result"].summary["goodput"] == pytest.approx(gp.goodput, abs=1e-3)
    # The summary table is printed at the end of the run.
    assert "goodput" in run["stdout"] and "failure detection" in run["stdout"]


def test_goodput_counts_rewound_steps_and_reads_the_last_run():
    def steps(ts, s, t):
        return {"ts": ts, "kind": "steps", "steps": s, "losses": [1.0] * len(s), "step_time_s": [t] * len(s)}

    events = [
        {"ts": 0.0, "kind": "run_started"},
        steps(1, [0, 1, 2], 0.1),
        {"ts": 100.0, "kind": "run_started"},
        {"ts": 101.0, "kind": "world_formed", "compile_s": 0.5, "total_s": 1.0, "slices": ["a"]},
        steps(102.0, [0, 1, 2], 0.2),
        steps(103.0, [1, 2, 3], 0.2),
        {"ts": 110.0, "kind": "run_finished"},
    ]
    gp = account(events)
    assert gp.total_s == pytest.approx(10.0)
    assert gp.productive_s == pytest.approx(0.8) and gp.badput_s["rewound_work"] == pytest.approx(0.4)
    assert gp.badput_s["startup"] == pytest.approx(0.5) and gp.badput_s["compilation"] == pytest.approx(0.5)


def test_goodput_counts_each_second_once_when_reports_overlap():
    """The first report of a step is kept, from whichever process sent it: intervals of two processes
    overlap, and steps drained after a failure overlap its detection window. Every second is still
    counted once (the parts add up to the run exactly)."""

    def steps(ts, s, t, ends):
        return {"ts": ts, "kind": "steps", "steps": s, "losses": [1.0] * len(s), "step_time_s": t, "finished_at": ends}

    events = [
        {"ts": 0.0, "kind": "run_started"},
        {"ts": 10.0, "kind": "world_formed", "compile_s": 1.0, "total_s": 10.0, "slices": ["a", "b"]},
        # step 1 reported by a process that finished step 0 later than the one that reported it
        steps(12.0, [0, 1, 2], [1.0, 1.5, 0.5], [11.0, 11.6, 12.0]),
        steps(14.0, [3], [1.0], [13.0]),  # drained after the failure: inside the detection window
        {"ts": 14.0, "kind": "failure", "since_last_progress_s": 2.0, "classify_s": 0.0},
        {"ts": 15.0, "kind": "world_formed", "compile_s": 0.5, "total_s": 0.8, "slices": ["a"]},
        {"ts": 15.0, "kind": "recovered", "teardown_s": 0.2, "wait_for_capacity_s": 0.0},
        steps(16.0, [3, 4], [0.5, 0.5], [15.5, 16.0]),
        {"ts": 16.0, "kind": "run_finished"},
    ]
    gp = account(events)
    assert gp.total_s == 16.0
    assert gp.productive_s + sum(gp.badput_s.values()) == pytest.approx(16.0)
    assert gp.productive_s == pytest.approx(3.0)  # steps 0-2 span 10.0-12.0, steps 3-4 15.0-16.0
    assert gp.badput_s["rewound_work"] == pytest.approx(1.0)  # step 3's first run, 12.0-13.0
    assert gp.badput_s["failure_detection"] == pytest.approx(1.0)  # 12.0-14.0 less step 3's run
    assert gp.badput_s["startup"] == pytest.approx(9.0) and gp.badput_s["compilation"] == pytest.approx(1.5)
    assert gp.badput_s["world_reformation"] == pytest.approx(0.3 + 0.2)


def test_goodput_counts_the_skew_between_reporting_processes_as_training():
    """Processes in lockstep finish a step milliseconds apart, and the reporter changes between
    stream items: the gap between one process's step s and another's step s+1 is training time
    of that world, not ``other``. A new world's first step still starts at its own interval."""

    def steps(s, ends, gen):
        return {
            "ts": ends[-1],
            "kind": "steps",
            "generation": gen,
            "steps": s,
            "losses": [1.0] * len(s),
            "step_time_s": [1.0] * len(s),
            "finished_at": ends,
        }

    events = [
        {"ts": 0.0, "kind": "run_started"},
        {"ts": 10.0, "kind": "world_formed", "compile_s": 0.0, "total_s": 10.0, "slices": ["a", "b"]},
        steps([0, 1], [11.0, 12.0], 0),  # process A
        steps([2, 3], [13.1, 14.1], 0),  # process B: it finished step 1 at 12.1
        {"ts": 15.0, "kind": "world_formed", "compile_s": 0.0, "total_s": 0.5, "slices": ["a"]},
        steps([4], [16.5], 1),  # a new world: 15.5-16.5, not from 14.1
        {"ts": 16.5, "kind": "run_finished"},
    ]
    gp = account(events)
    assert gp.productive_s == pytest.approx(4.1 + 1.0)  # 10.0-14.1 without a gap at 12.0-12.1, and 15.5-16.5
    assert gp.badput_s["world_reformation"] == pytest.approx(0.5)
    assert gp.badput_s["other"] == pytest.approx(0.4 + 0.5)  # 14.1-14.5 and 15.0-15.5: no step, no phase
    assert gp.productive_s + sum(gp.badput_s.values()) == pytest.approx(16.5)


def test_report_timeline_reflects_the_events(run):
    tl = timeline(load_events(run["run_dir"]))
    assert [n for _, n in tl.slices_alive] == [0, 3, 2, 0]
    ((t_fail, lost),) = tl.failures
    assert lost == [run["killed"]["name"]]
    ((r0, r1),) = tl.recoveries
    assert r0 <= t_fail + 1e-6 and r1 > t_fail
    assert tl.slices_alive[2][0] == pytest.approx(t_fail)
    assert [s for s, _ in tl.losses] == list(range(STEPS))
    assert tl.losses == [(s, v) for s, v in zip(run["result"].steps, run["result"].losses)]
    assert tl.step_rate and all(r > 0 for _, r in tl.step_rate)


def test_report_timeline_marks_grow_back_pauses():
    events = [
        {"ts": 10.0, "kind": "run_started", "num_slices": 3},
        {"ts": 12.0, "kind": "world_formed", "slices": ["a", "b"], "compile_s": 0.5, "total_s": 1.0},
        {"ts": 20.0, "kind": "scale_up", "pause_s": 1.5, "ready_at": 20.0, "from_slices": 2, "to_slices": 3},
        {"ts": 20.0, "kind": "world_formed", "slices": ["a", "b", "c"], "compile_s": 0.5, "total_s": 1.0},
        {"ts": 30.0, "kind": "run_finished"},
    ]
    tl = timeline(events)
    assert tl.grow_pauses == [(8.5, 10.0)]
    assert [n for _, n in tl.slices_alive] == [0, 2, 3, 0]


def test_report_renders_a_png_and_the_cli_prints_goodput(run, tmp_path):
    import matplotlib.image

    out = render(run["run_dir"], str(tmp_path / "t.png"))
    img = matplotlib.image.imread(out)
    assert img.shape[0] > 500 and img.shape[1] > 800
    assert img[..., :3].std() > 0.05  # not a blank canvas
    proc = subprocess.run([BIN, "report", run["run_dir"]], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "goodput" in proc.stdout and os.path.getsize(os.path.join(run["run_dir"], "report.png")) > 10_000
    bad = subprocess.run([BIN, "report", str(tmp_path / "nothing")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no events.jsonl" in bad.stderr


def test_live_progress_shows_step_loss_slices_and_state(run):
    text = run["stderr"]
    assert "loss=" in text and "slices=3/3" in text and "slices=2/3" in text
    assert "state=recovering" in text and "state=running" in text
    assert f"{STEPS}/{STEPS}" in text


def _prometheus_text() -> str:
    me = ray.get_runtime_context().get_node_id()
    node = {n["NodeID"]: n for n in ray.nodes()}[me]
    url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    return urllib.request.urlopen(url, timeout=5).read().decode()


def _sample(text: str, name: str, run_name: str):
    for line in text.splitlines():
        if line.startswith(name + "{") and f'run="{run_name}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def test_ray_metrics_reach_the_prometheus_endpoint(run):
    name = RUN_NAME  # the argument itself, not trainer.name: what the user asked for must reach the tag
    deadline = time.monotonic() + 60  # Ray exports metrics every few seconds
    while True:
        text = _prometheus_text()
        got = {
            m: _sample(text, m, name)
            for m in (
                "ray_elastic_step",
                "ray_elastic_slices_alive",
                "ray_elastic_recoveries_total",
                "ray_elastic_goodput",
            )
        }
        if got["ray_elastic_step"] == STEPS - 1 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert got["ray_elastic_step"] == STEPS - 1, got
    assert got["ray_elastic_slices_alive"] == 2 and got["ray_elastic_recoveries_total"] == 1
    assert 0 < got["ray_elastic_goodput"] < 1
