"""The node provider Ray's autoscaler (v2) launches simulated TPU slices with.

Loaded by the autoscaler's monitor process on the head of a :class:`~ray_elastic.sim.cluster.SimulatedTPUCluster`
started with ``autoscaler=True`` (provider type ``external``). Its instances are local Ray nodes that
carry the resources, labels and environment of :func:`~ray_elastic.sim.hosts.tpu_host`, so a pending slice
placement group makes the real autoscaler launch a real (simulated) TPU host, and a dead host is
retired by the real reconciler.

Why a subclass of Ray's ``FakeMultiNodeProvider`` and not the built-in ``fake_multinode`` type: that
type cannot be loaded from the wheel (its example config is missing), and it gives every node of a
type the same labels and no TPU environment, while each slice needs its own name.

What it adds:

- **Slice names.** Single-host slices are one node type; each launch gets a fresh name.
  Multi-host slices are a pool of pre-named slices (one node type per slice and host, ``max_workers``
  1), because the second step of Ray's slice reservation pins hosts to the slice name of the head
  host it claimed, and the autoscaler matches that label only against node types' static labels.
  Asked for host 0 of a pool slice, it starts the whole slice (the other hosts are adopted by the
  autoscaler as unrequested instances); told to terminate one host of a slice, it terminates the
  slice, as a TPU slice is provisioned and lost as a whole.
- **Provisioning time and stock-out.** Each slice launch waits ``launch_delay_s`` (a real slice takes
  minutes); a launch beyond the capacity ``max_slices`` fails the way a zone without TPUs fails it,
  and the autoscaler retries it every round, its demand pending. Both are knobs in
  ``<state_dir>/knobs.json``, read at every launch, so a test can change them while it runs.
  (Lowering ``max_workers`` below the live count is not a stock-out: the v2 scheduler terminates
  running nodes to meet it.)
- **A record of its nodes.** Every create and terminate is a line of ``<state_dir>/events.jsonl``
  with the node's process ids and their start times: the nodes live under the monitor, and the
  simulated cluster reaches them (kills, hangs, shutdown) by these, never by process name.
- Node starts are serialized: two ``Node()`` built at once race on the session's socket names.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time

import psutil

logger = logging.getLogger(__name__)

os.environ.setdefault("RAY_FAKE_CLUSTER", "1")  # the base class refuses to start without it

from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider  # noqa: E402
from ray.autoscaler.tags import (  # noqa: E402
    NODE_KIND_WORKER,
    STATUS_UP_TO_DATE,
    TAG_RAY_NODE_KIND,
    TAG_RAY_NODE_NAME,
    TAG_RAY_NODE_STATUS,
    TAG_RAY_USER_NODE_TYPE,
)

from ray_elastic.sim.hosts import SimulatedHost, TPUHost, free_port, send_signal, tpu_host  # noqa: E402
from ray_elastic.tpu import SLICE_NAME_LABEL  # noqa: E402

HEAD_NODE_TYPE = "ray.head.default"  # the name FakeMultiNodeProvider gives the head
EVENTS_FILE = "events.jsonl"
KNOBS_FILE = "knobs.json"
_START_LOCK = threading.Lock()


class StockOutError(RuntimeError):
    """No TPU capacity for one more slice (what a cloud answers when a zone has none)."""


def pool_node_type(slice_index: int, worker_id: int) -> str:
    return f"slice-{slice_index}-host-{worker_id}"


def record_event(state_dir: str, **event) -> None:
    event.setdefault("t", time.time())
    with open(os.path.join(state_dir, EVENTS_FILE), "a") as f:
        f.write(json.dumps(event) + "\n")


def read_events(state_dir: str) -> list[dict]:
    try:
        with open(os.path.join(state_dir, EVENTS_FILE)) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def write_knobs(state_dir: str, **knobs) -> None:
    """Change the simulated cloud while it runs: ``max_slices`` (capacity; ``None``: no limit) and
    ``launch_delay_s`` (provisioning time). Read at every launch."""
    merged = {**read_knobs(state_dir), **knobs}
    tmp = os.path.join(state_dir, KNOBS_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(merged, f)
    os.replace(tmp, os.path.join(state_dir, KNOBS_FILE))


def launches_in_flight(events: list[dict]) -> set[str]:
    """Launches begun and not finished: their nodes may be starting under the monitor."""
    return {e["launch"] for e in events if e["event"] == "launch"} - {
        e["launch"] for e in events if e["event"] == "launch_done"
    }


def read_knobs(state_dir: str) -> dict:
    try:
        with open(os.path.join(state_dir, KNOBS_FILE)) as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return {}


class TPUSliceProvider(FakeMultiNodeProvider):
    """Local Ray nodes as TPU slice hosts, for Ray's autoscaler (see the module docstring)."""

    def __init__(self, provider_config: dict, cluster_name: str):
        super().__init__(provider_config, cluster_name)
        from ray_elastic.tpu import SliceSpec

        c = provider_config
        self._state_dir = c["state_dir"]
        self._spec = SliceSpec.for_hosts(c["accelerator"], int(c["hosts_per_slice"]), int(c["devices_per_host"]))
        self._devices_per_host = int(c["devices_per_host"])
        self._ip = c["node_ip_address"]
        self._object_store_bytes = int(c["object_store_bytes"])
        self._prefix = c["slice_prefix"]
        self._next_slice = int(c.get("first_slice_index", 0))
        self._slice_of: dict[str, tuple[str, int]] = {}  # instance id -> (slice name, worker id)

    # ------------------------------------------------------------ launching
    def _create_node_with_resources_and_labels(self, node_config, tags, count, resources, labels):
        node_type = tags[TAG_RAY_USER_NODE_TYPE]
        live = self._live_slices()
        knobs = read_knobs(self._state_dir)
        capacity = knobs.get("max_slices")
        if capacity is not None and len(live) >= capacity:
            record_event(self._state_dir, event="stock_out", node_type=node_type, live_slices=len(live))
            raise StockOutError(
                f"no TPU capacity for another {self._spec.pod_type} slice ({len(live)} alive, capacity {capacity})"
            )
        launch = f"{node_type}@{time.time():.6f}"
        record_event(self._state_dir, event="launch", launch=launch, node_type=node_type)
        try:
            self._launch(knobs, node_type, tags, labels)
        finally:  # the simulated cluster waits for launches in flight before it stops the monitor
            record_event(self._state_dir, event="launch_done", launch=launch)

    def _launch(self, knobs: dict, node_type: str, tags: dict, labels: dict) -> None:
        if knobs.get("launch_delay_s"):
            time.sleep(knobs["launch_delay_s"])  # provisioning a slice
        if self._spec.num_hosts == 1:
            with self.lock:
                name = f"{self._prefix}-{self._next_slice}"
                self._next_slice += 1
            self._start_host(node_type, tags, name, 0)
            return
        # A pool slice: its name is in the node type's labels; start every host it lacks.
        name = labels[SLICE_NAME_LABEL]
        index = int(node_type.split("-")[1])
        with self.lock:
            have = {w for s, w in self._slice_of.values() if s == name}
        for w in range(self._spec.num_hosts):
            if w not in have:
                t = pool_node_type(index, w)
                self._start_host(t, {**tags, TAG_RAY_USER_NODE_TYPE: t}, name, w)

    def _live_slices(self) -> set[str]:
        """Slices with a host still running (or starting): a killed one counts no more, even before
        the autoscaler has terminated its instance."""
        with self.lock:
            hosts = [(name, self._nodes.get(cid, {}).get("node")) for cid, (name, _) in self._slice_of.items()]
        return {name for name, node in hosts if node is None or node.live_processes()}

    def _start_host(self, node_type: str, tags: dict, slice_name: str, worker_id: int) -> None:
        # Long: a Ray node's parameters are one long keyword list.
        import ray
        from ray._private import ray_constants

        host = tpu_host(self._spec, slice_name, worker_id, self._devices_per_host)
        resources = dict(host.resources)
        with self.lock:
            cid = self._next_hex_node_id()
            # Registered before the node starts: the reconciler then sees the cloud instance before
            # the Ray node and never adopts the node as unmanaged.
            self._nodes[cid] = {
                "tags": {
                    TAG_RAY_NODE_KIND: NODE_KIND_WORKER,
                    TAG_RAY_USER_NODE_TYPE: node_type,
                    TAG_RAY_NODE_NAME: cid,
                    TAG_RAY_NODE_STATUS: STATUS_UP_TO_DATE,
                    **tags,
                },
                "node": None,
            }
            self._slice_of[cid] = (slice_name, worker_id)
        params = ray._private.parameter.RayParams(
            min_worker_port=0,
            max_worker_port=0,
            dashboard_port=None,
            dashboard_agent_listen_port=free_port(),
            node_manager_port=0,
            include_log_monitor=False,
            node_ip_address=self._ip,
            num_cpus=2,
            num_gpus=0,
            object_store_memory=self._object_store_bytes,
            resources=resources,
            labels=host.labels,
            redis_address=self._gcs_address,
            gcs_address=self._gcs_address,
            env_vars={
                **host.env,
                "RAY_OVERRIDE_NODE_ID_FOR_TESTING": cid,
                "RAY_CLOUD_INSTANCE_ID": cid,
                "RAY_NODE_TYPE_NAME": node_type,
                ray_constants.RESOURCES_ENVIRONMENT_VARIABLE: json.dumps(resources),
                ray_constants.LABELS_ENVIRONMENT_VARIABLE: json.dumps(host.labels),
            },
        )
        t0 = time.monotonic()
        try:
            with _START_LOCK:
                node = ray._private.node.Node(params, head=False, shutdown_at_exit=False, spawn_reaper=False)
        except BaseException:
            with self.lock:
                self._nodes.pop(cid, None)
                self._slice_of.pop(cid, None)
            raise
        with self.lock:
            if cid in self._nodes:
                self._nodes[cid]["node"] = node
        pids = []
        for infos in node.all_processes.values():
            for info in infos:
                try:
                    pids.append([info.process.pid, psutil.Process(info.process.pid).create_time()])
                except psutil.NoSuchProcess:
                    pass
        record_event(
            self._state_dir,
            event="create",
            instance=cid,
            node_id=node.node_id,
            node_type=node_type,
            slice=slice_name,
            worker=worker_id,
            pids=pids,
            start_s=round(time.monotonic() - t0, 3),
        )

    # ---------------------------------------------------------- terminating
    def terminate_node(self, node_id):
        """Terminate the instance and, for a multi-host slice, its sibling hosts (a slice is one unit)."""
        with self.lock:
            slice_name, _ = self._slice_of.get(node_id, (None, None))
            ids = [i for i, (s, _) in self._slice_of.items() if s == slice_name] if slice_name else [node_id]
            gone = [(i, self._nodes.pop(i, None)) for i in ids]
            for i in ids:
                self._slice_of.pop(i, None)
        for i, entry in gone:
            if entry is None:
                continue  # terminated already, with its slice
            if entry.get("node") is not None:
                # The raylet's own children (dashboard and runtime-env agents) are not in the node's
                # process table: found first (the host's processes), killed after it, or they
                # outlive the cluster.
                procs = SimulatedHost(node_id=i, node=entry["node"]).processes()
                try:
                    entry["node"].kill_all_processes(check_alive=False, allow_graceful=False)
                except Exception as e:  # noqa: BLE001 - its processes may be dead already
                    logger.debug("kill %s: %s", i, e)
                send_signal(procs, signal.SIGKILL)
            record_event(self._state_dir, event="terminate", instance=i, slice=slice_name, asked=i == node_id)


def autoscaling_config(
    spec,
    devices_per_host: int,
    *,
    cluster_name: str,
    gcs_address: str,
    head_instance_id: str,
    node_ip: str,
    state_dir: str | None,
    object_store_bytes: int,
    slices: int,
    idle_timeout_s: float,
) -> dict:
    """Ray's cluster config for the autoscaler with this provider: the head, and the TPU slice node
    types (multi-host: a pool of ``slices`` pre-named slices)."""
    # Long: one literal, the cluster config Ray's autoscaler reads.

    def node_type(host: TPUHost, max_workers: int, static_name: bool) -> dict:
        labels = dict(host.labels)
        if not static_name:
            labels.pop(SLICE_NAME_LABEL)  # the provider names each single-host slice it launches
        return {
            "resources": {"CPU": 2, **{k: int(v) for k, v in host.resources.items()}},
            "labels": labels,
            "node_config": {},
            "min_workers": 0,
            "max_workers": max_workers,
        }

    types = {"ray.head.default": {"resources": {"CPU": 1}, "node_config": {}, "min_workers": 0, "max_workers": 0}}
    prefix = f"sim-{spec.pod_type}"
    if spec.num_hosts == 1:
        types["tpu-slice"] = node_type(tpu_host(spec, prefix, 0, devices_per_host), 1000, False)
    else:
        # Ray's slice reservation pins hosts to the head host's slice name, and the autoscaler
        # matches names only against static labels: a pool of pre-named slices.
        for i in range(slices):
            for w in range(spec.num_hosts):
                types[pool_node_type(i, w)] = node_type(tpu_host(spec, f"{prefix}-{i}", w, devices_per_host), 1, True)
    config = {
        "cluster_name": cluster_name,
        "max_workers": 1000,
        "upscaling_speed": 1000.0,  # every slice lost at once is replaced in the same round
        "idle_timeout_minutes": idle_timeout_s / 60.0,
        "provider": {
            "type": "external",
            "module": "ray_elastic.sim.node_provider.TPUSliceProvider",
            "gcs_address": gcs_address,
            "head_node_id": head_instance_id,
            "state_dir": state_dir,
            "node_ip_address": node_ip,
            "accelerator": spec.accelerator,
            "hosts_per_slice": spec.num_hosts,
            "devices_per_host": devices_per_host,
            "object_store_bytes": object_store_bytes,
            "slice_prefix": prefix,
            "launch_multiple": True,
            "disable_node_updaters": True,  # the provider starts Ray itself
            "disable_launch_config_check": True,
        },
        "auth": {},
        "head_node_type": "ray.head.default",
        "available_node_types": types,
        "docker": {},
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
    }
    return config
