"""A thread that stands in for the autoscaler on the simulated cluster: exact delays, no monitor process."""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger(__name__)


class Provisioner:
    """Adds a slice ``delay_s`` after a slice placement group has been pending.

    It watches the placement group table for PENDING groups that ask for TPU
    resources (what the Ray autoscaler reacts to), waits ``delay_s`` (how long a
    real TPU slice takes to come up, scaled down), then adds one slice per
    pending group. ``max_slices`` bounds the slices it will ever add. A launch that fails (a node
    that does not start in time on loaded cores) is retried at the next poll, as a cloud
    autoscaler retries a failed instance launch.
    """

    def __init__(self, cluster, delay_s: float, poll_s: float, max_slices: int | None):
        self._cluster = cluster
        self.delay_s = delay_s
        self.poll_s = poll_s
        self.max_slices = max_slices
        self.added: list[str] = []
        self.failed_launches: list[str] = []  # why each launch that failed did (it was retried)
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
            if any(
                b.get("TPU", 0) > 0 or any(k.startswith("TPU-") and k.endswith("-head") for k in b) for b in bundles
            ):
                pending.append(pg_id)
        return pending

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.max_slices is not None and len(self.added) >= self.max_slices:
                return
            try:
                pending = self._pending_tpu_groups()
            except Exception as e:  # noqa: BLE001 - the driver may be shutting down
                logger.debug("provisioner poll failed: %s", e)
                continue
            now = time.monotonic()
            for pg_id in list(self._first_seen):
                if pg_id not in pending:
                    del self._first_seen[pg_id]
            for pg_id in pending:
                first = self._first_seen.setdefault(pg_id, now)
                if now - first >= self.delay_s:
                    try:
                        sl = self._cluster.add_slice()
                    except Exception as e:  # noqa: BLE001 - like a cloud's failed launch: try again
                        self.failed_launches.append(repr(e)[:300])
                        logger.warning("simulated slice launch failed (%s); retrying", repr(e)[:200])
                        break  # the group stays pending: the next poll launches again
                    self.added.append(sl.name)
                    # The new slice satisfies this group; forget it either way.
                    self._first_seen.pop(pg_id, None)
                    break
