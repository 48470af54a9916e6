"""A lost driver: SIGKILL the ``ray-elastic train`` process between two checkpoints, then rerun it.

Three simulated slices train the digits MLP for ``--steps`` steps with a checkpoint every
``--every`` steps, snapshots as the default chooses them. The driver is killed once it has reported
``--kill-at`` steps (between two checkpoints), and the same command runs again:

- **in memory** (ray-elastic): the rerun takes the lost driver's snapshot keepers over and
  resumes from the newest step they hold;
- **checkpoints alone** (the baseline, what a rerun did before keepers outlived the driver): the
  same kill, but the keepers are removed before the rerun, which resumes from the newest checkpoint.

For each it prints kill -> first step of the rerun (and its phases: the new driver's start, the
takeover and forming the world), the steps rewound (the lost driver's last step - the resumed
one), and whether the losses after the resume equal a failure-free run's (same world shape).
Last line: one JSON object.

    .venv/bin/python bench/driver_loss.py [--steps 300] [--every 100] [--kill-at 150]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

BIN = os.path.join(os.path.dirname(sys.executable), "ray-elastic")
GBS, SEED = 48, 7


def command(run_dir: str, ckpt: str, steps: int, every: int) -> list[str]:
    return [
        BIN, "train", "--example", "mlp", "--num-slices", "3", "--devices-per-host", "2",
        "--global-batch", str(GBS), "--seed", str(SEED), "--steps", str(steps), "--steps-per-chunk", "5",
        "--checkpoint-dir", ckpt, "--checkpoint-every", str(every),
        "--run-dir", run_dir, "--json", "--no-progress",
    ]  # fmt: skip


def runs_of(run_dir: str) -> list[list[dict]]:
    """The event log, split per run."""
    runs: list[list[dict]] = []
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        for line in f:
            e = json.loads(line)
            if e["kind"] == "run_started":
                runs.append([])
            if runs:
                runs[-1].append(e)
    return runs


def last_step(events: list[dict]) -> int:
    return max((s for e in events if e["kind"] == "steps" for s in e["steps"]), default=-1)


def kill_at(cmd: list[str], run_dir: str, step: int, env: dict) -> tuple[float, int]:
    """Start the driver, SIGKILL it once it reported ``step``: (when it was killed, its last step)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while proc.poll() is None:
        if os.path.exists(os.path.join(run_dir, "events.jsonl")) and last_step(runs_of(run_dir)[-1]) >= step:
            break
        time.sleep(0.02)
    killed_at = time.time()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return killed_at, last_step(runs_of(run_dir)[-1])


def remove_keepers() -> int:
    """The baseline: the lost driver's keepers gone with it (as before they outlived it)."""
    import ray

    from ray_elastic.ray_backend.keepers import NAMESPACE

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a.get("namespace") == NAMESPACE]
    for name in names:
        ray.kill(ray.get_actor(name, namespace=NAMESPACE))
    return len(names)


def one(cluster, args, in_memory: bool, reference: list[float]) -> dict:
    tmp = tempfile.mkdtemp(prefix="rel-driver-loss-")
    run_dir, ckpt = os.path.join(tmp, "run"), os.path.join(tmp, "ckpt")
    env = {**os.environ, "RAY_ADDRESS": cluster.address}
    cmd = command(run_dir, ckpt, args.steps, args.every)
    killed_at, lost_last = kill_at(cmd, run_dir, args.kill_at, env)
    removed = 0 if in_memory else remove_keepers()
    rerun = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-2000:]
    summary = json.loads([ln for ln in rerun.stdout.splitlines() if ln.startswith("{")][-1])
    events = runs_of(run_dir)[-1]
    first_world = next(e for e in events if e["kind"] == "world_formed")
    resumed = first_world["restored_from_step"]
    steps = next(e for e in events if e["kind"] == "steps")
    first_step_at = steps["finished_at"][0]
    losses = {}
    for e in events:
        if e["kind"] == "steps":
            losses.update(zip(e["steps"], e["losses"]))
    diff = max(abs(losses[s] - reference[s]) / abs(reference[s]) for s in losses)
    shutil.rmtree(tmp, ignore_errors=True)
    return {
        "path": "in memory" if in_memory else "checkpoints alone",
        "killed_after_step": lost_last,
        "resumed_from": resumed,
        "restore_source": first_world["restore_source"],
        "steps_rewound": lost_last - resumed,
        "summary_steps_rewound": summary["steps_rewound_on_resume"],
        "keepers_removed": removed,
        "kill_to_first_step_s": round(first_step_at - killed_at, 2),
        "kill_to_driver_up_s": round(events[0]["ts"] - killed_at, 2),
        "driver_up_to_world_s": round(first_world["ts"] - events[0]["ts"], 2),
        "world_to_first_step_s": round(first_step_at - first_world["ts"], 2),
        "max_rel_loss_diff": float(f"{diff:.3g}"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=100, help="steps between checkpoints")
    p.add_argument("--kill-at", type=int, default=150, help="kill the driver once it reported this step")
    args = p.parse_args()

    from ray_elastic import ElasticConfig, ElasticTrainer
    from ray_elastic.examples.digits_mlp import DigitsMLPTask
    from ray_elastic.sim.cluster import SimulatedTPUCluster

    with SimulatedTPUCluster(num_slices=3, log_to_driver=False) as cluster:
        cfg = ElasticConfig(
            num_slices=3, global_batch_size=GBS, slice=cluster.slice_spec, seed=SEED, steps_per_chunk=5,
            standby_workers=0,
        )  # fmt: skip
        reference = ElasticTrainer(DigitsMLPTask(), cfg, progress=False).fit(args.steps).losses
        rows = [one(cluster, args, True, reference), one(cluster, args, False, reference)]
    for r in rows:
        print(
            f"{r['path']:>17}: killed after step {r['killed_after_step']}, resumed from {r['resumed_from']} "
            f"({r['restore_source']}), {r['steps_rewound']} steps rewound; kill -> first step "
            f"{r['kill_to_first_step_s']}s (driver up {r['kill_to_driver_up_s']}s, world "
            f"{r['driver_up_to_world_s']}s, first step {r['world_to_first_step_s']}s); "
            f"losses vs failure-free: max rel diff {r['max_rel_loss_diff']}"
        )
    mem, base = rows
    print(
        json.dumps(
            {
                "steps_rewound_in_memory": mem["steps_rewound"],
                "steps_rewound_checkpoints_alone": base["steps_rewound"],
                "kill_to_first_step_s": mem["kill_to_first_step_s"],
                "kill_to_first_step_s_checkpoints_alone": base["kill_to_first_step_s"],
                "losses_equal": mem["max_rel_loss_diff"] <= 1e-6 and base["max_rel_loss_diff"] <= 1e-6,
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
