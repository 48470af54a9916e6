"""The bookkeeping of generations: which slices are members, which are asked for, which
snapshots exist, and the one path from survivors + replacements to the next world.

The controller decides *when* (states, failures, capacity); this module knows *what*
the next world is made of and forms it through the backend, returning typed records
instead of emitting events. Forming the first world, re-forming after a failure and
growing back at a step boundary are all :meth:`Generations.form`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Optional

from ray_elastic import checkpoints
from ray_elastic.config import ElasticConfig
from ray_elastic.plan import (Action, ErrorKind, NextWorld, RestorePlan, RestoreSource, batch_for_world, choose_restore,
                              decide_next_world, lr_scale, should_grow)
from ray_elastic.results import WorldRecord
from ray_elastic.snapshots import SnapshotStore
from ray_elastic.states import OutcomeKind, RunOutcome

logger = logging.getLogger(__name__)
WAIT_POLL_S = 0.2


@dataclasses.dataclass(frozen=True)
class Evidence:
    """What a failed world says: per slice the kind of its worst error, its hosts' nodes."""

    kinds: dict[str, ErrorKind]
    slice_nodes: dict[str, list[str]]
    slices: list[str]  # the world's slices, replica order
    generation: int
    vouched: set[str]  # slices whose hosts answered after their process died

    @property
    def suspects(self) -> set[str]:
        """Slices that may have lost a host: worth waiting a grace period for Ray to say so."""
        return set(self.kinds) - self.vouched


class Generations:
    """Members of the current (or next) world, pending replacements, snapshots and worlds so far."""

    def __init__(self, config: ElasticConfig, backend):
        self.config = config
        self.backend = backend
        self.members: list = []  # slice reservations of the current/next world, replica order
        self.replacements: list = []  # pending replacement requests (the autoscaler's demand)
        self.store = SnapshotStore(config.slice.num_hosts)
        self.worlds: list[WorldRecord] = []
        self.world = None  # the current World

    # ------------------------------------------------------------ capacity
    def reserve(self) -> list:
        """The first world's slices; their standby processes start while the world forms."""
        self.members = self.backend.reserve(self.config.num_slices)
        self.backend.replenish(self.members)
        return list(self.members)

    def ready_replacements(self) -> list:
        return [r for r in self.replacements if r.poll() is not None]

    def capacity_returned(self) -> bool:
        """A replacement is ready and the world is smaller than asked: grow at the next step boundary."""
        return should_grow(self.config.mode, len(self.members), len(self.ready_replacements()), self.config.num_slices)

    def decide(self, survivors: list, *, timed_out: bool) -> NextWorld:
        cfg = self.config
        return decide_next_world(mode=cfg.mode, survivors=[_name(r, i) for i, r in enumerate(survivors)],
                                 ready_replacements=len(self.ready_replacements()), num_slices=cfg.num_slices,
                                 min_slices=cfg.min_slices, timed_out=timed_out,
                                 fallback_to_resize=cfg.fallback_to_resize)

    def await_capacity(self, survivors: list, *, grow: bool, on_wait: Callable[[str], None]) -> tuple[NextWorld, float]:
        """Poll until the next world may form or the mode gives up; returns the decision and seconds waited.

        ``on_wait(reason)`` is called once when waiting starts. Growing never waits: the running
        world's size was already allowed.
        """
        t0, waited = time.perf_counter(), False
        while True:
            timed_out = grow or time.perf_counter() - t0 > self.config.replacement_timeout_s
            decision = self.decide(survivors, timed_out=timed_out)
            if decision.action is not Action.WAIT:
                return decision, (time.perf_counter() - t0 if waited else 0.0)
            if not waited:
                on_wait(decision.reason)
                waited = True
            time.sleep(WAIT_POLL_S)

    def take(self, survivors: list, decision: NextWorld) -> tuple[list, list]:
        """The members ``decision`` names: its survivors (in order) and up to ``decision.replacements``
        ready replacement slices, which stop being pending. Returns (members, added)."""
        kept = survivors[: len(decision.survivors)]  # decisions keep a prefix: replica order is stable
        for res in survivors[len(kept):]:  # trimmed: the world is full size without it
            self.drop(res, replace=False)
        taken = self.ready_replacements()[: decision.replacements]
        for req in taken:
            self.replacements.remove(req)
        added = [req.poll() for req in taken]
        return kept + added, added

    def drop(self, res, *, replace: bool = True) -> None:
        """A slice left for good: free it, forget its snapshots, and (by default) ask for a replacement."""
        if res.slice_name:
            self.store.forget(res.slice_name)
        res.release()
        self.backend.discard(res)
        if replace:
            # A pending slice placement group is what makes the autoscaler provision a new slice.
            self.replacements.append(self.backend.request_replacement())

    def split(self, lost: set[str]) -> list:
        """After a failure of the current world: drop the ``lost`` slices, return the others (replica order)."""
        survivors = []
        for i, res in enumerate(self.members):
            if _name(res, i) in lost:
                self.drop(res)
            else:
                survivors.append(res)
        return survivors

    def member_nodes(self) -> dict[str, list[str]]:
        """Per member slice, the nodes of its hosts (an unplaced reservation counts as a dead host)."""
        return {_name(res, i): res.node_ids() or ["<unplaced>"] for i, res in enumerate(self.members)}

    def evidence(self, outcome: RunOutcome, now: float) -> Evidence:
        """What the failed world (or the one that failed to form) says about each of its slices."""
        world = self.world
        if world is None:  # forming failed: the slices it names, else any member may be the cause
            nodes = self.member_nodes()
            error = outcome.errors[0]
            kind = self.backend.error_kind(error)
            named = [n for n in getattr(error, "slices", ()) if n in nodes]
            kinds = {name: kind for name in named or nodes}
            return Evidence(kinds, nodes, list(nodes), len(self.worlds), self._vouched(kinds, self.members))
        if outcome.kind is OutcomeKind.HANG:
            hung = self.backend.unresponsive(world)
            # Nobody silent: the whole world is stuck (for example a collective that never completes).
            for p in hung or range(len(world.workers)):
                outcome.errors[p] = TimeoutError(f"no step finished for {now - outcome.last_progress_at:.1f}s")
        kinds: dict[str, ErrorKind] = {}
        for p, e in outcome.errors.items():
            kinds.setdefault(world.slice_of(p), self.backend.error_kind(e))  # a TimeoutError is a hang
        names = list(world.plan.slice_names)
        return Evidence(kinds, world.slice_node_ids(), names, world.plan.generation,
                        self._vouched(kinds, world.reservations))

    def _vouched(self, kinds: dict, reservations: list) -> set[str]:
        """Slices whose process died while each of its hosts still answers: the hosts live, so the
        slice only crashed and no grace period for a node death needs to be spent."""
        crashed = [(i, r) for i, r in enumerate(reservations) if kinds.get(_name(r, i)) is ErrorKind.PROCESS_DIED]
        return {_name(r, i) for i, r in crashed if self.backend.hosts_answer(r)}

    # --------------------------------------------------------------- state
    def restore_plan(self, members: list, resume_step: Optional[int] = None) -> RestorePlan:
        """The newest state among ``members``' snapshots and the committed checkpoints."""
        names = [r.slice_name for r in members if r.slice_name]
        checkpoint_step = resume_step if resume_step is not None else self._checkpoint_step()
        return choose_restore(self.store.latest_complete(names), checkpoint_step)

    def _checkpoint_step(self) -> Optional[int]:
        if not self.config.checkpoint_dir:
            return None
        info = checkpoints.latest_checkpoint(self.config.checkpoint_dir)
        return info.restore_step if info else None

    # -------------------------------------------------------------- worlds
    def form(self, members: list, restore: RestorePlan) -> WorldRecord:
        """Form the next generation on ``members``, loading the state ``restore`` names.

        Raises whatever forming raised; ``members`` are the members either way, so the
        controller can look at their hosts.
        """
        cfg = self.config
        self.members = list(members)
        self.world = None
        generation = len(self.worlds)
        n = len(members)
        batch = batch_for_world(n, cfg.num_slices, cfg.global_batch_size, cfg.batch_policy)
        donors: dict[str, str] = {}

        def from_snapshot(name: str) -> Optional[list]:
            donor = restore.donor(name)
            if donor is None:
                return None
            donors[name] = donor
            return self.store.refs(donor, restore.step)

        world = self.backend.form(
            generation=generation, reservations=self.members, start_step=restore.step + 1, global_batch_size=batch,
            lr_scale=lr_scale(n, cfg.num_slices, cfg.lr_rule), restore=from_snapshot,
            checkpoint_step=restore.step + 1 if restore.source is RestoreSource.CHECKPOINT else None)
        self.world = world
        record = WorldRecord(generation=generation, slices=list(world.plan.slice_names), mesh=world.plan.mesh_shape,
                             global_batch_size=batch, start_step=restore.step + 1, restore_source=restore.source,
                             snapshot_donors=donors, times=dataclasses.asdict(world.times))
        self.worlds.append(record)
        return record

    def replenish(self) -> None:
        """Warm standby processes for every member host that has none."""
        self.backend.replenish(self.members)

    def release(self) -> None:
        """The run is over: stop every process, cancel pending requests, give every slice back."""
        if self.world is not None:
            self.world.teardown()
        self.backend.shutdown()
        for req in self.replacements:
            req.cancel()
        self.replacements = []
        for r in self.members:
            try:
                r.release()
            except Exception as e:  # noqa: BLE001
                logger.debug("release reservation: %s", e)


def _name(res, index: int) -> str:
    """A slice's name (one that never joined a world has none yet: named by its position)."""
    return res.slice_name or f"new-slice-{index}"
