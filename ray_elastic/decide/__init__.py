"""Pure decisions (no Ray, no JAX): callable from tests without a cluster.

- :mod:`~ray_elastic.decide.layout`: a slice's mesh axes and where each parameter's dimensions go;
- :mod:`~ray_elastic.decide.world`: one world's process ids, mesh, batch and learning-rate scale;
- :mod:`~ray_elastic.decide.schedule`: snapshot, eval and checkpoint steps, chunk lengths, time bounds;
- :mod:`~ray_elastic.decide.failures`: what a failure means, and the limits on retrying;
- :mod:`~ray_elastic.decide.restore`: where the next world's state comes from.
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
    is_snapshot_step,
    newest_due_snapshot,
    newest_snapshot_step,
    save_timeout,
    snapshot_cost_in_steps,
    snapshot_interval,
    watchdog_timeout,
)
from ray_elastic.decide.world import WorldPlan, WorldShapes, batch_for_world, lr_scale, plan_world

__all__ = [
    "REPLICA_AXIS",
    "FSDP_AXIS",
    "TENSOR_AXIS",
    "DEFAULT_SLICE_MESH",
    "resolve_slice_mesh",
    "normalize_rules",
    "fsdp_partition",
    "partition",
    "spec_sizes",
    "WorldPlan",
    "WorldShapes",
    "plan_world",
    "batch_for_world",
    "lr_scale",
    "is_snapshot_step",
    "MAX_SNAPSHOT_EVERY",
    "snapshot_interval",
    "SNAPSHOT_SPREAD",
    "snapshot_cost_in_steps",
    "newest_snapshot_step",
    "newest_due_snapshot",
    "is_eval_step",
    "is_checkpoint_step",
    "watchdog_timeout",
    "SAVE_TIMEOUT_MIN_S",
    "SAVE_TIMEOUT_FACTOR",
    "save_timeout",
    "PROCESSES_PER_CHUNK_STEP",
    "REPORT_EVERY_S",
    "MAX_CHUNK_S",
    "chunk_steps",
    "ErrorKind",
    "FailureVerdict",
    "classify_failure",
    "HOST_FAULTS",
    "drop_repeat_offender",
    "failures_exceeded",
    "RestoreSource",
    "RestorePlan",
    "choose_restore",
    "refuse_fresh_restart",
]
