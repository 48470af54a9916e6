"""A simulated multi-slice TPU Ray cluster on one machine.

Each slice host is a real Ray node (``ray.cluster_utils.Cluster``) that carries the
labels, resources and environment a GKE / GCE TPU host carries, so the controller
runs exactly the code paths it would run on real slices. JAX runs on CPU inside
those nodes, with ``--xla_force_host_platform_device_count`` devices per host.

It also offers the faults the tests and the demo need (kill a slice, hang a slice)
and a :class:`Provisioner` that stands in for the Ray autoscaler: Ray's own fake
autoscaler does not replace dead nodes.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from typing import Optional

import psutil

from ray_elastic.config import SliceSpec

logger = logging.getLogger(__name__)

# Fast failure detection: a killed host (its raylet refuses connections) is declared
# dead after 3 checks 200 ms apart, ~0.6 s instead of ~14 s. A host that is only slow
# gets 1.5 s per check: on a loaded machine a 200 ms timeout declares live hosts dead.
# A hung (SIGSTOPped) host takes 3 timeouts, ~5 s; the controller's watchdog may see it first.
# On a real cluster the same keys go into `ray start --system-config` (see cluster/).
FAST_HEALTH_CHECKS = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 200,
    "health_check_timeout_ms": 1500,
    "health_check_failure_threshold": 3,
}


def _allow_nodes_from_any_thread() -> None:
    """Let Ray nodes be started off the main thread.

    Each ``ray._private.node.Node`` installs a SIGTERM handler, which Python only
    permits on the main thread. Off the main thread we skip that one call; the
    node's atexit hook and reaper process still clean it up, and
    :meth:`SimulatedTPUCluster.shutdown` stops it explicitly.
    """
    import ray._private.utils as ray_utils

    original = ray_utils.set_sigterm_handler
    if getattr(original, "_ray_elastic_wrapped", False):
        return

    def set_sigterm_handler(handler):
        if threading.current_thread() is threading.main_thread():
            original(handler)

    set_sigterm_handler._ray_elastic_wrapped = True
    ray_utils.set_sigterm_handler = set_sigterm_handler


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

        return ["--resources", json.dumps(self.resources),
                "--labels", ",".join(f"{k}={v}" for k, v in self.labels.items())]


def tpu_host(spec, slice_name: str, worker_id: int, devices_per_host: int) -> TPUHost:
    """Resources, labels and environment of host ``worker_id`` of a simulated slice."""
    acc = f"TPU-{spec.accelerator.upper()}"
    resources = {"TPU": spec.chips_per_host, f"accelerator_type:{acc}": 1}
    if worker_id == 0:
        resources[f"TPU-{spec.pod_type}-head"] = 1
    labels = {
        "ray.io/tpu-slice-name": slice_name,
        "ray.io/tpu-worker-id": str(worker_id),
        "ray.io/tpu-pod-type": spec.pod_type,
        "ray.io/tpu-topology": spec.topology,
        "ray.io/accelerator-type": acc,
    }
    env = {
        "TPU_NAME": slice_name,
        "TPU_WORKER_ID": str(worker_id),
        # What makes a CPU process look like a TPU host with N devices.
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices_per_host}",
    }
    return TPUHost(resources, labels, env)


@dataclasses.dataclass
class SimulatedSlice:
    """One slice: its name and the Ray nodes of its hosts (worker 0 first)."""

    name: str
    nodes: list  # ray._private.node.Node, one per host
    alive: bool = True

    @property
    def node_ids(self) -> list[str]:
        return [n.node_id for n in self.nodes]


LOOPBACK = "127.0.0.1"
# Every simulated node's address is LOOPBACK: nothing of a local run listens on or sends to the
# machine's network address. Ray turns a loopback address given to ray.init (or a job driver's
# RAY_ADDRESS) into the machine's "reachable" address unless it is told the cluster is one machine,
# which is what this flag (named for Windows and macOS, where it is the default) says. Processes
# Ray starts read it from the environment; this process read it when it imported Ray.
ONE_MACHINE_FLAG = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _one_machine(on: bool) -> bool:
    """Tell this process's Ray whether the cluster is one machine; returns what it said before."""
    from ray._private import ray_constants

    before, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, not on
    return not before


class SimulatedTPUCluster:
    """A Ray head plus one Ray node per simulated TPU slice host.

    Use as a context manager; :meth:`shutdown` stops only the processes it started.

    Args:
        num_slices: slices to start with.
        hosts_per_slice: Ray nodes per slice (v4: 1 host = 2x2x1, 2 hosts = 2x2x2, ...).
        devices_per_host: JAX CPU devices each host's process sees.
        accelerator: TPU generation the hosts pretend to be.
        fast_health_checks: use :data:`FAST_HEALTH_CHECKS` (sub-second node-death detection).
        object_store_mb: object store size per node.
        dashboard: start Ray's dashboard on ``dashboard_port`` (needed for ``ray job submit``).
    """

    def __init__(
        self,
        num_slices: int = 3,
        hosts_per_slice: int = 1,
        devices_per_host: int = 2,
        accelerator: str = "v4",
        fast_health_checks: bool = True,
        object_store_mb: int = 100,
        connect: bool = True,
        log_to_driver: bool = True,
        dashboard: bool = False,
    ):
        self.slice_spec = SliceSpec.for_hosts(accelerator, hosts_per_slice, devices_per_host)
        self.devices_per_host = devices_per_host
        self._object_store_bytes = object_store_mb * 1024 * 1024
        self._connect = connect
        self._log_to_driver = log_to_driver
        self._lock = threading.Lock()
        self._next_slice = 0
        self.slices: list[SimulatedSlice] = []
        self._provisioners: list[Provisioner] = []
        self._starter = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sim-node-starter")

        import ray  # noqa: F401  (import here so the module can be inspected without Ray)
        from ray.cluster_utils import Cluster

        _allow_nodes_from_any_thread()

        # A private temp dir: never touch other Ray instances on this machine.
        self.temp_dir = tempfile.mkdtemp(prefix="rel-", dir="/tmp")
        os.makedirs(os.path.join(self.temp_dir, "ray"), exist_ok=True)
        # Ray reads these from the environment of every process it starts (raylets, workers, job
        # drivers), so they are set here and given back at shutdown.
        self._old_env = {k: os.environ.get(k) for k in ("RAY_TMPDIR", ONE_MACHINE_FLAG)}
        os.environ.update({"RAY_TMPDIR": self.temp_dir, ONE_MACHINE_FLAG: "0"})
        self._was_one_machine = _one_machine(True)
        self.dashboard_port = free_port()
        head_args = dict(
            num_cpus=1,
            node_ip_address=LOOPBACK,
            gcs_server_port=free_port(),
            temp_dir=os.path.join(self.temp_dir, "ray"),
            include_dashboard=dashboard,
            dashboard_host="127.0.0.1",
            dashboard_port=self.dashboard_port,
            # Every node's agent on its own port (the default, 52365, is one per machine).
            dashboard_agent_listen_port=free_port(),
            object_store_memory=self._object_store_bytes,
            _system_config=dict(FAST_HEALTH_CHECKS) if fast_health_checks else {},
        )
        t0 = time.monotonic()
        self._cluster = Cluster(initialize_head=True, head_node_args=head_args, shutdown_at_exit=True)
        logger.info("simulated head up in %.1fs at %s", time.monotonic() - t0, self.address)
        try:
            for _ in range(num_slices):
                self.add_slice()
            if connect:
                self._init_driver()
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ basics
    @property
    def address(self) -> str:
        return self._cluster.address

    def _init_driver(self) -> None:
        import ray

        ray.init(address=self.address, log_to_driver=self._log_to_driver, namespace="ray_elastic")

    def __enter__(self) -> "SimulatedTPUCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def alive_slices(self) -> list[SimulatedSlice]:
        return [s for s in self.slices if s.alive]

    def slice_by_name(self, name: str) -> SimulatedSlice:
        for s in self.slices:
            if s.name == name:
                return s
        raise KeyError(f"no simulated slice named {name!r}; have {[s.name for s in self.slices]}")

    # -------------------------------------------------------------- operations
    def add_slice(self) -> SimulatedSlice:
        """Start the Ray nodes of one more slice; returns when they are registered.

        Nodes are always started from one long-lived thread: Ray starts node processes
        with a parent-death signal, which Linux ties to the *thread* that started them,
        so a node started from a short-lived thread (a provisioner's) would die with it.
        """
        return self._starter.submit(self._add_slice).result()

    def _add_slice(self) -> SimulatedSlice:
        spec = self.slice_spec
        with self._lock:
            name = f"sim-{spec.pod_type}-{self._next_slice}"
            self._next_slice += 1
        nodes = []
        for worker_id in range(spec.num_hosts):
            host = tpu_host(spec, name, worker_id, self.devices_per_host)
            nodes.append(
                self._cluster.add_node(
                    num_cpus=2,
                    node_ip_address=LOOPBACK,
                    resources=host.resources,
                    labels=host.labels,
                    env_vars=host.env,
                    dashboard_agent_listen_port=free_port(),
                    object_store_memory=self._object_store_bytes,
                )
            )
        sl = SimulatedSlice(name=name, nodes=nodes)
        with self._lock:
            self.slices.append(sl)
        logger.info("simulated slice %s added (%d host(s))", name, len(nodes))
        return sl

    def processes(self) -> list[psutil.Process]:
        """Every live process of the cluster: the head's and each live slice host's, with children."""
        nodes = [self._cluster.head_node] + [n for sl in self.alive_slices() for n in sl.nodes]
        return [p for node in nodes for p in self._node_processes(node)]

    def _node_processes(self, node) -> list[psutil.Process]:
        """The raylet of a node and everything it started (workers, agents)."""
        procs = []
        for ptype, infos in node.all_processes.items():
            for info in infos:
                try:
                    p = psutil.Process(info.process.pid)
                    procs.append(p)
                    procs.extend(p.children(recursive=True))
                except psutil.NoSuchProcess:
                    pass
        return procs

    def kill_slice(self, name: str) -> None:
        """A lost slice: SIGKILL every process of its hosts, then remove its nodes."""
        sl = self.slice_by_name(name)
        for node in sl.nodes:
            self._kill_node(node, name)
        sl.alive = False
        logger.info("simulated slice %s killed", name)

    def kill_host(self, name: str, worker_id: int) -> None:
        """One host of a multi-host slice lost (the slice is unusable; ``reap_dead_slices`` clears the rest)."""
        self._kill_node(self.slice_by_name(name).nodes[worker_id], name)
        logger.info("simulated host %d of slice %s killed", worker_id, name)

    def _kill_node(self, node, name: str) -> None:
        for p in self._node_processes(node):
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        try:
            self._cluster.remove_node(node, allow_graceful=False)
        except Exception as e:  # already dead processes make remove_node's checks noisy
            logger.debug("remove_node(%s): %s", name, e)
            self._cluster.worker_nodes.discard(node)

    def reap_dead_slices(self) -> list[str]:
        """Kill and remove slices that Ray has declared dead (for example hung ones); returns their names."""
        import ray

        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        dead = [s.name for s in self.alive_slices() if any(nid not in alive for nid in s.node_ids)]
        for name in dead:
            self.kill_slice(name)
        return dead

    def hang_slice(self, name: str) -> None:
        """A hung slice: SIGSTOP its hosts' processes (raylet and workers)."""
        self._signal_slice(name, signal.SIGSTOP)

    def resume_slice(self, name: str) -> None:
        """Undo :meth:`hang_slice`."""
        self._signal_slice(name, signal.SIGCONT)

    def _signal_slice(self, name: str, sig: int) -> None:
        for node in self.slice_by_name(name).nodes:
            for p in self._node_processes(node):
                try:
                    p.send_signal(sig)
                except psutil.NoSuchProcess:
                    pass

    def worker_pids(self, name: str) -> list[int]:
        """PIDs of the Ray worker processes (actors) running on a slice's hosts."""
        pids = []
        for node in self.slice_by_name(name).nodes:
            for p in self._node_processes(node):
                try:
                    if p.name().startswith("ray::") or "default_worker.py" in " ".join(p.cmdline()):
                        pids.append(p.pid)
                except psutil.NoSuchProcess:
                    pass
        return pids

    def provisioner(self, delay_s: float = 0.0, poll_s: float = 0.2, max_slices: Optional[int] = None) -> "Provisioner":
        """Start a :class:`Provisioner` bound to this cluster (stopped by :meth:`shutdown`)."""
        p = Provisioner(self, delay_s=delay_s, poll_s=poll_s, max_slices=max_slices)
        self._provisioners.append(p)
        p.start()
        return p

    def shutdown(self) -> None:
        """Stop the provisioners, disconnect, stop every node this cluster started."""
        for p in self._provisioners:
            p.stop()
        self._provisioners.clear()
        import ray

        if self._connect and ray.is_initialized():
            ray.shutdown()
        # SIGCONT anything we stopped so it can be killed cleanly.
        for sl in self.slices:
            if sl.alive:
                try:
                    self._signal_slice(sl.name, signal.SIGCONT)
                except Exception:
                    pass
        cluster = getattr(self, "_cluster", None)
        if cluster is not None:
            try:
                cluster.shutdown()
            except Exception as e:
                logger.warning("cluster shutdown: %s", e)
            self._cluster = None
        self._starter.shutdown(wait=False)
        _one_machine(self._was_one_machine)
        for k, v in self._old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(self.temp_dir, ignore_errors=True)


class Provisioner:
    """Adds a slice ``delay_s`` after a slice placement group has been pending.

    It watches the placement group table for PENDING groups that ask for TPU
    resources (what the Ray autoscaler reacts to), waits ``delay_s`` (how long a
    real TPU slice takes to come up, scaled down), then adds one slice per
    pending group. ``max_slices`` bounds the slices it will ever add.
    """

    def __init__(self, cluster: SimulatedTPUCluster, delay_s: float, poll_s: float, max_slices: Optional[int]):
        self._cluster = cluster
        self.delay_s = delay_s
        self.poll_s = poll_s
        self.max_slices = max_slices
        self.added: list[str] = []
        self._first_seen: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ray-elastic-provisioner", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)

    def _pending_tpu_groups(self) -> list[str]:
        import ray

        pending = []
        for pg_id, info in ray.util.placement_group_table().items():
            if info.get("state") != "PENDING":
                continue
            bundles = info.get("bundles", {}).values()
            # TPU hosts, or the head host of a multi-host slice (``TPU-<pod type>-head``: the first
            # step of a slice reservation, which the Ray autoscaler also launches a slice for)
            if any(b.get("TPU", 0) > 0 or any(k.startswith("TPU-") and k.endswith("-head") for k in b) for b in bundles):
                pending.append(pg_id)
        return pending

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.max_slices is not None and len(self.added) >= self.max_slices:
                return
            try:
                pending = self._pending_tpu_groups()
            except Exception as e:  # the driver may be shutting down
                logger.debug("provisioner poll failed: %s", e)
                continue
            now = time.monotonic()
            for pg_id in list(self._first_seen):
                if pg_id not in pending:
                    del self._first_seen[pg_id]
            for pg_id in pending:
                first = self._first_seen.setdefault(pg_id, now)
                if now - first >= self.delay_s:
                    sl = self._cluster.add_slice()
                    self.added.append(sl.name)
                    # The new slice satisfies this group; forget it either way.
                    self._first_seen.pop(pg_id, None)
                    break
