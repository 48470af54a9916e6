"""The simulated cluster's hosts: what a Ray node must carry to pass for a TPU host, the host's
processes, free ports, and waiting for the job server. Used by the cluster and its node provider."""

from __future__ import annotations

import dataclasses
import socket
import time

import psutil

from ray_elastic.tpu import ACCELERATOR_LABEL, POD_TYPE_LABEL, SLICE_NAME_LABEL, TOPOLOGY_LABEL, WORKER_ID_LABEL


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_job_server(url: str, timeout_s: float = 120.0) -> None:
    """Block until ``ray job submit`` to ``url`` works: a no-op job is accepted and finishes.

    The dashboard answers before its job agent has registered, and a submission in
    between fails with "No available agent to submit job".
    """
    from ray.job_submission import JobStatus, JobSubmissionClient

    deadline = time.monotonic() + timeout_s
    last: Exception = TimeoutError(url)
    while time.monotonic() < deadline:
        try:
            client = JobSubmissionClient(url)
            job = client.submit_job(entrypoint="true")
            while client.get_job_status(job) not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"probe job {job} did not finish")
                time.sleep(0.2)
            client.delete_job(job)
            return
        except Exception as e:  # noqa: BLE001 - not ready yet
            last = e
            time.sleep(0.5)
    raise TimeoutError(f"Ray job server at {url} not ready after {timeout_s:.0f}s: {last}")


@dataclasses.dataclass(frozen=True)
class TPUHost:
    """What a Ray node must carry to pass for one host of a TPU slice (for ``ray.util.tpu``)."""

    resources: dict
    labels: dict
    env: dict

    def ray_start_args(self) -> list[str]:
        """The same as ``ray start`` flags (the environment goes into the process's env)."""
        import json

        return [
            "--resources",
            json.dumps(self.resources),
            "--labels",
            ",".join(f"{k}={v}" for k, v in self.labels.items()),
        ]


def tpu_host(spec, slice_name: str, worker_id: int, devices_per_host: int) -> TPUHost:
    """Resources, labels and environment of host ``worker_id`` of a simulated slice."""
    acc = f"TPU-{spec.accelerator.upper()}"
    resources = {"TPU": spec.chips_per_host, f"accelerator_type:{acc}": 1}
    if worker_id == 0:
        resources[f"TPU-{spec.pod_type}-head"] = 1
    labels = {
        SLICE_NAME_LABEL: slice_name,
        WORKER_ID_LABEL: str(worker_id),
        POD_TYPE_LABEL: spec.pod_type,
        TOPOLOGY_LABEL: spec.topology,
        ACCELERATOR_LABEL: acc,
    }
    env = {
        "TPU_NAME": slice_name,
        "TPU_WORKER_ID": str(worker_id),
        # Its processes open their "chips" through the TPU runtime's stand-in (sim/tpu_runtime.py).
        "SIM_TPU_HOST": f"{slice_name}/{worker_id}",
        # What makes a CPU process look like a TPU host with N devices.
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices_per_host}",
    }
    return TPUHost(resources, labels, env)


def process_children() -> dict[int, list[psutil.Process]]:
    """The process table, read once, by parent pid: what :meth:`SimulatedHost.processes` walks (one
    read serves every host of a call, so their processes are found at one moment)."""
    children: dict[int, list[psutil.Process]] = {}
    for p in psutil.process_iter(["ppid"]):
        children.setdefault(p.info["ppid"], []).append(p)
    return children


def send_signal(procs: list[psutil.Process], sig: int) -> None:
    """``sig`` to each of ``procs``, those already gone skipped."""
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


@dataclasses.dataclass
class SimulatedHost:
    """One slice host: its Ray node id and the processes that make it (raylet, agents, ...).

    A host the cluster started itself has its ``ray._private.node.Node``; one the autoscaler
    launched lives under the monitor process, and is known by the process ids and start times its
    provider recorded (a start time guards against a reused pid)."""

    node_id: str
    node: object = None  # ray._private.node.Node, for hosts started by this process
    pids: tuple = ()  # ((pid, create_time), ...) for autoscaled hosts
    instance_id: str | None = None  # the autoscaler's cloud instance id
    worker_id: int = 0

    def processes(self, children: dict[int, list[psutil.Process]] | None = None) -> list[psutil.Process]:
        """The host's own processes and everything they started (Ray workers: slice actors).
        ``children``: a :func:`process_children` already read (else it is read here)."""
        roots = []
        if self.node is not None:
            roots = [info.process.pid for infos in self.node.all_processes.values() for info in infos]
        if children is None:
            children = process_children()
        procs, seen = [], set()
        for pid in roots or [p for p, _ in self.pids]:
            try:
                p = psutil.Process(pid)
                if not roots and abs(p.create_time() - dict(self.pids)[pid]) > 0.01:
                    continue  # the pid was reused: not ours
            except psutil.NoSuchProcess:
                continue
            todo = [p]
            while todo:
                q = todo.pop()
                if q.pid not in seen:
                    seen.add(q.pid)
                    procs.append(q)
                    todo.extend(children.get(q.pid, []))
        return procs


@dataclasses.dataclass
class SimulatedSlice:
    """One slice: its name and its hosts (worker 0 first)."""

    name: str
    hosts: list  # SimulatedHost, one per host
    alive: bool = True

    @property
    def node_ids(self) -> list[str]:
        return [h.node_id for h in self.hosts]
