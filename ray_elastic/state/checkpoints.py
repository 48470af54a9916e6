"""Orbax checkpoints of the train state, on local disk or straight to GCS.

Two sides, no Ray in either:

* :class:`Checkpointer` lives in every slice process of a world. Each process
  writes its own shards with an async :class:`orbax.checkpoint.CheckpointManager`
  (nothing goes through the driver); orbax commits a step once every host is
  done (``commit_success.txt`` on GCS, the final rename on local disk).
* :func:`latest_checkpoint` runs on the driver (after :mod:`~ray_elastic.state.storage_locations`
  checked the location, before any slice is reserved): it finds the newest *committed* step
  with orbax's own finalisation rules, so an unfinished step is never restored.

Steps are named by steps completed: checkpoint ``100`` holds the state after
step index 99, and training resumes at step index 100.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
from typing import Any, ClassVar

from ray_elastic.errors import StorageError
from ray_elastic.state.storage_locations import is_gcs

logger = logging.getLogger(__name__)
STATE_ITEM = "state"
META_ITEM = "meta"


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint: its step (steps completed) and the metadata saved with it."""

    step: int
    metadata: dict
    directory: str | None = None

    @property
    def restore_step(self) -> int:
        """The step index whose state it holds (training resumes at ``step``)."""
        return self.step - 1


# ------------------------------------------------------------------ driver side
def _manager(directory: str, read_only: bool, max_to_keep: int | None = None, async_save: bool = True):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(
        read_only=read_only,
        save_interval_steps=0 if read_only else 1,
        max_to_keep=max_to_keep,
        create=not read_only,
        # The primary host deletes steps a crash left unfinished, when a world starts.
        cleanup_tmp_directories=not read_only,
        enable_async_checkpointing=async_save,
    )
    return ocp.CheckpointManager(directory, item_names=(STATE_ITEM, META_ITEM), options=options)


def foreign_task(info: CheckpointInfo | None, task_name: str) -> str | None:
    """The task that wrote ``info`` when it is not ``task_name`` (checkpoints belong to a run's task);
    None when it is ours, or unknown (written before checkpoints carried it)."""
    theirs = info.metadata.get("task") if info is not None else None
    return theirs if theirs not in (None, task_name) else None


def set_aside(directory: str, step: int, why: str = "unreadable") -> str:
    """Move a committed step out of orbax's way (kept, never deleted), so the run can save that step
    again: one that cannot be restored (the storage may have failed, not the data), or one newer
    than the state the run goes on from (``why="superseded"``). Returns where it went."""
    name = f"{step}.{why}-{time.strftime('%Y%m%dT%H%M%S')}"
    if is_gcs(directory):
        from etils.epath import backend

        fs = backend.fsspec_backend.fs(directory)
        fs.mv(f"{directory.rstrip('/')}/{step}", f"{directory.rstrip('/')}/{name}", recursive=True)
        fs.invalidate_cache()
    else:
        os.rename(os.path.join(directory, str(step)), os.path.join(directory, name))
    return f"{directory.rstrip('/')}/{name}"


def state_shapes(directory: str, step: int) -> list[tuple[tuple, str]]:
    """(shape, dtype) of every array of checkpoint ``step``'s train state, read from its metadata
    only (no array is loaded), in a stable order."""
    import orbax.checkpoint as ocp
    from etils import epath

    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)  # our saves write no per-item metadata file: orbax says so
    try:
        meta = ocp.StandardCheckpointer().metadata(epath.Path(directory) / str(step) / STATE_ITEM)
    finally:
        absl_logger.setLevel(level)
    tree = getattr(meta, "item_metadata", meta)
    return sorted((tuple(x.shape), str(x.dtype)) for x in _leaves(getattr(tree, "tree", tree)))


def _leaves(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _leaves(v)
    elif tree is not None:
        yield tree


def latest_checkpoint(directory: str, skip: frozenset = frozenset()) -> CheckpointInfo | None:
    """The newest committed checkpoint in ``directory`` whose metadata reads, and that metadata, or None.

    ``skip``: steps known to be unreadable (a world failed to restore them): the previous one is used.
    """
    import orbax.checkpoint as ocp

    if is_gcs(directory):
        # epath keeps one gcsfs filesystem per process, and gcsfs caches directory listings:
        # a listing from an earlier call would hide steps committed since by the slice hosts.
        from etils.epath import backend

        backend.fsspec_backend.fs(directory).invalidate_cache()
    elif not os.path.isdir(directory):
        return None
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)  # orbax warns that a read-only manager is read-only
    try:
        mgr = _manager(directory, read_only=True)
    finally:
        absl_logger.setLevel(level)
    try:
        for step in sorted(mgr.all_steps(), reverse=True):  # committed steps only, newest first
            if step in skip:
                continue
            try:
                meta = mgr.restore(step, args=ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()}))[META_ITEM]
            except Exception as e:  # noqa: BLE001 - a damaged step: the previous committed one will do
                logger.warning("checkpoint %d in %s cannot be read (%r): using an earlier one", step, directory, e)
                continue
            return CheckpointInfo(int(step), dict(meta), directory)
        return None
    finally:
        mgr.close()


# ------------------------------------------------------------- slice-process side
class _SaveDurations:
    """Total duration of each async save, from orbax's own jax.monitoring events."""

    EVENT = "/jax/checkpoint/write/async/thread_duration_sec"
    _installed = False
    _lock = threading.Lock()
    durations: ClassVar[list[float]] = []

    @classmethod
    def install(cls) -> None:
        import jax

        with cls._lock:
            if cls._installed:
                return

            def listener(event: str, duration_s: float, **_kw) -> None:
                if event == cls.EVENT:
                    cls.durations.append(duration_s)

            jax.monitoring.register_event_duration_secs_listener(listener)
            cls._installed = True

    @classmethod
    def take(cls) -> list[float]:
        out, cls.durations[:] = list(cls.durations), []
        return out


# A replicated array's shard is split over its replicas for writing (orbax's replica-parallel
# save) only when each part is at least this big. Splitting slices the shard on the device with a
# program compiled on the first save of every process, for every shape: most of the time the first
# save of a world blocked its steps, for the example MLP's small state. Below
# this size one replica writing the whole shard is cheaper; above it the parallel write wins.
REPLICA_PARALLEL_MIN_SLICE_BYTES = 4 << 20


@functools.cache  # process-wide settings: once per process, not once per world's Checkpointer
def configure_orbax() -> None:
    """Orbax settings of a slice process, before its first save: what a save blocks the steps for.

    - Hosts sync with the JAX coordination service's barrier (orbax's
      ``experimental_orbax_use_distributed_barrier``), not its default, a device all-gather. A save
      passes ~8 of them; as device programs they wait behind the steps in flight, and the commit
      thread's ones run on the devices while the next steps train. The service's barrier touches no
      device, and has a timeout.
    - ``jax.Array`` leaves are written by one replica unless a replica's part is at least
      :data:`REPLICA_PARALLEL_MIN_SLICE_BYTES`.

    A setting this orbax version lacks is left alone.
    """
    import jax
    import orbax.checkpoint as ocp  # also defines the flag
    from absl import flags

    name = "experimental_orbax_use_distributed_barrier"
    if name in flags.FLAGS and not flags.FLAGS[name].present:
        flags.FLAGS[name].parse(True)  # parse, not assign: an unparsed flag's value cannot be read
    ocp.type_handlers.register_type_handler(
        jax.Array,
        ocp.type_handlers.ArrayHandler(min_slice_bytes_for_replica_parallel=REPLICA_PARALLEL_MIN_SLICE_BYTES),
        override=True,
    )


class Checkpointer:
    """One world's view of the checkpoint directory, inside a slice process.

    Created after ``jax.distributed.initialize`` (orbax syncs the hosts through it),
    one per world generation.

    Args:
        directory: local path or ``gs://bucket/prefix``.
        max_to_keep: committed steps kept (older ones are deleted by orbax).
        async_save: write in a background thread; the step only waits for the device-to-host copy.
        read_only: only restore (another run's directory, ``fit(resume_from=...)``).
    """

    def __init__(self, directory: str, max_to_keep: int | None, async_save: bool = True, read_only: bool = False):
        _SaveDurations.install()
        configure_orbax()
        _SaveDurations.take()  # durations of an earlier world in this process are not ours
        self._started: list[int] = []  # saves in flight, oldest first
        self.directory = directory
        self._mgr = _manager(directory, read_only=read_only, max_to_keep=max_to_keep, async_save=async_save)

    def save(self, step: int, state: Any, metadata: dict) -> float:
        """Start saving ``state`` as checkpoint ``step``; returns the seconds the caller was blocked."""
        import orbax.checkpoint as ocp

        t0 = time.perf_counter()
        try:
            self._mgr.save(
                step,
                args=ocp.args.Composite(
                    **{
                        STATE_ITEM: ocp.args.StandardSave(state),
                        META_ITEM: ocp.args.JsonSave(metadata),
                    }
                ),
                force=True,
            )
        except Exception as e:  # this save, or the previous async one, failed in storage
            raise StorageError(f"saving checkpoint {step} failed: {e!r}") from e
        self._started.append(step)
        return time.perf_counter() - t0

    def restore(self, step: int, target: Any) -> tuple[Any, dict]:
        """Load checkpoint ``step`` onto ``target`` (a pytree of ShapeDtypeStructs with this world's shardings)."""
        import orbax.checkpoint as ocp

        got = self._mgr.restore(
            step,
            args=ocp.args.Composite(
                **{
                    STATE_ITEM: ocp.args.StandardRestore(target),
                    META_ITEM: ocp.args.JsonRestore(),
                }
            ),
        )
        return got[STATE_ITEM], dict(got[META_ITEM])

    def finished_saves(self) -> list[tuple[int, float]]:
        """(step, total seconds) of each save that finished since the last call (orbax finishes them in order)."""
        return [(self._started.pop(0), d) for d in _SaveDurations.take() if self._started]

    def wait(self) -> None:
        """Block until the in-flight save is committed.

        A storage error is raised as :class:`StorageError`: the controller recovers with another
        world (which saves the step again if it was the last). It is not retried here: orbax syncs
        every process of the world inside a save, so one process cannot redo it alone.
        """
        try:
            self._mgr.wait_until_finished()
        except Exception as e:
            raise StorageError(
                f"committing checkpoint {self._started[-1] if self._started else '?'} failed: {e!r}"
            ) from e

    def close(self) -> None:
        self._mgr.close()


def checkpoint_metadata(task_name: str, plan, seed: int, batch_policy: str, steps_done: int) -> dict:
    """Saved with every checkpoint: whose it is, where the data stands and the world that wrote it
    (``plan``: its WorldPlan; ``seed`` and ``batch_policy``: the run's)."""
    return {
        "step": steps_done,
        "task": task_name,  # checkpoints belong to a task: another one's are not resumed silently
        "data_position": steps_done * plan.stride,
        "data_stride": plan.stride,
        "seed": seed,
        "world": {
            "generation": plan.generation,
            "slices": list(plan.slice_names),
            "num_slices": plan.num_slices,
            "hosts_per_slice": plan.hosts_per_slice,
            "mesh": plan.mesh_shape,
            "global_batch_size": plan.global_batch_size,
            "batch_policy": batch_policy,
            "lr_scale": plan.lr_scale,
        },
        "saved_at": time.time(),
    }
