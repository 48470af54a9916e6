"""A scripted stand-in for :class:`ray_elastic.ray_backend.backend.RayBackend`: no Ray, no JAX, milliseconds.

The controller, ``Generations`` and ``plan`` run for real; only the cluster is scripted:
slices are names with a node that is alive or dead, a world's steps are a loop that
reports a made-up loss and a snapshot per step, and faults fire before a given step
(``faults={step: fn(backend, world)}``) or while a world forms (``form_script``).
Install it with ``trainer.backend_cls = FakeBackend(...)``: it is called as the class would be.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import ClassVar

from ray_elastic.control.backend import FormationTimes
from ray_elastic.control.states import OutcomeKind, RunOutcome
from ray_elastic.decide import ErrorKind, is_snapshot_step
from ray_elastic.errors import CapacityTimeoutError, FormingError, ProcessFailed, StorageError, SupersededError
from ray_elastic.policy.snapshots import SnapshotCosts
from ray_elastic.state.snapshots import SnapshotRef


class ProcessDied(RuntimeError):
    """What a fake actor's death looks like (Ray's ``ActorDiedError`` in the real backend)."""


class NodeDied(ProcessDied):
    """An actor whose node died (Ray's ``ActorDiedError`` saying "because its node has died")."""


class TaskBug(ValueError):
    """An error raised by the task's own code."""


@dataclasses.dataclass
class FakeSpec:
    num_hosts: int = 1


class FakeReservation:
    def __init__(self, backend: FakeBackend, host: str):
        self.backend, self.host, self.spec = backend, host, FakeSpec()
        self.slice_name: str | None = None
        self.released = False

    def node_ids(self) -> list[str]:
        return [f"node-{self.host}"]

    def release(self) -> None:
        self.released = True
        self.backend.reserved.discard(self.host)
        self.backend.freed.append((self.host, len(self.backend.steps_run)))


class FakeRequest:
    """A pending replacement: ready once the cluster has a free live slice."""

    def __init__(self, backend: FakeBackend):
        self.backend = backend
        self.res: FakeReservation | None = None
        self.cancelled = False

    def poll(self) -> FakeReservation | None:
        if self.res is None:
            free = self.backend.free_slices()
            if free:
                self.res = self.backend.claim(free[0])
        return self.res

    def cancel(self) -> None:
        self.cancelled = True
        if self.res is not None:
            self.res.release()


class FakeWorld:
    def __init__(self, backend, plan, reservations, restored: dict):
        self.backend, self.plan, self.reservations = backend, plan, list(reservations)
        self.restored = restored  # slice -> step of the snapshot it loaded
        self.times = FormationTimes(
            start_actors_s=0.001, jax_init_s=0.001, state_load_s=0.001, compile_s=0.001, total_s=0.004
        )
        self.workers = list(range(plan.num_processes))
        self.join_infos = [{} for _ in self.workers]
        self.host_infos = [{"node_id": f"node-{r.host}", "pid": 0} for r in reservations]
        self.torn_down = False

    def slice_of(self, process_id: int) -> str:
        return self.plan.slice_names[process_id // self.plan.hosts_per_slice]

    def slice_node_ids(self) -> dict[str, list[str]]:
        return {self.slice_of(p): [info["node_id"]] for p, info in enumerate(self.host_infos)}

    def teardown(self, confirm_s: float = 0.0) -> None:
        self.torn_down = True

    def finish_checkpoints(self, timeout_s: float, save_step=None) -> list:
        self.backend.saved += 1
        if self.backend.finish_checkpoint_failures:  # a process dies while the in-flight save commits
            self.backend.finish_checkpoint_failures -= 1
            raise ProcessFailed(0, ProcessDied(f"process 0 of {self.plan.slice_names[0]} died while committing"))
        return []


class FakeStreams:
    def __init__(self, backend, world, store, on_metrics):
        self.backend, self.world, self.store, self.on_metrics = backend, world, store, on_metrics
        self.not_kept: list = []
        self.not_kept_count = 0

    def run(
        self,
        start_step: int,
        end_step: int,
        stop_requested: Callable[[], OutcomeKind | None],
        donors: dict[str, str] | None = None,
    ) -> RunOutcome:
        for step in range(start_step, end_step):
            if self.backend.superseded:  # the real lease thread kills the world's processes
                return RunOutcome(OutcomeKind.FAILURE, {0: ProcessDied("killed: a newer driver owns the run")})
            kind = stop_requested() if step > start_step else None
            if kind is not None:  # a planned stop: every holder snapshots the boundary step (as the real one)
                self._snapshot(step - 1)
                # a straggler confirmed by the checks still in flight while the world stopped
                self.backend.straggler = self.backend.straggler or getattr(self.backend, "straggler_at_stop", None)
                return RunOutcome(kind, {}, time.time())
            fault = self.backend.faults.pop(step, None)
            if fault is not None:
                outcome = fault(self.backend, self.world)
                if outcome is not None:
                    return outcome
            self.backend.steps_run.append((self.world.plan.generation, step))
            self.on_metrics({"step": step, "loss": 1.0 / (step + 1), "step_time_s": 0.001})
            if is_snapshot_step(step, self.backend.config.snapshot_policy.interval(SnapshotCosts())):
                self._snapshot(step)
        return RunOutcome(OutcomeKind.DONE)

    def _snapshot(self, step: int) -> None:
        for p in range(self.world.plan.num_processes):
            if self.world.plan.takes_snapshots(p):
                self.store.add(self.world.slice_of(p), 0, step, SnapshotRef(None, self.world.plan.generation, step))

    def drain(self, timeout_s: float, errors: dict) -> None:
        pass

    def take_snapshot_steps(self) -> list[int]:
        return []

    def take_straggler(self):
        """A straggler the backend measured (``FakeBackend.straggle``), once."""
        found, self.backend.straggler = self.backend.straggler, None
        return found

    def take_mismatch(self):
        """Replicas found to disagree (``FakeBackend.mismatch``), once."""
        found, self.backend.mismatch = getattr(self.backend, "mismatch", None), None
        return found


class FakeBackend:
    """A cluster of named one-host slices; ``spare`` of them start unreserved."""

    def __init__(self, slices: int = 3, *, faults: dict | None = None, form_script: list | None = None):
        self.hosts = [f"s{i}" for i in range(slices)]
        self.alive = set(self.hosts)
        self.hung: set[str] = set()
        self.reserved: set[str] = set()
        self.freed: list[tuple[str, int]] = []  # (host, steps run by then) per reservation given back
        self.faults = dict(faults or {})
        self.form_script = list(form_script or [])  # per forming attempt: None (form) or fn(backend) that raises
        self.formed: list[FakeWorld] = []
        self.saved = 0  # finish_checkpoints calls (the in-flight save, the final one)
        self.form_attempts = 0
        self.steps_run: list[tuple[int, int]] = []
        self.requests: list[FakeRequest] = []
        self.suspects_seen: list[set] = []  # per failure, the slices worth a grace period
        self.warms_after = 0  # a host's standby is warm after this many ``warm`` checks since it started
        self.standby_checks: dict[str, int] = {}  # host -> checks since its standby started
        self.config = None
        self.finish_checkpoint_failures = 0  # finish_checkpoints calls that fail with a dead process
        self.warned: dict[str, float | None] = {}  # host -> its drain deadline (``warn``)
        self.straggler = None  # a decide.Straggler the streams report once (``straggle``)

    def check_task(self, task, config, resume=None) -> None:
        """No JAX runs here: the fake slices never build the task's model."""

    def __call__(self, task, config, address=None) -> FakeBackend:  # stands in for the class
        self.config = config
        return self

    # cluster changes a test script makes
    def add_slice(self) -> str:
        name = f"s{len(self.hosts)}"
        self.hosts.append(name)
        self.alive.add(name)
        return name

    def kill(self, name: str) -> None:
        self.alive.discard(name)

    def free_slices(self) -> list[str]:
        """Live, unreserved and not warned (Ray schedules nothing on a draining node)."""
        return [h for h in self.hosts if h in self.alive and h not in self.reserved and h not in self.warned]

    def claim(self, host: str) -> FakeReservation:
        self.reserved.add(host)
        return FakeReservation(self, host)

    # the backend interface; the fake is its own ownership (RunOwnership) and cluster health (ClusterHealth)
    superseded = False
    dropped_snapshots = 0

    @property
    def ownership(self) -> FakeBackend:
        return self

    @property
    def health(self) -> FakeBackend:
        return self

    left_behind: ClassVar[list] = []  # TakenOver s a test leaves for the run to take over (a lost driver's keepers)
    released_after_steps: int | None = None  # how many steps had run when they were released

    def take_over(self) -> list:
        return list(self.left_behind)

    def release_unclaimed(self) -> None:
        if self.released_after_steps is None:
            self.released_after_steps = len(self.steps_run)

    def hand_back(self) -> None:
        pass

    def confirm(self) -> None:
        if self.superseded:
            raise SupersededError("another driver took this run over")

    def connect(self, run_id: str, *, home=None, findable=True) -> None:
        pass

    def run_metrics(self, name: str):
        return None

    def pending_demand(self) -> str:
        return f"{len(self.requests)} replacement request(s)"

    def reserve(self, count: int, on_wait=None) -> list[FakeReservation]:
        free = self.free_slices()
        if len(free) < count:
            raise CapacityTimeoutError(f"could not reserve {count} slices: {len(free)} free")
        return [self.claim(h) for h in free[:count]]

    def request_replacement(self) -> FakeRequest:
        self.requests.append(FakeRequest(self))
        return self.requests[-1]

    def lost_hosts(self, reservations) -> list:
        return [r for r in reservations if r.host not in self.alive]

    def replenish(self, members, per_host=None, at_once=False, for_world=None) -> bool:
        for r in members:
            self.standby_checks.setdefault(r.host, 0)
        return True

    def warm(self, reservations, every=False) -> bool:
        hosts = [r.host for r in reservations]
        for h in hosts:
            if h in self.standby_checks:
                self.standby_checks[h] += 1
        return all(self.standby_checks.get(h, 0) > self.warms_after for h in hosts)

    def discard(self, reservation) -> None:
        pass

    def form(self, *, generation, reservations, start_step, restore, checkpoint_step, checkpoint_dir=None):
        self.form_attempts += 1
        action = self.form_script.pop(0) if self.form_script else None
        if action is not None:
            action(self)
        for r in reservations:
            if r.host not in self.alive:
                raise ProcessDied(f"host of {r.host} is dead")
            r.slice_name = r.host
        names = [r.slice_name for r in reservations]
        plan = self.config.world_plan(generation, names)
        restored = {}
        for n in names:
            refs = restore(n)
            if refs is not None:
                restored[n] = refs[0].step
        world = FakeWorld(self, plan, reservations, restored)
        self.formed.append(world)
        return world

    def missing_snapshots(self, refs, members=()) -> set:
        return set()  # the store is the truth here

    def drive(self, world, store, sink) -> FakeStreams:
        return FakeStreams(self, world, store, sink.add)

    def error_text(self, error: BaseException) -> str:
        return str(error).splitlines()[0][:300] if str(error) else ""

    def error_kind(self, error: BaseException) -> ErrorKind:
        if isinstance(error, FormingError):
            return self.error_kind(error.cause)  # as health.error_kind
        if isinstance(error, StorageError):
            return ErrorKind.STORAGE
        if isinstance(error, NodeDied):
            return ErrorKind.NODE_DIED
        if isinstance(error, ProcessDied):
            return ErrorKind.PROCESS_DIED  # as Ray reports a SIGKILLed process, whether or not its host lives
        if isinstance(error, TimeoutError):
            return ErrorKind.HANG  # as health.error_kind
        return ErrorKind.TASK_ERROR

    def dead_slices(self, slice_nodes: dict, suspects: set) -> set[str]:
        self.suspects_seen.append(set(suspects))
        alive = {f"node-{h}" for h in self.alive}
        return {s for s, nodes in slice_nodes.items() if any(n not in alive for n in nodes)}

    def hosts_answer(self, reservation) -> bool:
        return reservation.host in self.alive

    def draining(self) -> dict:
        """Hosts warned they will be taken (``warn``): node id -> (deadline, reason)."""
        return {f"node-{h}": (deadline, "preemption") for h, deadline in self.warned.items()}

    def warn(self, host: str, notice_s: float | None = 30.0) -> None:
        """A preemption notice for ``host`` (as a drained Ray node)."""
        self.warned[host] = None if notice_s is None else time.time() + notice_s

    def unresponsive(self, world) -> set[int]:
        return {p for p in range(world.plan.num_processes) if world.slice_of(p) in self.hung}

    def shutdown(self) -> None:
        pass


# Faults, as ``faults={step: ...}`` values.
def lose_slice(index: int):
    """The host of the world's slice ``index`` dies (its process with it)."""

    def fire(backend, world):
        backend.kill(world.plan.slice_names[index])
        return RunOutcome(OutcomeKind.FAILURE, {index: ProcessDied("actor died")})

    return fire


def crash_process(index: int):
    """Slice ``index``'s process dies; its host lives."""

    def fire(backend, world):
        return RunOutcome(OutcomeKind.FAILURE, {index: ProcessDied("actor died")})

    return fire


def lose_coordinator_survivor_reports_first(survivor: int):
    """Slice 0's host dies; the JAX processes elsewhere abort with it, and ``survivor``'s death is
    the first (and only) error seen."""

    def fire(backend, world):
        backend.kill(world.plan.slice_names[0])
        return RunOutcome(OutcomeKind.FAILURE, {survivor: ProcessDied("actor died")})

    return fire


def hang_slice(index: int):
    def fire(backend, world):
        backend.hung.add(world.plan.slice_names[index])
        return RunOutcome(OutcomeKind.HANG)

    return fire


def task_bug(index: int = 0):
    def fire(backend, world):
        return RunOutcome(OutcomeKind.FAILURE, {index: TaskBug("bug in the loss")})

    return fire


def warn_slice(index: int, notice_s: float | None = 30.0):
    """A preemption notice for the world's slice ``index`` (its host drained); the step runs."""

    def fire(backend, world):
        backend.warn(world.plan.slice_names[index], notice_s)

    return fire


def straggle(index: int, slowdown: float = 5.0):
    """The world's slice ``index`` measured as a straggler: every step waits for it (the step runs)."""

    def fire(backend, world):
        from ray_elastic.decide.stragglers import Straggler

        period = 0.1 * slowdown
        backend.straggler = Straggler(
            world.plan.slice_names[index], index, period, period - 0.1, (period - 0.1) / 0.1, False, 20
        )

    return fire


def add_capacity(backend, world):
    """A replacement slice is provisioned (no fault: the step runs)."""
    backend.add_slice()
    return None
