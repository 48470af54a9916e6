"""Where a run starts from: its own directory's newest committed checkpoint, or ``resume_from``'s,
after the locations are checked and mixing two runs' checkpoints is refused (before any slice is
reserved)."""

from __future__ import annotations

from typing import Optional

from ray_elastic.config import ElasticConfig
from ray_elastic.state import checkpoints


def resume_point(cfg: ElasticConfig, ours: str, resume_from: Optional[str]) -> Optional[checkpoints.CheckpointInfo]:
    """The checkpoint a run of task ``ours`` starts from, after checking the locations (a bad one
    fails now, not at the first save) and that the run's own directory holds no other task's
    checkpoints, nor any at all when the run resumes from elsewhere."""
    if resume_from is not None:
        if not isinstance(resume_from, str) or not resume_from.strip():
            raise ValueError(f"resume_from must be a local path or gs://bucket/prefix, got {resume_from!r}")
        if checkpoints.is_gcs(resume_from):
            checkpoints.check_location(resume_from, writable=False)  # read access is all a resume needs
    own = None
    if cfg.checkpoint_dir:
        checkpoints.check_location(cfg.checkpoint_dir)
        own = checkpoints.latest_checkpoint(cfg.checkpoint_dir)
        theirs = checkpoints.foreign_task(own, ours)
        if own is not None and resume_from not in (None, cfg.checkpoint_dir):
            # Its saves would land among those checkpoints, and a recovery without a snapshot
            # would restore the newest of them: possibly another run's later step.
            raise ValueError(
                f"checkpoint_dir {cfg.checkpoint_dir!r} already holds checkpoints (newest: step {own.step}, "
                f"task {own.metadata.get('task')!r}), so a run resumed from {resume_from!r} would save among "
                "them and could restore one of theirs: give it an empty checkpoint_dir, or drop resume_from "
                "to train on from checkpoint_dir's own newest checkpoint"
            )
        if own is not None and theirs and resume_from != cfg.checkpoint_dir:
            raise ValueError(
                f"checkpoint_dir {cfg.checkpoint_dir!r} holds checkpoints of task {theirs!r} (newest: step "
                f"{own.step}), not of {ours!r}: use another checkpoint_dir, or fit(..., resume_from="
                f"{cfg.checkpoint_dir!r}) to train on from them anyway"
            )
    if resume_from is None:
        return own
    info = checkpoints.latest_checkpoint(resume_from)
    if info is None:
        raise ValueError(f"resume_from {resume_from!r} holds no committed checkpoint: check the path")
    return info
