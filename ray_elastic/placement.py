"""Reserving TPU slices with Ray placement groups.

One :class:`SliceReservation` per slice (``ray.util.tpu.SlicePlacementGroup``),
so each slice can be lost, released and replaced on its own. A pending
reservation is exactly the demand the Ray autoscaler (or the simulated
cluster's provisioner) reacts to.
"""

from __future__ import annotations

import logging
from typing import Optional

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from ray.util.tpu import SlicePlacementGroup

from ray_elastic.config import SliceSpec

logger = logging.getLogger(__name__)
UNPLACED = "<unplaced>"  # no node: never among the live ones


class SliceReservation:
    """A placement group holding every host of one TPU slice (one bundle per host)."""

    def __init__(self, spec: SliceSpec, head_timeout_s: Optional[float] = None):
        self.spec = spec
        self._handle = SlicePlacementGroup(
            topology=spec.topology,
            accelerator_version=spec.accelerator,
            resources_per_bundle={"CPU": 1, "TPU": spec.chips_per_host},
            head_reservation_timeout_s=head_timeout_s,
        )
        self.placement_group = self._handle.placement_group
        self.slice_name: Optional[str] = None  # learnt from the hosts when a world forms on it
        self._ready_ref: Optional[ray.ObjectRef] = None
        self._is_ready = False

    def node_ids(self) -> list[str]:
        """The node of each host's bundle, ``UNPLACED`` for a bundle that has none (pending, or its
        node died and Ray is placing it again): a slice that lost one host is then seen as having a
        dead host, not as a smaller healthy slice."""
        placed = ray.util.placement_group_table(self.placement_group).get("bundles_to_node_id", {})
        return [placed.get(i) or UNPLACED for i in range(self.spec.num_hosts)]

    def ready(self) -> ray.ObjectRef:
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
                self._handle.release_head_pgs()
                self._is_ready = True
        return self._is_ready

    def host_strategy(self, host_index: int) -> PlacementGroupSchedulingStrategy:
        """Schedule onto bundle ``host_index`` of this slice."""
        return PlacementGroupSchedulingStrategy(
            placement_group=self.placement_group, placement_group_bundle_index=host_index
        )

    def release(self) -> None:
        self._handle.shutdown()


def reserve_slices(spec: SliceSpec, count: int, timeout_s: float) -> list[SliceReservation]:
    """Reserve ``count`` slices; release all of them and raise if they are not ready in time."""
    reservations: list[SliceReservation] = []
    try:
        # Multi-host slices block here until their head host is claimed (Ray's two-step reservation).
        for _ in range(count):
            reservations.append(SliceReservation(spec, head_timeout_s=timeout_s))
        pending = [r.ready() for r in reservations]
        _, not_ready = ray.wait(pending, num_returns=len(pending), timeout=timeout_s)
        if not_ready:
            raise TimeoutError(f"{len(not_ready)} reservation(s) still pending")
    except (TimeoutError, RuntimeError) as e:
        for r in reservations:
            r.release()
        raise TimeoutError(
            f"could not reserve {count} {spec.pod_type} slice(s) ({spec.topology}, {spec.num_hosts} host(s) each) "
            f"within {timeout_s:.0f}s ({e}). Cluster resources: {ray.cluster_resources()}. "
            "Add TPU capacity, check the accelerator/topology, or lower num_slices"
        ) from None
    for r in reservations:
        r.wait(0)
    return reservations


class ReplacementRequest:
    """A replacement slice asked for in the background.

    Its pending placement group is exactly the demand the Ray autoscaler (or the
    simulated provisioner) provisions a new slice for. Multi-host slices reserve
    their head host first, which blocks, so the reservation is made on a thread.
    A failed head reservation is retried, keeping the demand alive.
    """

    _executor = None

    def __init__(self, spec: SliceSpec, head_timeout_s: float):
        import concurrent.futures
        import time

        if ReplacementRequest._executor is None:
            ReplacementRequest._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=8, thread_name_prefix="ray-elastic-replacement"
            )
        self.spec = spec
        self.head_timeout_s = head_timeout_s
        self.requested_at = time.monotonic()
        self._future = self._submit()

    def _submit(self):
        return ReplacementRequest._executor.submit(SliceReservation, self.spec, self.head_timeout_s)

    def poll(self) -> Optional[SliceReservation]:
        """The reservation if its slice is ready now (never blocks); asks again if the head reservation failed."""
        if not self._future.done():
            return None
        try:
            res = self._future.result()
        except Exception as e:
            logger.info("replacement head reservation failed (%s); asking again", e)
            self._future = self._submit()
            return None
        return res if res.wait(0) else None

    def cancel(self) -> None:
        """No longer needed: give the reservation back (now, or when it is made)."""
        self._future.add_done_callback(lambda f: f.exception() is None and f.result().release())
