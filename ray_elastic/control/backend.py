"""The seam between the controller and the cluster: what a backend, its worlds, streams, slice
reservations and replacement requests offer. :class:`~ray_elastic.ray_backend.backend.RayBackend`
is the real one; ``tests/fake_backend.py`` scripts one. The controller and
:class:`~ray_elastic.control.generations.Generations` reach Ray only through these."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Protocol, Sequence

from ray_elastic.control.states import RunOutcome
from ray_elastic.decide import ErrorKind, WorldPlan


class Reservation(Protocol):
    """One reserved slice (a placement group over its hosts)."""

    slice_name: Optional[str]

    def node_ids(self) -> list[str]: ...

    def release(self) -> None: ...


def slice_name(reservation: Reservation, index: int) -> str:
    """A reserved slice's name; one that never joined a world has none yet: named by its position."""
    return reservation.slice_name or f"new-slice-{index}"


class ReplacementRequest(Protocol):
    """A slice asked for (pending demand for the autoscaler): ``poll`` gives it once placed."""

    def poll(self) -> Optional[Any]: ...

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
    total_s: float = 0.0
    standbys_used: int = 0
    processes_starting: int = 0  # taken before they had started (Python, JAX, data): forming waited for them
    compiled_from_cache: int = 0  # processes whose step came from the persistent cache (not compiled)
    snapshots_by_call: int = 0  # holders that could not map their keeper's ring: a call per snapshot

    def joined(self, joins: list[dict]) -> None:
        """What the processes' ``join_world`` said: the slowest of each phase."""
        self.jax_init_s = max(j["init_s"] for j in joins)
        self.chips_wait_s = max(j["chips_wait_s"] for j in joins)
        self.state_load_s = max(j["snapshot_fetch_s"] + j["state_s"] for j in joins)
        self.snapshots_by_call = sum(j["snapshots_in_place"] is False for j in joins)


class WorldHandle(Protocol):
    """One generation of the JAX world, formed on ``reservations`` (plan order)."""

    plan: WorldPlan
    workers: list
    reservations: list
    times: FormationTimes
    join_infos: list[dict]
    host_infos: list[dict]

    def slice_of(self, process_id: int) -> str: ...

    def slice_node_ids(self) -> dict[str, list[str]]: ...

    def teardown(self, confirm_s: float = 0.0) -> None: ...

    def finish_checkpoints(self, timeout_s: float, save_step: Optional[int] = None) -> list: ...


class Streams(Protocol):
    """Driving one world: its steps until done, a failure, a hang or a grow-back."""

    not_kept: list
    not_kept_count: int

    def run(self, start_step: int, end_step: int, grow_requested: Callable[[], bool]) -> RunOutcome: ...

    def drain(self, timeout_s: float, errors: dict) -> None: ...

    def take_snapshot_steps(self) -> list[int]: ...


class Backend(Protocol):
    """Slices, processes, worlds and failure evidence on one cluster."""

    # the cluster
    def connect(self, run_id: str, *, home: Optional[str] = None, findable: bool = True) -> None: ...

    # a rerun: the keepers an earlier driver of the run left (``TakenOver``), and the lease
    def take_over_keepers(self) -> list: ...

    def release_unclaimed_keepers(self) -> None: ...

    def confirm_owner(self) -> None: ...  # asks the keepers now; raises SupersededError when one refuses

    def hand_back_keepers(self) -> None: ...  # left unrenewed for a later rerun (this one is refused)

    @property
    def superseded(self) -> bool: ...

    @property
    def dropped_snapshots(self) -> int: ...

    def run_metrics(self, name: str) -> Any: ...

    def shutdown(self) -> None: ...

    # slices
    def reserve(self, count: int, on_wait: Optional[Callable[[int, int], None]] = None) -> list: ...

    def pending_demand(self) -> str: ...

    def request_replacement(self) -> ReplacementRequest: ...

    def replenish(
        self, members: list, per_host: Optional[int] = None, at_once: bool = False, for_world: Optional[int] = None
    ) -> bool: ...

    def warm(self, reservations: list, every: bool = False) -> bool: ...

    def discard(self, reservation: Any) -> None: ...

    def missing_snapshots(self, refs: list, members: Sequence = ()) -> set[int]: ...

    # worlds
    def form(
        self,
        *,
        generation: int,
        reservations: list,
        start_step: int,
        restore: Callable[[str], Optional[list]],
        checkpoint_step: Optional[int],
        checkpoint_dir: Optional[str] = None,
    ) -> WorldHandle: ...

    def drive(
        self,
        world: Any,
        store: Any,
        on_metrics: Callable[[dict], None],
        step_times: list[float],
        on_interval: Optional[Callable[[int, int], None]] = None,
        on_committed: Optional[Callable[[list], None]] = None,
        on_eval: Optional[Callable[[dict], bool]] = None,
        save_limit: Callable[[], float] = lambda: float("inf"),
        logged_step: Optional[Callable[[], int]] = None,
    ) -> Streams: ...

    # evidence
    def error_kind(self, error: BaseException) -> ErrorKind: ...

    def error_text(self, error: BaseException) -> str: ...

    def hosts_answer(self, reservation: Any) -> bool: ...

    def lost_hosts(self, reservations: list) -> list: ...

    def dead_slices(self, slice_nodes: dict[str, list[str]], suspects: set[str]) -> set[str]: ...

    def unresponsive(self, world: Any) -> set[int]: ...


class BackendFactory(Protocol):
    """What the controller is given: a backend's class (or a stand-in called as one). ``check_task``
    runs on the driver before any cluster resource is taken."""

    def __call__(self, task: Any, config: Any, address: Optional[str] = None) -> Backend: ...

    def check_task(self, task: Any, config: Any, resume: Any = None) -> None: ...
