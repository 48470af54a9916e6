"""Where the next world's state comes from: living slices' snapshots, a committed checkpoint, or fresh."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from ray_elastic.errors import StateLostError


class RestoreSource(enum.StrEnum):
    SNAPSHOT = "snapshot"  # in-memory, from living slices
    CHECKPOINT = "checkpoint"  # the newest committed Orbax checkpoint
    FRESH = "fresh"  # nothing survived (or the first run): fresh parameters


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
    directory: str | None = None  # where a checkpoint comes from (the run's own, or resume_from)
    # What it was chosen from (``Generations.restore_plan`` fills it; the world_formed event carries it).
    evidence: dict[Any, Any] = dataclasses.field(default_factory=dict, compare=False)

    def donor(self, slice_name: str) -> str | None:
        """Whose snapshot ``slice_name`` loads: its own when it holds one (a zero-copy read from its
        own node), else the first holder's; None when the state does not come from a snapshot."""
        if self.source is not RestoreSource.SNAPSHOT:
            return None
        return slice_name if slice_name in self.holders else self.holders[0]


def choose_restore(
    snapshot_steps: dict[str, int], checkpoint_step: int | None = None, last_step: int | None = None
) -> RestorePlan:
    """The newest state that survives: a complete snapshot among living slices (``snapshot_steps``:
    slice -> its newest complete step), else a newer committed checkpoint, else fresh parameters.

    ``checkpoint_step`` is the step index whose state the newest committed checkpoint holds.
    On a tie the snapshot wins: it is read from memory, not from storage. ``last_step``: the
    newest step the run has the metrics of. A checkpoint is saved when its step is dispatched, so
    it can commit although the world failed before that step's loss reached the driver; a
    snapshot of ``last_step`` beats such a checkpoint (else that step's loss would be missing
    from the run's record, when a process is killed right after a save started). Without that snapshot the checkpoint is still taken: a hole in the
    losses costs less than rewinding to the checkpoint before.
    """
    best = max(snapshot_steps.values()) if snapshot_steps else -1
    record_ends_at_snapshot = bool(snapshot_steps) and best == last_step
    if checkpoint_step is not None and checkpoint_step > best and not record_ends_at_snapshot:
        return RestorePlan(checkpoint_step, RestoreSource.CHECKPOINT)
    if not snapshot_steps:
        return RestorePlan(-1, RestoreSource.FRESH)
    return RestorePlan(best, RestoreSource.SNAPSHOT, tuple(s for s, st in snapshot_steps.items() if st == best))


def refuse_fresh_restart(plan: RestorePlan, steps_done: int, allowed: bool, reason: str) -> None:
    """Going on from fresh parameters once steps were done (or resumed from) would silently restart
    training from step 0: :class:`StateLostError`, unless ``allow_restart_from_scratch``."""
    if plan.source is RestoreSource.FRESH and steps_done > 0 and not allowed:
        raise StateLostError(
            f"{reason}: every slice holding a snapshot is gone and no checkpoint could be loaded, so "
            f"going on would restart training from step 0 ({steps_done} steps done or resumed from). "
            "Set checkpoint_dir, raise snapshot_replicas, or allow_restart_from_scratch=True"
        )
