"""Controller overhead: a Ray-driven run against the same step function as a bare multi-process JAX program.

Both sides run 3 processes x 2 CPU devices (3 simulated v4-8 slices), the same
task, batch and step function (``ray_elastic.jax_world.TrainLoop``). The bare
side is plain ``jax.distributed`` over subprocesses, no Ray. The controller side
pays for everything ray-elastic adds, including the per-step in-memory snapshots
(default ``snapshot_every=1`` on ``snapshot_replicas=3`` slices, here all of them) that make recovery rewind-free. Each side runs
``--reps`` times, interleaved, and the medians of the steady-state time per step
are compared. Last line: ``{"overhead_ratio": ...}``.

    .venv/bin/python bench/overhead.py [--steps 300] [--reps 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

NUM_SLICES, DEVICES, BATCH, CHUNK = 3, 2, 48, 20


def task():
    from ray_elastic.examples.char_transformer import CharTransformerTask

    return CharTransformerTask(seq_len=32, d_model=32, num_layers=1, max_chars=100_000)


def bare_worker(process_id: int, coordinator: str, steps: int, out: str) -> None:
    """One process of the bare JAX program (no Ray anywhere)."""
    from ray_elastic import jax_world
    from ray_elastic.data import StepBatches
    from ray_elastic.plan import plan_world

    plan = plan_world(0, [f"s{i}" for i in range(NUM_SLICES)], 1, DEVICES, BATCH)
    jax_world.enable_compilation_cache("/tmp/ray-elastic-jax-cache")
    jax_world.initialize(coordinator, plan, process_id, 120)
    from ray_elastic import ElasticConfig, SliceSpec

    fsdp_min_size = ElasticConfig(num_slices=1, global_batch_size=BATCH, slice=SliceSpec()).fsdp_min_size  # the default
    t = task()
    loop = jax_world.TrainLoop(t, plan, process_id, 0, jax_world.build_mesh(plan), fsdp_min_size,
                               StepBatches(t.dataset(), BATCH, 0))
    loop.compile(0)
    half = steps // 2
    loop.run(0, half)  # warm-up: measured like the controller side, over the second half
    t0 = time.perf_counter()
    loop.run(half, steps - half)
    dt = time.perf_counter() - t0
    if process_id == 0:
        with open(out, "w") as f:
            json.dump({"step_s": dt / (steps - half)}, f)


def run_bare(steps: int) -> float:
    from ray_elastic.sim import free_port

    out = f"/tmp/ray-elastic-bare-{os.getpid()}.json"
    coord = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}"}
    procs = [
        subprocess.Popen([sys.executable, __file__, "--bare-worker", str(i), coord, str(steps), out], env=env)
        for i in range(NUM_SLICES)
    ]
    for p in procs:
        if p.wait(timeout=600) != 0:
            raise RuntimeError("bare worker failed")
    with open(out) as f:
        return json.load(f)["step_s"]


def run_ray(steps: int, spec, snapshot_every: int, snapshot_replicas: int = 3) -> float:
    from ray_elastic import ElasticConfig, ElasticTrainer

    arrivals = []
    cfg = ElasticConfig(num_slices=NUM_SLICES, global_batch_size=BATCH, slice=spec, steps_per_chunk=CHUNK,
                        snapshot_every=snapshot_every, snapshot_replicas=snapshot_replicas,
                        allow_restart_from_scratch=snapshot_every == 0)  # no faults here
    result = ElasticTrainer(task(), cfg, progress=False,
                            on_step=lambda m: arrivals.append((time.perf_counter(), m["step"]))).fit(steps)
    # Steady state: the second half of the run. The first half also pays one-time work
    # (standby processes for the next generation start after the first step).
    t_half = next(t for t, step in arrivals if step == steps // 2 - 1)
    return (arrivals[-1][0] - t_half) / (steps - steps // 2)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--bare-worker":
        bare_worker(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--snapshot-every", type=int, default=1, help="ElasticConfig.snapshot_every of the controller run")
    ap.add_argument("--snapshot-replicas", type=int, default=3, help="ElasticConfig.snapshot_replicas (slices holding one)")
    args = ap.parse_args()

    from ray_elastic.sim import SimulatedTPUCluster

    bare, ray_side = [], []
    with SimulatedTPUCluster(num_slices=NUM_SLICES, devices_per_host=DEVICES, log_to_driver=False) as cluster:
        for rep in range(args.reps):
            bare.append(run_bare(args.steps))
            ray_side.append(run_ray(args.steps, cluster.slice_spec, args.snapshot_every, args.snapshot_replicas))
            print(f"rep {rep}: bare {bare[-1] * 1e3:.2f} ms/step, ray-elastic {ray_side[-1] * 1e3:.2f} ms/step", flush=True)
    b, r = statistics.median(bare), statistics.median(ray_side)
    print(f"median step time: bare JAX {b * 1e3:.2f} ms, ray-elastic controller {r * 1e3:.2f} ms")
    print(json.dumps({"overhead_ratio": round(r / b, 4), "bare_step_s": round(b, 5), "controller_step_s": round(r, 5),
                      "steps": args.steps, "reps": args.reps, "snapshot_every": args.snapshot_every,
                      "snapshot_replicas": args.snapshot_replicas}))


if __name__ == "__main__":
    main()
