"""Checkpoint cost on 3 simulated slices: blocking time per save, total async save time, restore time.

The example transformer trains ``--steps`` steps with ``checkpoint_every=--every``
twice: once to a local directory, once to ``gs://`` on fake-gcs-server (the real
GCS JSON API, started here on 127.0.0.1). Every host writes its own shards; the
controller records, per save, how long the step was blocked (device-to-host copy
and orbax's start-up) and how long the background write took until committed.
A second trainer then resumes from the last checkpoint, which times the restore
(read + reshard onto the new world's mesh). Figures:

    save_blocking_fraction = mean blocking per save / (every x median step time)

i.e. the share of training time lost to saving (goal <= 0.02 at every=100). The
last line is one JSON object for ``gs://``:

    {"save_blocking_fraction": ..., "save_total_s": ..., "restore_s": ...}

    .venv/bin/python bench/checkpoint.py [--steps 300] [--every 100]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile


def measure(cluster, task, directory: str, steps: int, every: int) -> dict:
    from ray_elastic import ElasticConfig, ElasticTrainer

    cfg = ElasticConfig(
        num_slices=3,
        global_batch_size=48,
        slice=cluster.slice_spec,
        steps_per_chunk=10,
        checkpoint_dir=directory,
        checkpoint_every=every,
    )
    result = ElasticTrainer(task, cfg, progress=False).fit(steps)
    saves = [e for e in result.events if e["kind"] == "checkpoint_save"]
    committed = [e for e in result.events if e["kind"] == "checkpoint_committed"]
    ckpt_steps = {e["step"] - 1 for e in saves}
    plain = sorted(t for s, t in zip(result.steps, result.step_times_s) if s not in ckpt_steps and s > 0)
    step_s = statistics.median(plain)
    blocking = statistics.mean(e["blocking_s"] for e in saves)
    resumed = ElasticTrainer(task, cfg, progress=False).fit(steps + 1)
    restore = next(e for e in resumed.events if e["kind"] == "checkpoint_restore")
    return {
        "saves": len(saves),
        "median_step_s": round(step_s, 4),
        "save_blocking_s": round(blocking, 4),
        "save_blocking_fraction": round(blocking / (every * step_s), 4),
        "save_total_s": round(statistics.mean(e["total_s"] for e in committed), 3),
        "restore_s": round(restore["seconds"], 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300, help="training steps per run")
    ap.add_argument("--every", type=int, default=100, help="checkpoint_every")
    ap.add_argument("--example", default="transformer", help="example task (transformer, mlp)")
    args = ap.parse_args()

    from ray_elastic.cli import load_task

    task = load_task(args.example)

    from ray_elastic.sim.local_gcs import LocalGCS

    with LocalGCS() as gcs:
        gcs.activate()  # before any GCS client is imported
        from ray_elastic.sim.cluster import SimulatedTPUCluster

        bucket = gcs.create_bucket("ray-elastic-bench")
        local = tempfile.mkdtemp(prefix="ray-elastic-ckpt-bench-")
        try:
            with SimulatedTPUCluster(num_slices=3, log_to_driver=False) as cluster:
                rows = {
                    "local": measure(cluster, task, local + "/run", args.steps, args.every),
                    "gcs": measure(cluster, task, bucket + "/run", args.steps, args.every),
                }
        finally:
            shutil.rmtree(local, ignore_errors=True)
    print(f"\ncheckpoints of the example {args.example}, 3 slices, every {args.every} steps, {args.steps} steps")
    keys = list(rows["local"])
    print("  " + f"{'':>6}" + "".join(f"{k:>24}" for k in keys))
    for where, row in rows.items():
        print("  " + f"{where:>6}" + "".join(f"{row[k]:>24}" for k in keys))
    g = rows["gcs"]
    print(
        json.dumps(
            {
                "save_blocking_fraction": g["save_blocking_fraction"],
                "save_total_s": g["save_total_s"],
                "restore_s": g["restore_s"],
                "local": rows["local"],
                "every": args.every,
            }
        )
    )


if __name__ == "__main__":
    main()
