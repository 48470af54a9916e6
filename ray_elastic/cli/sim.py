"""``sim``: a simulated TPU cluster in the foreground, with a shell on stdin to lose and add slices."""

from __future__ import annotations

import sys

from ray_elastic.cli.options import simulated_cluster
from ray_elastic.tpu import SliceSpec


def cmd_sim(args) -> int:
    """A simulated TPU cluster in the foreground, for ``ray job submit`` and fault drills by hand."""
    import math
    import os

    from ray_elastic.sim.hosts import wait_for_job_server

    # Jobs run on this cluster's nodes: they must find this installation's ray-elastic.
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    args.devices_per_host = args.devices_per_host or 2
    spec = SliceSpec.for_hosts(args.accelerator, args.hosts_per_slice, args.devices_per_host)
    with simulated_cluster(args, dashboard=True) as cluster:
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
        _shell(cluster)
    return 0


SIM_COMMANDS = "list | kill [SLICE] (default: the newest) | add | capacity N (autoscaler) | quit"


def _shell(cluster) -> None:
    """Read commands from stdin until ``quit`` or its end: list, kill, add slices, set the capacity."""
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
