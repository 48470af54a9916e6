"""The scale curve: how steady-state cost and recovery grow with the world, and what limits the driver.

Two parts:

1. **Simulated clusters** at 2, 4 and 8 one-host slices (1 CPU device per host, so 8 fit
   on this machine) and 2 two-host slices: per world, the best bare multi-process JAX loop
   against ray-elastic with default settings (the overhead ratio), then one process kill
   and one lost node (kill -> first step after recovery, and detection).
2. **Driver model** at 64, 256 and 1024 processes: the controller's real per-step path
   (``StepStreams``: chunks submitted as Ray streaming generators to the snapshot holders and
   as plain tasks, or through relays (``ray_elastic.ray_backend.relay``) from 16 quiet processes up, to the
   others; every item read, the holders' reports folded into the snapshot store and the step
   ledger) driving scripted streams instead of JAX (a few async Ray actors play every process
   and yield what a slice process yields, at a fixed step time). Reports driver CPU per step,
   and the relays' CPU beside it (they run on the driver's node, in processes of their own).

Last line, one JSON object: ``{"clusters": [{...}, ...], "driver": [{"processes": N,
"driver_cpu_ms_per_step": ...}, ...]}``; ``--plot scale.png`` draws the curve.

    .venv/bin/python bench/scale.py [--slices 2 4 8] [--processes 64 256 1024] [--plot docs/scale.png]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))

BATCH = 840  # splits evenly over any world of 1 to 8 processes


class _Done(Exception):
    """Both faults fired and the world trained on: stop the run."""


# ----------------------------------------------------------------------------- part 1: clusters
def cluster_point(num_slices: int, hosts: int, steps: int) -> dict:
    """Overhead ratio and recovery figures of one world size on its own simulated cluster."""
    import overhead

    from ray_elastic import ElasticConfig, ElasticTrainer
    from ray_elastic.errors import ElasticRuntimeError
    from ray_elastic.examples.char_transformer import CharTransformerTask
    from ray_elastic.sim.cluster import SimulatedTPUCluster

    bare = overhead.run_bare(steps, "small", 1, processes=num_slices * hosts, devices=1, batch=BATCH)["step_s"]
    with SimulatedTPUCluster(
        num_slices=num_slices, devices_per_host=1, hosts_per_slice=hosts, log_to_driver=False
    ) as cluster:
        cfg = dict(
            num_slices=num_slices,
            global_batch_size=BATCH,
            slice=cluster.slice_spec,
            steps_per_chunk=20,
            snapshot_replicas=num_slices,
            standby_workers=1,
            min_slices=1,
        )
        task = CharTransformerTask(max_chars=100_000, **overhead.MODELS["small"])
        steady = ElasticTrainer(task, ElasticConfig(**cfg), progress=False).fit(steps)
        ray_step = statistics.mean(steady.step_times_s[steps // 2 :])

        kills = [("process", 0), ("node", num_slices - 1)]  # the coordinator's process; the last slice's host
        fired: list[dict] = []
        done_at: list[float] = []

        def on_step(m: dict) -> None:
            done_at.append(m["finished_at"])
            t = box["t"]
            if not kills and m["step"] >= box["next"]:
                raise _Done()
            if (
                kills
                and m["step"] >= box["next"]
                and t.world.plan.num_slices == num_slices
                and t.backend.warm(t.gens.members)
            ):
                kind, pos = kills.pop(0)
                fired.append({"kind": kind, "at": time.time()})
                if kind == "process":
                    os.kill(t.world.host_infos[pos * hosts]["pid"], signal.SIGKILL)
                else:
                    name = t.world.plan.slice_names[pos]
                    target = cluster.kill_slice if hosts == 1 else (lambda n: cluster.kill_host(n, hosts - 1))
                    threading.Thread(target=target, args=(name,), daemon=True).start()
                box["next"] = m["step"] + 20

        box = {"next": 10}
        t = box["t"] = ElasticTrainer(task, ElasticConfig(**cfg), progress=False, on_step=on_step)
        regrow = threading.Thread(target=_regrow, args=(cluster, num_slices, box), daemon=True)
        regrow.start()
        try:
            t.fit(100_000)
        except ElasticRuntimeError as e:
            if not isinstance(e.__cause__, _Done):
                raise
        finally:
            box["stop"] = True
        rows = []
        for f in fired:
            recs = [r for r in t.recoveries if r.ready_at > f["at"]]
            fails = [e for e in t.events.events if e["kind"] == "failure" and e["ts"] > f["at"]]
            if recs and fails:
                first = min(a for a in done_at if a > recs[0].ready_at)
                rows.append(
                    {
                        "kind": f["kind"],
                        "detection_s": round(fails[0].seen_at - f["at"], 3),
                        "kill_to_step_s": round(first - f["at"], 3),
                        "steps_rewound": recs[0].steps_rewound,
                    }
                )
    return {
        "slices": num_slices,
        "hosts_per_slice": hosts,
        "processes": num_slices * hosts,
        "bare_step_ms": round(bare * 1e3, 2),
        "step_ms": round(ray_step * 1e3, 2),
        "overhead_ratio": round(ray_step / bare, 4),
        "recoveries": rows,
    }


def _regrow(cluster, num_slices: int, box: dict) -> None:
    """Bring a lost slice back a few seconds later, so the next kill finds a full world."""
    while not box.get("stop"):
        time.sleep(1.0)
        cluster.reap_dead_slices()
        if len(cluster.alive_slices()) < num_slices:
            time.sleep(2.0)
            cluster.add_slice()


# ----------------------------------------------------------------------------- part 2: driver model
def driver_point(processes: int, steps: int, step_s: float, holders: int, actors: int, steps_per_chunk: int) -> dict:
    """Driver CPU per step of ``StepStreams`` driving ``processes`` scripted streams."""
    import ray

    from ray_elastic.config import ElasticConfig, SliceSpec
    from ray_elastic.decide import plan_world
    from ray_elastic.observe.events import EventLog
    from ray_elastic.observe.step_ledger import StepLedger
    from ray_elastic.policy.failure import FailureConfig
    from ray_elastic.ray_backend.relay import RelayPool
    from ray_elastic.ray_backend.stepping import StepStreams
    from ray_elastic.slice.chunk_running import FLUSH_S
    from ray_elastic.state.snapshots import SnapshotStore

    @ray.remote(num_cpus=0, max_concurrency=100_000)
    class Script:
        """Plays slice processes: what ``SliceWorker.run_chunk`` yields, without JAX."""

        def __init__(self):
            self.turns: dict[int, asyncio.Lock] = {}

        @ray.method(num_returns="streaming")
        async def run_chunk(self, pid, holder, step_s, start, n, final, every):
            # A slice process runs its chunks one after the other (the next waits in its queue).
            async with self.turns.setdefault(pid, asyncio.Lock()):
                async for item in self._chunk(start, n, holder, step_s):
                    yield item

        async def run_chunk_quiet(self, pid, holder, step_s, start, n, final, every):
            async with self.turns.setdefault(pid, asyncio.Lock()):
                async for _ in self._chunk(start, n, holder, step_s):
                    pass

        async def _chunk(self, start, n, holder, step_s):
            loop = asyncio.get_running_loop()
            t_start = loop.time()
            batch, flush_at = [], loop.time()
            for step in range(start, start + n):
                await asyncio.sleep(max(0.0, t_start + (step - start + 1) * step_s - loop.time()))
                batch.append({"step": step, "loss": 1.0, "step_time_s": step_s, "finished_at": time.time()})
                if holder and loop.time() >= flush_at:
                    flush_at = loop.time() + FLUSH_S
                    yield {"steps": batch, "kept": [m["step"] for m in batch], "snapshot_s": [0.001] * len(batch)}
                    batch = []
            yield {"steps": batch, "kept": [m["step"] for m in batch] if holder else [], "snapshot_s": []}

    scripts = [Script.remote() for _ in range(actors)]
    ray.get([s.__ray_ready__.remote() for s in scripts])
    plan = plan_world(0, [f"s{i}" for i in range(processes)], 1, 1, processes, snapshot_slices=holders)

    relay_pool = RelayPool()
    chans, relays = relay_pool.reach(
        0,
        processes,
        [p for p in range(processes) if not plan.takes_snapshots(p)],
        lambda p: (scripts[p % actors], "run_chunk_quiet", (p, False, step_s)),
    )

    class ScriptedWorld:
        def __init__(self):
            self.plan, self.keepers = plan, [None] * processes
            self.workers = [scripts[p % actors] for p in range(processes)]  # who plays each process
            self.channels, self.relays = chans, relays
            self.sent = 0  # chunks sent: a relay submits them in this order

        def slice_of(self, p: int) -> str:
            return plan.slice_names[p]

        def run_chunk(self, start, n, final, every):
            # Like World.run_chunk: a stream per snapshot holder, a plain task or a relay's call for the others.
            refs = []
            for procs, relay in zip(self.channels, self.relays):
                if relay is not None:
                    refs.append(relay.run.remote(0, self.sent, start, n, final, every))
                    continue
                (p,) = procs
                method = (
                    scripts[p % actors].run_chunk if plan.takes_snapshots(p) else scripts[p % actors].run_chunk_quiet
                )
                refs.append(method.remote(p, plan.takes_snapshots(p), step_s, start, n, final, every))
            self.sent += 1
            return refs

    cfg = ElasticConfig(
        num_slices=1,
        global_batch_size=1,
        slice=SliceSpec(devices_per_host=1),
        steps_per_chunk=steps_per_chunk,
        failure=FailureConfig(hang_timeout_min_s=600),
    )
    ledger = StepLedger(EventLog(), steps_per_chunk)
    streams = StepStreams(ScriptedWorld(), cfg, SnapshotStore(1), ledger)
    import psutil

    relay_procs = [
        psutil.Process(pid)
        for pid in ray.get([r.__ray_call__.remote(lambda self: os.getpid()) for r in relay_pool.relays])
    ]
    relay_cpu0 = sum(sum(p.cpu_times()[:2]) for p in relay_procs)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    streams.run(0, steps, lambda: False)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    relay_cpu = sum(sum(p.cpu_times()[:2]) for p in relay_procs) - relay_cpu0
    for s in scripts:
        ray.kill(s)
    relay_pool.shutdown()
    assert sorted(ledger.metrics) == list(range(steps)), "the driver lost steps"
    return {
        "processes": processes,
        "holders": holders,
        "steps": steps,
        "steps_per_chunk": cfg.steps_per_chunk,
        "chunk_steps_run": streams.steps_per_chunk,
        "relays": sum(r is not None for r in relays),
        "driver_cpu_ms_per_step": round(cpu / steps * 1e3, 3),
        "wall_ms_per_step": round(wall / steps * 1e3, 2),
        "relay_cpu_ms_per_step": round(relay_cpu / steps * 1e3, 3),
        "scripted_step_ms": step_s * 1e3,
    }


def plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    one = [c for c in out["clusters"] if c["hosts_per_slice"] == 1]
    if one:
        a.plot([c["processes"] for c in one], [c["overhead_ratio"] for c in one], "o-", label="step time / bare loop")
        for kind, marker in (("process", "s--"), ("node", "^--")):
            pts = [(c["processes"], r["kill_to_step_s"]) for c in one for r in c["recoveries"] if r["kind"] == kind]
            if pts:
                a2 = a.twinx() if kind == "process" else a2  # noqa: F821
                a2.plot(*zip(*pts), marker, label=f"{kind} kill -> step (s)")
        a.set_xlabel("processes (1-host slices)")
        a.set_ylabel("overhead ratio")
        a.set_title("simulated cluster")
        a.legend(loc="upper left", fontsize=8)
        a2.set_ylabel("seconds")
        a2.legend(loc="lower right", fontsize=8)
    for chunk in sorted({x["steps_per_chunk"] for x in out["driver"]}):
        d = [x for x in out["driver"] if x["steps_per_chunk"] == chunk]
        b.plot(
            [x["processes"] for x in d],
            [x["driver_cpu_ms_per_step"] for x in d],
            "o-",
            label=f"steps_per_chunk={chunk}",
        )
        if any(x.get("relay_cpu_ms_per_step") for x in d):
            b.plot(
                [x["processes"] for x in d],
                [x.get("relay_cpu_ms_per_step", 0.0) for x in d],
                "x:",
                label=f"relays' CPU (their own processes), chunk {chunk}",
            )
    b.axhline(5.0, color="grey", ls=":", label="goal: 5 ms/step at 1024")
    b.set_xscale("log", base=2)
    b.set_xlabel("processes (driver model)")
    b.set_ylabel("CPU ms per step (driver; relays)")
    b.set_title("controller path, scripted streams")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def chunk_steps(steps_per_chunk: int, processes: int, step_s: float) -> int:
    from ray_elastic.decide import chunk_steps as steps

    return steps(steps_per_chunk, processes, [step_s])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slices", type=int, nargs="*", default=[2, 4, 8])
    ap.add_argument("--multihost", type=int, default=2, help="also this many 2-host slices (0: skip)")
    ap.add_argument("--steps", type=int, default=100, help="steps of each steady-state run")
    ap.add_argument("--processes", type=int, nargs="*", default=[64, 256, 1024])
    # (scripted step 100 ms: the driver keeps up with 1024 processes at chunk 10 only if its CPU allows)
    ap.add_argument("--model-steps", type=int, default=100, help="at least two chunks are run")
    ap.add_argument(
        "--model-chunks",
        type=int,
        nargs="*",
        default=[10, 100],
        help="steps_per_chunk values (10 is ElasticConfig's default)",
    )
    ap.add_argument("--model-step-ms", type=float, default=100.0)
    ap.add_argument("--plot", default=None, help="write the curve to this PNG")
    ap.add_argument(
        "--clusters-from",
        default=None,
        help="take the cluster points from an earlier run's output (its last line) instead of measuring",
    )
    args = ap.parse_args()

    out: dict = {"clusters": [], "driver": []}
    if args.clusters_from:
        with open(args.clusters_from) as f:
            out["clusters"] = json.loads([ln for ln in f if ln.startswith('{"clusters"')][-1])["clusters"]
    for n in args.slices:
        out["clusters"].append(cluster_point(n, 1, args.steps))
        print(json.dumps(out["clusters"][-1]), flush=True)
    if args.multihost:
        out["clusters"].append(cluster_point(args.multihost, 2, args.steps))
        print(json.dumps(out["clusters"][-1]), flush=True)
    if args.processes:
        from ray_elastic.sim.cluster import SimulatedTPUCluster

        with SimulatedTPUCluster(num_slices=1, devices_per_host=1, log_to_driver=False):
            for chunk in args.model_chunks:
                for n in args.processes:
                    steps = max(
                        args.model_steps, 2 * chunk_steps(chunk, n, args.model_step_ms / 1e3)
                    )  # at least two chunks as run
                    out["driver"].append(
                        driver_point(n, steps, args.model_step_ms / 1e3, holders=3, actors=8, steps_per_chunk=chunk)
                    )
                    print(json.dumps(out["driver"][-1]), flush=True)
    if args.plot:
        plot(out, args.plot)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
