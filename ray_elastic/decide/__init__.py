"""Pure decisions (no Ray, no JAX): callable from tests without a cluster.

- :mod:`~ray_elastic.decide.layout`: a slice's mesh axes and where each parameter's dimensions go;
- :mod:`~ray_elastic.decide.world`: one world's process ids, mesh, batch and learning-rate scale;
- :mod:`~ray_elastic.decide.schedule`: snapshot, eval and checkpoint steps, chunk lengths, time bounds;
- :mod:`~ray_elastic.decide.failures`: what a failure means, and the limits on retrying;
- :mod:`~ray_elastic.decide.restore`: where the next world's state comes from;
- :mod:`~ray_elastic.decide.notices`: which slices a drain notice concerns, and how they leave.
"""

from ray_elastic.decide.failures import (
    HOST_FAULTS,
    ErrorKind,
    FailureVerdict,
    classify_failure,
    drop_repeat_offender,
    failures_exceeded,
)
from ray_elastic.decide.layout import (
    DEFAULT_SLICE_MESH,
    FSDP_AXIS,
    REPLICA_AXIS,
    TENSOR_AXIS,
    fsdp_partition,
    normalize_rules,
    partition,
    resolve_slice_mesh,
    spec_sizes,
)
from ray_elastic.decide.notices import ExitPlan, Notice, leave_now, plan_exit, warned_slices
from ray_elastic.decide.restore import RestorePlan, RestoreSource, choose_restore, refuse_fresh_restart
from ray_elastic.decide.schedule import (
    MAX_CHUNK_S,
    MAX_SNAPSHOT_EVERY,
    PROCESSES_PER_CHUNK_STEP,
    REPORT_EVERY_S,
    SAVE_TIMEOUT_FACTOR,
    SAVE_TIMEOUT_MIN_S,
    SNAPSHOT_SPREAD,
    chunk_steps,
    is_checkpoint_step,
    is_eval_step,
    is_fingerprint_step,
    is_snapshot_step,
    newest_due_snapshot,
    newest_snapshot_step,
    save_timeout,
    snapshot_cost_in_steps,
    snapshot_interval,
    stop_lead_steps,
    watchdog_timeout,
)
from ray_elastic.decide.world import WorldPlan, WorldShapes, batch_for_world, lr_scale, plan_world

__all__ = [
    "DEFAULT_SLICE_MESH",
    "FSDP_AXIS",
    "HOST_FAULTS",
    "MAX_CHUNK_S",
    "MAX_SNAPSHOT_EVERY",
    "PROCESSES_PER_CHUNK_STEP",
    "REPLICA_AXIS",
    "REPORT_EVERY_S",
    "SAVE_TIMEOUT_FACTOR",
    "SAVE_TIMEOUT_MIN_S",
    "SNAPSHOT_SPREAD",
    "TENSOR_AXIS",
    "ErrorKind",
    "ExitPlan",
    "FailureVerdict",
    "Notice",
    "RestorePlan",
    "RestoreSource",
    "WorldPlan",
    "WorldShapes",
    "batch_for_world",
    "choose_restore",
    "chunk_steps",
    "classify_failure",
    "drop_repeat_offender",
    "failures_exceeded",
    "fsdp_partition",
    "is_checkpoint_step",
    "is_eval_step",
    "is_fingerprint_step",
    "is_snapshot_step",
    "leave_now",
    "lr_scale",
    "newest_due_snapshot",
    "newest_snapshot_step",
    "normalize_rules",
    "partition",
    "plan_exit",
    "plan_world",
    "refuse_fresh_restart",
    "resolve_slice_mesh",
    "save_timeout",
    "snapshot_cost_in_steps",
    "snapshot_interval",
    "spec_sizes",
    "stop_lead_steps",
    "warned_slices",
    "watchdog_timeout",
]
