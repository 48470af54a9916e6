"""Slice supply on the simulated cluster: Ray's autoscaler (v2) against the provisioner thread.

Per source (``autoscaler``: the head's v2 monitor with ``ray_elastic.sim.node_provider``; ``thread``:
``SimulatedTPUCluster.provisioner(delay_s=0)``), on a 3-slice cluster with no provisioning delay:

- ``demand``: every slice reserved, one more slice reservation made: seconds until it is ready
  (pending demand -> a new slice's node up -> placement group placed);
- ``replace``: every slice reserved, one slice's host SIGKILLed and a replacement asked for at once
  (what pause-and-resume does): seconds from the kill until the replacement reservation is ready.

Then the same ``replace`` for 2-host slices (``--multihost``; the autoscaler's pool of pre-named
slices, the lost slice replaced whole under its name). Each row is printed; then the median and
worst per source and measure. The last line is one JSON object:

    {"autoscaler_demand_median_s": ..., "autoscaler_demand_worst_s": ..., "autoscaler_replace_median_s": ...,
     "autoscaler_replace_worst_s": ..., "thread_...": ..., "multihost_autoscaler_replace_median_s": ...}

    .venv/bin/python bench/autoscaler.py [--repeats 5] [--multihost 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def measure(source: str, hosts: int, repeats: int, demand: bool) -> dict[str, list[float]]:
    from ray_elastic.ray_backend.placement import ReplacementRequest, SliceReservation, reserve_slices
    from ray_elastic.sim.cluster import SimulatedTPUCluster

    kw = {"autoscaler": True, "max_slices": 4, "pool_slices": 4} if source == "autoscaler" else {}
    out: dict[str, list[float]] = {"demand": [], "replace": []}
    with SimulatedTPUCluster(num_slices=3, hosts_per_slice=hosts, log_to_driver=False, **kw) as cluster:
        if source == "thread":
            cluster.provisioner(delay_s=0.0, poll_s=0.2)
        spec = cluster.slice_spec
        for _ in range(repeats if demand else 0):
            held = reserve_slices(spec, 3, timeout_s=60)
            _only_held(cluster, held)
            t0 = time.monotonic()
            extra = SliceReservation(spec, head_timeout_s=120)
            assert extra.wait(120), "the extra slice never came"
            out["demand"].append(time.monotonic() - t0)
            print(
                json.dumps({"source": source, "hosts": hosts, "measure": "demand", "s": round(out["demand"][-1], 3)}),
                flush=True,
            )
            for r in held + [extra]:
                r.release()
            _back_to(cluster, 3)
        if source == "autoscaler":
            cluster.set_capacity(3)  # the replacement is the only launch allowed
        for _ in range(repeats):
            held = reserve_slices(spec, 3, timeout_s=60)
            _only_held(cluster, held)
            victim = next(s for s in cluster.alive_slices() if set(s.node_ids) & set(held[-1].node_ids()))
            t0 = time.monotonic()
            cluster.kill_host(victim.name, 0)
            held.pop().release()  # as the controller drops a lost slice (else Ray re-places its group first)
            request = ReplacementRequest(spec, head_timeout_s=120)
            while request.poll() is None:
                if time.monotonic() - t0 > 120:
                    raise TimeoutError("no replacement in 120 s")
                time.sleep(0.02)
            out["replace"].append(time.monotonic() - t0)
            print(
                json.dumps({"source": source, "hosts": hosts, "measure": "replace", "s": round(out["replace"][-1], 3)}),
                flush=True,
            )
            for r in held + [request.poll()]:
                r.release()
            cluster.reap_dead_slices()
            _back_to(cluster, 3)
    return out


def _only_held(cluster, held: list) -> None:
    """A reservation made right after others were released can look unsatisfiable for a moment, to
    the autoscaler and the thread alike, and a spare slice is launched for it: wait for such spares
    and kill them, so that the next measure has to wait for a slice of its own."""
    time.sleep(2.5)
    ours = {n for r in held for n in r.node_ids()}
    for sl in cluster.alive_slices():
        if not set(sl.node_ids) & ours:
            cluster.kill_slice(sl.name)


def _back_to(cluster, n: int) -> None:
    """Exactly ``n`` live slices again (the surplus killed; an autoscaled one is then terminated)."""
    import ray

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # a killed multi-host slice's survivors go with it
        cluster.reap_dead_slices()
        alive = cluster.alive_slices()
        for sl in alive[n:]:
            cluster.kill_slice(sl.name)
        if len(cluster.alive_slices()) == n and all(
            nid in {x["NodeID"] for x in ray.nodes() if x["Alive"]}
            for s in cluster.alive_slices()
            for nid in s.node_ids
        ):
            return
        if len(cluster.alive_slices()) < n:
            cluster.add_slice()
        time.sleep(0.5)


def stats(xs: list[float]) -> tuple[float, float]:
    return round(statistics.median(xs), 3), round(max(xs), 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--multihost", type=int, default=2, help="replacements measured with 2-host slices (0: none)")
    ap.add_argument("--sources", default="autoscaler,thread")
    args = ap.parse_args()
    summary = {}
    for source in args.sources.split(","):
        for measure_name, xs in measure(source, 1, args.repeats, demand=True).items():
            summary[f"{source}_{measure_name}_median_s"], summary[f"{source}_{measure_name}_worst_s"] = stats(xs)
        if args.multihost:
            xs = measure(source, 2, args.multihost, demand=False)["replace"]
            summary[f"multihost_{source}_replace_median_s"], summary[f"multihost_{source}_replace_worst_s"] = stats(xs)
    print("\nsource       measure            median    worst")
    for key in [k for k in summary if k.endswith("_median_s")]:
        name = key[: -len("_median_s")]
        print(f"{name:<32} {summary[key]:>7.2f}  {summary[name + '_worst_s']:>7.2f}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
