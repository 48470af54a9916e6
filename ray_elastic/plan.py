"""Pure decisions about a world: no Ray, no JAX, callable from tests without a cluster.

A *world* is one generation of the multi-process JAX program: an ordered list of
slices, one process per slice host. Everything that must agree between the
controller and every worker (process ids, mesh shape, which rows of the global
batch a process feeds, how parameters are split) is decided here, once.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import statistics
from typing import Optional, Sequence

from ray_elastic.layout import FSDP_AXIS, REPLICA_AXIS, resolve_slice_mesh

__all__ = ["FSDP_AXIS", "REPLICA_AXIS", "WorldPlan", "plan_world"]


@dataclasses.dataclass(frozen=True)
class WorldPlan:
    """The layout of one generation.

    Attributes:
        generation: 0 for the first world, +1 for every re-formation.
        slice_names: slices in replica order (replica i = slice_names[i]).
        hosts_per_slice: processes per slice.
        devices_per_host: JAX devices per process.
        global_batch_size: examples per step in this world.
    """

    generation: int
    slice_names: tuple[str, ...]
    hosts_per_slice: int
    devices_per_host: int
    global_batch_size: int
    data_stride: int = 0  # examples per step in the data order (the full-size batch); 0 = global_batch_size
    lr_scale: float = 1.0
    snapshot_slices: int = 0  # the first this many slices yield snapshots
    slice_axes: tuple[tuple[str, int], ...] = ()  # the slice's mesh axes (``layout.resolve_slice_mesh``); () = all fsdp
    microbatch_size: int = 0  # examples per device per microbatch (gradient accumulation); 0 = one batch per step

    @property
    def stride(self) -> int:
        return self.data_stride or self.global_batch_size

    def takes_snapshots(self, process_id: int) -> bool:
        return process_id // self.hosts_per_slice < self.snapshot_slices

    @property
    def num_slices(self) -> int:
        return len(self.slice_names)

    @property
    def num_processes(self) -> int:
        return self.num_slices * self.hosts_per_slice

    @property
    def mesh_shape(self) -> dict[str, int]:
        """``replica`` across slices (data parallel over DCN), then the slice's own axes (ICI)."""
        return {REPLICA_AXIS: self.num_slices, **dict(self.slice_axes or ((FSDP_AXIS, self.devices_per_slice),))}

    @property
    def devices_per_slice(self) -> int:
        return self.hosts_per_slice * self.devices_per_host

    @property
    def data_parallel(self) -> int:
        """Devices that each take their own rows of the batch: ``replica`` x ``fsdp``."""
        return self.num_slices * self.mesh_shape[FSDP_AXIS]

    @property
    def per_device_batch(self) -> int:
        return self.global_batch_size // self.data_parallel

    @property
    def num_microbatches(self) -> int:
        """Microbatches per step: more when a smaller world keeps the global batch, so each
        device's microbatch (and its activation memory) stays the same size."""
        return self.per_device_batch // self.microbatch_size if self.microbatch_size else 1

    def process_id(self, slice_index: int, host_index: int) -> int:
        """Processes are numbered slice-major, so a slice's devices are contiguous in the mesh."""
        return slice_index * self.hosts_per_slice + host_index

    @property
    def rows_per_process(self) -> int:
        return self.global_batch_size // self.num_processes

    def process_rows(self, process_id: int) -> tuple[int, int]:
        """Half-open range of global-batch rows that ``process_id`` feeds every step.

        The batch is split over (replica, fsdp) in mesh order, and process p owns
        mesh columns [p * devices_per_host, (p + 1) * devices_per_host) of its slice,
        so its rows are one contiguous block.
        """
        n = self.rows_per_process
        return process_id * n, (process_id + 1) * n


def plan_world(
    generation: int,
    slice_names: Sequence[str],
    hosts_per_slice: int,
    devices_per_host: int,
    global_batch_size: int,
    data_stride: int = 0,
    lr_scale: float = 1.0,
    snapshot_slices: int = 0,
    slice_mesh: Optional[dict] = None,
    microbatch_size: int = 0,
) -> WorldPlan:
    """Lay out a world, refusing layouts that cannot split the batch evenly.

    ``slice_mesh``: the slice's axes and sizes (``-1``: the rest), default all ``fsdp``."""
    if not slice_names:
        raise ValueError("a world needs at least one slice")
    axes = resolve_slice_mesh(slice_mesh or {FSDP_AXIS: -1}, hosts_per_slice * devices_per_host, devices_per_host)
    plan = WorldPlan(
        generation, tuple(slice_names), hosts_per_slice, devices_per_host, global_batch_size,
        data_stride, lr_scale, min(snapshot_slices, len(slice_names)), axes, microbatch_size or 0,
    )
    fsdp = plan.mesh_shape[FSDP_AXIS]
    if global_batch_size % plan.data_parallel:
        raise ValueError(
            f"global batch {global_batch_size} does not split over {plan.num_slices} slice(s) x "
            f"{fsdp} fsdp device(s)"
        )
    if microbatch_size and plan.per_device_batch % microbatch_size:
        raise ValueError(
            f"microbatch_size={microbatch_size} does not divide the per-device batch {plan.per_device_batch} of a "
            f"world of {plan.num_slices} slice(s) (global batch {global_batch_size} over {plan.data_parallel} "
            f"data-parallel devices)")
    return plan


# --------------------------------------------------------------------------- batch policy
def batch_for_world(num_active: int, num_total: int, global_batch_size: int, policy: str) -> int:
    """Global batch of a world of ``num_active`` slices.

    ``constant``: unchanged, survivors take larger shares (the mathematics is the same).
    ``scale``: proportional to active slices, as pathwaysutils' ``scale_by_active_slices``
    (exact for ints: an error if it does not divide).
    """
    if policy == "constant":
        return global_batch_size
    scaled, rem = divmod(global_batch_size * num_active, num_total)
    if rem:
        raise ValueError(f"global batch {global_batch_size} x {num_active}/{num_total} is not an integer")
    return scaled


def lr_scale(num_active: int, num_total: int, rule) -> float:
    """Multiplier on the optimizer's updates under the ``scale`` policy (None: 1.0)."""
    if rule is None:
        return 1.0
    frac = num_active / num_total
    return frac if rule == "linear" else frac**0.5


def is_snapshot_step(step: int, every: int) -> bool:
    """Snapshots are taken after steps every-1, 2*every-1, ... (after every step when every=1; never when 0)."""
    return every > 0 and (step + 1) % every == 0


MAX_SNAPSHOT_EVERY = 1000  # the longest interval "auto" picks


def snapshot_interval(snapshot_s: list[float], step_s: list[float], budget: float, current: int = 1,
                      max_every: int = MAX_SNAPSHOT_EVERY, step_cost: Optional[float] = None) -> int:
    """``snapshot_every="auto"``: the smallest interval at which snapshots cost at most ``budget`` of
    the run's time. A snapshot costing ``c`` seconds every ``k`` steps of ``t`` seconds costs
    ``c / (k t)``; ``c`` is the larger of what it cost its process (see ``SnapshotWriter``: host copy
    and hand-over to the keeper, and any wait of the step loop) and what it cost the steps
    (``step_cost``, :func:`snapshot_cost_in_steps`). Medians of the recent measurements; ``current``
    until both exist, and while the new interval is within an eighth of it. The rewind this allows
    is at most ``k - 1`` steps."""
    if not snapshot_s or not step_s:
        return current
    c, t = max(statistics.median(snapshot_s), step_cost or 0.0), statistics.median(step_s)
    if t <= 0:
        return current
    every = max(1, min(max_every, math.ceil(c / (budget * t) - 1e-9)))
    return current if abs(every - current) <= current // 8 else every  # noise does not flip it every chunk


SNAPSHOT_SPREAD = 4  # steps from a snapshot on that its copies may slow (it is written in the background)


def snapshot_cost_in_steps(timed: Sequence[tuple[int, float]], every: int, spread: int = SNAPSHOT_SPREAD,
                           min_samples: int = 3) -> Optional[float]:
    """What one snapshot taken every ``every`` steps costs the step loop, read from the step times
    ``timed`` ((step, seconds) pairs): the extra time of the ``spread`` steps from a snapshot step
    on, over the median of the steps farther from one (per distance, medians: a stray slow step
    is not a snapshot). It sees what the writing process's own clock cannot: the keeper's and
    the object store's copies and the memory traffic on the cores the step shares (on the large
    bench model, 2026-12-02, it agreed with the writer: ~0.07-0.10 s, all on the step after the
    snapshot step). None while it cannot tell (an interval too short to leave steps without a
    snapshot near, or too few steps)."""
    if every < spread + 2:
        return None
    near: list[list[float]] = [[] for _ in range(spread)]
    far: list[float] = []
    for step, seconds in timed:
        d = (step + 1) % every  # 0: the snapshot step itself (its state is copied after it)
        (near[d] if d < spread else far).append(seconds)
    if min(map(len, near)) < min_samples or len(far) < min_samples * 2:
        return None
    base = statistics.median(far)
    return max(0.0, sum(statistics.median(ts) - base for ts in near))


def newest_snapshot_step(step: int, every: int) -> int:
    """The newest step at or before ``step`` after which a snapshot is taken (-1: none)."""
    return step - (step + 1) % every if every > 0 else -1


def newest_due_snapshot(step: int, intervals: list[tuple[int, int]]) -> int:
    """The newest step at or before ``step`` after which a snapshot was due, given the intervals
    a world ran with (``(first step, interval)`` from each change on, oldest first; -1: none).

    Each interval counts from step 0 (``is_snapshot_step``) but holds only from its first step:
    after a change from 11 to 8 at step 60, step 60's newest is 54, not 55."""
    for i in range(len(intervals) - 1, -1, -1):
        first, every = intervals[i]
        last = step if i + 1 == len(intervals) else min(step, intervals[i + 1][0] - 1)
        if last >= first and (due := newest_snapshot_step(last, every)) >= first:
            return due
    return -1


def is_eval_step(step: int, every: int, final_step: int) -> bool:
    """Evaluations run after steps every-1, 2*every-1, ... and after the last step (never when 0)."""
    return every > 0 and ((step + 1) % every == 0 or step == final_step)


def is_checkpoint_step(step: int, every: int, final_step: int) -> bool:
    """Checkpoint after steps every-1, 2*every-1, ... and after the run's last step."""
    return (step + 1) % every == 0 or step == final_step


# --------------------------------------------------------------------------- failures
class ErrorKind(enum.StrEnum):
    """What an error from a slice process says about its slice."""

    ACTOR_DIED = "actor_died"  # the process is gone (its node may or may not be)
    PROCESS_DIED = "process_died"  # Ray says the worker process died; its host was alive then
    NODE_DIED = "node_died"  # Ray says the process's node died
    UNAVAILABLE = "unavailable"  # maybe dead: node health decides
    SLICE_DOWN = "slice_down"  # JAX reported a lost peer (pathwaysutils' slice-down statuses)
    STORAGE = "storage"  # a checkpoint could not be read or written: the storage's fault, not the host's
    HANG = "hang"  # no step finished and the process did not answer a probe
    TASK_ERROR = "task_error"  # the task's own code raised


class Action(enum.StrEnum):
    """The controller's next move after a failure or when capacity returns."""

    FORM = "form"
    WAIT = "wait"
    FAIL = "fail"


class RestoreSource(enum.StrEnum):
    SNAPSHOT = "snapshot"  # in-memory, from living slices
    CHECKPOINT = "checkpoint"  # the newest committed Orbax checkpoint
    FRESH = "fresh"  # nothing survived (or the first run): fresh parameters


@dataclasses.dataclass(frozen=True)
class FailureVerdict:
    """What a failure means for the world.

    lost_slices leave the world (a host is dead or hung); crashed_slices lost a
    process but their hosts are healthy, so they can host the next generation.
    """

    lost_slices: tuple[str, ...]
    crashed_slices: tuple[str, ...]
    recoverable: bool
    reason: str
    training_code: bool = False  # the task's own code raised: a bug, never retried
    quarantined: tuple[str, ...] = ()  # lost slices whose hosts live but keep failing: held, never reused


def classify_failure(
    *,
    errors: dict[str, ErrorKind],
    dead_slices: set[str],
    world_slices: Sequence[str],
    error_text: str = "",
) -> FailureVerdict:
    """Decide which slices are lost from per-slice error kinds and node health.

    Args:
        errors: slice name -> kind of the worst error seen on it.
        dead_slices: slices with a host that Ray reports dead (or that was hung: SIGSTOPped
            hosts stop answering and are marked dead the same way). A ``node_died`` error
            counts too: Ray said so before its node table did.
        world_slices: the slices of the failed world.
        error_text: the first error's text, for the reason.

    A process that died while its node lives is collateral (for example killed when
    the coordination process died): its slice is healthy. A ``task_error`` is user
    code failing, not a slice: not recoverable by re-forming the world, unless
    something else died too (a lost slice, a dead or hung process, a slice-down
    error): then the peers' errors are collateral, whatever their text says.
    """
    dead_slices = set(dead_slices) | {s for s, k in errors.items() if k is ErrorKind.NODE_DIED}
    lost = tuple(s for s in world_slices if s in dead_slices)
    crashed = tuple(s for s in world_slices if s in errors and s not in dead_slices)
    deaths = lost or any(k is not ErrorKind.TASK_ERROR for k in errors.values())
    user = [] if deaths else [s for s, k in errors.items() if k is ErrorKind.TASK_ERROR]
    if user:
        return FailureVerdict(lost, crashed, False, f"training code failed on slice {user[0]}: {error_text}", True)
    if not errors and not lost:
        return FailureVerdict((), (), False, "no failure to recover from")
    what = f"lost slice(s) {', '.join(lost)}" if lost else f"process failure on {', '.join(crashed)}"
    return FailureVerdict(lost, crashed, True, what)


HOST_FAULTS = (ErrorKind.PROCESS_DIED, ErrorKind.ACTOR_DIED, ErrorKind.UNAVAILABLE, ErrorKind.HANG)


def drop_repeat_offender(verdict: FailureVerdict, *, origin: Optional[str], previous_origin: Optional[str],
                         progressed: bool, origin_kind: Optional[ErrorKind] = ErrorKind.PROCESS_DIED) -> FailureVerdict:
    """A slice whose process failed first in two failures in a row, with no step finished in between,
    is lost even though its host answers: a host that fails the same way in every generation would
    otherwise be re-formed forever. It is also quarantined: its reservation stays held, so the
    replacement asked for cannot be placed on the same hosts again."""
    if progressed or origin is None or origin != previous_origin or origin not in verdict.crashed_slices:
        return verdict
    if origin_kind not in HOST_FAULTS:  # storage or a peer's collective error: not this host's doing
        return verdict
    return dataclasses.replace(
        verdict, lost_slices=verdict.lost_slices + (origin,), quarantined=verdict.quarantined + (origin,),
        crashed_slices=tuple(s for s in verdict.crashed_slices if s != origin),
        reason=f"slice {origin} failed twice in a row without a step finished: dropped ({verdict.reason})")


@dataclasses.dataclass(frozen=True)
class NextWorld:
    """The controller's next move after a failure: form a world, wait for capacity, or fail."""

    action: Action
    survivors: tuple[str, ...] = ()  # the slices that stay, in replica order
    replacements: int = 0  # ready replacement slices to add
    reason: str = ""

    @property
    def size(self) -> int:
        return len(self.survivors) + self.replacements


def decide_next_world(
    *,
    mode: str,
    survivors: Sequence[str],
    ready_replacements: int,
    num_slices: int,
    min_slices: int,
    timed_out: bool = False,
    fallback_to_resize: bool = False,
) -> NextWorld:
    """Which slices form the next world (survivors first, so replica order is stable)."""
    survivors = tuple(survivors)
    need = max(0, num_slices - len(survivors))
    add = min(need, ready_replacements)
    if len(survivors) + add >= num_slices:
        return NextWorld(Action.FORM, survivors[:num_slices], add, "full size")
    can_resize = mode == "replica-resize" or (timed_out and fallback_to_resize)
    if can_resize and len(survivors) + add >= min_slices:
        return NextWorld(Action.FORM, survivors, add, f"resize to {len(survivors) + add} of {num_slices} slices")
    if timed_out:  # never below min_slices forever: replica-resize waits as long as pause-and-resume
        have = f"only {len(survivors) + add} slice(s) available, fewer than min_slices={min_slices}"
        why = have if mode == "replica-resize" or fallback_to_resize else "fallback_to_resize is off"
        return NextWorld(Action.FAIL, survivors, add, f"no replacement slice arrived in time and {why}")
    return NextWorld(Action.WAIT, survivors, add, f"{len(survivors) + add} of {num_slices} slices, need "
                     f"{num_slices if mode == 'pause-and-resume' else min_slices}")


def should_grow(mode: str, world_size: int, ready_replacements: int, num_slices: int) -> bool:
    """Grow back at a step boundary as soon as a replacement is ready: replica-resize after a
    shrink, and pause-and-resume after a ``fallback_to_resize`` left it smaller."""
    return mode in ("replica-resize", "pause-and-resume") and world_size < num_slices and ready_replacements > 0


def failures_exceeded(failure_times: Sequence[float], now: float, max_failures: int, window_s: float) -> bool:
    """More than ``max_failures`` failures in the last ``window_s`` seconds."""
    return sum(1 for t in failure_times if now - t <= window_s) > max_failures


def watchdog_timeout(step_times: Sequence[float], factor: float, min_s: float) -> float:
    """How long without a finished step before the world is suspected hung."""
    recent = sorted(step_times[-50:])
    if not recent:
        return min_s
    return max(min_s, factor * recent[len(recent) // 2])


SAVE_TIMEOUT_MIN_S = 300.0  # the automatic bound on one save: never below this
SAVE_TIMEOUT_FACTOR = 10.0  # ... and this many times the slowest save the run committed


def save_timeout(configured: Optional[float], save_seconds: Sequence[float]) -> float:
    """How long one checkpoint save may keep a world busy before it counts as failed:
    ``configured`` (``save_timeout_s``), else ``SAVE_TIMEOUT_FACTOR`` x the slowest committed save
    so far, at least ``SAVE_TIMEOUT_MIN_S``."""
    if configured is not None:
        return float(configured)
    return max(SAVE_TIMEOUT_MIN_S, SAVE_TIMEOUT_FACTOR * max(save_seconds, default=0.0))


# --------------------------------------------------------------------------- restore source
@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """Where the next world loads its state from.

    step: the state is the one after this step (-1: fresh initialisation).
    source: a snapshot of living slices, the committed checkpoint holding step ``step``, or fresh.
    holders: slices with a complete snapshot of ``step`` (empty unless source is ``snapshot``).
    """

    step: int
    source: RestoreSource
    holders: tuple[str, ...] = ()
    directory: Optional[str] = None  # a checkpoint from another directory (``fit(resume_from=...)``); None: the run's own
    # What it was chosen from (``Generations.restore_plan`` fills it; the world_formed event carries it).
    evidence: dict = dataclasses.field(default_factory=dict, compare=False)

    def donor(self, slice_name: str) -> Optional[str]:
        """Whose snapshot ``slice_name`` loads: its own when it holds one (a zero-copy read from its
        own node), else the first holder's; None when the state does not come from a snapshot."""
        if self.source is not RestoreSource.SNAPSHOT:
            return None
        return slice_name if slice_name in self.holders else self.holders[0]


def choose_restore(snapshot_steps: dict[str, int], checkpoint_step: Optional[int] = None,
                   last_step: Optional[int] = None) -> RestorePlan:
    """The newest state that survives: a complete snapshot among living slices (``snapshot_steps``:
    slice -> its newest complete step), else a newer committed checkpoint, else fresh parameters.

    ``checkpoint_step`` is the step index whose state the newest committed checkpoint holds.
    On a tie the snapshot wins: it is read from memory, not from storage. ``last_step``: the
    newest step the run has the metrics of. A checkpoint is saved when its step is dispatched, so
    it can commit although the world failed before that step's loss reached the driver; a
    snapshot of ``last_step`` beats such a checkpoint (else that step's loss would be missing
    from the run's record: seen twice in ``bench/chaos.py --faults 100``, a process killed right
    after a save started). Without that snapshot the checkpoint is still taken: a hole in the
    losses costs less than rewinding to the checkpoint before.
    """
    best = max(snapshot_steps.values()) if snapshot_steps else -1
    record_ends_at_snapshot = bool(snapshot_steps) and best == last_step
    if checkpoint_step is not None and checkpoint_step > best and not record_ends_at_snapshot:
        return RestorePlan(checkpoint_step, RestoreSource.CHECKPOINT)
    if not snapshot_steps:
        return RestorePlan(-1, RestoreSource.FRESH)
    return RestorePlan(best, RestoreSource.SNAPSHOT, tuple(s for s, st in snapshot_steps.items() if st == best))


# Each process costs the driver one task submission per chunk (~0.2 ms of CPU in Ray 2.60): a chunk
# is at least processes / PROCESSES_PER_CHUNK_STEP steps, so that cost per step stays flat as the
# world grows, but lasts at most MAX_CHUNK_S by the recent step time (a grow-back waits for the
# chunks already queued, and with slow steps the submissions are cheap per step anyway).
PROCESSES_PER_CHUNK_STEP = 10
MAX_CHUNK_S = 10.0


def chunk_steps(steps_per_chunk: int, processes: int, step_times: Sequence[float] = ()) -> int:
    """Steps in the next chunk: the configured number, longer for a world of many processes while
    a chunk stays within ``MAX_CHUNK_S`` (never shorter than configured)."""
    n = max(steps_per_chunk, -(-processes // PROCESSES_PER_CHUNK_STEP))
    if step_times:
        step_s = statistics.median(step_times)
        if step_s > 0:
            n = min(n, max(steps_per_chunk, int(MAX_CHUNK_S / step_s)))
    return n
