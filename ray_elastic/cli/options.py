"""The command line's options, and the task and config they make (validated before any cluster starts)."""

from __future__ import annotations

import argparse
import importlib

from ray_elastic.config import BATCH_POLICIES, MODES, ElasticConfig
from ray_elastic.examples import EXAMPLE_SETTINGS, EXAMPLES
from ray_elastic.policy.snapshots import AutoInterval
from ray_elastic.task import TrainTask
from ray_elastic.tpu import SliceSpec


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


def add_training_args(p: argparse.ArgumentParser, default_slices: int) -> None:
    """The options of a training run (``demo`` and ``train``), in groups as ``--help`` shows them."""
    _add_run_args(p.add_argument_group("the run"), default_slices)
    _add_state_args(p.add_argument_group("state: checkpoints and snapshots"))
    _add_model_args(p.add_argument_group("model layout, eval and accumulation (default: the example's own)"))
    out = p.add_argument_group("output")
    out.add_argument("--run-dir", default=None, help="write the event log (events.jsonl) here")
    out.add_argument(
        "--tensorboard-dir",
        default=None,
        help="TensorBoard scalars here (local or gs://; default RUN_DIR/tensorboard with --run-dir)",
    )
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    out.add_argument("--json", action="store_true", help="print the summary as one JSON line")


def _add_run_args(p, default_slices: int) -> None:
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
    p.add_argument(
        "--standby-workers",
        type=int,
        default=ElasticConfig.standby_workers,
        help="warm processes kept on every slice host for the next generations (0: none; a "
        "recovery then starts its processes cold, seconds more)",
    )


def _add_state_args(p) -> None:
    p.add_argument(
        "--run-id",
        default=None,
        help="what makes a rerun the same run (default: --run-dir, else --checkpoint-dir): a rerun "
        "within --orphan-timeout of a lost driver resumes from its in-memory snapshots",
    )
    p.add_argument(
        "--orphan-timeout",
        type=float,
        default=ElasticConfig.orphan_timeout_s,
        help="seconds the snapshot keepers outlive a lost driver before they free everything",
    )
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
        type=parse_snapshot_every,
        default="auto",
        help="steps between in-memory snapshots (0: none, recover from checkpoints; 'auto': "
        "the smallest interval costing at most --snapshot-budget of the step time)",
    )
    p.add_argument(
        "--snapshot-budget",
        type=float,
        default=AutoInterval.budget,
        help="share of the step time snapshots may cost with --snapshot-every auto",
    )
    p.add_argument(
        "--allow-restart-from-scratch",
        action="store_true",
        help="when every snapshot holder is lost and there is no checkpoint, restart from step 0 instead of failing",
    )


def _add_model_args(p) -> None:
    p.add_argument(
        "--slice-mesh",
        type=parse_slice_mesh,
        default=None,
        help="a slice's mesh axes, e.g. fsdp=-1,tensor=2 (default fsdp=-1,tensor=1; the llm example: tensor=2)",
    )
    p.add_argument(
        "--logical-axis-rules",
        type=parse_rules,
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


def model_settings(args) -> dict:
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
        settings["logical_axis_rules"] = parse_rules(settings["logical_axis_rules"])
    return settings


def parse_slice_mesh(value: str) -> dict:
    try:
        return {k.strip(): int(v) for k, v in (part.split("=") for part in value.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected AXIS=SIZE,... (e.g. fsdp=-1,tensor=2), got {value!r}") from None


def parse_rules(value: str) -> tuple:
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


def config_from_args(args, spec: SliceSpec) -> ElasticConfig:
    return ElasticConfig(
        **model_settings(args),
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
        snapshot_every=AutoInterval(args.snapshot_budget) if args.snapshot_every == "auto" else args.snapshot_every,
        standby_workers=args.standby_workers,
        allow_restart_from_scratch=args.allow_restart_from_scratch,
        orphan_timeout_s=args.orphan_timeout,
    )


def parse_snapshot_every(value: str):
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 or 'auto', got {value!r}") from None


def add_slice_source_args(p: argparse.ArgumentParser, arrival_delay: float) -> None:
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


def slice_source(args) -> dict:
    """Where the simulated cluster's slices come from: Ray's autoscaler (v2), unless --no-autoscaler."""
    if args.no_autoscaler:
        return {}
    return {
        "autoscaler": True,
        "launch_delay_s": max(0.0, args.arrival_delay),
        "max_slices": args.max_slices or args.num_slices,
    }


def add_sim_host_args(p: argparse.ArgumentParser, devices_help: str) -> None:
    """The simulated hosts' shape (``demo`` and ``sim``); ``--devices-per-host`` None: the command's default."""
    p.add_argument("--accelerator", default="v4", help="TPU generation the simulated hosts pretend to be")
    p.add_argument("--hosts-per-slice", type=int, default=1)
    p.add_argument(
        "--devices-per-host", type=int, default=None, help="JAX CPU devices per simulated host " + devices_help
    )


def simulated_cluster(args, **extra):
    """The simulated cluster ``demo``'s and ``sim``'s options describe: its hosts, their devices, and
    where its slices come from (``extra``: more SimulatedTPUCluster arguments)."""
    from ray_elastic.sim.cluster import SimulatedTPUCluster

    return SimulatedTPUCluster(
        num_slices=args.num_slices,
        hosts_per_slice=args.hosts_per_slice,
        devices_per_host=args.devices_per_host,
        accelerator=args.accelerator,
        log_to_driver=False,
        **slice_source(args),
        **extra,
    )
