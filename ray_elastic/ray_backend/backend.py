"""Every Ray effect the controller causes, behind one object: the seam a test replaces.

The controller and :class:`~ray_elastic.control.generations.Generations` never call Ray
themselves: they reserve slices, start processes, form and drive worlds and gather
failure evidence through a backend. :class:`RayBackend` is the real one (placement
groups, slice actors, streaming generators, node health); tests swap in a scripted
fake through ``ElasticTrainer.backend_cls``, as Ray Train's controller takes a
``worker_group_cls``, so a whole recovery sequence runs in milliseconds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import ray

from ray_elastic.config import ElasticConfig
from ray_elastic.control.backend import Reservation, StepSink, WorldHandle
from ray_elastic.ray_backend.cluster_health import RayClusterHealth
from ray_elastic.ray_backend.keepers import KeeperOwnership, Keepers, RunIdentity
from ray_elastic.ray_backend.placement import (
    ReplacementRequest,
    SliceReservation,
    host_labels,
    pending_slice_demand,
    reserve_slices,
)
from ray_elastic.ray_backend.pool import WorkerPool, kill
from ray_elastic.ray_backend.preflight import run_settings, snapshot_layout
from ray_elastic.ray_backend.stepping import StepStreams
from ray_elastic.ray_backend.world import World
from ray_elastic.state import storage_locations
from ray_elastic.state.run_secret import run_secret
from ray_elastic.state.snapshot_keeper import ask_keepers
from ray_elastic.state.snapshots import SnapshotStore
from ray_elastic.task import TrainTask

if TYPE_CHECKING:  # (Orbax is imported where a checkpoint is read, not with this module)
    from ray_elastic.state.checkpoints import CheckpointInfo

logger = logging.getLogger(__name__)


class RayBackend:
    """Slices, processes and worlds on the Ray cluster this driver is connected to
    (a :class:`~ray_elastic.control.backend.Backend`)."""

    pool: WorkerPool  # set by connect

    def __init__(self, task: TrainTask, config: ElasticConfig, address: str | None = None):
        self.task = task
        self.config = config
        self.address = address
        self.ownership = KeeperOwnership(self._superseded)  # holds the run's keepers once connected
        self.health = RayClusterHealth(config)

    def connect(self, run_id: str, *, home: str | None = None, findable: bool = True) -> None:
        """Connect; the run's keepers are named by ``run_id`` and taken over only with the secret
        kept in ``home`` (the run or checkpoint directory); ``findable``: a rerun can find the run."""
        if not ray.is_initialized():
            ray.init(address=self.address, namespace="ray_elastic", log_to_driver=True)
        layout, settings = snapshot_layout(self.task, self.config), run_settings(self.task, self.config)
        secret = run_secret(home) if findable else None
        identity = RunIdentity.of(run_id, self.task.name(), layout, settings, secret, findable)
        self.keepers = self.ownership.keepers = Keepers(identity, self.config.orphan_timeout_s)
        self.pool = WorkerPool(ray.put(self.task), self.config, self.keepers, env=storage_locations.gcs_env())
        self._world: World | None = None
        # The newest world's streams: what its straggler watch knows goes on to the next world's.
        self._driving: StepStreams | None = None

    def _superseded(self) -> None:
        """A newer driver owns the run: stop training now (its processes' failures end the loop)."""
        self.pool.stop_processes()
        if self._world is not None:
            for w in self._world.workers:
                kill(w)

    def run_metrics(self, name: str) -> Any:
        """Ray metrics for this run; a run goes on without them if they cannot be set up."""
        from ray_elastic.observe.metrics import RunMetrics

        try:
            return RunMetrics(name)
        except Exception as e:  # noqa: BLE001
            logger.warning("Ray metrics disabled: %s", e)
            return None

    # -------------------------------------------------------------- slices
    def reserve(self, count: int, on_wait: Callable[[int, int], None] | None = None) -> list[Reservation]:
        """``count`` slices, named by their hosts' TPU labels where Ray has them (a rerun's snapshots
        are filed by slice name), else when their first world forms."""
        reserved = reserve_slices(self.config.slice, count, self.config.slice_timeout_s, on_wait=on_wait)
        labels = host_labels(reserved)
        for res, hosts in zip(reserved, labels or []):
            res.slice_name = hosts[0]["slice_name"] or res.slice_name
        return list(reserved)

    def pending_demand(self) -> str:
        return pending_slice_demand()

    def request_replacement(self) -> ReplacementRequest:
        """A pending slice placement group: the demand the autoscaler provisions a slice for."""
        return ReplacementRequest(self.config.slice, self.config.replacement_timeout_s)

    def replenish(
        self, members: list[Any], per_host: int | None = None, at_once: bool = False, for_world: int | None = None
    ) -> bool:
        return self.pool.replenish(members, per_host, at_once, for_world)

    def missing_snapshots(self, refs: list[Any], members: Sequence[Any] = (), timeout_s: float = 1.0) -> set[int]:
        """Indices of ``refs`` (:class:`SnapshotRef`) whose keeper answers but no longer holds them, or
        is dead. In the same round, the keeper of every host of ``members`` is asked too: one that
        died while its slice stays (an OOM kill, ``ray.kill``) is replaced by a new, empty one, so
        the next world does not fail to form on it and the slice is not blamed for it."""
        hosts = self.pool.keepers_of(list(members))
        keepers = list({k._actor_id: k for k in [r.keeper for r in refs] + [k for _, k in hosts]}.values())
        dead: set[int] = set()
        starting = frozenset(i for i, k in enumerate(keepers) if not self.pool.answered(k))
        # One that does not answer: its slice's loss is decided elsewhere.
        answers = ask_keepers(keepers, timeout_s, dead, starting)
        self.pool.confirm_keepers([keepers[i] for i in answers if i not in dead])
        dead_ids = {keepers[i]._actor_id for i in dead}
        for (res, host), k in hosts:
            if k._actor_id in dead_ids:
                logger.warning(
                    "the snapshot keeper of host %d of slice %s died: starting a new one", host, res.slice_name
                )
                self.pool.renew_keeper(res, host)
        held = {keepers[i]._actor_id: set(h) for i, h in answers.items()}
        return {
            i
            for i, r in enumerate(refs)
            if r.keeper._actor_id in held and (r.generation, r.step) not in held[r.keeper._actor_id]
        }

    def warm(self, reservations: list[Any], every: bool = False) -> bool:
        return self.pool.warm(reservations, every)

    def discard(self, reservation: Reservation) -> None:
        if not isinstance(reservation, SliceReservation):  # the controller hands back what reserve() made
            raise TypeError(f"not a reservation of the Ray backend: {reservation!r}")
        self.pool.discard(reservation)

    # --------------------------------------------------------------- worlds
    def form(
        self,
        *,
        generation: int,
        reservations: list[Any],
        start_step: int,
        restore: Callable[[str], list[Any] | None],
        checkpoint_step: int | None,
        checkpoint_dir: str | None = None,
    ) -> World:
        self._world = World.form(
            pool=self.pool,
            epoch=self.keepers.epoch,
            config=self.config,
            generation=generation,
            reservations=reservations,
            start_step=start_step,
            restore=restore,
            checkpoint_step=checkpoint_step,
            checkpoint_dir=checkpoint_dir,
        )
        return self._world

    @staticmethod
    def check_task(task: TrainTask, config: ElasticConfig, resume: CheckpointInfo | None = None) -> None:
        """The task's model, layout, step and eval data against the config, and the checkpoint the
        run resumes from (``resume``) against the model, on the driver (:mod:`ray_elastic.ray_backend.preflight`):
        bad input fails before any slice is reserved."""
        from ray_elastic.ray_backend.preflight import check_task

        check_task(task, config, resume)

    def drive(self, world: WorldHandle, store: SnapshotStore, sink: StepSink) -> StepStreams:
        if not isinstance(world, World):
            raise TypeError(f"RayBackend drives the worlds it formed, not a {type(world).__name__}")
        before = self._driving.stragglers.handover() if self._driving is not None else None
        self._driving = StepStreams(world, self.config, store, sink, before)
        return self._driving

    def shutdown(self) -> None:
        if getattr(self, "pool", None) is not None:
            self.pool.shutdown()
