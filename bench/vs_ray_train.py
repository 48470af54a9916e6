"""Steady state against Ray Train's JaxTrainer on its benchmark workload: what keeping every step costs.

The workload: an MLP 64-256-256-10 (``DigitsMLPTask(hidden=256)``) with Adam, global batch 192,
3 workers of 2 CPU devices each, data parallel. Ray Train v2's ``JaxTrainer`` runs it as its
users write it (one ``jax.distributed`` world, a jitted step that donates the state, the next step
dispatched before the last loss is read, no ``ray.train.report`` inside the timed loop: one
costs ~1.5 s here, and one every 20 steps tripled the mean step; on CPUs the
train function initialises ``jax.distributed`` itself, which JaxTrainer does only on TPUs and
GPUs), on a local Ray instance; ray-elastic runs it on 3 simulated slices of 1 host x 2 devices, with snapshots after
every step (``every_step``), with its default (``default``) and with snapshots off.
``ray_train_grain`` is JaxTrainer reading its rows as ray-elastic does (``slice.data.StepBatches``:
grain's shuffled, repeated order, one example at a time, ~20 us each here) instead of
indexing numpy arrays: the data path apart from the trainers. Each run is a
fresh subprocess; runs are interleaved, each repetition in an order rotated by one. The figure is
the mean time per step over the second half of each run (the interval between finished steps);
medians over repetitions are compared. Beside it, the CPU time per steady step by role
(``bench/machine.py: cpu_seconds_by_role``): on these 2 cores everything a run adds besides its
training processes (a driver, keepers, standby processes, Ray's own) competes with the steps,
where a TPU host has cores to spare beside its chips; ``slices`` (the training processes) against
Ray Train's workers says what the training processes themselves cost. ``--workers 1`` runs one
training process of each, which leaves a core free beside the step: what each trainer's step
costs when its other work is not competing with it for the only two cores.

    .venv/bin/python bench/vs_ray_train.py [--steps 800] [--reps 2] [--workers 3] [--only ray_train,every_step]

Last line, one JSON object: ``{"every_step_vs_ray_train": ..., "default_vs_ray_train": ...,
"every_step_cost": ..., "step_ms": {...}, "cpu_ms_per_step": {run: {role: ms}}, "cpu_probe_s": [...]}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading

BATCH, DEVICES, HIDDEN = 192, 2, 256
WORKERS = int(os.environ.get("VS_RAY_TRAIN_WORKERS", "3"))  # --workers: the runs' subprocesses read it


def ray_train_loop(config: dict) -> None:
    """One JaxTrainer worker: the MLP trained data-parallel over the world's devices."""
    import time

    import jax
    import numpy as np
    import optax
    import ray.train
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from ray_elastic.examples.digits_mlp import MLP, load_digits

    # JaxTrainer initialises jax.distributed on TPUs and GPUs only: on CPUs its users do it, or each
    # worker would train alone on its own batch.
    ctx = ray.train.get_context()
    jax.distributed.initialize(config["coordinator"], ctx.get_world_size(), ctx.get_world_rank())
    steps, rank = config["steps"], jax.process_index()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    model = MLP(64, HIDDEN, 10, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    state = jax.device_put(state, NamedSharding(mesh, PartitionSpec()))
    rows = NamedSharding(mesh, PartitionSpec("data"))

    def step(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(m):
            return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    step = jax.jit(step, donate_argnums=0)
    pixels, labels = load_digits()
    x_all, y_all = (pixels / 16.0).astype(np.float32), labels.astype(np.int32)
    per = BATCH // jax.process_count()
    order = np.random.default_rng(0).permutation(len(y_all))

    if config.get("grain"):  # the rows as ray-elastic reads them: grain, shuffled per epoch, example by example
        from ray_elastic.examples.digits_mlp import DigitsMLPTask
        from ray_elastic.slice.data import StepBatches

        batches = StepBatches(DigitsMLPTask(hidden=HIDDEN).dataset(), BATCH, 0)

    def batch(s: int):
        if config.get("grain"):
            local = batches.rows(s, rank * per, (rank + 1) * per)
            x, y = local["x"], local["y"]
        else:
            idx = order[(np.arange(per) + s * BATCH + rank * per) % len(y_all)]
            x, y = x_all[idx], y_all[idx]
        return jax.make_array_from_process_local_data(rows, x), jax.make_array_from_process_local_data(rows, y)

    finished, pending = [], None
    for s in range(steps):
        state, loss = step(state, *batch(s))
        if pending is not None:
            float(pending)
            finished.append(time.perf_counter())
            if rank == 0 and s - 1 == steps // 2:  # the steady state starts: the driver reads the CPU clocks
                open(config["out"] + ".steady", "w").close()
        pending = loss
    float(pending)
    finished.append(time.perf_counter())
    if rank == 0:
        open(config["out"] + ".end", "w").close()
    time.sleep(1.0)  # every worker alive while the driver reads the CPU clocks at the end
    times = np.diff(finished)
    if rank == 0:  # what the bench reads (a report's metrics need a checkpoint to be kept in v2)
        with open(config["out"], "w") as f:
            f.write(str(float(np.mean(times[len(times) // 2 :]))))


def cpu_at_markers(out: str, stop: threading.Event, cpu: dict) -> None:
    """The driver's side of the CPU probe of a JaxTrainer run: CPU seconds by role when rank 0
    marks the steady state's start and the run's end (files beside ``out``)."""
    from machine import cpu_seconds_by_role

    for mark in ("steady", "end"):
        while not os.path.exists(f"{out}.{mark}"):
            if stop.wait(0.002):
                return
        cpu[mark] = cpu_seconds_by_role()


def run_ray_train(steps: int, grain: bool = False) -> dict:
    import ray
    from machine import cpu_ms_per_step
    from ray.train import RunConfig
    from ray.train.v2.api.config import ScalingConfig
    from ray.train.v2.jax import JaxTrainer

    from ray_elastic.sim.hosts import free_port

    storage = tempfile.mkdtemp(prefix="vs-ray-train-")
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}"}
    ray.init(num_cpus=WORKERS, include_dashboard=False, runtime_env={"env_vars": env}, log_to_driver=False)
    try:
        trainer = JaxTrainer(
            ray_train_loop,
            train_loop_config={
                "steps": steps,
                "out": os.path.join(storage, "step_s"),
                "coordinator": f"127.0.0.1:{free_port()}",
                "grain": grain,
            },
            scaling_config=ScalingConfig(num_workers=WORKERS),
            run_config=RunConfig(storage_path=storage, name="bench"),
        )
        cpu: dict = {}
        stop = threading.Event()
        probe = threading.Thread(target=cpu_at_markers, args=(os.path.join(storage, "step_s"), stop, cpu))
        probe.start()
        try:
            trainer.fit()
        finally:
            stop.set()
            probe.join()
        with open(os.path.join(storage, "step_s")) as f:
            step_s = float(f.read())
        # from the step after steps // 2 to the last
        return {
            "step_s": step_s,
            "cpu_ms_per_step": cpu_ms_per_step(cpu.get("steady"), cpu.get("end"), steps - 1 - steps // 2),
        }
    finally:
        ray.shutdown()


def run_ray_elastic(steps: int, snapshot_every, **overrides) -> float:
    from machine import cpu_ms_per_step, cpu_seconds_by_role

    from ray_elastic import ElasticConfig, ElasticTrainer
    from ray_elastic.examples.digits_mlp import DigitsMLPTask
    from ray_elastic.sim.cluster import SimulatedTPUCluster

    with SimulatedTPUCluster(num_slices=WORKERS, devices_per_host=DEVICES, log_to_driver=False) as cluster:
        kw = ({} if snapshot_every is None else {"snapshot_every": snapshot_every}) | overrides
        if snapshot_every == 0:
            kw["allow_restart_from_scratch"] = True  # no faults here
        cfg = ElasticConfig(num_slices=WORKERS, global_batch_size=BATCH, slice=cluster.slice_spec, **kw)
        cpu: dict = {}

        def on_step(m: dict) -> None:
            if m["step"] in (steps // 2, steps - 1):
                cpu[m["step"]] = cpu_seconds_by_role()

        result = ElasticTrainer(DigitsMLPTask(hidden=HIDDEN), cfg, progress=False, on_step=on_step).fit(steps)
        times = result.step_times_s[steps // 2 :]
        a, b = cpu.get(steps // 2), cpu.get(steps - 1)
        return {"step_s": statistics.mean(times), "cpu_ms_per_step": cpu_ms_per_step(a, b, steps - 1 - steps // 2)}


RUNS = {
    "ray_train": lambda n: run_ray_train(n),
    # JaxTrainer reading its rows through ray-elastic's data path (grain, one example at a time)
    "ray_train_grain": lambda n: run_ray_train(n, grain=True),
    "every_step": lambda n: run_ray_elastic(n, 1),
    "default": lambda n: run_ray_elastic(n, None),
    "no_snapshots": lambda n: run_ray_elastic(n, 0),
    # what the warm standby processes (one per host, idle until a recovery) cost on these 2 cores
    "no_snapshots_no_standbys": lambda n: run_ray_elastic(n, 0, standby_workers=0),
}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        print(json.dumps(RUNS[sys.argv[2]](int(sys.argv[3]))))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument(
        "--workers",
        type=int,
        default=WORKERS,
        help="training processes (3: the workload's; 1 leaves a core of this machine free beside the step)",
    )
    ap.add_argument("--only", default=None, help=f"comma-separated runs (default: all): {', '.join(RUNS)}")
    args = ap.parse_args()
    names = list(RUNS) if args.only is None else args.only.split(",")
    if set(names) - set(RUNS):
        ap.error(f"--only: the runs are {', '.join(RUNS)}")
    from machine import cpu_probe_s, hour, median_cpu_by_role

    probes = [cpu_probe_s()]
    got: dict[str, list[float]] = {k: [] for k in names}
    cpu_runs: dict[str, list[dict]] = {k: [] for k in names}
    for rep in range(args.reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            out = subprocess.run(
                [sys.executable, __file__, "--one", name, str(args.steps)],
                check=True,
                capture_output=True,
                text=True,
                env={
                    **os.environ,
                    "RAY_TMPDIR": tempfile.mkdtemp(prefix="rvt-", dir="/tmp"),
                    "VS_RAY_TRAIN_WORKERS": str(args.workers),
                },
            )
            one = json.loads(out.stdout.strip().splitlines()[-1])
            got[name].append(one["step_s"])
            cpu_runs[name].append(one["cpu_ms_per_step"])
            print(f"rep {rep} {name:<14} {got[name][-1] * 1e3:8.2f} ms/step", flush=True)
    probes.append(cpu_probe_s())
    print(f"machine: {hour(probes)}", flush=True)
    med = {k: statistics.median(v) for k, v in got.items()}
    print("median ms/step: " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in med.items()))
    print("min-max ms/step: " + ", ".join(f"{k} {min(v) * 1e3:.1f}-{max(v) * 1e3:.1f}" for k, v in got.items()))

    cpu = median_cpu_by_role(cpu_runs)

    def ratio(a: str, b: str):
        return round(med[a] / med[b], 4) if a in med and b in med else None

    out = {
        "every_step_vs_ray_train": ratio("every_step", "ray_train"),
        "default_vs_ray_train": ratio("default", "ray_train"),
        "every_step_cost": round(r - 1, 4) if (r := ratio("every_step", "no_snapshots")) else None,
        "no_snapshots_vs_ray_train": ratio("no_snapshots", "ray_train"),
        "no_standbys_vs_ray_train": ratio("no_snapshots_no_standbys", "ray_train"),
        "every_step_vs_ray_train_grain": ratio("every_step", "ray_train_grain"),
        "no_standbys_vs_ray_train_grain": ratio("no_snapshots_no_standbys", "ray_train_grain"),
        "step_ms": {k: round(v * 1e3, 2) for k, v in med.items()},
        "cpu_ms_per_step": cpu,
        "steps": args.steps,
        "workers": args.workers,
        "reps": args.reps,
        "cpu_probe_s": probes,
    }
    print(json.dumps({k: v for k, v in out.items() if v is not None}))


if __name__ == "__main__":
    main()
