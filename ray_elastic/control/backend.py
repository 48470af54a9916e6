"""The seam between the controller and the cluster: what a backend, its worlds, streams, slice
reservations and replacement requests offer. :class:`~ray_elastic.ray_backend.backend.RayBackend`
is the real one; ``tests/fake_backend.py`` scripts one. The controller and
:class:`~ray_elastic.control.generations.Generations` reach Ray only through these."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ray_elastic.control.states import OutcomeKind, RunOutcome
from ray_elastic.decide import ErrorKind, WorldPlan
from ray_elastic.decide.integrity import Mismatch
from ray_elastic.decide.stragglers import Straggler


class Reservation(Protocol):
    """One reserved slice (a placement group over its hosts)."""

    slice_name: str | None

    def node_ids(self) -> list[str]: ...

    def release(self) -> None: ...


def slice_name(reservation: Reservation, index: int) -> str:
    """A reserved slice's name; one that never joined a world has none yet: named by its position."""
    return reservation.slice_name or f"new-slice-{index}"


class ReplacementRequest(Protocol):
    """A slice asked for (pending demand for the autoscaler): ``poll`` gives it once placed."""

    def poll(self) -> Any | None: ...

    def cancel(self) -> None: ...


@dataclasses.dataclass
class FormationTimes:
    """Seconds spent in each phase of forming a world (for events and goodput)."""

    start_actors_s: float = 0.0
    jax_init_s: float = 0.0
    state_load_s: float = 0.0
    compile_s: float = 0.0  # trace + lower + load, slowest process
    trace_s: float = 0.0
    lower_s: float = 0.0
    load_s: float = 0.0  # XLA compile, or loading from the persistent cache
    chips_wait_s: float = 0.0  # a host's previous TPU owner still exiting (slowest process)
    # The driver's own clock over joining and compiling: the processes' phases above run inside
    # them, so what these add is waiting (a call queued behind a standby's work, a keeper busy).
    join_wall_s: float = 0.0
    compile_wall_s: float = 0.0
    total_s: float = 0.0
    standbys_used: int = 0
    processes_starting: int = 0  # taken before they had started (Python, JAX, data): forming waited for them
    compiled_from_cache: int = 0  # processes whose step came from the persistent cache (not compiled)
    snapshots_by_call: int = 0  # holders that could not map their keeper's ring: a call per snapshot

    def joined(self, joins: list[dict[Any, Any]]) -> None:
        """What the processes' ``join_world`` said: the slowest of each phase."""
        self.jax_init_s = max(j["init_s"] for j in joins)
        self.chips_wait_s = max(j["chips_wait_s"] for j in joins)
        self.state_load_s = max(j["snapshot_fetch_s"] + j["state_s"] for j in joins)
        self.snapshots_by_call = sum(j["snapshots_in_place"] is False for j in joins)


class WorldHandle(Protocol):
    """One generation of the JAX world, formed on ``reservations`` (plan order)."""

    plan: WorldPlan
    workers: list[Any]
    reservations: list[Any]
    times: FormationTimes
    join_infos: list[dict[Any, Any]]
    host_infos: list[dict[Any, Any]]

    def slice_of(self, process_id: int) -> str: ...

    def slice_node_ids(self) -> dict[str, list[str]]: ...

    def teardown(self, confirm_s: float = 0.0) -> None: ...

    def finish_checkpoints(self, timeout_s: float, save_step: int | None = None) -> list[Any]: ...


class StepSink(Protocol):
    """Where a driven world's steps go (the run's :class:`~ray_elastic.observe.step_ledger.StepLedger`):
    their metrics, evals, committed saves and snapshot intervals, and what the drive reads back."""

    step_times: list[float]  # every step run, rewound ones too (the watchdog, the snapshot policy)
    logged_step: int  # the newest step in the event log: keepers are told no step past it

    def add(self, metrics: dict[Any, Any]) -> None: ...

    def add_eval(self, item: dict[Any, Any]) -> bool: ...  # with {"step": s} alone: whether s's eval is known

    def saves_committed(self, finished: list[Any]) -> None: ...

    def save_limit_s(self) -> float: ...  # how long a checkpoint save may run

    def snapshot_interval(self, step: int, every: int) -> None: ...  # the interval from ``step`` on


class Streams(Protocol):
    """Driving one world: its steps until done, a failure, a hang or a planned stop (a grow-back, warned slices leaving)."""

    not_kept: list[Any]
    not_kept_count: int

    def run(
        self,
        start_step: int,
        end_step: int,
        stop_requested: Callable[[], OutcomeKind | None],
        donors: dict[str, str] | None = None,
    ) -> RunOutcome: ...

    def drain(self, timeout_s: float, errors: dict[Any, Any]) -> None: ...

    def take_straggler(self) -> Straggler | None: ...

    def take_mismatch(self) -> Mismatch | None: ...

    def take_snapshot_steps(self) -> list[int]: ...


class RunOwnership(Protocol):
    """This driver's hold on the run through its hosts' snapshot keepers (which outlive a lost
    driver): a rerun takes them over, and a driver that a newer one superseded stops."""

    @property
    def superseded(self) -> bool: ...

    @property
    def dropped_snapshots(self) -> int: ...  # taken over, but of another model or settings

    def take_over(self) -> list[Any]: ...  # the keepers an earlier driver left (``TakenOver``); the lease starts

    def release_unclaimed(self) -> None: ...

    def confirm(self) -> None: ...  # asks the keepers now; raises SupersededError when one refuses

    def hand_back(self) -> None: ...  # left unrenewed for a later rerun (this one is refused)


class ClusterHealth(Protocol):
    """What the cluster says about a failure: the kind of an error, which hosts and slices are gone,
    which processes do not answer; and which hosts are warned they will go (``draining``: node id ->
    (deadline, reason))."""

    def error_kind(self, error: BaseException) -> ErrorKind: ...

    def error_text(self, error: BaseException) -> str: ...

    def hosts_answer(self, reservation: Reservation) -> bool: ...

    def lost_hosts(self, reservations: list[Reservation]) -> list[Reservation]: ...

    def dead_slices(self, slice_nodes: dict[str, list[str]], suspects: set[str]) -> set[str]: ...

    def unresponsive(self, world: WorldHandle) -> set[int]: ...

    def draining(self) -> dict[str, tuple[float | None, str]]: ...


class Backend(Protocol):
    """Slices, processes and worlds on one cluster; the run's ownership (``ownership``, set by
    ``connect``) and what the cluster says of a failure (``health``)."""

    @property
    def ownership(self) -> RunOwnership: ...

    @property
    def health(self) -> ClusterHealth: ...

    def connect(self, run_id: str, *, home: str | None = None, findable: bool = True) -> None: ...

    def run_metrics(self, name: str) -> Any: ...

    def shutdown(self) -> None: ...

    # slices
    def reserve(self, count: int, on_wait: Callable[[int, int], None] | None = None) -> list[Reservation]: ...

    def pending_demand(self) -> str: ...

    def request_replacement(self) -> ReplacementRequest: ...

    def replenish(
        self,
        members: list[Reservation],
        per_host: int | None = None,
        at_once: bool = False,
        for_world: int | None = None,
    ) -> bool: ...

    def warm(self, reservations: list[Reservation], every: bool = False) -> bool: ...

    def discard(self, reservation: Reservation) -> None: ...

    def missing_snapshots(self, refs: list[Any], members: Sequence[Reservation] = ()) -> set[int]: ...

    # worlds
    def form(
        self,
        *,
        generation: int,
        reservations: list[Reservation],
        start_step: int,
        restore: Callable[[str], list[Any] | None],
        checkpoint_step: int | None,
        checkpoint_dir: str | None = None,
    ) -> WorldHandle: ...

    def drive(self, world: WorldHandle, store: Any, sink: StepSink) -> Streams: ...


class BackendFactory(Protocol):
    """What the controller is given: a backend's class (or a stand-in called as one). ``check_task``
    runs on the driver before any cluster resource is taken."""

    def __call__(self, task: Any, config: Any, address: str | None = None) -> Backend: ...

    def check_task(self, task: Any, config: Any, resume: Any = None) -> None: ...
