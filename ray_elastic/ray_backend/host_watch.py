"""Which of a world's hosts lost their node, from their raylets refusing connections.

Ray's health checks mark a node dead seconds after it is gone, and until then no call of ours
fails; a raylet that refuses connections proves its node gone at once. Only a raylet this
driver has reached can prove that, so the world's raylets are reached when it starts.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from ray_elastic.detect import health
from ray_elastic.errors import ProcessGone, RayletGone

if TYPE_CHECKING:  # the world watched (its module imports this one's users)
    from ray_elastic.ray_backend.world import World

logger = logging.getLogger(__name__)


class HostWatch:
    """The raylets of one world's hosts, and which processes a refusing one took with it."""

    def __init__(self, world: World) -> None:
        self.world = world
        self._raylets: dict[Any, Any] | None = None  # node id -> where its raylet listens
        self._learning: threading.Thread | None = None

    def start(self) -> None:
        """Learn where the raylets listen, off the step loop, once per world."""
        if self._learning is None:
            self._learning = threading.Thread(target=self._learn, name="ray-elastic-raylets", daemon=True)
            self._learning.start()

    def _learn(self) -> None:
        """Where the world's raylets listen, each connected to once (off the step loop, once per
        world: nodes do not move during a world): only a raylet this driver has reached can later
        prove its node dead by refusing (``health.refusing``), so reach them before any dies."""
        try:
            addresses = health.raylet_addresses({i["node_id"] for i in self.world.host_infos})
        except Exception as e:  # noqa: BLE001 - the GCS unreachable for a moment: no evidence this world
            logger.debug("raylet addresses: %r", e)
            addresses = {}
        health.answering(addresses)
        self._raylets = addresses

    def gone(self, processes: set[int]) -> dict[int, BaseException]:
        """Processes whose liveness connection closed, by process: with its host (a refusing raylet:
        the node died, every process there is gone) or alone (the node check decides later)."""
        errors = self.lost(processes)  # every process of such a host, not only the closed ones
        for p in processes & set(errors):
            errors[p] = RayletGone(f"{errors[p]} (and the liveness connection of its process {p} closed)")
        for p in sorted(processes - set(errors)):
            errors[p] = ProcessGone(
                f"process {p} of slice {self.world.slice_of(p)} "
                f"(pid {self.world.host_infos[p]['pid']}) is gone: its liveness connection closed"
            )
        return errors

    def lost(self, of: set[int] | None = None) -> dict[int, BaseException]:
        """The processes (of ``of``, default all) whose host's raylet refuses connections (its Ray
        node is dead), by process: every process on such a host, not only those of ``of``."""
        if not self._raylets:  # not learnt yet (the world's first moments) or none reachable
            return {}
        nodes = None if of is None else {self.world.host_infos[p]["node_id"] for p in of}
        gone = health.refusing({n: a for n, a in self._raylets.items() if nodes is None or n in nodes})
        return {
            p: RayletGone(
                f"the raylet of host {p % self.world.plan.hosts_per_slice} of slice "
                f"{self.world.slice_of(p)} (node {info['node_id'][:12]}) refuses connections: its node is gone"
            )
            for p, info in enumerate(self.world.host_infos)
            if info["node_id"] in gone
        }
