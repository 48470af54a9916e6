"""What the Ray cluster says about a failure (the controller's
:class:`~ray_elastic.control.backend.ClusterHealth`): an error's kind, hosts and slices gone, processes
that do not answer, hosts warned they will go. The checks themselves are :mod:`ray_elastic.detect.health`'s."""

from __future__ import annotations

from ray_elastic.config import ElasticConfig
from ray_elastic.control.backend import Reservation, WorldHandle
from ray_elastic.decide import ErrorKind
from ray_elastic.detect import health


class RayClusterHealth:
    def __init__(self, config: ElasticConfig):
        self.config = config

    def error_kind(self, error: BaseException) -> ErrorKind:
        return health.error_kind(error)

    def error_text(self, error: BaseException) -> str:
        return health.error_text(error)

    def hosts_answer(self, reservation: Reservation) -> bool:
        """Every host of the slice answers (its raylet accepts a connection): the hosts are alive."""
        return health.raylets_answer(reservation.node_ids())

    def lost_hosts(self, reservations: list[Reservation]) -> list[Reservation]:
        """The reservations with a host Ray's node table has marked dead (one look, no grace)."""
        if not reservations:
            return []
        dead = health.dead_slices({str(i): r.node_ids() for i, r in enumerate(reservations)}, set(), 0.0)
        return [r for i, r in enumerate(reservations) if str(i) in dead]

    def dead_slices(self, slice_nodes: dict[str, list[str]], suspects: set[str]) -> set[str]:
        return health.dead_slices(slice_nodes, suspects, self.config.failure.node_death_grace_s)

    def unresponsive(self, world: WorldHandle) -> set[int]:
        return health.unresponsive(world.workers, self.config.failure.probe_timeout_s)

    def draining(self) -> dict[str, tuple[float | None, str]]:
        """Hosts warned they will be taken (drained nodes with their deadlines)."""
        return health.draining_nodes()
