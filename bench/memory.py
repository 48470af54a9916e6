"""Per-device memory of the LLM example's compiled step, at full size and after losing half the slices.

The step is compiled exactly as a world compiles it (``jax_world.trace_ahead`` for the world's
plan, lowered for its devices) in one process with ``--slices x 4`` CPU devices, slices of
2 fsdp x 2 tensor. ``compiled.memory_analysis()`` gives the bytes per device XLA allocates:
arguments (train state shards and the batch) plus temporaries (activations, gradients). Under
``batch_policy="constant"`` a world of half the slices gives each device twice the batch; with
accumulation (``microbatch_size``) it runs twice the microbatches of the same size instead.
Deterministic on CPU (no TPU needed). Last line, one JSON object with ``resize_memory_ratio``
(after / before, accumulation on; goal <= 1.05) and ``resize_memory_ratio_no_accumulation``.

    .venv/bin/python bench/memory.py [--slices 4] [--d-model 256] [--layers 4] [--seq-len 256] [--batch 96]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

DEVICES_PER_SLICE = 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slices", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=96, help="global batch (examples per step)")
    args = ap.parse_args()
    if args.slices < 2 or args.slices % 2:
        sys.exit("--slices must be an even number >= 2 (half of them are lost)")
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.slices * DEVICES_PER_SLICE}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    from ray_elastic import ElasticConfig, SliceSpec
    from ray_elastic.examples.llm import LOGICAL_AXIS_RULES, DecoderLMTask
    from ray_elastic.slice import compile_cache, jax_world
    from ray_elastic.slice import mesh as world_mesh
    from ray_elastic.slice.data import StepBatches

    task = DecoderLMTask(
        seq_len=args.seq_len,
        d_model=args.d_model,
        num_layers=args.layers,
        num_heads=max(4, args.d_model // 64),
        num_kv_heads=2,
        d_ff=4 * args.d_model,
        max_chars=200_000,
    )
    batches = StepBatches(task.dataset(), args.batch, 0)
    # One microbatch size that divides the per-device batch of every world the run may form.
    microbatch = math.gcd(*(args.batch // (n * 2) for n in range(args.slices // 2, args.slices + 1)))
    rows, out = [], {}
    for accumulate in (False, True):
        config = ElasticConfig(
            num_slices=args.slices,
            global_batch_size=args.batch,
            min_slices=args.slices // 2,
            slice=SliceSpec("v4", "2x2x1", DEVICES_PER_SLICE),
            slice_mesh={"fsdp": -1, "tensor": 2},
            logical_axis_rules=LOGICAL_AXIS_RULES,
            microbatch_size=microbatch if accumulate else None,
        )
        per_size = {}
        for n in (args.slices, args.slices // 2):
            plan = config.world_plan(0, [f"s{i}" for i in range(n)])
            traced = jax_world.trace_ahead(
                task, plan, 0, config.fsdp_min_size, batches, rules=config.logical_axis_rules
            )
            compiled, _ = compile_cache.lower_and_compile(traced, world_mesh.device_grid(plan))
            mem = compiled.memory_analysis()
            total = mem.argument_size_in_bytes + mem.temp_size_in_bytes
            per_size[n] = total
            rows.append(
                (
                    accumulate,
                    n,
                    plan.per_device_batch,
                    plan.num_microbatches,
                    mem.argument_size_in_bytes,
                    mem.temp_size_in_bytes,
                    total,
                )
            )
        ratio = per_size[args.slices // 2] / per_size[args.slices]
        out["resize_memory_ratio" if accumulate else "resize_memory_ratio_no_accumulation"] = round(ratio, 4)
    print(
        f"LLM example d_model={args.d_model} layers={args.layers} seq={args.seq_len} global batch={args.batch}; "
        f"slices of {DEVICES_PER_SLICE} devices (fsdp 2 x tensor 2); bytes per device"
    )
    print(
        f"{'accumulation':>12} {'slices':>6} {'batch/dev':>9} {'micro':>5} {'arguments':>12} {'temp':>12} {'total':>12}"
    )
    for acc, n, per_dev, micro, arg, temp, total in rows:
        print(f"{'on' if acc else 'off':>12} {n:>6} {per_dev:>9} {micro:>5} {arg:>12,} {temp:>12,} {total:>12,}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
