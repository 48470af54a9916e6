"""``ray-elastic`` command line: ``demo`` on a simulated cluster, ``train`` on an existing one,
``check`` an existing one before training.

``ray job submit --address http://HEAD:8265 -- ray-elastic train --example transformer ...``
runs the driver inside the cluster; ``train`` connects to ``--address`` or ``RAY_ADDRESS``.
"""

from __future__ import annotations

import argparse
import logging
import sys

from ray_elastic.cli.check import add_check_parser
from ray_elastic.cli.commands import cmd_demo, cmd_report, cmd_train
from ray_elastic.cli.options import add_sim_host_args, add_slice_source_args, add_training_args, load_task
from ray_elastic.cli.sim import cmd_sim
from ray_elastic.errors import ElasticRuntimeError

__all__ = ["load_task", "main"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="ray-elastic", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log controller decisions")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train an example on a simulated multi-slice TPU cluster on this machine")
    add_training_args(demo, default_slices=3)
    add_sim_host_args(demo, devices_help="(default 2; 4 for the llm example: 2 fsdp x 2 tensor)")
    demo.add_argument(
        "--kill-at",
        type=int,
        default=None,
        help="kill a slice (node and processes) after this step (default: half way; -1: never)",
    )
    add_slice_source_args(demo, arrival_delay=2.0)
    demo.set_defaults(func=cmd_demo)

    train = sub.add_parser("train", help="train on an existing Ray cluster (RAY_ADDRESS or --address)")
    add_training_args(train, default_slices=2)
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
    add_sim_host_args(sim, devices_help="(default 2)")
    add_slice_source_args(sim, arrival_delay=2.0)
    sim.set_defaults(func=cmd_sim)

    add_check_parser(sub)

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
