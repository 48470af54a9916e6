"""The head node: Ray's GCS killed and started again (GCS fault tolerance, its tables in Redis).

Measured on 3 simulated slices whose head keeps the GCS tables in a private ``redis-server``
(Debian's package, as KubeRay's ``gcsFaultToleranceOptions`` does with a Redis service):

- **GCS restart, driver alive**: the GCS killed at step ``--at`` for ``--down`` seconds while
  this process drives training. Does training go on? How many steps ran while the GCS was down,
  how many failures, recoveries and rewound steps it caused, whether the run finished and the
  keepers lived through it.
- **head lost (GCS restart and driver killed)**: a ``ray-elastic train`` driver SIGKILLed together
  with the GCS (the driver runs on the head); after the GCS is back, the same command runs again
  and resumes from the keepers: steps rewound, and kill -> first step.

Last line: one JSON object.

    .venv/bin/python bench/head_loss.py [--steps 400] [--at 100] [--down 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time

import driver_loss as dl


def gcs_restart_while_training(cluster, args) -> dict:
    """This process drives; the GCS goes away at step ``args.at`` and comes back ``args.down`` later."""
    import ray

    from ray_elastic import ElasticConfig, ElasticTrainer
    from ray_elastic.examples.digits_mlp import DigitsMLPTask

    cfg = ElasticConfig(
        num_slices=3, global_batch_size=dl.GBS, slice=cluster.slice_spec, seed=dl.SEED, steps_per_chunk=5,
        standby_workers=0,
    )  # fmt: skip
    arrivals: list[tuple[int, float]] = []
    outage: dict = {}

    def on_step(m: dict) -> None:
        arrivals.append((m["step"], time.time()))
        if m["step"] == args.at and not outage:
            t = threading.Thread(target=lambda: outage.update(zip(("down", "up"), cluster.restart_gcs(args.down))))
            t.start()
            outage["thread"] = t

    error = None
    try:
        result = ElasticTrainer(DigitsMLPTask(), cfg, progress=False, on_step=on_step).fit(args.steps)
    except Exception as e:  # noqa: BLE001 - what the outage did is the measurement
        result, error = None, repr(e)[:500]
    outage.pop("thread").join()
    during = [s for s, t in arrivals if outage["down"] <= t <= outage["up"]]
    events = result.events if result else []
    return {
        "scenario": "GCS restart, driver alive",
        "gcs_down_s": round(outage["up"] - outage["down"], 2),
        "finished": result is not None and result.steps[-1] == args.steps - 1,
        "error": error,
        "steps_while_gcs_down": len(during),
        "failures": sum(e["kind"] == "failure" for e in events),
        "recoveries": sum(e["kind"] == "recovered" for e in events),
        "steps_rewound": result.summary["steps_rewound"] if result else None,
        "nodes_alive_after": sum(n["Alive"] for n in ray.nodes()),
    }


def head_lost(cluster, args) -> dict:
    """A CLI driver killed with the GCS; the same command again once the GCS is back."""
    tmp = tempfile.mkdtemp(prefix="rel-head-loss-")
    run_dir, ckpt = os.path.join(tmp, "run"), os.path.join(tmp, "ckpt")
    env = {**os.environ, "RAY_ADDRESS": cluster.address}
    cmd = dl.command(run_dir, ckpt, args.steps, args.steps)  # one checkpoint, at the end
    killed_at, lost_last = dl.kill_at(cmd, run_dir, args.at, env)
    cluster.restart_gcs(args.down)
    rerun = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    ok = rerun.returncode == 0
    events = dl.runs_of(run_dir)[-1] if ok else []
    formed = next((e for e in events if e["kind"] == "world_formed"), None)
    first = next((e for e in events if e["kind"] == "steps"), None)
    shutil.rmtree(tmp, ignore_errors=True)
    return {
        "scenario": "head lost (GCS restart and driver killed)",
        "finished": ok,
        "error": None if ok else (rerun.stdout + rerun.stderr)[-500:],
        "killed_after_step": lost_last,
        "resumed_from": formed["restored_from_step"] if formed else None,
        "restore_source": formed["restore_source"] if formed else None,
        "steps_rewound": lost_last - formed["restored_from_step"] if formed else None,
        "kill_to_first_step_s": round(first["finished_at"][0] - killed_at, 2) if first else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--at", type=int, default=100, help="the step at which the GCS (and the driver) go")
    p.add_argument("--down", type=float, default=5.0, help="seconds the GCS stays down")
    args = p.parse_args()

    from ray_elastic.sim.cluster import SimulatedTPUCluster

    with SimulatedTPUCluster(num_slices=3, log_to_driver=False, gcs_fault_tolerance=True) as cluster:
        rows = [gcs_restart_while_training(cluster, args), head_lost(cluster, args)]
    for r in rows:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
