"""Where "a snapshot every step" stops fitting the budget: what one snapshot costs by state size.

A process's snapshot is its block of the train state packed on the device into one buffer per
device (a new buffer: the next step may donate the state's), read out to host and written into a
slot of its keeper's shared-memory ring (``ray_elastic.state.snapshot_slots``): the path ``SnapshotWriter`` takes,
with the same functions, on this machine's CPU devices (2 per process, the state sharded over
them as a slice's fsdp axis shards it). For each state size per host it prints what one
snapshot costs *cold* (the first write into each slot of a new ring, as in a world's first steps:
every page of the slot faults in) and *warm* (every later one: median and worst), and the shortest
step time at which a warm snapshot after every step costs at most the budget (3%): above it
the default snapshot policy (``AutoInterval``) keeps every step; below it, it picks an interval.

    .venv/bin/python bench/snapshot_copy.py [--sizes-mb 1,4,16,64,256] [--reps 7]

Last line, one JSON object: ``{"copy_gb_per_s": ..., "every_step_min_step_ms": {"<MB>": ms, ...}, ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

BUDGET = 0.03


def one_size(mb: int, reps: int) -> tuple[list[float], list[float]]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from ray_elastic.slice import snapshot_pack
    from ray_elastic.state.snapshot_slots import SlotSegment

    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    rows = mb * (1 << 20) // 4 // 1024
    leaves = [
        jax.device_put(jnp.ones((rows // 2, 1024), jnp.float32), NamedSharding(mesh, PartitionSpec("fsdp")))
        for _ in range(2)
    ]
    pack = snapshot_pack.packer(leaves)
    layout = snapshot_pack.layout(leaves, ("['a']", "['b']"))
    nslots = layout.slots()
    keeper = SlotSegment.create(0, layout, nslots)
    writer = SlotSegment.open(keeper.path, layout)
    seconds = []
    try:
        for step in range(nslots + reps):
            t0 = time.perf_counter()
            packed = pack(leaves)
            packed.copy_to_host_async()
            packed.block_until_ready()
            writer.write(0, step, lambda rows, packed=packed: snapshot_pack.fill(packed, layout, rows))
            seconds.append(time.perf_counter() - t0)
    finally:
        writer.close()
        keeper.close(unlink=True)
    return seconds[1:nslots], seconds[nslots:]  # (the first program run compiles)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", default="1,4,16,64,256")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes_mb.split(",")]
    out: dict = {"budget": BUDGET, "snapshot_ms": {}, "worst_ms": {}, "cold_ms": {}, "every_step_min_step_ms": {}}
    rates = []
    print(
        f"{'state MB/host':>14} {'cold ms':>8} {'warm median ms':>15} {'warm worst ms':>14} {'GB/s':>6}"
        f" {'every step fits 3% at steps >=':>32}"
    )
    for mb in sizes:
        cold, warm = one_size(mb, args.reps)
        med, worst = statistics.median(warm), max(warm)
        rate = mb / 1024 / med
        rates.append(rate)
        min_step = med / BUDGET
        out["cold_ms"][str(mb)] = round(statistics.median(cold) * 1e3, 2)
        out["snapshot_ms"][str(mb)] = round(med * 1e3, 2)
        out["worst_ms"][str(mb)] = round(worst * 1e3, 2)
        out["every_step_min_step_ms"][str(mb)] = round(min_step * 1e3, 1)
        print(
            f"{mb:>14} {statistics.median(cold) * 1e3:>8.2f} {med * 1e3:>15.2f} {worst * 1e3:>14.2f} {rate:>6.2f}"
            f" {min_step * 1e3:>29.0f} ms"
        )
    out["copy_gb_per_s"] = round(statistics.median(rates), 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
