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
from collections.abc import Callable
from typing import Any

from ray_elastic.config import ElasticConfig
from ray_elastic.control.backend import Backend, WorldHandle
from ray_elastic.control.backend import slice_name as _name
from ray_elastic.control.run_checkpoints import RunCheckpoints
from ray_elastic.control.states import OutcomeKind, RunOutcome
from ray_elastic.decide import REPORT_EVERY_S, ErrorKind, RestorePlan, RestoreSource, choose_restore
from ray_elastic.errors import StuckProcess, unreadable_checkpoint
from ray_elastic.observe.results import WorldRecord
from ray_elastic.policy.failure import FailureEvidence
from ray_elastic.policy.scaling import Action, NextWorld
from ray_elastic.state import checkpoints
from ray_elastic.state.snapshots import SnapshotStore

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
    origin: str | None = None  # the slice whose error came first (None: unknown, or the whole world)
    unreadable_checkpoints: frozenset[Any] = frozenset()  # checkpoint steps a process failed to restore
    silent: frozenset[str] = frozenset()  # hung slices whose hosts do not answer either: lost, as dead ones

    @property
    def suspects(self) -> set[str]:
        """Slices that may have lost a host: worth waiting a grace period for Ray to say so."""
        return set(self.kinds) - self.vouched


class Generations:
    """Members of the current (or next) world, pending replacements, snapshots and worlds so far."""

    def __init__(self, config: ElasticConfig, backend: Backend, run_checkpoints: RunCheckpoints | None = None):
        self.config = config
        self.backend = backend
        self.checkpoints = run_checkpoints or RunCheckpoints(config.checkpoint_dir)
        self.scaling = config.scaling_policy()
        self.members: list[Any] = []  # slice reservations of the current/next world, replica order
        self.replacements: list[Any] = []  # pending replacement requests (the autoscaler's demand)
        self.quarantined: list[Any] = []  # reservations of slices that kept failing: held until the run ends
        self.left: list[Any] = []  # warned slices that left alive: freed once the next world stepped
        self.last_restore: RestorePlan | None = None  # what the newest world loaded (or tried to)
        self.store = SnapshotStore(config.slice.num_hosts, checked_every=config.failure.integrity_every)
        self.worlds: list[WorldRecord] = []
        self.world: WorldHandle | None = None  # the current generation
        self.taken_over_slices: set[str] = set()  # slices an earlier driver's keepers hold snapshots of
        self.taken_over_step = -1  # the newest step they hold completely (the run resumes at least there)

    # ------------------------------------------------------------ capacity
    def reserve(self, on_wait: Callable[[int, int], None] | None = None) -> list[Any]:
        """The first world's slices, with a process started on each host while the world is
        asked for (the pool starts one per host at a time: the one the world takes, which prepares
        for that world only; the others after its first step). ``on_wait(ready, asked)`` every few
        seconds while slices are missing."""
        self.members = self.backend.reserve(self.config.num_slices, on_wait=on_wait)
        self.backend.replenish(self.members, for_world=len(self.members))
        return list(self.members)

    def ready_replacements(self) -> list[Any]:
        return [r for r in self.replacements if r.poll() is not None]

    def capacity_returned(self) -> bool:
        """A replacement is ready and the world is smaller than asked: grow at the next step boundary,
        once the bigger world's processes have started.

        The newcomers' processes start here, while the smaller world keeps training, and the
        world stops only when every host of the bigger world has a warm standby: the training
        pause of a grow-back is then teardown, joining and loading, not Python and JAX starting.
        """
        ready = self.ready_replacements()
        if not self.scaling.should_grow(len(self.members), len(ready)):
            return False
        newcomers = [req.poll() for req in ready[: self.config.num_slices - len(self.members)]]
        self.backend.replenish(newcomers, at_once=True)  # together: none is still starting beside the grow
        return self.backend.warm(self.members + newcomers)

    def decide(self, survivors: list[Any], *, timed_out: bool) -> NextWorld:
        names = [_name(r, i) for i, r in enumerate(survivors)]
        ready = self.ready_replacements()
        warm = sum(self.backend.warm([r.poll()]) for r in ready)
        return self.scaling.next_world_warm_first(names, warm, len(ready) - warm, timed_out=timed_out)

    def await_capacity(
        self,
        survivors: list[Any],
        *,
        grow: bool,
        on_wait: Callable[[str, float], None],
        on_lost: Callable[[list[str]], None] | None = None,
    ) -> tuple[NextWorld, float, list[Any]]:
        """Poll until the next world may form or the mode gives up; returns the decision, seconds
        waited and the survivors still alive.

        While it waits, a survivor whose host dies is dropped (its replacement asked for) at once
        rather than found by the next world failing to form, and a replacement that arrives starts
        its process while the others are awaited (``on_lost(names)`` reports the dropped slices).
        ``on_wait(reason, waited_s)`` is called when waiting starts (``waited_s`` 0) and every
        ``REPORT_EVERY_S`` after. Growing never waits: the running world's size was already allowed.
        """
        t0, reported, survivors = time.perf_counter(), None, list(survivors)
        while True:
            waited = time.perf_counter() - t0
            timed_out = grow or waited > self.config.replacement_timeout_s
            decision = self.decide(survivors, timed_out=timed_out)
            if decision.action is not Action.WAIT:
                return decision, (waited if reported is not None else 0.0), survivors
            if reported is None or waited - reported >= REPORT_EVERY_S:
                on_wait(decision.reason, 0.0 if reported is None else waited)
                reported = waited
            time.sleep(WAIT_POLL_S)
            lost = self.backend.health.lost_hosts(survivors)
            if lost:
                names = [_name(r, survivors.index(r)) for r in lost]
                for res in lost:
                    survivors.remove(res)
                    self.drop(res)
                if on_lost is not None:
                    on_lost(names)
            self.backend.replenish([req.poll() for req in self.ready_replacements()], per_host=1)

    def take(self, survivors: list[Any], decision: NextWorld) -> tuple[list[Any], list[Any]]:
        """The members ``decision`` names: its survivors (in order) and up to ``decision.replacements``
        ready replacement slices, which stop being pending and become members at once (whatever
        fails before the world forms, :meth:`release` still gives them back). Returns (members, added)."""
        kept = survivors[: len(decision.survivors)]  # decisions keep a prefix: replica order is stable
        for res in survivors[len(kept) :]:  # trimmed: the world is full size without it
            self.drop(res, replace=False)
        warm_first = sorted(self.ready_replacements(), key=lambda r: not self.backend.warm([r.poll()]))
        taken = warm_first[: decision.replacements]  # as decided: cold ones only where no world forms without them
        added = [req.poll() for req in taken]
        self.members = kept + added
        for req in taken:
            self.replacements.remove(req)
        return list(self.members), added

    def drop(self, res: Any, *, replace: bool = True, quarantine: bool = False, alive: bool = False) -> None:
        """A slice left for good: free it (or, ``quarantine``, keep holding it until the run ends, so
        nothing of this run is placed there again), forget its snapshots, and (by default) ask for a
        replacement. A slice that leaves ``alive`` (warned) is freed once the next world has
        stepped (:meth:`replenish`): stopping its processes competes for the CPUs forming needs."""
        if res.slice_name:
            self.store.forget(res.slice_name)
        if alive:
            self.left.append(res)
        else:
            self._free(res, quarantine)
        if replace:
            # A pending slice placement group is what makes the autoscaler provision a new slice.
            self.replacements.append(self.backend.request_replacement())

    def _free(self, res: Any, quarantine: bool = False) -> None:
        if quarantine:
            self.quarantined.append(res)
        else:
            res.release()
        self.backend.discard(res)

    def split(
        self, lost: set[str], quarantined: frozenset[str] | set[str] = frozenset(), alive: frozenset[str] = frozenset()
    ) -> list[Any]:
        """After the current world: drop the ``lost`` slices (holding the ``quarantined`` ones,
        freeing the ``alive`` ones later: :meth:`drop`), return the others (replica order)."""
        survivors = []
        for i, res in enumerate(self.members):
            if _name(res, i) in lost:
                self.drop(res, quarantine=_name(res, i) in quarantined, alive=_name(res, i) in alive)
            else:
                survivors.append(res)
        return survivors

    def member_nodes(self) -> dict[str, list[str]]:
        """Per member slice, the nodes of its hosts (an unplaced bundle counts as a dead host)."""
        return {_name(res, i): res.node_ids() for i, res in enumerate(self.members)}

    def evidence(self, outcome: RunOutcome, now: float) -> Evidence:
        """What the failed world (or the one that failed to form) says about each of its slices."""
        world = self.world
        if world is None:  # forming failed: the slices it names, else any member may be the cause
            nodes = self.member_nodes()
            error = outcome.errors[0]
            kind = self.backend.health.error_kind(error)
            named = [n for n in getattr(error, "slices", ()) if n in nodes]
            if not named and kind in (ErrorKind.NODE_DIED, ErrorKind.PROCESS_DIED):
                kind = ErrorKind.ACTOR_DIED  # whose process it was is unknown: the node table decides
            return Evidence(
                {name: kind for name in named or nodes},
                nodes,
                list(nodes),
                len(self.worlds),
                self._vouched({name: kind for name in named or nodes}, self.members),
                origin=named[0] if named else None,
                unreadable_checkpoints=self._unreadable(outcome),
            )
        first = next(iter(outcome.errors), None)
        origin = world.slice_of(first) if first is not None else None
        if outcome.kind is OutcomeKind.HANG:
            hung = set(outcome.errors) or self.backend.health.unresponsive(world)  # the watchdog's, if it named any
            origin = world.slice_of(min(hung)) if hung else None
            # Nobody silent: the whole world is stuck (for example a collective that never completes).
            for p in hung or range(len(world.workers)):
                if not isinstance(outcome.errors.get(p), StuckProcess):  # a named stuck process keeps its account
                    outcome.errors[p] = TimeoutError(f"no step finished for {now - outcome.last_progress_at:.1f}s")
        kinds: dict[str, ErrorKind] = {}
        for p, e in outcome.errors.items():
            kinds.setdefault(world.slice_of(p), self.backend.health.error_kind(e))  # a TimeoutError is a hang
        names = list(world.plan.slice_names)
        # One host's death kills processes elsewhere (the JAX coordinator's host died: every process
        # aborts), and a survivor's death can reach us first. Every host of the world is looked at,
        # not only those that reported: one that stops answering is a suspect too.
        for name, res in zip(names, world.reservations):
            if name not in kinds and not self.backend.health.hosts_answer(res):
                kinds[name] = ErrorKind.ACTOR_DIED
        # A process named stuck answered the watchdog's probe a moment ago: its host lives.
        answered = {world.slice_of(p) for p, e in outcome.errors.items() if isinstance(e, StuckProcess)}
        # A hung process whose host's raylet does not answer either: the host hangs (or is gone). A
        # new process there would hang too, and Ray's own verdict on a host that accepts connections
        # but never replies waits for its health checks' timeouts: the slice is lost now.
        silent = frozenset(
            name
            for name, res in zip(names, world.reservations)
            if kinds.get(name) is ErrorKind.HANG and name not in answered and not self.backend.health.hosts_answer(res)
        )
        return Evidence(
            kinds,
            world.slice_node_ids(),
            names,
            world.plan.generation,
            self._vouched(kinds, world.reservations) | answered,
            origin=origin,
            unreadable_checkpoints=self._unreadable(outcome),
            silent=silent,
        )

    def _unreadable(self, outcome: RunOutcome) -> frozenset[Any]:
        steps = {unreadable_checkpoint(e) for e in outcome.errors.values()}
        return frozenset(s for s in steps if s is not None)

    def _vouched(self, kinds: dict[Any, Any], reservations: list[Any]) -> set[str]:
        """Slices whose process died while each of its hosts still answers: the hosts live, so the
        slice only crashed and no grace period for a node death needs to be spent."""
        crashed = [(i, r) for i, r in enumerate(reservations) if kinds.get(_name(r, i)) is ErrorKind.PROCESS_DIED]
        return {_name(r, i) for i, r in crashed if self.backend.health.hosts_answer(r)}

    # --------------------------------------------------------------- state
    def failure_evidence(
        self, seen: Any, outcome: RunOutcome, first: BaseException, saves: list[Any], ledger: Any
    ) -> FailureEvidence:
        """What the failure policy decides from: the world's evidence, node health, the run's progress."""
        return FailureEvidence(
            kinds=seen.kinds,
            dead_slices=self.backend.health.dead_slices(seen.slice_nodes, seen.suspects)
            | seen.silent,  # node health first: then blame code
            world_slices=seen.slices,
            error_text=self.backend.health.error_text(first),
            origin=seen.origin,
            forming=outcome.kind is OutcomeKind.FORMING_FAILED,
            steps_run=len(ledger.step_times),
            save_failed=self.backend.health.error_text(saves[0]) if saves else None,
            committed_step=ledger.committed_step,
            checkpoint_dir=self.config.checkpoint_dir,
        )

    def restore_plan(
        self, members: list[Any], resume: checkpoints.CheckpointInfo | None = None, last_step: int | None = None
    ) -> RestorePlan:
        """The newest state among ``members``' snapshots and the committed checkpoints (``resume``: the
        checkpoint the run starts from, the first world only; ``last_step``: the newest step the run
        has the metrics of, see :func:`~ray_elastic.decide.choose_restore`)."""
        # The first world after a takeover may load from a slice it did not reserve (any keeper serves).
        names = [r.slice_name for r in members if r.slice_name] + sorted(self.taken_over_slices)
        entries = self.store.entries(names)
        reported = self.store.latest_complete(names)
        let_go: dict[str, list[int]] = {}
        for i in self.backend.missing_snapshots([ref for *_, ref in entries], members):  # a keeper let go of it
            self.store.drop(*entries[i][:3])
            let_go.setdefault(entries[i][0], []).append(entries[i][2])
        directory, step = (self.checkpoints.start_dir, resume.restore_step) if resume else self.checkpoints.newest()
        held = self.store.latest_complete(names)
        plan = choose_restore(held, step, last_step)
        superseded = []
        if plan.source is RestoreSource.SNAPSHOT and step is not None and step > plan.step:
            superseded = self.checkpoints.set_aside_newer(directory, step, plan.step)
        # Why this source: the world_formed event carries it (a rewind must be explainable from the log).
        plan = dataclasses.replace(
            plan,
            evidence={
                "snapshot_steps": held,
                "reported_snapshot_steps": reported,
                "let_go": {k: sorted(v) for k, v in let_go.items()},
                "checkpoint_step": step,
                "superseded_checkpoints": superseded,
            },
        )
        if plan.source is RestoreSource.CHECKPOINT:
            plan = dataclasses.replace(plan, directory=directory)
        return plan

    # -------------------------------------------------------------- worlds
    def form(self, members: list[Any], restore: RestorePlan) -> WorldRecord:
        """Form the next generation on ``members``, loading the state ``restore`` names.

        Raises whatever forming raised; ``members`` are the members either way, so the
        controller can look at their hosts.
        """
        self.members = list(members)
        self.world = None
        self.store.drop_after(restore.step)  # steps after it are run again by this world
        self.last_restore = restore
        generation = len(self.worlds)
        donors: dict[str, str] = {}

        def from_snapshot(name: str) -> list[Any] | None:
            donor = restore.donor(name)
            if donor is None:
                return None
            donors[name] = donor
            return self.store.refs(donor, restore.step)

        world = self.backend.form(
            generation=generation,
            reservations=self.members,
            start_step=restore.step + 1,
            restore=from_snapshot,
            checkpoint_step=restore.step + 1 if restore.source is RestoreSource.CHECKPOINT else None,
            checkpoint_dir=restore.directory,
        )
        self.world = world
        record = WorldRecord(
            generation=generation,
            slices=list(world.plan.slice_names),
            mesh=world.plan.mesh_shape,
            global_batch_size=world.plan.global_batch_size,
            start_step=restore.step + 1,
            restore_source=restore.source,
            snapshot_donors=donors,
            times=dataclasses.asdict(world.times),
            restore_evidence=dict(restore.evidence),
        )
        self.worlds.append(record)
        return record

    def replenish(self) -> bool:
        """Once a world has stepped: free the slices that left alive, and start warm standby
        processes on member hosts that lack some; True once none lacks any."""
        left, self.left = self.left, []
        for res in left:
            self._free(res)
        return self.backend.replenish(self.members)

    def donors_released(self) -> bool:
        """The earlier driver's keepers this run did not take are freed once a world of this run
        holds a complete snapshot (until then a failure restores from them, not from a checkpoint)."""
        if not self.taken_over_slices:
            return True
        plan = self.world.plan if self.world is not None else None
        newest = self.store.latest_complete(list(plan.slice_names)) if plan is not None else {}
        if plan is None or not any(self.store.refs(n, s)[0].generation == plan.generation for n, s in newest.items()):
            return False
        self.taken_over_slices = set()
        self.backend.ownership.release_unclaimed()
        return True

    def release(self) -> None:
        """The run is over: stop every process, cancel pending requests, give every slice back."""
        if self.world is not None:
            self.world.teardown()
        self.backend.shutdown()
        for req in self.replacements:
            req.cancel()
        self.replacements = []
        for r in self.members + self.quarantined + self.left:
            try:
                r.release()
            except Exception as e:  # noqa: BLE001
                logger.debug("release reservation: %s", e)
