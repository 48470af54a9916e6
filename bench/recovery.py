"""Recovery time on 3 simulated slices: from a kill to the first step finished afterwards.

For each mode, one long run on a 3-slice simulated cluster with a provisioner
(replacement slices arrive ``--arrival-delay`` seconds after they are asked for),
a slice killed (node removed + processes SIGKILLed) every ``--every`` steps. Each
recovery is split into detection / classification / teardown / waiting for
capacity / world formation / state load / compile, from the controller's own
records. Medians over the kills; the last line is one JSON object:

    {"replica_resize_recovery_s": ..., "pause_resume_recovery_after_arrival_s": ..., "steps_rewound_max": ...}

    .venv/bin/python bench/recovery.py [--kills 4] [--every 40] [--resize-every 200]

In replica-resize mode the lost slice comes back ``--regrow-delay`` seconds later
(after the recovery being measured), and kills happen only at full size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

PHASES = ("detection_s", "classify_s", "teardown_s", "wait_for_capacity_s", "world_formation_s", "state_load_s",
          "compile_s", "first_step_s")


def run_mode(cluster, mode: str, kills: int, every: int) -> list[dict]:
    from ray_elastic import ElasticConfig, ElasticTrainer
    from ray_elastic.examples.digits_mlp import DigitsMLPTask

    kill_times: list[tuple[int, float]] = []
    arrivals: list[tuple[int, float]] = []  # (step, wall time) of every finished step
    trainer_box = {}

    def on_step(m):
        arrivals.append((m["step"], time.time()))
        t = trainer_box["t"]
        if m["step"] > 0 and m["step"] % every == 0 and len(kill_times) < kills \
                and all(s != m["step"] for s, _ in kill_times) and t.world.plan.num_slices == 3:
            victim = t.world.plan.slice_names[-1]
            kill_times.append((m["step"], time.time()))
            threading.Thread(target=cluster.kill_slice, args=(victim,), daemon=True).start()

    cfg = ElasticConfig(num_slices=3, global_batch_size=48, slice=cluster.slice_spec, steps_per_chunk=10, mode=mode)
    trainer = ElasticTrainer(DigitsMLPTask(), cfg, progress=False, on_step=on_step)
    trainer_box["t"] = trainer
    result = trainer.fit(every * (kills + 1) + 20)
    out = []
    recs = result.recoveries
    for (step, t_kill), rec in zip(kill_times, recs):
        first_after = min(t for s, t in arrivals if t > rec.ready_at)
        row = {k: getattr(rec, k) for k in ("classify_s", "teardown_s", "wait_for_capacity_s", "world_formation_s",
                                    "state_load_s", "compile_s", "steps_rewound")}
        row["detection_s"] = rec.detected_at - t_kill
        row["first_step_s"] = first_after - rec.ready_at
        row["kill_to_step_s"] = first_after - t_kill
        row["after_arrival_s"] = first_after - rec.capacity_ready_at
        row["slices_after"] = rec.slices
        out.append(row)
    # Wait until the provisioner has brought the cluster back to 3 slices.
    deadline = time.time() + 60
    while len(cluster.alive_slices()) < 3 and time.time() < deadline:
        time.sleep(0.2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=4, help="kills per mode")
    ap.add_argument("--every", type=int, default=40, help="pause-and-resume: steps between kills")
    ap.add_argument("--resize-every", type=int, default=200,
                    help="replica-resize: steps between kills (the slice must have come back first)")
    ap.add_argument("--arrival-delay", type=float, default=1.0,
                    help="pause-and-resume: seconds until a replacement slice arrives")
    ap.add_argument("--regrow-delay", type=float, default=8.0,
                    help="replica-resize: seconds until a slice comes back (after the recovery being measured)")
    args = ap.parse_args()

    from ray_elastic.sim import SimulatedTPUCluster

    results = {}
    with SimulatedTPUCluster(num_slices=3, log_to_driver=False) as cluster:
        for mode in ("replica-resize", "pause-and-resume"):
            prov = cluster.provisioner(delay_s=args.regrow_delay if mode == "replica-resize" else args.arrival_delay)
            every = args.resize_every if mode == "replica-resize" else args.every
            rows = run_mode(cluster, mode, args.kills, every)
            prov.stop()
            results[mode] = rows
            print(f"\n{mode}: {len(rows)} kills")
            print("  " + " ".join(f"{p:>20}" for p in PHASES + ("kill_to_step_s", "after_arrival_s")))
            for r in rows:
                print("  " + " ".join(f"{r[p]:>20.3f}" for p in PHASES + ("kill_to_step_s", "after_arrival_s")))
            med = {p: statistics.median(r[p] for r in rows) for p in PHASES + ("kill_to_step_s", "after_arrival_s")}
            print("  median " + ", ".join(f"{p}={v:.3f}" for p, v in med.items()), flush=True)
    rr = statistics.median(r["kill_to_step_s"] for r in results["replica-resize"])
    pr = statistics.median(r["after_arrival_s"] for r in results["pause-and-resume"])
    rewound = max(r["steps_rewound"] for rows in results.values() for r in rows)
    print(json.dumps({"replica_resize_recovery_s": round(rr, 3), "pause_resume_recovery_after_arrival_s": round(pr, 3),
                      "steps_rewound_max": rewound, "kills_per_mode": args.kills}))


if __name__ == "__main__":
    main()
