"""What a rerun takes from the lost driver of the same run, before it reserves a slice.

The lost driver's keepers are taken over (or released, when the user names ``resume_from``:
an explicit checkpoint wins), only the steps whose losses it logged as finite are offered to
the first world, and a rerun asked for fewer steps than the lost driver already ran is refused
before it trains (its final checkpoint would be labelled with a step it is not).
"""

from __future__ import annotations

import logging
from typing import Any

from ray_elastic.control.backend import Backend
from ray_elastic.control.generations import Generations
from ray_elastic.control.recorder import RunRecorder
from ray_elastic.observe import results
from ray_elastic.state import checkpoints
from ray_elastic.state.snapshot_keeper import PREVIOUS_DRIVER
from ray_elastic.state.snapshots import SnapshotRef

logger = logging.getLogger(__name__)


def take_over_run(
    backend: Backend,
    gens: Generations,
    record: RunRecorder,
    run_dir: str | None,
    num_steps: int,
    resume: checkpoints.CheckpointInfo | None,
    resume_from: str | None,
) -> results.PreviousRun:
    """Take over what a lost driver of this run left (see the module); returns what its log says.
    Raises ``ValueError`` when it ran past ``num_steps`` (its keepers are left for a rerun that asks
    for more) and :class:`~ray_elastic.errors.SupersededError` when a newer driver owns the run."""
    found = backend.ownership.take_over()
    # Read after the takeover: an older driver still alive adds no snapshot from now on, and the
    # step its last acknowledgement pinned in the keepers is in its log by now.
    previous = results.previous_run(run_dir)
    released = bool(found) and resume_from is not None
    if released:  # the user named the state to start from: the lost run's memory is not it
        backend.ownership.release_unclaimed()
        found = []
    committed = resume.step if resume is not None and resume_from is None else None
    held, refused, why = file_taken_over(gens, found, previous.last_step, committed)
    record.taken_over(
        held,
        gens.taken_over_step,
        previous.last_step,
        refused=refused,
        why=why,
        released=f"resume_from={resume_from!r} was given: it wins over the lost run's snapshots" if released else "",
        dropped=backend.ownership.dropped_snapshots,
    )
    if gens.taken_over_step >= num_steps:
        backend.ownership.hand_back()
        raise ValueError(
            f"this run (its run_dir / run_id) already trained step {gens.taken_over_step}: its lost driver's "
            f"snapshot keepers hold it, so fit({num_steps}) would save the state after step "
            f"{gens.taken_over_step} as checkpoint {num_steps}. Call fit(num_steps > {gens.taken_over_step}), "
            "or use another run_dir / run_id for a new run (the keepers are left for a rerun until "
            "orphan_timeout_s)"
        )
    if gens.taken_over_step == num_steps - 1:
        logger.warning(
            "the lost driver of this run already trained every step of fit(%d) (its keepers hold step %d): "
            "this run trains none, and commits the final checkpoint if there is a checkpoint_dir",
            num_steps,
            gens.taken_over_step,
        )
    return previous


def file_taken_over(
    gens: Generations, found: list[Any], logged: int | None = None, committed: int | None = None
) -> tuple[dict[str, dict[int, list[int]]], list[int], str]:
    """File the snapshots an earlier driver's keepers hold (``TakenOver`` s) as this run's, by
    slice and host: the first world restores them if they are newer than the newest checkpoint.

    Only a step whose loss that driver saw and logged as finite is offered (``logged``: the
    newest such step in its log): a snapshot reaches its keeper before its loss is checked, and
    the metrics of later steps died with that driver. With nothing logged (no run directory),
    none past the newest committed checkpoint (``committed``: the steps it covers).
    Returns (slice -> host -> steps held, the steps refused, why they were)."""
    placed = [t for t in found if t.place is not None]
    held: dict[str, dict[int, list[int]]] = {}
    for t in placed:
        held.setdefault(t.place[0], {})[t.place[1]] = sorted(t.steps)
    if logged is not None:
        upto, why = logged, f"after step {logged}, the last the lost driver logged with a finite loss"
    else:
        upto = (committed or 0) - 1
        why = "no run log says their losses were finite (no run_dir): none past the newest committed checkpoint"
    for t in placed:
        name, host = t.place
        gens.store.hold_only(name, host, {s: SnapshotRef(t.keeper, PREVIOUS_DRIVER, s) for s in t.steps if s <= upto})
    gens.taken_over_slices = set(held)
    gens.taken_over_step = max(gens.store.latest_complete(list(held)).values(), default=-1)
    refused = sorted({s for t in placed for s in t.steps if s > upto})
    return held, refused, why if refused else ""
