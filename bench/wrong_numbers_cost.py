"""What guarding against wrong numbers costs a step: the bad-step guard and the replicas' fingerprints.

One process with 4 CPU devices trains the LLM example and the overhead bench's large char
transformer with ``jax_world.TrainLoop`` (the slice processes' loop, one step in flight):

- ``bad_step_guard_cost``: the steady step with the guard that skips a bad step (the default)
  against ``on_bad_step="raise"`` (no selection), the two loops' chunks interleaved in one run
  (medians of the chunks' per-step times): the ratio minus one.
- ``integrity_cost``: the seconds of one fingerprint of the whole state (``slice.integrity``,
  compiled once before timing; median of ``--reps``), over ``integrity_every`` (the default, 100)
  steady steps: what a check every 100 steps costs.

A direct measure: the overhead bench compares whole runs, whose 5-15% run-to-run noise on this
machine is far above the 0.5% goal. Last line, one JSON object.

    .venv/bin/python bench/wrong_numbers_cost.py [--steps 200] [--reps 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def loop_for(task, bad_steps, batch: int, rules=()):
    from ray_elastic.decide import plan_world
    from ray_elastic.slice import jax_world
    from ray_elastic.slice import mesh as world_mesh
    from ray_elastic.slice.data import StepBatches

    plan = plan_world(0, ["s0"], 1, 4, batch, slice_mesh={"fsdp": -1, "tensor": 2} if rules else None)
    mesh = world_mesh.build_mesh(plan)
    loop = jax_world.TrainLoop(
        task, plan, 0, 0, mesh, 1, StepBatches(task.dataset(), batch, 0), rules=rules, bad_steps=bad_steps
    )
    loop.compile(0)
    return loop


def measure(name: str, task, rules, steps: int, reps: int, batch: int) -> dict:
    import jax

    from ray_elastic.decide.bad_steps import BadSteps
    from ray_elastic.slice.integrity import Fingerprints

    guarded, plain = loop_for(task, BadSteps(), batch, rules), loop_for(task, BadSteps(skip=False), batch, rules)
    chunk = 10
    times: dict[str, list[float]] = {"guard": [], "raise": []}
    for c in range(steps // chunk):  # interleaved, in a rotating order
        for key, loop in (("guard", guarded), ("raise", plain))[:: 1 if c % 2 else -1]:
            out = loop.run(c * chunk, chunk)
            if c >= 2:  # warm
                times[key].append(statistics.median(m["step_time_s"] for m in out))
    step_s = statistics.median(times["raise"])
    fingerprints, seconds = Fingerprints(every=1), []
    for r in range(reps + 1):
        jax.block_until_ready(guarded.state)
        t0 = time.perf_counter()
        fingerprints.dispatched(r, guarded.state)
        fingerprints.finished(r)
        if r:  # the first compiles _bits_sum for each block shape
            seconds.append(time.perf_counter() - t0)
    fp_s = statistics.median(seconds)
    state_mb = sum(x.nbytes for x in jax.tree.leaves(guarded.state)) / 1e6
    out = {
        f"bad_step_guard_cost_{name}": round(statistics.median(times["guard"]) / step_s - 1, 4),
        f"integrity_cost_{name}": round(fp_s / (100 * step_s), 5),
        f"fingerprint_ms_{name}": round(fp_s * 1e3, 2),
        f"step_ms_{name}": round(step_s * 1e3, 2),
        f"state_mb_{name}": round(state_mb, 1),
    }
    print(
        f"{name}: step {step_s * 1e3:.1f} ms, guard {out[f'bad_step_guard_cost_{name}']:+.2%}, "
        f"fingerprint of {state_mb:.1f} MB {fp_s * 1e3:.2f} ms = {out[f'integrity_cost_{name}']:.3%} every 100 steps",
        flush=True,
    )
    guarded.close()
    plain.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from ray_elastic.examples.char_transformer import CharTransformerTask
    from ray_elastic.examples.llm import LOGICAL_AXIS_RULES, DecoderLMTask

    out = {}
    out |= measure(
        "large",
        CharTransformerTask(max_chars=100_000, seq_len=32, d_model=256, num_layers=2),
        (),
        args.steps,
        args.reps,
        48,
    )
    out |= measure(
        "llm",
        DecoderLMTask(seq_len=32, d_model=128, num_layers=2, d_ff=256, max_chars=100_000),
        LOGICAL_AXIS_RULES,
        args.steps,
        args.reps,
        48,
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
