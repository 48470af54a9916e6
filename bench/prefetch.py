"""Data off the critical path: a slow dataset costs max(compute, data) per step, not their sum.

One process with 4 CPU devices trains the LLM example with ``jax_world.TrainLoop`` (the slice
processes' loop, one step in flight) on a dataset whose ``__getitem__`` sleeps (a remote read),
sized so that reading a step's rows takes about as long as computing the step. Runs: the fast
dataset (compute alone), then the slow one read in the step loop (``prefetch=0``) and read ahead
by the reader thread (``prefetch=2``, the default), with one step in flight (as the slice
processes run) and with a blocking loop (each loss read before the next step is dispatched, where
a read in the loop adds the whole data time). Medians of the steady-state step time. Last line,
one JSON object with ``prefetch_ratio`` (read ahead / max(compute, data); goal about 1),
``serial_ratio`` (read in the loop / the same) and the blocking loop's two ratios.

    .venv/bin/python bench/prefetch.py [--steps 40] [--data-share 1.0]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


class SlowDataset:
    """Another dataset's examples, each read ``delay_s`` late (sleeping: the GIL is free meanwhile)."""

    def __init__(self, base, delay_s: float):
        self.base, self.delay_s = base, delay_s

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        time.sleep(self.delay_s)
        return self.base[i]


def run(task, dataset, prefetch: int, steps: int, batch: int, in_flight: int = 1) -> float:
    from ray_elastic.decide import plan_world
    from ray_elastic.slice import jax_world
    from ray_elastic.slice import mesh as world_mesh
    from ray_elastic.slice.data import StepBatches

    plan = plan_world(0, ["s0"], 1, 4, batch, slice_mesh={"fsdp": -1, "tensor": 2})
    from ray_elastic.examples.llm import LOGICAL_AXIS_RULES

    loop = jax_world.TrainLoop(
        task,
        plan,
        0,
        0,
        world_mesh.build_mesh(plan),
        1,
        StepBatches(dataset, batch, 0),
        rules=LOGICAL_AXIS_RULES,
        prefetch=prefetch,
    )
    loop.compile(0)
    times = [m["step_time_s"] for m in loop.run(0, steps, in_flight=in_flight)]
    loop.close()
    return statistics.median(times[steps // 4 :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--data-share", type=float, default=1.0, help="data time per step / compute time per step")
    args = ap.parse_args()
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from ray_elastic.examples.llm import DecoderLMTask

    task = DecoderLMTask(seq_len=64, d_model=128, num_layers=2, max_chars=100_000)
    base = task.dataset()
    compute = run(task, base, 0, args.steps, args.batch)
    delay = args.data_share * compute / args.batch
    data = args.batch * delay
    slow = SlowDataset(base, delay)
    serial = run(task, slow, 0, args.steps, args.batch)
    ahead = run(task, slow, 2, args.steps, args.batch)
    # A loop that reads each loss before the next step (no step in flight): reading in it adds the data
    # time to every step; the reader thread still hides it.
    serial_blocking = run(task, slow, 0, args.steps, args.batch, in_flight=0)
    ahead_blocking = run(task, slow, 2, args.steps, args.batch, in_flight=0)
    bound = max(compute, data)
    print(f"per step: compute {compute * 1e3:.1f} ms, data {data * 1e3:.1f} ms")
    print(
        f"  one step in flight (the slice processes' loop): read in the loop {serial * 1e3:.1f} ms, "
        f"read ahead {ahead * 1e3:.1f} ms"
    )
    print(f"  blocking loop: read in the loop {serial_blocking * 1e3:.1f} ms, read ahead {ahead_blocking * 1e3:.1f} ms")
    print(
        json.dumps(
            {
                "compute_s": round(compute, 4),
                "data_s": round(data, 4),
                "serial_s": round(serial, 4),
                "prefetch_s": round(ahead, 4),
                "prefetch_ratio": round(ahead / bound, 3),
                "serial_ratio": round(serial / bound, 3),
                "blocking_serial_ratio": round(serial_blocking / bound, 3),
                "blocking_prefetch_ratio": round(ahead_blocking / bound, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
