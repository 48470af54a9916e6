"""Every kind of event a run logs: one frozen dataclass per kind, and its JSON form.

``events.jsonl`` holds one :meth:`Event.to_json` object per line (``ts``, ``kind`` and the
fields); :func:`parse` reads a line back, from this version's logs or older ones (a field an
older log lacks is ``None``, one it has that this version does not know is kept in ``extra``).
Consumers match on the classes. An event also reads like the dict it was before it had a type
(``event["kind"]``, ``event.get("steps_rewound")``), so callbacks written against dicts keep working.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from ray_elastic.observe.event_base import KINDS, Event, UnknownEvent
from ray_elastic.observe.planned_events import PlannedChange as PlannedChange
from ray_elastic.observe.planned_events import PreemptionNotice as PreemptionNotice
from ray_elastic.observe.planned_events import ReplicaMismatch as ReplicaMismatch
from ray_elastic.observe.planned_events import ScaleUp as ScaleUp
from ray_elastic.observe.planned_events import SliceLeft as SliceLeft
from ray_elastic.observe.planned_events import Straggler as Straggler


def parse(raw: Mapping[Any, Any]) -> Event:
    """An event from its JSON form (or the event itself)."""
    if isinstance(raw, Event):
        return raw
    fields = dict(raw)
    kind, ts = fields.pop("kind", ""), fields.pop("ts", 0.0)
    for cls in KINDS.get(kind, []):
        if cls.accepts(fields):
            return cls.from_fields(ts, fields)
    return UnknownEvent(kind=kind, ts=ts, extra=fields)


def parse_all(raws) -> list[Event]:
    return [parse(r) for r in raws]


# ------------------------------------------------------------------- the run
@dataclasses.dataclass(frozen=True, kw_only=True)
class RunStarted(Event):
    kind = "run_started"
    num_steps: int
    num_slices: int
    mode: str
    checkpoint_dir: str | None = None
    resume_from_checkpoint: int | None = None  # the checkpoint step resumed from


@dataclasses.dataclass(frozen=True, kw_only=True)
class Resume(Event):
    """The run resumes from a checkpoint written by an earlier run."""

    kind = "resume"
    checkpoint_step: int
    directory: str | None = None
    task: dict[Any, Any] | None = None
    saved_world: dict[Any, Any] | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rerun(Event):
    """This run follows an earlier one of the same run (its driver was lost): what that one had
    reached, and the snapshots its keepers still hold (taken over by this driver)."""

    kind = "rerun"
    previous_last_step: int | None = None  # the newest step the earlier driver reported (its log)
    snapshot_step: int = -1  # the newest step the taken-over keepers hold completely
    held: dict[Any, Any] = dataclasses.field(default_factory=dict)  # slice -> host -> steps held
    refused_steps: list[Any] = dataclasses.field(default_factory=list)  # held, but not restorable: ...
    refused_why: str = ""  # ... why (their losses were never logged as finite)
    released: str = ""  # the keepers were released instead (why: an explicit resume_from)
    dropped_snapshots: int = 0  # held of another model or training settings: dropped


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResumeConfigChanged(Event):
    """Settings that change the data order differ from the checkpoint's: name -> (then, now)."""

    kind = "resume_config_changed"
    changed: dict[Any, Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunFinished(Event):
    kind = "run_finished"
    steps: int
    wall_s: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class Errored(Event):
    """The run stopped with an error in ``state``."""

    kind = "errored"
    state: str
    error: str


# ------------------------------------------------------------------- steps and checkpoints
@dataclasses.dataclass(frozen=True, kw_only=True)
class Steps(Event):
    """A chunk of finished steps (a rewound step appears again in a later chunk)."""

    kind = "steps"
    generation: int
    steps: list[int]
    losses: list[float]
    step_time_s: list[float]
    finished_at: list[Any] | None = None  # wall clock per step (older logs: absent)
    snapshot_steps: list[Any] = dataclasses.field(default_factory=list)
    metrics: dict[Any, Any] = dataclasses.field(default_factory=dict)  # the task's own metrics, one list per name
    skipped: list[int] = dataclasses.field(default_factory=list)  # steps not kept (a bad step: its loss as it was)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepSkipped(Event):
    """A bad step's update was not applied and its batch skipped (``why``: non_finite or spike)."""

    kind = "step_skipped"
    step: int
    why: str
    loss: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkRun(Event):
    """The controller's view of one stretch of steps of a world and how it ended."""

    kind = "chunk_run"
    generation: int
    first_step: int
    last_step: int
    seconds: float
    outcome: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Eval(Event):
    kind = "eval"
    step: int
    metrics: dict[Any, Any]  # "eval/..." -> value


@dataclasses.dataclass(frozen=True, kw_only=True)
class SnapshotInterval(Event):
    """The snapshot interval (the snapshot policy's) from ``step`` on."""

    kind = "snapshot_interval"
    step: int
    every: int
    max_rewind_steps: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class SnapshotNotKept(Event):
    """Snapshots a process failed to keep in a world (``first``: the first few, with why)."""

    kind = "snapshot_not_kept"
    generation: int
    count: int
    first: list[Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointSave(Event):
    kind = "checkpoint_save"
    step: int
    blocking_s: float = 0.0  # how long the step waited for the save to start


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointCommitted(Event):
    kind = "checkpoint_committed"
    step: int
    total_s: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointRestore(Event):
    kind = "checkpoint_restore"
    step: int
    generation: int
    seconds: float
    saved_by: dict[Any, Any] | None = None  # the checkpoint's metadata (task, world)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointUnreadable(Event):
    """A checkpoint could not be loaded; it was moved aside so no later world picks it."""

    kind = "checkpoint_unreadable"
    step: int
    error: str
    set_aside_to: str | None = None


# ------------------------------------------------------------------- failures and recoveries
@dataclasses.dataclass(frozen=True, kw_only=True)
class FailureEvent(Event):
    """Slices were lost: the ``failure`` kind, in its two variants below."""

    generation: int
    cause: str
    lost_slices: list[str]
    kinds: dict[Any, Any]  # slice -> what happened to it
    last_step: int
    classify_s: float = 0.0
    since_last_progress_s: float = 0.0

    @property
    def gone_slices(self) -> set[str]:
        """Slices whose processes (and snapshots) are gone."""
        return set(self.lost_slices)

    @property
    def seen_at(self) -> float:
        """When the controller saw the failure, before it drained and classified."""
        return self.ts - (self.classify_s or 0.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Failure(FailureEvent):
    """A world failed: which slices it lost, what was blamed and how long detecting it took."""

    kind = "failure"
    world_slices: int
    vouched_slices: list[str] = dataclasses.field(default_factory=list)
    crashed_slices: list[str] = dataclasses.field(default_factory=list)
    quarantined_slices: list[str] = dataclasses.field(default_factory=list)
    error: str = ""
    origin: str | None = None
    failures_in_a_row: int = 0
    drain_s: float = 0.0
    detection_latency_s: float | None = None

    @property
    def gone_slices(self) -> set[str]:
        return set(self.lost_slices) | set(self.crashed_slices or ())

    @property
    def seen_at(self) -> float:
        return super().seen_at - (self.drain_s or 0.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LostWhileWaiting(FailureEvent):
    """A survivor's host died while the controller waited for replacements (no world was running)."""

    CAUSE: ClassVar[str] = "lost_while_waiting"
    kind = "failure"
    cause: str = CAUSE

    @classmethod
    def accepts(cls, fields: dict[Any, Any]) -> bool:
        return fields.get("cause") == cls.CAUSE


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorldFormed(Event):
    """A generation formed: its slices, layout, where its state came from and how long forming took.

    Logged with ``restored_from_step`` (``start_step - 1``) and the times flattened."""

    kind = "world_formed"
    generation: int
    slices: list[str]
    mesh: dict[str, int]
    global_batch_size: int
    start_step: int
    restore_source: str
    snapshot_donors: dict[str, str]
    times: dict[str, float]  # the FormationTimes: start_actors_s, jax_init_s, state_load_s, compile_s, total_s ...
    # What the restore was chosen from: the newest complete snapshot step per slice as the streams
    # reported them and as the keepers still held them, the steps keepers had let go of, the
    # newest committed checkpoint's step. A rewind is explained by it, or is a bug.
    restore_evidence: dict[Any, Any] = dataclasses.field(default_factory=dict)

    TIMES: ClassVar[tuple[str, ...]] = (
        "start_actors_s",
        "jax_init_s",
        "state_load_s",
        "compile_s",
        "trace_s",
        "lower_s",
        "load_s",
        "chips_wait_s",
        "join_wall_s",
        "compile_wall_s",
        "total_s",
        "standbys_used",
        "processes_starting",
        "compiled_from_cache",
        "snapshots_by_call",
    )

    @property
    def restored_from_step(self) -> int:
        return self.start_step - 1

    def fields(self) -> dict[str, Any]:
        own = super().fields()
        own["restored_from_step"] = own.pop("start_step") - 1
        times = own.pop("times")
        return {**own, **times}

    @classmethod
    def from_fields(cls, ts: float, fields: dict[Any, Any]) -> Event:
        times = {k: fields.pop(k) for k in cls.TIMES if k in fields}
        restored = fields.pop("restored_from_step", None)
        fields.update(times=times, start_step=None if restored is None else restored + 1)
        return super().from_fields(ts, fields)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recovered(Event):
    """One recovery: the new world and the seconds of every phase from detection to ready."""

    kind = "recovered"
    generation: int
    reason: str
    mode: str
    slices: int
    added_slices: int
    restored_from_step: int
    restore_source: str
    steps_rewound: int
    since_last_progress_s: float
    classify_s: float
    teardown_s: float
    wait_for_capacity_s: float
    world_formation_s: float  # actors, waiting for processes still starting, jax.distributed
    state_load_s: float
    compile_s: float
    recovery_s: float
    detected_at: float
    capacity_ready_at: float
    ready_at: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class Resize(Event):
    kind = "resize"
    generation: int
    from_slices: int
    to_slices: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class WaitingForCapacity(Event):
    """Pause-and-resume (or too few slices): the controller waits for replacements."""

    kind = "waiting_for_capacity"
    reason: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Waiting(Event):
    """Still waiting for slices (reported every few seconds), with what the autoscaler sees."""

    kind = "waiting"
    state: str
    ready: int
    asked: int
    waited_s: float
    demand: Any = None

    def __post_init__(self):
        object.__setattr__(self, "waited_s", round(self.waited_s, 1))


# What the user's ``on_event`` gets: the elastic events, waits for slices and evaluations.
ELASTIC = (
    FailureEvent,
    Recovered,
    Resize,
    ScaleUp,
    PreemptionNotice,
    Straggler,
    SliceLeft,
    StepSkipped,
    ReplicaMismatch,
    WaitingForCapacity,
    Waiting,
    Eval,
)
