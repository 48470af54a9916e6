"""A simulated multi-slice TPU Ray cluster on one machine.

Each slice host is a real Ray node (``ray.cluster_utils.Cluster``) that carries the
labels, resources and environment a GKE / GCE TPU host carries, so the controller
runs exactly the code paths it would run on real slices. JAX runs on CPU inside
those nodes, with ``--xla_force_host_platform_device_count`` devices per host.

It also offers the faults the tests and the demo need (kill a slice, hang a slice). Slices are
launched and replaced either by Ray's own autoscaler (``autoscaler=True``: the v2 autoscaler with
the node provider of :mod:`ray_elastic.sim.node_provider`) or by this process, with a
:class:`~ray_elastic.sim.provisioner.Provisioner` thread standing in for the autoscaler.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
import signal
import tempfile
import threading
import time

from ray_elastic.sim.autoscaled_slices import AutoscaledSlices
from ray_elastic.sim.faults import SliceFaults
from ray_elastic.sim.hosts import (
    SimulatedHost,
    SimulatedSlice,
    free_port,
    tpu_host,
)
from ray_elastic.sim.node_provider import (
    write_knobs,
)
from ray_elastic.sim.one_machine import (
    FAST_HEALTH_CHECKS,
    HEAD_INSTANCE_ID,
    LOOPBACK,
    ONE_MACHINE_FLAG,
    allow_nodes_from_any_thread,
    one_machine,
)
from ray_elastic.sim.provisioner import Provisioner
from ray_elastic.sim.redis import RedisServer
from ray_elastic.state.snapshot_slots import remove_orphans
from ray_elastic.tpu import SliceSpec

logger = logging.getLogger(__name__)
SLICE_START_TRIES = 2


class SimulatedTPUCluster(SliceFaults, AutoscaledSlices):
    """A Ray head plus one Ray node per simulated TPU slice host.

    Use as a context manager; :meth:`shutdown` stops only the processes it started.

    Slices come from one of two places. With ``autoscaler=True`` the head runs Ray's own autoscaler
    (v2) with :class:`~ray_elastic.sim.node_provider.TPUSliceProvider`: the initial slices, every
    :meth:`add_slice` and every replacement are launched by the autoscaler for pending demand (a slice
    placement group), and it retires dead hosts. Without it, this process starts the nodes itself and
    :meth:`provisioner` stands in for the autoscaler.

    Args:
        num_slices: slices to start with.
        hosts_per_slice: Ray nodes per slice (v4: 1 host = 2x2x1, 2 hosts = 2x2x2, ...).
        devices_per_host: JAX CPU devices each host's process sees.
        accelerator: TPU generation the hosts pretend to be.
        fast_health_checks: use :data:`FAST_HEALTH_CHECKS` (sub-second node-death detection).
        object_store_mb: object store size per node.
        dashboard: start Ray's dashboard on ``dashboard_port`` (needed for ``ray job submit``).
        autoscaler: launch and replace slices with Ray's autoscaler.
        launch_delay_s: (autoscaler) how long provisioning a slice takes, scaled down (the first
            ``num_slices`` are launched without it).
        max_slices: (autoscaler) capacity: slices that may be alive at once (``None``: no limit);
            a launch beyond it fails like a stock-out, see :meth:`set_capacity`.
        gcs_fault_tolerance: the head's GCS keeps its tables in a private Redis (``redis-server``),
            so :meth:`restart_gcs` can kill it and start it again (KubeRay's GCS fault tolerance).
        idle_timeout_s: (autoscaler) an idle slice is terminated after this long.
        pool_slices: (autoscaler, multi-host) how many pre-named slices the pool has
            (default ``num_slices + 2``): a replacement takes a free name of the pool, often the lost one's.
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
        autoscaler: bool = False,
        launch_delay_s: float = 0.0,
        max_slices: int | None = None,
        idle_timeout_s: float = 3600.0,
        pool_slices: int | None = None,
        gcs_fault_tolerance: bool = False,
    ):
        # Long: the head's parameters are one long keyword list; the rest is one call per step.
        self.slice_spec = SliceSpec.for_hosts(accelerator, hosts_per_slice, devices_per_host)
        self.devices_per_host = devices_per_host
        self.autoscaler = autoscaler
        self._object_store_bytes = object_store_mb * 1024 * 1024
        self._connect = connect
        self._log_to_driver = log_to_driver
        self._lock = threading.Lock()
        self._next_slice = 0
        self.slices: list[SimulatedSlice] = []
        self._provisioners: list[Provisioner] = []
        self._timers: list = []  # preempt_slice: the kills at the deadlines
        self._starter = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sim-node-starter")
        self._events_seen = 0
        self.state_dir: str | None = None  # the autoscaler provider's records
        self.autoscaling_config_path: str | None = None

        import ray  # noqa: F401  (import here so the module can be inspected without Ray)
        from ray.cluster_utils import Cluster

        allow_nodes_from_any_thread()

        # A private temp dir: never touch other Ray instances on this machine.
        self.temp_dir = tempfile.mkdtemp(prefix="rel-", dir="/tmp")
        os.makedirs(os.path.join(self.temp_dir, "ray"), exist_ok=True)
        gcs_port = free_port()
        env = self._environment(gcs_port, num_slices, max_slices, idle_timeout_s, pool_slices)
        self.redis = RedisServer(self.temp_dir) if gcs_fault_tolerance else None
        if self.redis is not None:  # the GCS keeps its tables there: it can be killed and started again
            env["RAY_REDIS_ADDRESS"] = self.redis.address
        self._old_env = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        self._was_one_machine = one_machine(True)
        self.dashboard_port = free_port()
        head_args = dict(
            num_cpus=1,
            node_ip_address=LOOPBACK,
            gcs_server_port=gcs_port,
            temp_dir=os.path.join(self.temp_dir, "ray"),
            include_dashboard=dashboard,
            dashboard_host="127.0.0.1",
            dashboard_port=self.dashboard_port,
            # Every node's agent on its own port (the default, 52365, is one per machine).
            dashboard_agent_listen_port=free_port(),
            object_store_memory=self._object_store_bytes,
            _system_config=dict(FAST_HEALTH_CHECKS) if fast_health_checks else {},
        )
        if autoscaler:
            head_env = {"RAY_CLOUD_INSTANCE_ID": HEAD_INSTANCE_ID, "RAY_NODE_TYPE_NAME": "ray.head.default"}
            head_args.update(autoscaling_config=self.autoscaling_config_path, env_vars=head_env)
        t0 = time.monotonic()
        self._cluster = Cluster(initialize_head=True, head_node_args=head_args, shutdown_at_exit=True)
        logger.info("simulated head up in %.1fs at %s", time.monotonic() - t0, self.address)
        try:
            if autoscaler:
                self._launch_slices(num_slices)
                self.set_launch_delay(launch_delay_s)
            else:
                for _ in range(num_slices):
                    self.add_slice()
            if connect:
                self._init_driver()
        except BaseException:
            self.shutdown()
            raise

    def _environment(
        self, gcs_port: int, num_slices: int, max_slices: int | None, idle_timeout_s: float, pool_slices
    ) -> dict[str, str]:
        """What Ray reads from the environment of every process it starts (raylets, workers, job
        drivers, the autoscaler's monitor): set by the caller, given back at shutdown. With the
        autoscaler, its config and knobs are written first."""
        env = {"RAY_TMPDIR": self.temp_dir, ONE_MACHINE_FLAG: "0"}
        if not self.autoscaler:
            return env
        self.state_dir = os.path.join(self.temp_dir, "autoscaler")
        os.makedirs(self.state_dir)
        self.autoscaling_config_path = os.path.join(self.state_dir, "autoscaling.json")
        self._write_autoscaling_config(f"{LOOPBACK}:{gcs_port}", num_slices, idle_timeout_s, pool_slices)
        write_knobs(self.state_dir, max_slices=max_slices, launch_delay_s=0.0)  # the first slices: no delay
        return {
            **env,
            "RAY_enable_autoscaler_v2": "1",  # GCS stores it; the head then starts the v2 monitor
            "AUTOSCALER_UPDATE_INTERVAL_S": "1",  # one reconcile round a second (the floor)
            "AUTOSCALER_METRIC_PORT": str(free_port()),  # the default port is one per machine
        }

    # ------------------------------------------------------------------ basics
    @property
    def address(self) -> str:
        return self._cluster.address

    def _init_driver(self) -> None:
        import ray

        ray.init(address=self.address, log_to_driver=self._log_to_driver, namespace="ray_elastic")

    def __enter__(self) -> SimulatedTPUCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def alive_slices(self) -> list[SimulatedSlice]:
        self._sync()
        return [s for s in self.slices if s.alive and len(s.hosts) == self.slice_spec.num_hosts]

    def slice_by_name(self, name: str) -> SimulatedSlice:
        """The slice of that name; the live one where a replacement reuses a lost slice's name."""
        self._sync()
        named = [s for s in self.slices if s.name == name]
        if not named:
            raise KeyError(f"no simulated slice named {name!r}; have {[s.name for s in self.slices]}")
        return next((s for s in reversed(named) if s.alive), named[-1])

    # -------------------------------------------------------------- operations
    def add_slice(self) -> SimulatedSlice:
        """One more slice; returns when its nodes are registered.

        Without the autoscaler, nodes are always started from one long-lived thread: Ray starts node
        processes with a parent-death signal, which Linux ties to the *thread* that started them,
        so a node started from a short-lived thread (a provisioner's) would die with it.
        """
        if self.autoscaler:
            return self._launch_slices(1)[0]
        return self._starter.submit(self._add_slice).result()

    def _add_slice(self) -> SimulatedSlice:
        """:meth:`_start_slice`, once more (a new slice, under a new name) when a host's node did not
        start in time: on loaded cores Ray's fixed 30 s for a raylet to register can pass, and a
        test or the demo then finds no slice where one was asked for."""
        for _ in range(SLICE_START_TRIES - 1):
            try:
                return self._start_slice()
            except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for a node that did not start
                logger.warning("a simulated slice did not start (%r): starting a new one", e)
        return self._start_slice()  # the last try raises what it raises

    def _start_slice(self) -> SimulatedSlice:
        spec = self.slice_spec
        with self._lock:
            name = f"sim-{spec.pod_type}-{self._next_slice}"
            self._next_slice += 1
        hosts = []
        for worker_id in range(spec.num_hosts):
            host = tpu_host(spec, name, worker_id, self.devices_per_host)
            try:
                node = self._cluster.add_node(
                    num_cpus=2,
                    node_ip_address=LOOPBACK,
                    resources=host.resources,
                    labels=host.labels,
                    env_vars=host.env,
                    dashboard_agent_listen_port=free_port(),
                    object_store_memory=self._object_store_bytes,
                )
            except Exception:
                # A node that did not start in time (seen on loaded cores: "The current node timed out
                # during startup", its raylet then declared dead by the GCS and exiting on its own):
                # the slice's hosts already up are stopped too, so no half slice is left behind.
                self._kill_hosts(hosts, name)
                raise
            hosts.append(SimulatedHost(node_id=node.node_id, node=node, worker_id=worker_id))
        sl = SimulatedSlice(name=name, hosts=hosts)
        with self._lock:
            self.slices.append(sl)
        logger.info("simulated slice %s added (%d host(s))", name, len(hosts))
        return sl

    def provisioner(self, delay_s: float = 0.0, poll_s: float = 0.2, max_slices: int | None = None) -> Provisioner:
        """Start a :class:`Provisioner` bound to this cluster (stopped by :meth:`shutdown`)."""
        if self.autoscaler:
            raise RuntimeError(
                "this cluster's slices come from Ray's autoscaler: use launch_delay_s, "
                "max_slices and set_capacity() instead of a provisioner"
            )
        p = Provisioner(self, delay_s=delay_s, poll_s=poll_s, max_slices=max_slices)
        self._provisioners.append(p)
        p.start()
        return p

    def shutdown(self) -> None:
        """Stop the provisioners, disconnect, stop every node this cluster started.

        With the autoscaler: its monitor first (no more launches), then every host it launched (by
        the process ids its provider recorded), then the head."""
        for p in self._provisioners:
            p.stop()
        self._provisioners.clear()
        for t in self._timers:  # preemptions whose deadline has not come: nothing to kill any more
            t.cancel()
        import ray

        if self._connect and ray.is_initialized():
            ray.shutdown()
        cluster = getattr(self, "_cluster", None)
        if self.autoscaler and cluster is not None:
            self._stop_autoscaled_nodes(cluster)
        # SIGCONT anything we stopped so it can be killed cleanly.
        for sl in self.slices:
            if sl.alive:
                try:
                    self._signal_slice(sl, signal.SIGCONT)
                except Exception:  # noqa: BLE001 - a slice already gone needs no resuming
                    pass
        if cluster is not None:
            try:
                cluster.shutdown()
            except Exception as e:  # noqa: BLE001 - shutting down: say it and go on
                logger.warning("cluster shutdown: %s", e)
            self._cluster = None
        self._starter.shutdown(wait=False)
        one_machine(self._was_one_machine)
        for k, v in self._old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if getattr(self, "redis", None) is not None:
            self.redis.stop()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        remove_orphans()  # the snapshot rings of keepers its killed hosts took with them
