"""The run's slice processes before they join a world: warm standbys on every reserved host, the
snapshot keeper of each host, and the relays, kept across generations so that forming the next
world does not wait for Python and JAX to start."""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import ray

from ray_elastic.config import ElasticConfig
from ray_elastic.ray_backend.keepers import Keepers
from ray_elastic.ray_backend.placement import UNPLACED, SliceReservation
from ray_elastic.ray_backend.relay import RelayPool
from ray_elastic.ray_backend.slice_settings import slice_settings
from ray_elastic.slice.worker import SliceWorker
from ray_elastic.state.snapshot_keeper import SnapshotKeeper

logger = logging.getLogger(__name__)
CHIP_OWNER_WORLDS = 3  # the joiners of this many latest worlds may hold chips (a failed forming is one)
CHIP_OWNER_ANSWER_S = 30.0  # for a killed process's prepare to answer (or fail) when its pid is not known yet


class Standby(NamedTuple):
    """A slice process started ahead of need, with the refs that say how far it got."""

    actor: ray.actor.ActorHandle[Any]
    prepared: ray.ObjectRef[Any]  # Python, JAX and the task's data loaded (its host info)
    traced: ray.ObjectRef[Any]  # the steps of the likely worlds traced too


class WorkerPool:
    """Slice actors for the next generation: standbys started ahead of need.

    Actors take no Ray resources of their own: the slice's placement group holds
    the host, and any number of processes can live in its bundle. On a real TPU
    host only the promoted process touches the TPU (JAX opens devices at
    ``jax.distributed.initialize``), so a standby does not compete for chips.
    """

    def __init__(
        self, task_ref: ray.ObjectRef[Any], config: ElasticConfig, keepers: Keepers, env: dict[Any, Any] | None = None
    ):
        self.task_ref = task_ref
        self.run_keepers = keepers
        self.config = config
        self.settings = slice_settings(config)  # what the slice processes get of it
        self.env = env or {}  # forwarded to every slice process (GCS endpoint and credentials)
        # (id(reservation), host) -> standbys, oldest first
        self._standby: dict[tuple[int, int], list[Standby]] = {}
        self._keepers: dict[tuple[int, int], ray.actor.ActorHandle[Any]] = {}  # (id(reservation), host) -> keeper
        self._answered: set[Any] = set()  # actor ids of keepers that have answered a call: their process is up
        self.relays = RelayPool()  # fan chunks out to many quiet processes (large worlds)
        self._chip_owners: list[list[ray.ObjectRef[Any]]] = []  # prepare refs of the latest worlds' joiners

    def keeper(self, res: SliceReservation, host: int) -> ray.actor.ActorHandle[Any]:
        """The host's snapshot keeper, started with the first process placed there (or the previous
        driver's, taken over): pinned to the host's node, it outlives every slice process, and the
        driver too (:mod:`ray_elastic.ray_backend.keepers`)."""
        key = (id(res), host)
        if key not in self._keepers:
            node = res.node_ids()[host]
            if node == UNPLACED:  # not placed yet: in the bundle, living as long as the reservation
                self._keepers[key] = SnapshotKeeper.options(  # type: ignore[attr-defined]
                    num_cpus=0, scheduling_strategy=res.host_strategy(host)
                ).remote(epoch=self.run_keepers.epoch)  # the driver's: it refuses any other's snapshots
            else:
                self._keepers[key] = self.run_keepers.keeper(node)
        return self._keepers[key]

    def keepers_of(
        self, reservations: list[SliceReservation]
    ) -> list[tuple[tuple[SliceReservation, int], ray.actor.ActorHandle[Any]]]:
        """((reservation, host), keeper) of every host of these slices that has a keeper already."""
        return [
            ((res, h), self._keepers[(id(res), h)])
            for res in reservations
            for h in range(res.spec.num_hosts)
            if (id(res), h) in self._keepers
        ]

    def answered(self, keeper: ray.actor.ActorHandle[Any]) -> bool:
        """The keeper has answered a call (a new one may still be starting, and holds nothing yet)."""
        return keeper._actor_id in self._answered

    def confirm_keepers(self, keepers: list[Any]) -> None:
        self._answered.update(k._actor_id for k in keepers)

    def renew_keeper(self, res: SliceReservation, host: int) -> ray.actor.ActorHandle[Any]:
        """A new, empty keeper for a host whose keeper died (its snapshots died with it)."""
        old = self._keepers.pop((id(res), host), None)
        if old is not None:
            self.run_keepers.remove([old], wait=False)
        return self.keeper(res, host)

    def claim_chips(self, prepared: list[ray.ObjectRef[Any]]) -> None:
        """The processes whose prepares are ``prepared`` were asked to join a world: each may open its
        host's chips (the TPU runtime lets one process per host at a time)."""
        self._chip_owners = ([list(prepared)] + self._chip_owners)[:CHIP_OWNER_WORLDS]

    def chip_owners(self) -> tuple[tuple[str, int], ...]:
        """(node id, pid) of the processes that may still hold a host's chips: the next process on
        that host waits for them to exit. Each says where it runs and who it is when its prepare
        answers; an answer still on its way is waited for (the process may be past it, in
        ``join_world``, holding the chips): it was killed with its world, so the answer, or its
        death, comes at once."""
        refs = [r for world in self._chip_owners for r in world]
        ready, late = ray.wait(refs, num_returns=len(refs), timeout=CHIP_OWNER_ANSWER_S) if refs else ([], [])
        if late:
            logger.warning("%d earlier slice process(es) never said where they run", len(late))
        owners = []
        for ref in ready:
            try:
                info = ray.get(ref)
            except Exception:  # noqa: BLE001 - it died before it said who it was: it holds nothing
                continue
            owners.append((info["node_id"], info["pid"]))
        return tuple(owners)

    def _start(self, res: SliceReservation, host: int, for_world: int | None = None) -> Standby:
        """A new slice process; ``for_world``: the size (slices) of the world it is started for, the
        only one whose step it then traces ahead (else the likely ones: see ``SliceWorker.prepare``)."""
        options = {"num_cpus": 0, "scheduling_strategy": res.host_strategy(host)}
        if self.env:
            options["runtime_env"] = {"env_vars": self.env}
        actor = SliceWorker.options(**options).remote(self.task_ref, self.settings)  # type: ignore[attr-defined]
        return Standby(actor, actor.prepare.remote(for_world), actor.traced_ahead.remote())

    def take(self, res: SliceReservation, host: int, for_world: int | None = None) -> tuple[tuple[Any, ...], bool]:
        """An actor and its prepare ref for (slice, host): the warm standby if there is one, else a
        new process, started for a world of ``for_world`` slices."""
        queue = self._standby.get((id(res), host))
        s, warm = (queue.pop(0), True) if queue else (self._start(res, host, for_world), False)
        return (s.actor, s.prepared), warm

    def replenish(
        self,
        reservations: list[SliceReservation],
        per_host: int | None = None,
        at_once: bool = False,
        for_world: int | None = None,
    ) -> bool:
        """Start standbys until every host of these slices has ``config.standby_workers`` of them
        (``per_host`` instead: a replacement that arrives while others are awaited starts only the
        process its first world will take, so a second one does not slow it down). True when every
        host has them all.

        One at a time per host unless ``at_once``: a host whose newest standby is still starting
        (Python, JAX, data, the trace ahead) gets the next one only when it is done (call again).
        After faults in quick succession a world may have to take a process still starting; one
        started beside it shared the CPUs it needed (``bench/recovery.py``'s cold chain of process
        kills shows it). ``at_once`` is for a slice that is not yet a
        member (the newcomers of a grow-back): nothing of the run waits on them while they start,
        and the grow waits until one is ready on each host. ``for_world``: the processes started
        now are for a world of that many slices (the first world's), see ``_start``.
        """
        want = self.config.standby_workers if per_host is None else per_host
        queues = {}
        for res in reservations:
            for h in range(res.spec.num_hosts):
                self.keeper(res, h)
                queues[(res, h)] = self._standby.setdefault((id(res), h), [])
        busy: set[Any] = set()  # the newest standby of hosts still short of ``want``, if still starting
        if not at_once:
            newest = [q[-1].traced for q in queues.values() if q and len(q) < want]
            if newest:
                busy = set(ray.wait(newest, num_returns=len(newest), timeout=0)[1])
        for (res, h), queue in queues.items():
            missing = max(0, want - len(queue))
            if queue and queue[-1].traced in busy:
                continue
            queue.extend(self._start(res, h, for_world) for _ in range(missing if at_once else min(1, missing)))
        return all(len(q) >= want for q in queues.values())

    def warm(self, reservations: list[SliceReservation], every: bool = False) -> bool:
        """Every host of these slices has a standby that finished starting (Python, JAX, data) and
        tracing the step ahead (``every``: all its standbys have, so none of them still uses CPU)."""
        if not self.config.standby_workers:
            return True
        queues = [self._standby.get((id(res), h)) or [] for res in reservations for h in range(res.spec.num_hosts)]
        if not all(queues):
            return False
        refs = [s.traced for q in queues for s in (q if every else q[:1])]  # q[0]: the one ``take`` hands out next
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return len(done) == len(refs)

    def discard(self, res: SliceReservation) -> None:
        """The slice left: kill its standbys."""
        for h in range(res.spec.num_hosts):
            for s in self._standby.pop((id(res), h), []):
                kill(s.actor)
            keeper = self._keepers.pop((id(res), h), None)
            if keeper is not None:
                self.run_keepers.remove([keeper], wait=False)

    def stop_processes(self) -> None:
        """Kill every standby (a superseded driver stops; its keepers are the new driver's)."""
        for queue in self._standby.values():
            for s in queue:
                kill(s.actor)
        self._standby.clear()

    def shutdown(self) -> None:
        self.stop_processes()
        self.run_keepers.remove(list(self._keepers.values()))  # those it still owns (none once superseded)
        self._keepers.clear()
        self.run_keepers.shutdown()
        self.relays.shutdown()


def kill(actor: ray.actor.ActorHandle[Any]) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception as e:  # noqa: BLE001 - already gone
        logger.debug("kill %s: %s", actor, e)
