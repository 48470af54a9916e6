"""Where a run's checkpoints are, and which of them it may restore: the one owner of checkpoint
locations. A run saves into its own directory (``checkpoint_dir``) and starts from that directory's
newest committed checkpoint, or from ``fit(resume_from=...)``'s, which it reads until it has saved
one of its own. Both locations are checked, and mixing two runs' checkpoints refused, before any
slice is reserved (:meth:`RunCheckpoints.open`)."""

from __future__ import annotations

import logging

from ray_elastic.config import ElasticConfig
from ray_elastic.state import checkpoints, storage_locations
from ray_elastic.state.checkpoints import CheckpointInfo

logger = logging.getLogger(__name__)


class RunCheckpoints:
    """The run's own checkpoint directory (``own``; None: the run keeps none) and the one it started
    from (``start_dir``: ``resume_from``, else ``own``); the steps a world failed to read."""

    def __init__(self, own: str | None, start_dir: str | None = None):
        self.own = own
        self.start_dir = start_dir or own
        self.unreadable: set[int] = set()  # steps a world failed to restore: never tried again

    @classmethod
    def open(
        cls, cfg: ElasticConfig, task_name: str, resume_from: str | None = None
    ) -> tuple[RunCheckpoints, CheckpointInfo | None]:
        """The run's checkpoints and the checkpoint it starts from (None: step 0), after checking
        the locations (a bad one fails now, not at the first save) and that the run's own directory
        holds no other task's checkpoints, nor any at all when the run resumes from elsewhere."""
        if resume_from is not None:
            if not isinstance(resume_from, str) or not resume_from.strip():
                raise ValueError(f"resume_from must be a local path or gs://bucket/prefix, got {resume_from!r}")
            resume_from = storage_locations.resolve(
                resume_from.strip()
            )  # ~ and relative paths, as the workers read them
            if storage_locations.is_gcs(resume_from):
                storage_locations.check_location(resume_from, writable=False)  # read access is all a resume needs
        own = _own_checkpoint(cfg, task_name, resume_from) if cfg.checkpoint_dir else None
        run = cls(cfg.checkpoint_dir, resume_from)
        if resume_from is None:
            return run, own
        info = checkpoints.latest_checkpoint(resume_from)
        if info is None:
            raise ValueError(f"resume_from {resume_from!r} holds no committed checkpoint: check the path")
        return run, info

    def newest(self) -> tuple[str | None, int | None]:
        """(directory, restore step) of the newest readable committed checkpoint: the run's own, else
        the one it was started from until it has saved one."""
        for directory in dict.fromkeys(d for d in (self.own, self.start_dir) if d):
            info = checkpoints.latest_checkpoint(directory, frozenset(self.unreadable))
            if info is not None:
                return directory, info.restore_step
        return None, None

    def newest_own(self) -> CheckpointInfo | None:
        """The newest committed checkpoint in the run's own directory, whoever reported it."""
        return checkpoints.latest_checkpoint(self.own) if self.own else None

    def set_aside_newer(
        self, directory: str | None, step: int | None, restore_step: int, why: str = "superseded"
    ) -> list[str]:
        """The run goes on from a snapshot of ``restore_step`` though a newer checkpoint committed (see
        :func:`~ray_elastic.decide.choose_restore`): the steps after it run again and save that
        checkpoint again, which orbax refuses while it exists (``StepAlreadyExistsError``: one more
        failure, and the next world would take the checkpoint after all).
        ``step`` in ``directory``: the newest committed one, already read by the caller. Every
        committed step of the run's own directory newer than ``restore_step`` is set aside (kept),
        newest first (``why`` names them: superseded, or suspect when replicas disagreed since).
        Returns where they went."""
        moved: list[str] = []
        tried: set[int] = set()
        while step is not None and step > restore_step and directory == self.own and step not in tried:
            assert directory is not None  # the loop runs only in the run's own directory
            tried.add(step)
            try:
                moved.append(checkpoints.set_aside(directory, step + 1, why=why))
            except OSError as e:  # the storage failing: the save of that step fails and is recovered
                logger.warning("could not set aside checkpoint %d: %r", step + 1, e)
                break
            directory, step = self.newest()
        return moved

    def failed_to_read(self, step: int, directory: str | None) -> str | None:
        """A world failed to restore checkpoint ``step`` of ``directory``: the next one restores the
        previous committed step. In the run's own directory the step is set aside (kept), so it can
        be saved again; elsewhere (``resume_from``) it is only skipped. Returns where it was set
        aside, if it was."""
        if directory == self.own and self.own:
            try:
                return checkpoints.set_aside(self.own, step)
            except OSError as e:  # gone already, or the storage still failing: skip it instead
                logger.warning("could not set aside checkpoint %d: %r", step, e)
        self.unreadable.add(step)
        return None


def _own_checkpoint(cfg: ElasticConfig, task_name: str, resume_from: str | None) -> CheckpointInfo | None:
    """The newest checkpoint of ``cfg.checkpoint_dir``, refused when a run of ``task_name`` must not
    start from or save among them."""
    assert cfg.checkpoint_dir is not None
    storage_locations.check_location(cfg.checkpoint_dir)
    own = checkpoints.latest_checkpoint(cfg.checkpoint_dir)
    theirs = checkpoints.foreign_task(own, task_name)
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
            f"{own.step}), not of {task_name!r}: use another checkpoint_dir, or fit(..., resume_from="
            f"{cfg.checkpoint_dir!r}) to train on from them anyway"
        )
    return own
