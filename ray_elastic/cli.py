"""``ray-elastic`` command line: ``demo`` on a simulated cluster, ``train`` on an existing one.

``ray job submit --address http://HEAD:8265 -- ray-elastic train --example transformer ...``
runs the driver inside the cluster; ``train`` connects to ``--address`` or ``RAY_ADDRESS``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys

from ray_elastic.config import BATCH_POLICIES, MODES, ElasticConfig, SliceSpec
from ray_elastic.control.controller import ElasticTrainer
from ray_elastic.errors import ElasticRuntimeError
from ray_elastic.examples import EXAMPLE_SETTINGS, EXAMPLES
from ray_elastic.task import TrainTask


def load_task(ref: str) -> TrainTask:
    """A task from an example name (``mlp``, ``transformer``) or ``module:attr``.

    ``attr`` may be a TrainTask instance, a TrainTask subclass, or a function
    returning one (both called without arguments).
    """
    ref = EXAMPLES.get(ref, ref)
    if ":" not in ref:
        raise ValueError(f"task {ref!r}: use an example name ({', '.join(EXAMPLES)}) or 'module:attr'")
    mod_name, attr = ref.split(":", 1)
    try:
        obj = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load task {ref!r}: {e}") from e
    task = obj if isinstance(obj, TrainTask) else obj()
    if not isinstance(task, TrainTask):
        raise ValueError(f"{ref!r} gave {type(task).__name__}, not a ray_elastic.TrainTask")
    return task


def _add_training_args(p: argparse.ArgumentParser, default_slices: int) -> None:
    p.add_argument(
        "--example",
        "--task",
        dest="task",
        default="transformer",
        help=f"example name ({', '.join(EXAMPLES)}) or module:attr of a TrainTask (default: transformer)",
    )
    p.add_argument("--num-slices", type=int, default=default_slices, help="slices to train on")
    p.add_argument("--min-slices", type=int, default=None, help="fewest slices to continue on (replica-resize)")
    p.add_argument("--mode", choices=MODES, default=ElasticConfig.mode)
    p.add_argument("--batch-policy", choices=BATCH_POLICIES, default=ElasticConfig.batch_policy)
    p.add_argument("--global-batch", type=int, default=48, help="examples per step over all slices")
    p.add_argument("--steps", type=int, default=200, help="training steps")
    p.add_argument(
        "--steps-per-chunk", type=int, default=ElasticConfig.steps_per_chunk, help="steps per controller call"
    )
    p.add_argument("--seed", type=int, default=ElasticConfig.seed)
    p.add_argument(
        "--slice-timeout",
        type=float,
        default=ElasticConfig.slice_timeout_s,
        help="seconds to wait for slices to be reserved",
    )
    p.add_argument("--run-dir", default=None, help="write the event log (events.jsonl) here")
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        help="Orbax checkpoints: local path or gs://bucket/prefix; a rerun resumes from the newest",
    )
    p.add_argument(
        "--resume-from",
        default=None,
        help="start from the newest committed checkpoint of this directory (another run's, or "
        "--checkpoint-dir itself to accept another task's); new ones go to --checkpoint-dir",
    )
    p.add_argument(
        "--checkpoint-every", type=int, default=ElasticConfig.checkpoint_every, help="steps between checkpoints"
    )
    p.add_argument("--max-to-keep", type=int, default=ElasticConfig.max_to_keep, help="committed checkpoints kept")
    p.add_argument(
        "--snapshot-every",
        type=_snapshot_every,
        default=ElasticConfig.snapshot_every,
        help="steps between in-memory snapshots (0: none, recover from checkpoints; 'auto': "
        "the smallest interval costing at most --snapshot-budget of the step time)",
    )
    p.add_argument(
        "--snapshot-budget",
        type=float,
        default=ElasticConfig.snapshot_budget,
        help="share of the step time snapshots may cost with --snapshot-every auto",
    )
    p.add_argument(
        "--standby-workers",
        type=int,
        default=ElasticConfig.standby_workers,
        help="warm processes kept on every slice host for the next generations (0: none; a "
        "recovery then starts its processes cold, seconds more)",
    )
    p.add_argument(
        "--allow-restart-from-scratch",
        action="store_true",
        help="when every snapshot holder is lost and there is no checkpoint, restart from step 0 instead of failing",
    )
    p.add_argument(
        "--slice-mesh",
        type=_slice_mesh,
        default=None,
        help="a slice's mesh axes, e.g. fsdp=-1,tensor=2 (default fsdp=-1,tensor=1; the llm example: tensor=2)",
    )
    p.add_argument(
        "--logical-axis-rules",
        type=_rules,
        default=None,
        help="logical axis -> mesh axis, e.g. embed=fsdp,mlp=tensor,vocab=tensor (a module:attr of "
        "such a list works too); the llm example brings its own",
    )
    p.add_argument(
        "--microbatch-size",
        type=int,
        default=None,
        help="examples per device per microbatch (gradient accumulation); default: none",
    )
    p.add_argument("--eval-every", type=int, default=None, help="evaluate every N steps (0: never)")
    p.add_argument("--eval-steps", type=int, default=None, help="batches per evaluation")
    p.add_argument("--eval-batch", type=int, default=None, help="examples per eval batch (default: --global-batch)")
    p.add_argument(
        "--tensorboard-dir",
        default=None,
        help="TensorBoard scalars here (local or gs://; default RUN_DIR/tensorboard with --run-dir)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON line")


def _model_settings(args) -> dict:
    """The layout, eval and accumulation settings: the flags, else the example's own, else the defaults."""
    settings = dict(EXAMPLE_SETTINGS.get(args.task, {}))
    for key, value in (
        ("slice_mesh", args.slice_mesh),
        ("logical_axis_rules", args.logical_axis_rules),
        ("microbatch_size", args.microbatch_size),
        ("eval_every", args.eval_every),
        ("eval_steps", args.eval_steps),
        ("eval_batch_size", args.eval_batch),
    ):
        if value is not None:
            settings[key] = value
    if isinstance(settings.get("logical_axis_rules"), str):
        settings["logical_axis_rules"] = _rules(settings["logical_axis_rules"])
    return settings


def _slice_mesh(value: str) -> dict:
    try:
        return {k.strip(): int(v) for k, v in (part.split("=") for part in value.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected AXIS=SIZE,... (e.g. fsdp=-1,tensor=2), got {value!r}") from None


def _rules(value: str) -> tuple:
    if ":" in value and "=" not in value:
        mod, attr = value.split(":", 1)
        try:
            return tuple(getattr(importlib.import_module(mod), attr))
        except (ImportError, AttributeError) as e:
            raise argparse.ArgumentTypeError(f"cannot load rules {value!r}: {e}") from None
    try:
        pairs = [part.split("=") for part in value.split(",")]
        return tuple(
            (k.strip(), None if v.strip() in ("", "none", "None") else tuple(v.strip().split("+"))) for k, v in pairs
        )
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected NAME=AXIS,... (e.g. embed=fsdp,mlp=tensor; AXIS+AXIS for two), got {value!r}"
        ) from None


def _config(args, spec: SliceSpec) -> ElasticConfig:
    return ElasticConfig(
        **_model_settings(args),
        num_slices=args.num_slices,
        min_slices=args.min_slices,
        mode=args.mode,
        batch_policy=args.batch_policy,
        global_batch_size=args.global_batch,
        slice=spec,
        steps_per_chunk=args.steps_per_chunk,
        seed=args.seed,
        slice_timeout_s=args.slice_timeout,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        max_to_keep=args.max_to_keep,
        snapshot_every=args.snapshot_every,
        snapshot_budget=args.snapshot_budget,
        standby_workers=args.standby_workers,
        allow_restart_from_scratch=args.allow_restart_from_scratch,
    )


def _snapshot_every(value: str):
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 or 'auto', got {value!r}") from None


def _print_summary(result, as_json: bool, goodput_printed: bool = False) -> None:
    if as_json:
        print(json.dumps(result.summary))
        return
    if not goodput_printed and result.events:
        from ray_elastic.observe.goodput import account

        print(account(result.events).table())
    print("\nray-elastic summary")
    width = max(len(k) for k in result.summary)
    for k, v in result.summary.items():
        if isinstance(v, float):
            v = f"{v:.4f}"
        print(f"  {k:<{width}}  {v}")


def _fit(task, config, args, address=None):
    result = ElasticTrainer(
        task,
        config,
        address=address,
        progress=not args.no_progress,
        run_dir=args.run_dir,
        tensorboard_dir=args.tensorboard_dir,
    ).fit(args.steps, resume_from=args.resume_from)
    _print_summary(result, args.json, goodput_printed=not args.no_progress)
    return result


def cmd_demo(args) -> int:
    import threading
    import time

    from ray_elastic.sim.cluster import SimulatedTPUCluster

    args.devices_per_host = args.devices_per_host or (4 if args.task == "llm" else 2)
    spec = SliceSpec.for_hosts(args.accelerator, args.hosts_per_slice, args.devices_per_host)
    task = load_task(args.task)
    config = _config(args, spec)  # validated before the cluster starts
    if args.run_dir is None:
        import tempfile

        args.run_dir = tempfile.mkdtemp(prefix="ray-elastic-demo-")
    kill_at = args.steps // 2 if args.kill_at is None else args.kill_at
    if kill_at >= args.steps:
        raise ValueError(f"--kill-at {kill_at} must be below --steps {args.steps} (or -1 for no kill)")
    print(
        f"starting a simulated cluster: {args.num_slices} x {spec.pod_type} slice(s), "
        f"{spec.num_hosts} host(s) each, {spec.host_devices} JAX CPU device(s) per host; mode {args.mode}"
    )
    with SimulatedTPUCluster(
        num_slices=args.num_slices,
        hosts_per_slice=args.hosts_per_slice,
        devices_per_host=args.devices_per_host,
        accelerator=args.accelerator,
        log_to_driver=False,
        **_slice_source(args),
    ) as cluster:
        if not cluster.autoscaler:  # a thread stands in for the autoscaler
            cluster.provisioner(delay_s=args.arrival_delay)
        killed = {}
        trainer_box = {}

        def on_step(metrics):
            if kill_at >= 0 and not killed and metrics["step"] >= kill_at:
                victim = trainer_box["t"].world.plan.slice_names[-1]
                killed.update(name=victim, at=time.time(), step=metrics["step"])
                threading.Thread(target=cluster.kill_slice, args=(victim,), daemon=True).start()

        trainer = ElasticTrainer(
            task,
            config,
            progress=not args.no_progress,
            on_step=on_step,
            run_dir=args.run_dir,
            tensorboard_dir=args.tensorboard_dir,
        )
        trainer_box["t"] = trainer
        result = trainer.fit(args.steps, resume_from=args.resume_from)
        if killed and result.recoveries:
            rec = result.recoveries[0]
            result.summary["killed_slice"] = f"{killed['name']} after step {killed['step']}"
            result.summary["detection_s"] = round(rec.detected_at - killed["at"], 3)
            result.summary["kill_to_training_again_s"] = round(rec.ready_at - killed["at"], 3)
        _print_summary(result, args.json, goodput_printed=not args.no_progress)
    if not args.json:
        from ray_elastic.observe import report

        print(f"timeline of this run: {report.render(args.run_dir)}  (ray-elastic report {args.run_dir})")
    return 0


def cmd_sim(args) -> int:
    """A simulated TPU cluster in the foreground, for ``ray job submit`` and fault drills by hand."""
    import math
    import os

    from ray_elastic.sim.cluster import SimulatedTPUCluster
    from ray_elastic.sim.hosts import wait_for_job_server

    # Jobs run on this cluster's nodes: they must find this installation's ray-elastic.
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    args.devices_per_host = args.devices_per_host or 2
    spec = SliceSpec.for_hosts(args.accelerator, args.hosts_per_slice, args.devices_per_host)
    with SimulatedTPUCluster(
        num_slices=args.num_slices,
        hosts_per_slice=args.hosts_per_slice,
        devices_per_host=args.devices_per_host,
        accelerator=args.accelerator,
        log_to_driver=False,
        dashboard=True,
        **_slice_source(args),
    ) as cluster:
        if not cluster.autoscaler and args.arrival_delay >= 0:
            cluster.provisioner(delay_s=args.arrival_delay)
        url = f"http://127.0.0.1:{cluster.dashboard_port}"
        wait_for_job_server(url)
        print(
            f"simulated cluster up: {args.num_slices} x {spec.pod_type} slice(s) ({spec.topology}), "
            f"{spec.num_hosts} host(s) each, {spec.host_devices} JAX CPU device(s) per host"
        )
        print(f"dashboard and job server: {url}")
        print("submit a job from another terminal:")
        print(
            f"  ray job submit --address {url} -- ray-elastic train --example mlp --num-slices {args.num_slices} "
            f"--topology {spec.topology} --devices-per-host {spec.host_devices} --global-batch "
            f"{4 * math.lcm(*range(1, args.num_slices + 1)) * spec.devices_per_slice} --steps 800 "
            "--run-dir /tmp/ray-elastic/job"
        )
        if cluster.autoscaler:
            print(
                f"slices come from Ray's autoscaler: a lost slice is replaced {args.arrival_delay:.0f}s after it is "
                f"asked for, up to {args.max_slices or args.num_slices} slices ('capacity N' changes that)"
            )
        print(f"commands: {SIM_COMMANDS}", flush=True)
        for line in sys.stdin:
            cmd, *rest = line.split() or [""]
            alive = [s.name for s in cluster.alive_slices()]
            if cmd == "list":
                print("slices:", " ".join(alive) or "(none)", flush=True)
            elif cmd == "kill" and alive:
                name = rest[0] if rest else alive[-1]
                if name not in alive:
                    print(f"no live slice {name!r}; live: {' '.join(alive)}", flush=True)
                    continue
                cluster.kill_slice(name)
                print(f"killed {name}", flush=True)
            elif cmd == "add":
                if cluster.autoscaler:  # one more slice of capacity, launched by the autoscaler
                    cluster.set_capacity(len(alive) + 1)
                print(f"added {cluster.add_slice().name}", flush=True)
            elif cmd == "capacity" and cluster.autoscaler and rest and rest[0].isdigit():
                cluster.set_capacity(int(rest[0]))
                print(f"capacity: {rest[0]} slice(s)", flush=True)
            elif cmd in ("quit", "exit"):
                break
            elif cmd:
                print(f"commands: {SIM_COMMANDS}", flush=True)
    return 0


SIM_COMMANDS = "list | kill [SLICE] (default: the newest) | add | capacity N (autoscaler) | quit"


def _add_slice_source_args(p: argparse.ArgumentParser, arrival_delay: float) -> None:
    p.add_argument(
        "--no-autoscaler",
        action="store_true",
        help="add replacement slices from a thread of this process instead of Ray's autoscaler",
    )
    p.add_argument(
        "--arrival-delay",
        type=float,
        default=arrival_delay,
        help="seconds a replacement slice takes to be provisioned (simulated)",
    )
    p.add_argument(
        "--max-slices",
        type=int,
        default=None,
        help="TPU capacity: slices that may be alive at once (default: --num-slices); beyond it "
        "launches fail like a stock-out",
    )


def _slice_source(args) -> dict:
    """Where the simulated cluster's slices come from: Ray's autoscaler (v2), unless --no-autoscaler."""
    if args.no_autoscaler:
        return {}
    return {
        "autoscaler": True,
        "launch_delay_s": max(0.0, args.arrival_delay),
        "max_slices": args.max_slices or args.num_slices,
    }


def cmd_report(args) -> int:
    from ray_elastic.observe import report

    tl = report.timeline(report.load_events(args.run_dir))
    out = report.render(args.run_dir, args.out, tl)
    print(tl.goodput.table())
    print(f"timeline: {out}")
    return 0


def cmd_train(args) -> int:
    spec = SliceSpec(accelerator=args.accelerator, topology=args.topology, devices_per_host=args.devices_per_host)
    task = load_task(args.task)
    config = _config(args, spec)
    _fit(task, config, args, address=args.address)
    return 0


def _add_sim_host_args(p: argparse.ArgumentParser, devices_help: str) -> None:
    """The simulated hosts' shape (``demo`` and ``sim``); ``--devices-per-host`` None: the command's default."""
    p.add_argument("--accelerator", default="v4", help="TPU generation the simulated hosts pretend to be")
    p.add_argument("--hosts-per-slice", type=int, default=1)
    p.add_argument(
        "--devices-per-host", type=int, default=None, help="JAX CPU devices per simulated host " + devices_help
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="ray-elastic", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log controller decisions")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train an example on a simulated multi-slice TPU cluster on this machine")
    _add_training_args(demo, default_slices=3)
    _add_sim_host_args(demo, devices_help="(default 2; 4 for the llm example: 2 fsdp x 2 tensor)")
    demo.add_argument(
        "--kill-at",
        type=int,
        default=None,
        help="kill a slice (node and processes) after this step (default: half way; -1: never)",
    )
    _add_slice_source_args(demo, arrival_delay=2.0)
    demo.set_defaults(func=cmd_demo)

    train = sub.add_parser("train", help="train on an existing Ray cluster (RAY_ADDRESS or --address)")
    _add_training_args(train, default_slices=2)
    train.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS, or the job's cluster)")
    train.add_argument(
        "--accelerator", default="v4", help="TPU generation of the slices (v4, v5p, v5litepod, v6e, ...)"
    )
    train.add_argument("--topology", default="2x2x1", help="topology of one slice, e.g. 2x2x2")
    train.add_argument(
        "--devices-per-host", type=int, default=None, help="JAX devices per host (default: one per TPU chip)"
    )
    train.set_defaults(func=cmd_train)

    sim = sub.add_parser(
        "sim", help="run a simulated TPU cluster in the foreground (for ray job submit); kill/add slices from stdin"
    )
    sim.add_argument("--num-slices", type=int, default=3)
    _add_sim_host_args(sim, devices_help="(default 2)")
    _add_slice_source_args(sim, arrival_delay=2.0)
    sim.set_defaults(func=cmd_sim)

    rep = sub.add_parser("report", help="draw a run's timeline and goodput (PNG) from its run directory")
    rep.add_argument("run_dir", help="the --run-dir of a run (holds events.jsonl)")
    rep.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/report.png)")
    rep.set_defaults(func=cmd_report)

    args = parser.parse_args(argv)
    if getattr(args, "steps", 1) < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
        return args.func(args)
    except ValueError as e:
        print(f"ray-elastic: error: {e}", file=sys.stderr)
        return 2
    except ElasticRuntimeError as e:
        print(f"ray-elastic: training failed: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
