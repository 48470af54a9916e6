"""The simulated cluster's slices when Ray's autoscaler launches them (``SimulatedTPUCluster(autoscaler=True)``).

Its node provider (:mod:`ray_elastic.sim.node_provider`) records what it did in ``state_dir``
and reads its knobs (capacity, launch delay) from there; this side writes the knobs, learns the
slices from the records, asks for launches, and stops every launched host at shutdown.
"""

from __future__ import annotations

import logging
import os
import signal
import time

from ray_elastic.sim.hosts import SimulatedHost, SimulatedSlice, process_children, send_signal
from ray_elastic.sim.node_provider import autoscaling_config, launches_in_flight, read_events, write_knobs
from ray_elastic.sim.one_machine import HEAD_INSTANCE_ID, LOOPBACK

logger = logging.getLogger(__name__)


class AutoscaledSlices:
    """Mixed into :class:`~ray_elastic.sim.cluster.SimulatedTPUCluster` (its ``autoscaler``,
    ``state_dir``, ``slices``, ``address``, ``alive_slices`` and ``stray_processes``)."""

    def _write_autoscaling_config(
        self, gcs_address: str, num_slices: int, idle_timeout_s: float, pool_slices: int | None
    ) -> None:
        """Ray's cluster config for the autoscaler: the head, and the TPU slice node types."""
        import json

        config = autoscaling_config(
            self.slice_spec,
            self.devices_per_host,
            cluster_name=os.path.basename(self.temp_dir),
            gcs_address=gcs_address,
            head_instance_id=HEAD_INSTANCE_ID,
            node_ip=LOOPBACK,
            state_dir=self.state_dir,
            object_store_bytes=self._object_store_bytes,
            slices=pool_slices or num_slices + 2,
            idle_timeout_s=idle_timeout_s,
        )
        with open(self.autoscaling_config_path, "w") as f:
            json.dump(config, f, indent=1)

    def set_capacity(self, max_slices: int | None) -> None:
        """(autoscaler) Slices that may be alive at once; ``None``: no limit. Below the live count it
        is a stock-out: nothing running is taken away, and every launch fails until capacity returns
        (the autoscaler retries each round; its demand stays visible in the cluster status)."""

        self._require_autoscaler("set_capacity")
        write_knobs(self.state_dir, max_slices=max_slices)

    def set_launch_delay(self, seconds: float) -> None:
        """(autoscaler) How long provisioning each slice takes from now on."""

        self._require_autoscaler("set_launch_delay")
        write_knobs(self.state_dir, launch_delay_s=float(seconds))

    def autoscaler_events(self) -> list[dict]:
        """(autoscaler) What the provider did: ``launch``, ``create`` (per host, with process ids),
        ``terminate`` and ``stock_out`` records, each with its wall-clock time ``t``."""

        self._require_autoscaler("autoscaler_events")
        return read_events(self.state_dir)

    def _require_autoscaler(self, what: str) -> None:
        if not self.autoscaler:
            raise RuntimeError(f"{what} needs SimulatedTPUCluster(autoscaler=True)")

    def _sync(self) -> None:
        """Learn the slices the autoscaler launched or terminated since the last look."""
        if not self.autoscaler:
            return

        with self._lock:
            events = read_events(self.state_dir)[self._events_seen :]
            self._events_seen += len(events)
            for e in events:
                if e["event"] == "create":
                    host = SimulatedHost(
                        node_id=e["node_id"],
                        pids=tuple(tuple(p) for p in e["pids"]),
                        instance_id=e["instance"],
                        worker_id=e["worker"],
                    )
                    sl = next((s for s in reversed(self.slices) if s.name == e["slice"]), None)
                    if sl is None or not sl.alive or any(h.worker_id == host.worker_id for h in sl.hosts):
                        sl = SimulatedSlice(name=e["slice"], hosts=[])
                        self.slices.append(sl)
                    sl.hosts = sorted(sl.hosts + [host], key=lambda h: h.worker_id)
                elif e["event"] == "terminate":
                    for sl in self.slices:
                        if any(h.instance_id == e["instance"] for h in sl.hosts):
                            sl.alive = False

    def _launch_slices(self, count: int, timeout_s: float = 120.0) -> list[SimulatedSlice]:
        """Have the autoscaler launch ``count`` more slices: a standing request for as many slice
        heads as are alive plus ``count`` (a request, unlike a placement group, cannot be met by an
        idle slice), withdrawn once they are up."""
        from ray.autoscaler.v2.sdk import request_cluster_resources

        before = {id(s) for s in self.alive_slices()}
        head = {"resources": {f"TPU-{self.slice_spec.pod_type}-head": 1}, "label_selector": {}}
        request_cluster_resources(self.address, [head] * (len(before) + count))
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                new = [s for s in self.alive_slices() if id(s) not in before]
                if len(new) >= count and self._registered(new):
                    return new
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"the autoscaler launched {len(new)} of {count} slice(s) in {timeout_s:.0f}s "
                        f"(see {self.state_dir} and the monitor log under {self.temp_dir}/ray)"
                    )
                time.sleep(0.2)
        finally:
            request_cluster_resources(self.address, [])

    def _registered(self, slices: list[SimulatedSlice]) -> bool:
        from ray._private.state import GlobalState
        from ray._raylet import GcsClientOptions

        state = GlobalState()
        state._initialize_global_state(
            GcsClientOptions.create(self.address, None, allow_cluster_id_nil=True, fetch_cluster_id_if_nil=False)
        )
        try:
            alive = {n["NodeID"] for n in state.node_table() if n["Alive"]}
        finally:
            state.disconnect()
        return all(nid in alive for s in slices for nid in s.node_ids)

    def _stop_autoscaled_nodes(self, cluster) -> None:
        """No new launches (capacity 0), wait for the ones in flight (a node half-started when the
        monitor dies would be orphaned), stop the monitor, then SIGKILL every node it launched by the
        recorded PIDs, and last whatever of their hosts still runs (:meth:`stray_processes`)."""

        write_knobs(self.state_dir, max_slices=0)
        deadline = time.monotonic() + 60
        while launches_in_flight(read_events(self.state_dir)) and time.monotonic() < deadline:
            time.sleep(0.2)
        try:
            cluster.head_node.kill_monitor(check_alive=False)
        except Exception as e:  # noqa: BLE001 - it may be gone already
            logger.debug("kill monitor: %s", e)
        self._sync()
        table = process_children()
        procs = [p for sl in self.slices for host in sl.hosts for p in host.processes(table)]
        head = {p.pid for p in SimulatedHost(node_id="", node=cluster.head_node).processes(table)}
        procs += [p for p in self.stray_processes() if p.pid not in head]  # missed by the records
        send_signal(procs, signal.SIGKILL)
