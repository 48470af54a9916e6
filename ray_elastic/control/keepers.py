"""The run's snapshot keepers outlive its driver, for a while: a new driver takes them over.

Each keeper is a detached actor pinned to its host's node (not inside the slice's placement
group, so releasing a reservation or losing the driver does not kill it), named by the run and
the node. The driver renews every keeper's lease; a keeper whose lease is not renewed for
``orphan_timeout_s`` frees its snapshots and exits, so an abandoned run leaves nothing behind.

A rerun of the same run (same ``run_id``, or run directory, and task) finds them before it
reserves a slice, takes them over with a higher epoch (fencing: a keeper refuses the calls of
an older driver, and an older driver that is still alive learns from its next renewal that it
was superseded and stops), and restores the newer of what they hold and the newest checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
import uuid
from typing import Callable, Optional

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_elastic.state.snapshot_keeper import SnapshotKeeper

logger = logging.getLogger(__name__)
NAMESPACE = "ray-elastic-keepers"
ANSWER_S = 10.0  # a live keeper answers in milliseconds; one on a lost node never does


@dataclasses.dataclass(frozen=True)
class RunIdentity:
    """``key`` names the run's keepers (run id and task); ``snapshot`` is what a held snapshot must
    match to be restored (the task, the model's arrays and one slice's layout)."""

    key: str
    snapshot: str

    @classmethod
    def of(cls, run_id: str, task_name: str, layout: object) -> "RunIdentity":
        key = hashlib.sha1(f"{run_id}\n{task_name}".encode()).hexdigest()[:16]
        return cls(key, hashlib.sha1(f"{task_name}\n{layout!r}".encode()).hexdigest()[:16])


@dataclasses.dataclass(frozen=True)
class TakenOver:
    """A keeper of the previous driver, now this driver's: where it is and the steps it holds."""

    keeper: ray.actor.ActorHandle
    node_id: str
    place: Optional[tuple[str, int]]  # (slice name, host index) of the process it kept for
    steps: list[int]


class Keepers:
    """The keepers of one run: created detached and named, found and taken over by a rerun, leased."""

    def __init__(self, identity: RunIdentity, orphan_timeout_s: float):
        self.identity = identity
        self.orphan_timeout_s = orphan_timeout_s
        self.epoch = time.time_ns() // 1_000_000  # above any earlier driver's (max'd with theirs below)
        self.taken_over: dict[str, TakenOver] = {}  # node id -> a keeper of the previous driver, unclaimed
        self.superseded = threading.Event()
        self._all: list[ray.actor.ActorHandle] = []  # every keeper this driver owns (alive or not)
        self._stop = threading.Event()
        self._renewer: Optional[threading.Thread] = None

    # ------------------------------------------------------------- a rerun
    def take_over(self) -> list[TakenOver]:
        """Find the run's keepers left by an earlier driver and take them over; those of another
        identity (a changed model) or that refuse are killed: their snapshots cannot be restored."""
        found = [
            ray.get_actor(a["name"], namespace=NAMESPACE)
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a.get("namespace") == NAMESPACE and a["name"].startswith(self.identity.key + "/")
        ]
        if not found:
            return []
        status = _answers([k.status.remote() for k in found])
        self.epoch = max([self.epoch] + [s["epoch"] + 1 for s in status if s is not None])
        claims = _answers(
            [k.take_over.remote(self.epoch, self.identity.snapshot) if s else None for k, s in zip(found, status)]
        )
        for keeper, s, claim in zip(found, status, claims):
            if claim is None:
                why = "no answer" if s is None else "another model or a newer driver"
                logger.warning("a keeper of this run was not taken over (%s): removed", why)
                _kill(keeper)
                continue
            place = tuple(claim["place"]) if claim["place"] else None
            self.taken_over[s["node_id"]] = TakenOver(keeper, s["node_id"], place, [st for _, st in claim["held"]])
            self._all.append(keeper)
        return list(self.taken_over.values())

    # ------------------------------------------------------------- keepers
    def keeper(self, node_id: str) -> ray.actor.ActorHandle:
        """A keeper on ``node_id``: the previous driver's one there, else a new one."""
        old = self.taken_over.pop(node_id, None)
        if old is not None:
            return old.keeper
        keeper = SnapshotKeeper.options(  # type: ignore[attr-defined]
            name=f"{self.identity.key}/{node_id}/{uuid.uuid4().hex[:8]}",
            namespace=NAMESPACE,
            lifetime="detached",
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(orphan_timeout_s=self.orphan_timeout_s, identity=self.identity.snapshot, epoch=self.epoch)
        self._all.append(keeper)
        return keeper

    def release_unclaimed(self) -> None:
        """The previous driver's keepers on nodes this run did not take (their snapshots were read)."""
        for old in self.taken_over.values():
            _kill(old.keeper)
        self.taken_over.clear()

    # ------------------------------------------------------------- the lease
    def start_lease(self, on_superseded: Callable[[], None]) -> None:
        """Renew every keeper's lease from a thread; a refusal means a newer driver took the run over."""
        every = min(max(self.orphan_timeout_s / 5, 0.5), 5.0)

        def renew() -> None:
            while not self._stop.wait(every):
                answers = _answers([k.renew.remote(self.epoch) for k in list(self._all)], timeout_s=every)
                if any(a is False for a in answers):
                    logger.error("another driver has taken this run over: stopping")
                    self.superseded.set()
                    on_superseded()
                    return

        self._renewer = threading.Thread(target=renew, name="ray-elastic-lease", daemon=True)
        self._renewer.start()

    def shutdown(self) -> None:
        """The run is over: stop renewing and remove every keeper, unless a newer driver owns them."""
        self._stop.set()
        if not self.superseded.is_set():
            for keeper in self._all:
                _kill(keeper)
        self._all.clear()
        self.taken_over.clear()


def _answers(refs: list, timeout_s: float = ANSWER_S) -> list:
    """Each ref's value, or None for one that failed or did not answer in time (None refs too)."""
    live = [r for r in refs if r is not None]
    if live:
        ray.wait(live, num_returns=len(live), timeout=timeout_s)
    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref, timeout=0) if ref is not None else None)
        except Exception:  # noqa: BLE001 - dead, or not answered in time: as if absent
            out.append(None)
    return out


def _kill(actor) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception as e:  # noqa: BLE001 - already gone
        logger.debug("kill keeper: %s", e)
