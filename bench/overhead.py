"""Controller overhead: a Ray-driven run against the best bare multi-process JAX loop, on two model sizes.

Both sides run 3 processes x 2 CPU devices (3 simulated v4-8 slices), the same
task, batch and step function (``ray_elastic.slice.jax_world.TrainLoop``). The bare side
is plain ``jax.distributed`` over subprocesses, no Ray, written as a JAX user would:
the next step is dispatched before the last one's loss is read (``--in-flight 1``);
the blocking loop (each loss read before the next step) is measured too. The
controller side pays for everything ray-elastic adds, with default settings
(``snapshot_every`` as ``ElasticConfig`` has it, snapshots on every slice) and with
snapshots off. The *small* model's train state is ~240 KB per process; the *large*
one's ~80x that, so the snapshot's cost as the state grows shows. The *llm* runs are the LLM
example, annotated, each slice's 2 devices on the tensor axis (``overhead_ratio_llm``). Each measurement
runs ``--reps`` times, interleaved, each repetition in an order rotated by one (so no
configuration always follows the same one), and the medians of the steady-state time
per step (the run's second half) are compared. On a shared 2-core machine two runs
of one configuration back to back differ by 10-15%: a 3% goal needs more
repetitions of the few runs it compares (``--only bare,default,no_snapshots --reps 6``).
What keeping every step costs is measured apart: ``every_step`` (``snapshot_every=1``) against
``no_snapshots`` on the same model, ``every_step_cost`` = the ratio of their medians - 1 (also
``_large`` and ``_llm``; the goal: 3% on the small models, 5% on the LLM example). What the step
guard that skips bad steps costs: ``bad_step_guard_cost_large``, the default against
``on_bad_step="raise"`` (``--only no_snapshots_large,no_snapshots_raise_large``; the bare loop runs
without the guard); what fingerprinting the replicas costs: ``integrity_cost_large`` and
``_llm``, the default ``integrity_every`` against none
(``--only no_snapshots_large,no_snapshots_no_integrity_large,no_snapshots_llm,no_snapshots_no_integrity_llm``),
and, since that difference is below this machine's noise, magnified: a check after every step
against none (``integrity_per_check_large`` and ``_llm``, runs made only when ``--only`` names them:
``no_snapshots_integrity_every_step_large``, ``_llm``) and that divided by the default interval
(``integrity_cost_from_per_check_large``, ``_llm``, the goal's figure: 0.5%);
``--only every_step,no_snapshots,every_step_llm,no_snapshots_llm --reps 5``. Beside each wall-clock
cost, ``every_step_cost_cpu`` (``_large``, ``_llm``): the CPU time per steady step of every process
of the run (driver, slices, keepers, Ray's own), median over the repetitions, every step against
off: ``fraction`` of all of it and ``extra_ms_per_step`` by role. Run-to-run wall-clock noise here
(5-15%) is larger than the goal; CPU time is what the snapshots take from the steps on a saturated
machine, and it varies far less.
Last line, one JSON object: ``{"every_step_cost": ..., "overhead_ratio": ... (default settings, small model),
"overhead_ratio_large": ..., "overhead_ratio_no_snapshots": ..., "snapshot_every_chosen": ..., ...}``
(the ratios of the runs chosen).

    .venv/bin/python bench/overhead.py [--steps 200] [--large-steps 60] [--reps 2] [--only NAME,...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys

NUM_SLICES, DEVICES, BATCH, CHUNK = 3, 2, 48, 20
MODELS = {"small": dict(seq_len=32, d_model=32, num_layers=1), "large": dict(seq_len=32, d_model=256, num_layers=2)}
LLM = dict(seq_len=32, d_model=128, num_layers=2, d_ff=256, max_chars=100_000)


def task(model: str):
    if model == "llm":
        from ray_elastic.examples.llm import DecoderLMTask

        return DecoderLMTask(**LLM)
    from ray_elastic.examples.char_transformer import CharTransformerTask

    return CharTransformerTask(max_chars=100_000, **MODELS[model])


def layout(model: str) -> dict:
    """The LLM example runs annotated, each slice's 2 devices on the tensor axis (fsdp 1 x tensor 2)."""
    if model != "llm":
        return {}
    from ray_elastic.examples.llm import LOGICAL_AXIS_RULES

    return {"slice_mesh": {"fsdp": -1, "tensor": 2}, "logical_axis_rules": LOGICAL_AXIS_RULES}


def bare_worker(
    process_id: int,
    coordinator: str,
    steps: int,
    out: str,
    model: str,
    in_flight: int,
    processes: int,
    devices: int,
    batch: int,
) -> None:
    """One process of the bare JAX program (no Ray anywhere)."""
    from ray_elastic.decide import plan_world
    from ray_elastic.slice import compile_cache, jax_world
    from ray_elastic.slice import mesh as world_mesh
    from ray_elastic.slice.data import StepBatches

    settings = layout(model)
    plan = plan_world(0, [f"s{i}" for i in range(processes)], 1, devices, batch, slice_mesh=settings.get("slice_mesh"))
    compile_cache.enable_compilation_cache("/tmp/ray-elastic-jax-cache")
    world_mesh.initialize(coordinator, plan, process_id, 120)
    from ray_elastic import ElasticConfig, SliceSpec
    from ray_elastic.decide.bad_steps import BadSteps

    fsdp_min_size = ElasticConfig(num_slices=1, global_batch_size=batch, slice=SliceSpec()).fsdp_min_size  # the default
    t = task(model)
    loop = jax_world.TrainLoop(
        t,
        plan,
        process_id,
        0,
        world_mesh.build_mesh(plan),
        fsdp_min_size,
        StepBatches(t.dataset(), batch, 0),
        rules=settings.get("logical_axis_rules", ()),
        bad_steps=BadSteps(skip=False),  # a plain loop keeps every update (its loss read, as a user's)
    )
    loop.compile(0)
    half = steps // 2
    loop.run(0, half, in_flight)  # warm-up: measured like the controller side, over the second half
    times = [m["step_time_s"] for m in loop.run(half, steps - half, in_flight)]
    if process_id == 0:
        state_bytes = sum(b.nbytes for b in loop.snapshot()["leaves"])
        with open(out, "w") as f:
            json.dump({"step_s": statistics.mean(times), "state_bytes": state_bytes}, f)


def run_bare(
    steps: int,
    model: str,
    in_flight: int,
    processes: int = NUM_SLICES,
    devices: int = DEVICES,
    batch: int = BATCH,
    **env_vars: str,
) -> dict:
    from ray_elastic.sim.hosts import free_port

    out = f"/tmp/ray-elastic-bare-{os.getpid()}.json"
    coord = f"127.0.0.1:{free_port()}"
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        **env_vars,
    }
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--bare-worker",
                str(i),
                coord,
                str(steps),
                out,
                model,
                str(in_flight),
                str(processes),
                str(devices),
                str(batch),
            ],
            env=env,
        )
        for i in range(processes)
    ]
    for p in procs:
        if p.wait(timeout=900) != 0:
            raise RuntimeError("bare worker failed")
    with open(out) as f:
        return json.load(f)


# Runs made only when --only names them: a fingerprint after every step, which magnifies what one
# check costs a hundredfold, so that it shows above this machine's run-to-run noise.
OPT_IN = ("no_snapshots_integrity_every_step_large", "no_snapshots_integrity_every_step_llm")
SETTLE = 4  # steps at the start of a chunk that an A/B run leaves out: the previous chunk's copies may still run


@contextlib.contextmanager
def alternating_snapshots(chunks: dict[int, int]):
    """An A/B run in one trainer: the snapshot interval of each chunk alternates between 1 (every
    step kept) and 0 (none), so both halves share the processes, the compiled step (which packs the
    state either way) and the machine's hour. ``chunks`` gets each chunk's first step -> interval."""
    from ray_elastic.control.snapshot_cadence import SnapshotCadence

    def interval_from(self, step: int) -> int:
        every = 1 if len(chunks) % 2 == 0 else 0
        chunks[step] = every
        if not self.intervals or self.intervals[-1][1] != every:
            self.intervals.append((step, every))
        return every

    original = SnapshotCadence.interval_from
    SnapshotCadence.interval_from = interval_from
    try:
        yield
    finally:
        SnapshotCadence.interval_from = original


def settled_steps(times: list[float], chunks: dict[int, int]) -> dict[int, list[float]]:
    """Per chunk (its first step): the step times of its steps after the first ``SETTLE``."""
    starts = sorted(chunks)
    return {
        a: [times[s] for s in range(a + SETTLE, b) if s < len(times)] for a, b in zip(starts, starts[1:] + [len(times)])
    }


def ab_chunks_ms(times: list[float], chunks: dict[int, int]) -> list[list]:
    """Per chunk of an A/B run: [first step, interval, median settled step in ms] (printed: drift shows)."""
    return [
        [a, chunks[a], round(statistics.median(ts) * 1e3, 1)] for a, ts in settled_steps(times, chunks).items() if ts
    ]


def ab_cost(times: list[float], chunks: dict[int, int], first: int) -> float | None:
    """What keeping every step costs, from an A/B run: per snapshotting chunk after ``first``, the
    median of its settled steps over the median of its neighbours' (chunks without snapshots); the
    median of those ratios, minus one. Pairs of neighbours cancel the hour's drift."""
    starts = sorted(chunks)
    settled = settled_steps(times, chunks)
    ratios = []
    for i in range(1, len(starts) - 1):
        a = starts[i]
        if a < first or chunks[a] != 1 or not settled[a]:
            continue
        off = settled[starts[i - 1]] + settled[starts[i + 1]]
        if off:
            ratios.append(statistics.median(settled[a]) / statistics.median(off))
    return round(statistics.median(ratios) - 1, 4) if ratios else None


def _failure(**kw):
    from ray_elastic import FailureConfig

    return FailureConfig(**kw)


def run_ray(steps: int, spec, model: str, ab: bool = False, **overrides) -> dict:
    from machine import cpu_ms_per_step, cpu_seconds_by_role

    from ray_elastic import ElasticConfig, ElasticTrainer

    kw = dict(snapshot_replicas=NUM_SLICES) | layout(model) | overrides
    if kw.get("snapshot_every") == 0:
        kw["allow_restart_from_scratch"] = True  # no faults here
    cfg = ElasticConfig(num_slices=NUM_SLICES, global_batch_size=BATCH, slice=spec, steps_per_chunk=CHUNK, **kw)
    warm_from: list[int] = []  # the first step reported once every standby of every host had started and traced
    cpu: dict[int, dict] = {}  # step -> CPU seconds by role when it was reported (steady state's first and last)

    def steady_from() -> int:
        return max(steps // 2, warm_from[0] if warm_from else steps)

    def on_step(m: dict) -> None:
        if not warm_from and trainer.backend.warm(trainer.gens.members, every=True):
            warm_from.append(m["step"])
        if m["step"] in (steady_from(), steps - 1) and m["step"] not in cpu:
            cpu[m["step"]] = cpu_seconds_by_role()

    trainer = ElasticTrainer(task(model), cfg, progress=False, on_step=on_step)
    chunks: dict[int, int] = {}
    with alternating_snapshots(chunks) if ab else contextlib.nullcontext():
        result = trainer.fit(steps)
    # Steady state: the second half of the run, and only once the standby processes are warm. Until
    # then they start Python and JAX and trace the step for three world sizes on the same two
    # cores (one-time work; on a TPU host it runs on the host CPUs, beside the chips). Each step's
    # time is the interval between finished steps, as the bare loop measures it.
    first = steady_from()
    times = result.step_times_s[first:] or result.step_times_s[steps // 2 :]
    (a, at), (b, bt) = sorted(cpu.items()) if len(cpu) == 2 else ((0, {}), (1, {}))
    return {
        "step_s": statistics.mean(times),
        **({"ab_cost": ab_cost(result.step_times_s, chunks, first)} if ab else {}),
        **({"ab_chunks_ms": ab_chunks_ms(result.step_times_s, chunks)} if ab else {}),
        "cpu_ms_per_step": cpu_ms_per_step(at, bt, b - a),
        "snapshot_every": result.summary["snapshot_every"],
        "steady_steps": len(times),
        "warm_at_step": warm_from[0] if warm_from else None,
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--bare-worker":
        bare_worker(
            int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6], *map(int, sys.argv[7:11])
        )
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300, help="steps per run, small model")
    ap.add_argument("--large-steps", type=int, default=120, help="steps per run, large model")
    ap.add_argument("--llm-steps", type=int, default=120, help="steps per run, the LLM example")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument(
        "--environment",
        action="store_true",
        help="also the bare loop with OMP_NUM_THREADS=1 and ray-elastic at niceness 0",
    )
    ap.add_argument(
        "--only", default=None, help="comma-separated run names (default: all), e.g. bare,default,no_snapshots"
    )
    ap.add_argument(
        "--snapshot-every", default=None, help="override ElasticConfig.snapshot_every (default: its default)"
    )
    args = ap.parse_args()

    from machine import cpu_probe_s, hour, median_cpu_by_role

    from ray_elastic import AutoInterval
    from ray_elastic.sim.cluster import SimulatedTPUCluster

    probes = [cpu_probe_s()]
    snap = (
        {}
        if args.snapshot_every is None
        else {"snapshot_every": AutoInterval() if args.snapshot_every == "auto" else int(args.snapshot_every)}
    )
    runs = {  # name -> (model, what runs it)
        "bare": ("small", lambda c, n: run_bare(n, "small", 1)),
        "bare_blocking": ("small", lambda c, n: run_bare(n, "small", 0)),
        "default": ("small", lambda c, n: run_ray(n, c.slice_spec, "small", **snap)),
        "no_snapshots": ("small", lambda c, n: run_ray(n, c.slice_spec, "small", snapshot_every=0)),
        "every_step": ("small", lambda c, n: run_ray(n, c.slice_spec, "small", snapshot_every=1)),
        "every_step_2_replicas": (
            "small",
            lambda c, n: run_ray(n, c.slice_spec, "small", snapshot_every=1, snapshot_replicas=2),
        ),
        "bare_large": ("large", lambda c, n: run_bare(n, "large", 1)),
        "default_large": ("large", lambda c, n: run_ray(n, c.slice_spec, "large", **snap)),
        "no_snapshots_large": ("large", lambda c, n: run_ray(n, c.slice_spec, "large", snapshot_every=0)),
        "every_step_large": ("large", lambda c, n: run_ray(n, c.slice_spec, "large", snapshot_every=1)),
        "no_snapshots_no_integrity_large": (  # replicas never fingerprinted (integrity_cost_large)
            "large",
            lambda c, n: run_ray(n, c.slice_spec, "large", snapshot_every=0, failure=_failure(integrity_every=0)),
        ),
        "no_snapshots_integrity_every_step_large": (  # a check after every step (opt-in: integrity_per_check_large)
            "large",
            lambda c, n: run_ray(n, c.slice_spec, "large", snapshot_every=0, failure=_failure(integrity_every=1)),
        ),
        "no_snapshots_integrity_every_step_llm": (
            "llm",
            lambda c, n: run_ray(n, c.slice_spec, "llm", snapshot_every=0, failure=_failure(integrity_every=1)),
        ),
        "no_snapshots_raise_large": (  # bad steps stop the run: no guard on the state (bad_step_guard_cost)
            "large",
            lambda c, n: run_ray(n, c.slice_spec, "large", snapshot_every=0, failure=_failure(on_bad_step="raise")),
        ),
        "no_snapshots_no_standbys_large": (
            "large",
            lambda c, n: run_ray(n, c.slice_spec, "large", snapshot_every=0, standby_workers=0),
        ),
        "bare_llm": ("llm", lambda c, n: run_bare(n, "llm", 1)),
        "default_llm": ("llm", lambda c, n: run_ray(n, c.slice_spec, "llm", **snap)),
        "no_snapshots_llm": ("llm", lambda c, n: run_ray(n, c.slice_spec, "llm", snapshot_every=0)),
        "no_snapshots_no_integrity_llm": (
            "llm",
            lambda c, n: run_ray(n, c.slice_spec, "llm", snapshot_every=0, failure=_failure(integrity_every=0)),
        ),
        "every_step_llm": ("llm", lambda c, n: run_ray(n, c.slice_spec, "llm", snapshot_every=1)),
        # keeping every step against none, chunk by chunk in one run (see alternating_snapshots)
        "every_step_ab": ("small", lambda c, n: run_ray(n, c.slice_spec, "small", ab=True, snapshot_every=1)),
        "every_step_ab_llm": ("llm", lambda c, n: run_ray(n, c.slice_spec, "llm", ab=True, snapshot_every=1)),
    }
    if args.environment:
        runs |= {  # what Ray sets inside a num_cpus=0 actor: does it matter here?
            "bare_omp_1": ("small", lambda c, n: run_bare(n, "small", 1, OMP_NUM_THREADS="1")),
            "default_nice_0": ("small", lambda c, n: run_ray(n, c.slice_spec, "small", worker_niceness=0, **snap)),
        }
    if args.only:
        only = set(args.only.split(","))
        if only - set(runs):
            ap.error(f"--only: no run named {sorted(only - set(runs))}; the runs are {', '.join(runs)}")
        runs = {k: v for k, v in runs.items() if k in only}
    else:
        runs = {k: v for k, v in runs.items() if k not in OPT_IN}
    got: dict[str, list[dict]] = {k: [] for k in runs}
    names = list(runs)
    with SimulatedTPUCluster(num_slices=NUM_SLICES, devices_per_host=DEVICES, log_to_driver=False) as cluster:
        for rep in range(args.reps):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                model, fn = runs[name]
                got[name].append(fn(cluster, {"large": args.large_steps, "llm": args.llm_steps}.get(model, args.steps)))
                print(f"rep {rep} {name:<22} {got[name][-1]['step_s'] * 1e3:8.2f} ms/step", flush=True)
                if "ab_cost" in got[name][-1]:
                    r = got[name][-1]
                    print(f"  A/B cost {r['ab_cost']}; chunks [first, every, ms]: {r['ab_chunks_ms']}", flush=True)
    probes.append(cpu_probe_s())
    print(f"machine: {hour(probes)}", flush=True)
    med = {k: statistics.median(r["step_s"] for r in v) for k, v in got.items()}
    print("median ms/step: " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in med.items()))
    print(
        "min-max ms/step: "
        + ", ".join(
            f"{k} {min(r['step_s'] for r in v) * 1e3:.1f}-{max(r['step_s'] for r in v) * 1e3:.1f}"
            for k, v in got.items()
        )
    )

    cpu = median_cpu_by_role({k: [r.get("cpu_ms_per_step") or {} for r in v] for k, v in got.items()})

    def cpu_cost(k: str, base: str) -> dict | None:
        """What ``k`` adds to ``base``'s CPU per step, by role, and as a fraction of all of base's."""
        if k not in cpu or base not in cpu:
            return None
        extra = {role: round(cpu[k][role] - cpu[base][role], 2) for role in cpu[k]}
        return {"fraction": round(extra["all"] / cpu[base]["all"], 4), "extra_ms_per_step": extra}

    def ratio(k: str, base: str):
        return round(med[k] / med[base], 4) if k in med and base in med else None  # None: not run (--only)

    def last(k: str, field: str, name: str) -> dict:
        return {name: got[k][-1][field]} if k in got else {}

    costs = {  # what keeping every step costs: snapshots every step against snapshots off, minus one
        "every_step_cost": ("every_step", "no_snapshots"),
        "every_step_cost_large": ("every_step_large", "no_snapshots_large"),
        "every_step_cost_llm": ("every_step_llm", "no_snapshots_llm"),
        # the step guard that skips a bad step (default) against on_bad_step="raise"
        "bad_step_guard_cost_large": ("no_snapshots_large", "no_snapshots_raise_large"),
        # the replicas' fingerprints every integrity_every steps (default) against never
        "integrity_cost_large": ("no_snapshots_large", "no_snapshots_no_integrity_large"),
        "integrity_cost_llm": ("no_snapshots_llm", "no_snapshots_no_integrity_llm"),
        # a check after every step against none: what one check costs, as a fraction of a step
        "integrity_per_check_large": ("no_snapshots_integrity_every_step_large", "no_snapshots_no_integrity_large"),
        "integrity_per_check_llm": ("no_snapshots_integrity_every_step_llm", "no_snapshots_no_integrity_llm"),
    }
    ratios = {
        "overhead_ratio": ("default", "bare"),
        "overhead_ratio_large": ("default_large", "bare_large"),
        "overhead_ratio_no_snapshots": ("no_snapshots", "bare"),
        "overhead_ratio_llm": ("default_llm", "bare_llm"),
        "overhead_ratio_no_snapshots_large": ("no_snapshots_large", "bare_large"),
        "overhead_ratio_no_snapshots_no_standbys_large": ("no_snapshots_no_standbys_large", "bare_large"),
        "overhead_ratio_every_step": ("every_step", "bare"),
        "overhead_ratio_every_step_2_replicas": ("every_step_2_replicas", "bare"),
        "blocking_loop_ratio": ("bare_blocking", "bare"),
        "overhead_ratio_nice_0": ("default_nice_0", "bare"),
        "bare_omp_1_ratio": ("bare_omp_1", "bare"),
    }
    print(
        json.dumps(
            {
                **{out: round(r - 1, 4) for out, (k, base) in costs.items() if (r := ratio(k, base)) is not None},
                **{  # one check's cost, at the default's one check every integrity_every steps
                    f"integrity_cost_from_per_check_{m}": round((r - 1) / _failure().integrity_every, 5)
                    for m in ("large", "llm")
                    if (r := ratio(*costs[f"integrity_per_check_{m}"])) is not None
                },
                **{out: r for out, (k, base) in ratios.items() if (r := ratio(k, base)) is not None},
                **{f"{out}_cpu": c for out, (k, base) in costs.items() if (c := cpu_cost(k, base)) is not None},
                **{
                    f"every_step_cost{sfx}_ab": statistics.median(r["ab_cost"] for r in got[k])
                    for k, sfx in (("every_step_ab", ""), ("every_step_ab_llm", "_llm"))
                    if k in got and all(r["ab_cost"] is not None for r in got[k])
                },
                **last("default", "snapshot_every", "snapshot_every_chosen"),
                **last("default_large", "snapshot_every", "snapshot_every_chosen_large"),
                **last("default_llm", "snapshot_every", "snapshot_every_chosen_llm"),
                **last("bare", "state_bytes", "state_bytes_per_process"),
                **last("bare_large", "state_bytes", "state_bytes_per_process_large"),
                "step_ms": {k: round(v * 1e3, 2) for k, v in med.items()},
                "steady_steps": {k: [r["steady_steps"] for r in v] for k, v in got.items() if "steady_steps" in v[0]},
                "steps": args.steps,
                "large_steps": args.large_steps,
                "llm_steps": args.llm_steps,
                "reps": args.reps,
                "cpu_probe_s": probes,
            }
        )
    )  # this hour's speed (bench/machine.py)


if __name__ == "__main__":
    main()
