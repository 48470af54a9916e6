"""Reserving TPU slices with Ray placement groups.

One :class:`SliceReservation` per slice (``ray.util.tpu.SlicePlacementGroup``),
so each slice can be lost, released and replaced on its own. A pending
reservation is exactly the demand the Ray autoscaler (or the simulated
cluster's provisioner) reacts to.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from ray.util.tpu import SlicePlacementGroup

from ray_elastic.decide import REPORT_EVERY_S
from ray_elastic.errors import CapacityTimeoutError
from ray_elastic.tpu import POD_TYPE_LABEL, SLICE_NAME_LABEL, WORKER_ID_LABEL, SliceSpec

logger = logging.getLogger(__name__)
JOINING_WAIT_S = 30.0  # a claimed slice whose hosts are still registering is waited for this long
WATCH_JOINING_S = 0.2
UNPLACED = "<unplaced>"  # no node: never among the live ones


class SliceReservation:
    """A placement group holding every host of one TPU slice (one bundle per host)."""

    def __init__(
        self,
        spec: SliceSpec,
        head_timeout_s: float | None = None,
        on_wait: Callable[[], None] | None = None,
        cancelled: threading.Event | None = None,
    ):
        self.spec = spec
        # Multi-host: claim the head host of a whole, idle slice first and pin every bundle to it.
        self.pinned_slice: str | None
        self._head_pg: PlacementGroup | None
        self.pinned_slice, self._head_pg = (
            _claim_whole_slice(spec, head_timeout_s, on_wait, cancelled) if spec.num_hosts > 1 else (None, None)
        )
        try:
            self._handle = SlicePlacementGroup(
                topology=spec.topology,
                accelerator_version=spec.accelerator,
                resources_per_bundle={"CPU": 1, "TPU": spec.chips_per_host},
                bundle_label_selector=[{SLICE_NAME_LABEL: self.pinned_slice}] * spec.num_hosts
                if self.pinned_slice
                else None,
            )
        except BaseException:
            self._release_head()
            raise
        placement_group = self._handle.placement_group
        assert placement_group is not None  # SlicePlacementGroup creates it in its constructor
        self.placement_group: PlacementGroup = placement_group
        self.slice_name: str | None = None  # learnt from the hosts when a world forms on it
        self._ready_ref: ray.ObjectRef[Any] | None = None
        self._is_ready = False

    def node_ids(self) -> list[str]:
        """The node of each host's bundle, ``UNPLACED`` for a bundle that has none (pending, or its
        node died and Ray is placing it again): a slice that lost one host is then seen as having a
        dead host, not as a smaller healthy slice."""
        placed = ray.util.placement_group_table(self.placement_group).get("bundles_to_node_id", {})
        return [placed.get(i) or UNPLACED for i in range(self.spec.num_hosts)]

    def ready(self) -> ray.ObjectRef[Any]:
        """One ref that resolves when every bundle is placed (made once: each call of
        ``PlacementGroup.ready()`` schedules a new probe task)."""
        if self._ready_ref is None:
            self._ready_ref = self.placement_group.ready()
        return self._ready_ref

    def wait(self, timeout_s: float) -> bool:
        if not self._is_ready:
            ready, _ = ray.wait([self.ready()], timeout=timeout_s)
            if ready:
                # The worker group now holds the hosts; the head marker is no longer needed.
                self._release_head()
                self._is_ready = True
        return self._is_ready

    def lost_a_host(self) -> bool:
        """The multi-host slice it is pinned to has lost a host since: it can never be placed."""
        return self.pinned_slice is not None and len(_live_hosts(self.pinned_slice)) < self.spec.num_hosts

    def _release_head(self) -> None:
        head, self._head_pg = self._head_pg, None
        if head is not None:
            _remove(head)

    def host_strategy(self, host_index: int) -> PlacementGroupSchedulingStrategy:
        """Schedule onto bundle ``host_index`` of this slice."""
        return PlacementGroupSchedulingStrategy(
            placement_group=self.placement_group, placement_group_bundle_index=host_index
        )

    def release(self) -> None:
        self._handle.shutdown()
        self._release_head()


def _live_hosts(slice_name: str) -> list[dict[Any, Any]]:
    return [n for n in ray.nodes() if n["Alive"] and (n.get("Labels") or {}).get(SLICE_NAME_LABEL) == slice_name]


def _joining(slice_name: str, spec: SliceSpec) -> bool:
    """Some of the slice's hosts have not registered yet and none of them died: it is coming up
    (hosts start one after the other), not broken."""
    hosts = [n for n in ray.nodes() if (n.get("Labels") or {}).get(SLICE_NAME_LABEL) == slice_name]
    alive = [n for n in hosts if n["Alive"]]
    return len(alive) == len(hosts) < spec.num_hosts


def _whole_and_idle(slice_name: str, spec: SliceSpec, claim: PlacementGroup) -> bool:
    """Every host of the slice is alive and none of its TPUs is held by another reservation.

    Two readings, because either alone lags: the nodes' available resources (what
    ``ray.util.tpu`` itself reads) trail a placement by a resource report, and the placement-group
    table names the groups placed on the hosts (ours, the claim, aside)."""
    from ray._private.state import available_resources_per_node

    hosts = _live_hosts(slice_name)
    if len(hosts) != spec.num_hosts:
        return False
    nodes = {n["NodeID"] for n in hosts}
    for pg_id, info in ray.util.placement_group_table().items():
        if pg_id == claim.id.hex() or info.get("state") == "REMOVED":
            continue
        bundles = info.get("bundles") or {}
        if any(
            node in nodes and (bundles.get(i) or {}).get("TPU", 0) > 0
            for i, node in (info.get("bundles_to_node_id") or {}).items()
        ):
            return False
    free = available_resources_per_node()
    return all(free.get(n["NodeID"], n["Resources"]).get("TPU", 0) >= n["Resources"].get("TPU", 0) for n in hosts)


def _claim_whole_slice(
    spec: SliceSpec,
    timeout_s: float | None,
    on_wait: Callable[[], None] | None = None,
    cancelled: threading.Event | None = None,
) -> tuple[str, PlacementGroup]:
    """The name of a whole, idle multi-host slice and the placement group holding its head host.

    Ray's two-step reservation claims any free head host, and a slice's head is free when the
    slice lost another host (its survivors stay up), when the slice is in use (the head marker is
    given back once its hosts are held), or while the slice's other hosts are still coming up.
    Pinned to such a slice, a reservation waits forever, or until that slice frees up, while a
    good slice may sit idle. So a claimed head is checked; one that is not usable yet is held (so
    the next claim lands elsewhere) and checked again every second; the rest are given back once
    a good one is found. The pending claim is the demand the autoscaler adds a slice for; no new
    claim is made while a held slice is still joining (up to ``JOINING_WAIT_S``), or the autoscaler
    would add a second slice for the one that is arriving. ``cancelled`` set: give up at once.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    reported = time.monotonic()
    held: dict[str, PlacementGroup] = {}
    held_at: dict[str, float] = {}
    claim, claimed = None, None
    try:
        while True:
            if cancelled is not None and cancelled.is_set():
                raise concurrent.futures.CancelledError("the slice is no longer needed")
            for name in list(held):
                if _whole_and_idle(name, spec, held[name]):
                    return name, held.pop(name)
            arriving = any(_joining(name, spec) and time.monotonic() - held_at[name] < JOINING_WAIT_S for name in held)
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(
                    f"no whole, idle {spec.pod_type} slice could be reserved within {timeout_s:.0f}s "
                    f"(claimed and unusable: {sorted(held) or 'none'})"
                )
            if on_wait is not None and time.monotonic() - reported >= REPORT_EVERY_S:
                reported = time.monotonic()
                on_wait()
            if claim is None and arriving:
                time.sleep(min(WATCH_JOINING_S, left) if left is not None else WATCH_JOINING_S)
                continue
            if claim is None:
                claim = placement_group(
                    [{f"TPU-{spec.pod_type}-head": 1}],
                    bundle_label_selector=[{WORKER_ID_LABEL: "0", POD_TYPE_LABEL: spec.pod_type}],
                )
                claimed = claim.ready()
            ready, _ = ray.wait([claimed], timeout=1.0 if left is None else min(1.0, left))
            if ready:
                node = ray.util.placement_group_table(claim)["bundles_to_node_id"][0]
                labels = next((n.get("Labels") or {} for n in ray.nodes() if n["NodeID"] == node), {})
                name = labels.get(SLICE_NAME_LABEL, node)
                held[name], held_at[name], claim = claim, time.monotonic(), None  # checked at the top of the loop
    finally:
        for pg in held.values():
            _remove(pg)
        if claim is not None:
            _remove(claim)


def _remove(pg: PlacementGroup) -> None:
    try:
        remove_placement_group(pg)
    except Exception as e:  # noqa: BLE001 - the cluster may be going away
        logger.debug("could not remove placement group %s: %s", pg.id, e)


def reserve_slices(
    spec: SliceSpec, count: int, timeout_s: float, on_wait: Callable[[int, int], None] | None = None
) -> list[SliceReservation]:
    """Reserve ``count`` slices; release all of them and raise if they are not ready in time.

    ``on_wait(ready, count)`` is called every :data:`REPORT_EVERY_S` while some are not ready: a job
    waiting minutes for TPU capacity says so instead of printing nothing."""
    reservations: list[SliceReservation] = []
    deadline = time.monotonic() + timeout_s
    try:
        # Multi-host slices block here until their head host is claimed (Ray's two-step reservation).
        for _ in range(count):
            reservations.append(
                SliceReservation(
                    spec,
                    head_timeout_s=max(0.0, deadline - time.monotonic()),
                    on_wait=None if on_wait is None else lambda: on_wait(len(reservations), count),
                )
            )
        pending = [r.ready() for r in reservations]
        while True:
            ready, not_ready = ray.wait(
                pending, num_returns=len(pending), timeout=max(0.0, min(REPORT_EVERY_S, deadline - time.monotonic()))
            )
            if not not_ready:
                break
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{len(not_ready)} reservation(s) still pending")
            if on_wait is not None:
                on_wait(len(ready), count)
    except BaseException as e:  # KeyboardInterrupt too: pending groups would keep asking the autoscaler
        for r in reservations:
            r.release()
        if not isinstance(e, (TimeoutError, RuntimeError)):
            raise
        raise CapacityTimeoutError(
            f"could not reserve {count} {spec.pod_type} slice(s) ({spec.topology}, {spec.num_hosts} host(s) each) "
            f"within slice_timeout_s={timeout_s:.0f} ({e}). Cluster resources: {ray.cluster_resources()}. "
            "Add TPU capacity, check the accelerator/topology, raise slice_timeout_s, or lower num_slices"
        ) from None
    for r in reservations:
        r.wait(0)
    return reservations


def pending_slice_demand() -> str:
    """The pending TPU placement groups, the demand an autoscaler sees: what the run still waits for."""
    import collections
    import json

    demand: collections.Counter[str] = collections.Counter()
    for info in ray.util.placement_group_table().values():
        if info.get("state") not in ("PENDING", "RESCHEDULING"):
            continue
        bundles = list((info.get("bundles") or {}).values())
        if any(k == "TPU" or (k.startswith("TPU-") and k.endswith("-head")) for b in bundles for k in b):
            each = {k: (int(v) if float(v).is_integer() else v) for k, v in sorted(bundles[0].items())}
            demand[f"{len(bundles)} x {json.dumps(each)}"] += 1
    return "; ".join(f"{n} group(s) of {shape}" for shape, n in demand.items()) or "none pending"


class ReplacementRequest:
    """A replacement slice asked for in the background.

    Its pending placement group is exactly the demand the Ray autoscaler (or the
    simulated provisioner) provisions a new slice for. Multi-host slices reserve
    their head host first, which blocks, so the reservation is made on a thread.
    A failed head reservation is retried, keeping the demand alive.
    """

    _executor: concurrent.futures.ThreadPoolExecutor | None = None

    def __init__(self, spec: SliceSpec, head_timeout_s: float):
        if ReplacementRequest._executor is None:
            ReplacementRequest._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=8, thread_name_prefix="ray-elastic-replacement"
            )
        self.spec = spec
        self.head_timeout_s = head_timeout_s
        self.requested_at = time.monotonic()
        self._cancelled = threading.Event()
        self._future = self._submit()

    def _submit(self) -> concurrent.futures.Future[SliceReservation]:
        assert ReplacementRequest._executor is not None  # made in __init__
        return ReplacementRequest._executor.submit(
            SliceReservation, self.spec, self.head_timeout_s, cancelled=self._cancelled
        )

    def poll(self) -> SliceReservation | None:
        """The reservation if its slice is ready now (never blocks); asks again if the head reservation failed."""
        if not self._future.done():
            return None
        try:
            res = self._future.result()
        except Exception as e:  # noqa: BLE001 - any failure of the reservation: ask again
            logger.info("replacement head reservation failed (%s); asking again", e)
            self._future = self._submit()
            return None
        if res.wait(0):
            return res
        if res.lost_a_host():  # its slice broke after it was claimed: it would wait forever
            logger.info("replacement slice %s lost a host before it was ready; asking again", res.pinned_slice)
            res.release()
            self._future = self._submit()
        return None

    def cancel(self) -> None:
        """No longer needed: stop claiming (a multi-host claim gives back what it holds at once) and
        give the reservation back (now, or when it is made)."""
        self._cancelled.set()
        self._future.add_done_callback(_release_when_made)


def _release_when_made(made: concurrent.futures.Future[SliceReservation]) -> None:
    if made.exception() is None:
        made.result().release()


def host_labels(reservations: list[SliceReservation]) -> list[list[dict[Any, Any]]] | None:
    """Per slice, per bundle: the TPU slice name and worker id of the node it is placed on.

    ``None`` when a node lacks the labels (the actors' own report is used instead).
    """
    node_labels = {n["NodeID"]: n.get("Labels") or {} for n in ray.nodes() if n["Alive"]}
    out = []
    for res in reservations:
        hosts = []
        for node in res.node_ids():
            lab = node_labels.get(node, {})
            if SLICE_NAME_LABEL not in lab:
                return None
            hosts.append({"slice_name": lab[SLICE_NAME_LABEL], "tpu_worker_id": lab.get(WORKER_ID_LABEL, "")})
        if len(hosts) != res.spec.num_hosts:
            return None
        out.append(hosts)
    return out
