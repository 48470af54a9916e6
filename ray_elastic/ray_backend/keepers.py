"""The run's snapshot keepers outlive its driver, for a while: a new driver takes them over.

Each keeper is a detached actor pinned to its host's node (not inside the slice's placement
group, so releasing a reservation or losing the driver does not kill it), named by the run and
the node. The driver renews every keeper's lease; a keeper whose lease is not renewed for
``orphan_timeout_s`` frees its snapshots and exits, so an abandoned run leaves nothing behind.

A rerun of the same run (same ``run_id``, or run directory, and task) finds them before it
reserves a slice, takes them over with a higher epoch and the run's secret (fencing: a keeper
refuses the calls of an older driver, and an older driver that is still alive learns from its
next refused call, a lease renewal at the latest, that it was superseded and stops before its
next effect), and restores the newer of what they hold and the newest checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_elastic.errors import SupersededError
from ray_elastic.state.snapshot_keeper import SnapshotKeeper

logger = logging.getLogger(__name__)
NAMESPACE = "ray-elastic-keepers"
ANSWER_S = 10.0  # a live keeper answers in milliseconds; one on a lost node never does


@dataclasses.dataclass(frozen=True)
class RunIdentity:
    """``key`` names the run's keepers (run id and task); ``snapshot`` is what a held snapshot must
    match to be restored (the task, the model's arrays, one slice's layout and the run's training
    settings); ``secret`` is what a takeover requires (None: the run keeps none); ``findable``: a
    rerun can find the run (its id is not a random one), so its keepers outlive the driver."""

    key: str
    snapshot: str
    secret: str | None = None
    findable: bool = True

    @classmethod
    def of(
        cls,
        run_id: str,
        task_name: str,
        layout: object,
        settings: object = (),
        secret: str | None = None,
        findable: bool = True,
    ) -> RunIdentity:
        key = hashlib.sha1(f"{run_id}\n{task_name}".encode()).hexdigest()[:16]
        snapshot = hashlib.sha1(f"{task_name}\n{layout!r}\n{settings!r}".encode()).hexdigest()[:16]
        return cls(key, snapshot, secret, findable)


@dataclasses.dataclass(frozen=True)
class TakenOver:
    """A keeper of the previous driver, now this driver's: where it is and the steps it holds."""

    keeper: ray.actor.ActorHandle[Any]
    node_id: str
    place: tuple[str, int] | None  # (slice name, host index) of the process it kept for
    steps: list[int]


def new_epoch() -> int:
    """Above any earlier driver's (the clock), and not guessable (random low bits): a keeper's
    snapshots are fetched only by the owning epoch's processes."""
    return (time.time_ns() // 1_000_000) << 20 | secrets.randbits(20)


class Keepers:
    """The keepers of one run: created detached and named, found and taken over by a rerun, leased.

    Only the owning driver removes a keeper (:meth:`SnapshotKeeper.release` checks the epoch): a
    driver that was superseded, or one that finds a keeper it does not own, leaves it alone. A run
    that no rerun can find (no run directory, checkpoint directory or run id) gets keepers that die
    with its driver. Besides the hosts' keepers, a run has an *owner record* (a keeper that holds
    nothing, named ``KEY/owner``): a rerun takes it over even before the older driver has placed a
    slice, so a driver superseded while it waits for slices learns it too.
    """

    def __init__(self, identity: RunIdentity, orphan_timeout_s: float):
        self.identity = identity
        self.orphan_timeout_s = orphan_timeout_s
        self.epoch = new_epoch()  # max'd with the earlier drivers' below
        self.taken_over: dict[str, TakenOver] = {}  # node id -> a keeper of the previous driver, unclaimed
        self.dropped = 0  # snapshots the taken-over keepers held of another identity (not restorable)
        self.superseded = threading.Event()
        self._all: list[ray.actor.ActorHandle[Any]] = []  # every keeper this driver owns (alive or not)
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self._handed_back = False
        self._claiming = threading.Lock()
        self._owner_claim: tuple[Any, ...] | None = None  # (owner record, its take_over ref) until the claim is read

    def check(self) -> None:
        """Raise :class:`SupersededError` once a newer driver owns the run (learned from any refusal)."""
        if self.superseded.is_set():
            raise SupersededError("another driver took this run over (a rerun of it): this driver stopped")

    def confirm(self) -> None:
        """Ask every keeper now whether this driver still owns the run (before a last effect: the
        final checkpoint, returning success); raise :class:`SupersededError` if one refuses."""
        self._claim_owner(wait_s=ANSWER_S)
        if any(a is False for a in _answers([k.renew.remote(self.epoch) for k in list(self._all)])):
            self.superseded.set()
        self.check()

    # ------------------------------------------------------------- a rerun
    def take_over(self) -> list[TakenOver]:
        """Find the run's keepers left by an earlier driver and take them over (the owner record
        first created if there is none). A keeper that refuses because a newer driver owns it stops
        this driver (:class:`SupersededError`); one that does not answer, or is not this run's
        (another secret), is left alone: it frees itself when its lease runs out."""
        if not self.identity.findable:
            return []
        found = {
            a["name"]: ray.get_actor(a["name"], namespace=NAMESPACE)
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a.get("namespace") == NAMESPACE and a["name"].startswith(self.identity.key + "/")
        }
        if self._owner_name not in found:  # started now; its claim is read by the lease thread, not waited for
            owner = self._owner()
            ref: ray.ObjectRef[Any] = owner.take_over.remote(self.epoch, self.identity.snapshot, self.identity.secret)
            self._owner_claim = (owner, ref)
        names, handles = list(found), list(found.values())
        status = _answers([k.status.remote(self.identity.secret) for k in handles])
        self.epoch = max([self.epoch] + [s["epoch"] + 1 for s in status if s is not None])
        claims = _answers(  # (an owner record that exists is claimed here, with the others)
            [
                k.take_over.remote(self.epoch, self.identity.snapshot, self.identity.secret) if s else None
                for k, s in zip(handles, status)
            ]
        )
        for name, keeper, s, claim in zip(names, handles, status, claims):
            if not self._claimed(keeper, claim):
                continue
            self.dropped += claim["dropped"]
            if name != self._owner_name:
                place = tuple(claim["place"]) if claim["place"] else None
                steps = [st for _, st in claim["held"]]
                self.taken_over[s["node_id"]] = TakenOver(keeper, s["node_id"], place, steps)
        self.check()
        return list(self.taken_over.values())

    def _claimed(self, keeper: ray.actor.ActorHandle[Any], claim: dict[Any, Any] | None) -> bool:
        """Whether ``claim`` (a ``take_over`` answer; None: none) made ``keeper`` this driver's; a
        refusal because a newer driver owns it marks this driver superseded."""
        if claim is None or not claim["taken"]:
            if claim is not None and claim["why"] == "newer":
                self.superseded.set()
            return False
        self._all.append(keeper)
        return True

    def _claim_owner(self, wait_s: float = 0.0) -> None:
        """Read the claim of the owner record started by :meth:`take_over` (from the lease thread:
        its process starts while the driver reserves slices); a newer driver's record supersedes this one."""
        # The lease thread and the driver's own confirmation both read it; the lease thread never
        # waits for the other (its renewals are due).
        if not self._claiming.acquire(blocking=wait_s > 0):
            return
        try:
            if self._owner_claim is None:
                return
            owner, ref = self._owner_claim
            if not ray.wait([ref], timeout=wait_s)[0]:
                return  # not answered yet: the next renewal looks again
            self._owner_claim = None
            (claim,) = _answers([ref], timeout_s=0)
            self._claimed(owner, claim)
        finally:
            self._claiming.release()

    @property
    def _owner_name(self) -> str:
        return f"{self.identity.key}/owner"

    def _owner(self) -> ray.actor.ActorHandle[Any]:
        """The run's owner record (one for all its drivers: created by the first, found by the others)."""
        here = ray.get_runtime_context().get_node_id()
        owner: ray.actor.ActorHandle[Any] = SnapshotKeeper.options(  # type: ignore[attr-defined]
            name=self._owner_name,
            namespace=NAMESPACE,
            get_if_exists=True,
            lifetime="detached",
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=True),
        ).remote(orphan_timeout_s=self.orphan_timeout_s, identity=self.identity.snapshot, secret=self.identity.secret)
        return owner

    # ------------------------------------------------------------- keepers
    def keeper(self, node_id: str) -> ray.actor.ActorHandle[Any]:
        """A keeper on ``node_id``: the previous driver's one there, else a new one."""
        self.check()
        old = self.taken_over.pop(node_id, None)
        if old is not None:
            return old.keeper
        keeper: ray.actor.ActorHandle[Any] = SnapshotKeeper.options(  # type: ignore[attr-defined]
            name=f"{self.identity.key}/{node_id}/{uuid.uuid4().hex[:8]}",
            namespace=NAMESPACE,
            lifetime="detached" if self.identity.findable else None,
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(
            orphan_timeout_s=self.orphan_timeout_s,
            identity=self.identity.snapshot,
            epoch=self.epoch,
            secret=self.identity.secret,
        )
        self._all.append(keeper)
        return keeper

    def release_unclaimed(self) -> None:
        """The previous driver's keepers on nodes this run did not take (their snapshots were read)."""
        self.remove([old.keeper for old in self.taken_over.values()], wait=False)  # (called while training)
        self.taken_over.clear()

    def remove(self, keepers: list[Any], wait: bool = True) -> None:
        """Kill ``keepers`` that this driver owns (each confirms it; one a newer driver owns says so,
        and this driver learns it was superseded); others (a bundle's own keeper) are killed.
        ``wait=False``: the answers are awaited on a thread (a lost node's keeper never answers, and
        the driver is dropping its slice meanwhile)."""
        ours = {k._actor_id for k in self._all}
        for keeper in keepers:
            if keeper._actor_id not in ours:
                _kill(keeper)
        leased = [k for k in keepers if k._actor_id in ours]
        if self.superseded.is_set() or self._handed_back or not leased:
            return
        gone = {k._actor_id for k in leased}
        self._all = [k for k in self._all if k._actor_id not in gone]  # renewed no more either way
        refs = [k.release.remote(self.epoch) for k in leased]

        def finish() -> None:
            for keeper, released in zip(leased, _answers(refs)):
                if released is False:  # a newer driver owns it: not ours to remove
                    self.superseded.set()
                    continue
                _kill(keeper)  # released, or no answer in ANSWER_S: a lost node's or a hung one

        if wait:
            finish()
        else:
            threading.Thread(target=finish, name="ray-elastic-release", daemon=True).start()

    # ------------------------------------------------------------- the lease
    def start_lease(self, on_superseded: Callable[[], None]) -> None:
        """Renew every keeper's lease from a thread; a refusal means a newer driver took the run over.
        A keeper that does not answer is not a refusal (a lost node: the failure path sees to it)."""
        every = min(max(self.orphan_timeout_s / 5, 0.5), 5.0)

        def renew() -> None:
            while not self._stop.wait(every):
                self._claim_owner()
                answers = _answers([k.renew.remote(self.epoch) for k in list(self._all)], timeout_s=every)
                if any(a is False for a in answers):
                    logger.error("another driver has taken this run over: stopping")
                    self.superseded.set()
                if self.superseded.is_set():
                    on_superseded()
                    return

        self._renewer = threading.Thread(target=renew, name="ray-elastic-lease", daemon=True)
        self._renewer.start()

    def hand_back(self) -> None:
        """Leave every keeper as it is, unrenewed: a later rerun may take them over (until they expire)."""
        self._handed_back = True
        self._stop.set()

    def shutdown(self) -> None:
        """The run is over: stop renewing and remove every keeper this driver still owns."""
        self._stop.set()
        self._claim_owner(wait_s=ANSWER_S)  # a short run may end before its lease thread read it
        if self._owner_claim is not None and not (self.superseded.is_set() or self._handed_back):
            _kill(self._owner_claim[0])  # its process never answered: nothing of the run is in it
        self.remove(list(self._all))
        self._all.clear()
        self.taken_over.clear()


def _answers(refs: list[Any], timeout_s: float = ANSWER_S) -> list[Any]:
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


def _kill(actor: ray.actor.ActorHandle[Any]) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception as e:  # noqa: BLE001 - already gone
        logger.debug("kill keeper: %s", e)


class KeeperOwnership:
    """The controller's :class:`~ray_elastic.control.backend.RunOwnership` over a run's
    :class:`Keepers` (set once the backend connects; before that, nothing is owned or superseded)."""

    def __init__(self, on_superseded: Callable[[], None]):
        self.keepers: Keepers | None = None
        self._on_superseded = on_superseded  # stops this driver's processes

    def _connected(self) -> Keepers:
        if self.keepers is None:
            raise RuntimeError("the backend is not connected: no keepers yet")
        return self.keepers

    @property
    def superseded(self) -> bool:
        return self.keepers is not None and self.keepers.superseded.is_set()

    @property
    def dropped_snapshots(self) -> int:
        """Snapshots the taken-over keepers held of another model or training settings."""
        return self._connected().dropped

    def take_over(self) -> list[TakenOver]:
        """The keepers an earlier driver of this run left, now this driver's (then its lease starts:
        a driver that takes this run over later stops this one)."""
        keepers = self._connected()
        found = keepers.take_over()
        keepers.start_lease(self._on_superseded)
        return found

    def release_unclaimed(self) -> None:
        self._connected().release_unclaimed()

    def confirm(self) -> None:
        self._connected().confirm()

    def hand_back(self) -> None:
        self._connected().hand_back()
