"""The JAX side of a slice process: the train state and compiled step on a world's mesh.

Nothing here imports Ray. The slice actor (``worker.py``) calls it, and so does
the bare multi-process baseline in ``bench/overhead.py``: both run exactly the
same step function.
"""

from __future__ import annotations

import collections
import logging
import time

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh

from ray_elastic.decide import WorldPlan
from ray_elastic.decide.bad_steps import (
    DEFAULT_BAD_STEPS,
    WHY,
    BadSteps,
    bad_step_message,
    too_many_message,
    too_many_skips,
)
from ray_elastic.errors import StorageError, TrainingCodeError
from ray_elastic.slice import step_program as sp
from ray_elastic.slice.background import run_in_background
from ray_elastic.slice.compile_cache import cache_hits, compile_ahead, lower_and_compile
from ray_elastic.slice.data import BatchPrefetcher, StepBatches
from ray_elastic.slice.host_blocks import block_range, host_blocks, leaf_paths
from ray_elastic.slice.integrity import Fingerprints, flip_one_bit
from ray_elastic.slice.settings import SliceSettings
from ray_elastic.slice.speed_check import SpeedCheck
from ray_elastic.slice.step_guard import history_struct, new_history

logger = logging.getLogger(__name__)


def _programs(
    task, plan: WorldPlan, seed: int, fsdp_min_size: int, mesh, rules, scale_updates: bool, pack: bool, bad: BadSteps
):
    """State spec, shardings and the train step for ``mesh`` (concrete, or abstract to trace ahead of
    a world). One definition for both, so what is traced ahead is what runs."""
    spec = sp.state_spec(task, seed, plan.lr_scale if scale_updates else None)
    shardings = sp.state_shardings(spec, mesh, rules, fsdp_min_size)
    batch_sharding, step = sp.train_program(
        task, spec, shardings, mesh, plan.num_microbatches, plan.data_parallel, pack, bad
    )
    return spec, shardings, batch_sharding, step


def program_key(plan: WorldPlan) -> tuple:
    """What the compiled step depends on besides the task: mesh shape, global batch, microbatches, update scale."""
    return (tuple(plan.mesh_shape.items()), plan.global_batch_size, plan.num_microbatches, plan.lr_scale)


def trace_ahead(
    task,
    plan: WorldPlan,
    seed: int,
    fsdp_min_size: int,
    batches: StepBatches,
    scale_updates: bool = False,
    rules=(),
    pack: bool = False,
    bad: BadSteps = DEFAULT_BAD_STEPS,
) -> jax.stages.Traced:
    """Trace the train step for a world laid out like ``plan``, before any world exists.

    Runs on an abstract mesh, so it needs no devices and may run before
    ``jax.distributed.initialize``: a standby process traces the worlds it may join
    while it waits, and joining one only lowers and loads (:meth:`TrainLoop.compile`).
    """
    mesh = AbstractMesh(tuple(plan.mesh_shape.values()), tuple(plan.mesh_shape))
    spec, shardings, batch_sharding, step = _programs(
        task, plan, seed, fsdp_min_size, mesh, rules, scale_updates, pack, bad
    )
    state = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), spec.abstract, shardings)
    example = batches.rows(0, 0, 1)  # one row: the fields' trailing shapes and dtypes
    batch = {
        k: jax.ShapeDtypeStruct((plan.global_batch_size,) + v.shape[1:], v.dtype, sharding=batch_sharding)
        for k, v in example.items()
    }
    return step.trace(state, batch, history_struct(mesh))


def trace_for(task, settings: SliceSettings, plan: WorldPlan, batches: StepBatches) -> jax.stages.Traced:
    """:func:`trace_ahead` with the run's settings."""
    return trace_ahead(
        task,
        plan,
        settings.seed,
        settings.fsdp_min_size,
        batches,
        scale_updates=settings.scale_updates,
        rules=settings.logical_axis_rules,
        pack=settings.pack,
        bad=settings.bad_steps,
    )


def compile_smaller_in_background(task, settings: SliceSettings, plan: WorldPlan, batches) -> None:
    """Compile the step of the next smaller world the run may form into the persistent cache, on a
    thread: a replica-resize recovery then loads it instead of compiling a layout never seen.
    Nothing to do without a persistent cache."""
    smaller = plan.num_slices - 1
    if not settings.compilation_cache_dir or smaller not in settings.worlds.sizes():
        return

    def run():
        target = settings.worlds.plan(plan.generation + 1, plan.slice_names[:smaller])
        try:
            compile_ahead(trace_for(task, settings, target, batches), target)
        except Exception as e:  # noqa: BLE001 - an optimisation: the world that needs it compiles it
            logger.warning("compiling ahead for %d slices failed: %r", smaller, e)

    run_in_background(run, "compile-ahead")


class NonFiniteLossError(TrainingCodeError):
    """A step's loss was NaN or infinite: the run stops before that state replaces the last good one."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step

    def __reduce__(self):  # crosses Ray from the slice process to the driver
        return type(self), (str(self), self.step)


def _host_metrics(metrics: dict) -> dict:
    """A step's replicated scalar metrics as Python floats."""
    return {k: float(np.asarray(v.addressable_shards[0].data)) for k, v in metrics.items()}


class TrainLoop:
    """Sharded train state and a compiled step on one world's mesh.

    Args:
        task, plan, process_id: the user's TrainTask, this world's layout, this process's place in it.
        seed: parameter initialisation seed.
        mesh, fsdp_min_size: from :func:`build_mesh`; see ``ElasticConfig.fsdp_min_size``.
        batches: the task's data by step (built once per process, reused across worlds).
        restore: what :meth:`snapshot` returned in the same host position of an earlier world (blocks
            and their index ranges, checked against this world's shardings); None: fresh parameters.
        scale_updates: wrap the optimizer with the plan's ``lr_scale`` (scale policy + lr rule).
        pack: the step also packs its new state for a snapshot (:attr:`packed`; the run snapshots).
        checkpointer: this world's :class:`~ray_elastic.state.checkpoints.Checkpointer` (None: no checkpoints).
        checkpoint_step: load this committed checkpoint (steps completed) instead of ``restore``,
            resharded onto this world's mesh, from ``restore_from`` (a Checkpointer) or ``checkpointer``.
        rules: the run's logical axis rules (``ElasticConfig.logical_axis_rules``).
        eval_batches: the task's held-out data (:class:`~ray_elastic.slice.data.EvalBatches`), or None.
        prefetch: steps whose rows a reader thread prepares ahead (0: read in the step loop).
        bad_steps, integrity_every: what the step guard skips; fingerprint the state this often (0: never).
    """

    def __init__(
        self,
        task,
        plan: WorldPlan,
        process_id: int,
        seed: int,
        mesh: Mesh,
        fsdp_min_size: int,
        batches: StepBatches,
        restore: list | None = None,
        scale_updates: bool = False,
        checkpointer=None,
        checkpoint_step: int | None = None,
        restore_from=None,
        rules=(),
        eval_batches=None,
        prefetch: int = 2,
        pack: bool = False,
        bad_steps: BadSteps = DEFAULT_BAD_STEPS,
        integrity_every: int = 0,
    ):
        self.task = task
        self.plan = plan
        self.mesh = mesh
        self.process_id = process_id
        self.row_range = plan.process_rows(process_id)
        self.batches = batches
        self.eval_batches = eval_batches
        self._rows = BatchPrefetcher(batches, *self.row_range, depth=prefetch)
        self._in_flight: collections.deque = collections.deque()  # (step, metrics, dispatched at)
        self._last_finish: float | None = None
        self.dispatched = -1  # the newest step dispatched (the health probe reports it)
        self.reading: int | None = None  # the step whose rows this process waits for (None: none)
        # Counters the health probe reports: steps finished, seconds waiting for this process's rows.
        self.timing = {"steps": 0, "data_s": 0.0}
        # (step, wall clock when its call returned): the call blocks until the step before released
        # the state, which happens at one moment for the whole world; a process whose call returns
        # later than its peers' kept the world waiting (its rows late, its host slow).
        self.released: collections.deque = collections.deque(maxlen=64)
        # Asked by the driver: time this process's devices before this step (``timing["speed"]``).
        self.speed_check_at: int | None = None
        self.speed = SpeedCheck(list(mesh.local_devices))
        self._eval = None  # the jitted eval step, compiled at the first evaluation

        self.spec, self.state_shardings, self.batch_sharding, self._step = _programs(
            task, plan, seed, fsdp_min_size, mesh, rules, scale_updates, pack, bad_steps
        )
        self.bad_steps, self.skipped = bad_steps, collections.deque(maxlen=bad_steps.max_skipped + 1)
        self.history = new_history(mesh)  # the step guard's recent losses
        self.fingerprints = Fingerprints(integrity_every)  # of the state, every integrity_every steps
        self.flip: tuple | None = None  # (array, bit) to flip before the next step (simulated), then (step,)
        self.packed: jax.Array | None = None  # the newest dispatched step's state, packed (``pack``)
        self.leaf_paths = leaf_paths(self.spec.abstract)
        self.sharded_params = sum(1 for sh in jax.tree.leaves(self.state_shardings) if any(sh.spec))
        self.checkpointer = checkpointer
        self.restored_metadata: dict | None = None
        if checkpoint_step is not None:
            self.state = self._from_checkpoint(restore_from or checkpointer, checkpoint_step)
        elif restore is None:
            self.state = sp.init_program(self.spec, self.state_shardings)()
        else:
            self.state = self._from_blocks(restore)

    def _from_checkpoint(self, source, step: int):
        """The state of committed checkpoint ``step``, laid out for this world."""
        target = jax.tree.map(
            lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), self.spec.abstract, self.state_shardings
        )
        try:
            state, self.restored_metadata = source.restore(step, target)
        except Exception as e:  # storage, not the task: another world may read it
            raise StorageError(f"restoring checkpoint {step} failed: {e!r}", step) from e
        return state

    def _from_blocks(self, restore: dict):
        """The state from this process's snapshot blocks, each checked to land where it belongs."""
        leaves, treedef = jax.tree.flatten(self.spec.abstract)
        shardings = jax.tree.leaves(self.state_shardings)
        blocks, ranges = restore["leaves"], restore["ranges"]
        if len(blocks) != len(leaves):
            raise ValueError(f"snapshot has {len(blocks)} arrays, the model's state has {len(leaves)}")
        paths = tuple(restore.get("paths") or ())
        if paths and paths != self.leaf_paths:
            renamed = next(f"{a} -> {b}" for a, b in zip(paths, self.leaf_paths) if a != b)
            raise ValueError(f"snapshot's arrays are named otherwise than the model's ({renamed}): refusing to restore")
        for i, (sh, a, got) in enumerate(zip(shardings, leaves, ranges)):
            want = block_range(sh.addressable_devices_indices_map(a.shape).values(), a.shape) if a.ndim else ()
            if tuple(map(tuple, got)) != want:
                raise ValueError(
                    f"snapshot block of state leaf {i} {a.shape} holds {got}, but this process "
                    f"of the new world needs {want}: refusing to place it by position"
                )
        arrays = [
            jax.make_array_from_process_local_data(sh, np.asarray(blk, dtype=a.dtype), a.shape)
            for sh, blk, a in zip(shardings, blocks, leaves)
        ]
        return jax.tree.unflatten(treedef, arrays)

    def global_batch_array(self, step: int) -> dict:
        """This process's rows of step ``step`` (prepared ahead by the reader thread), assembled into
        global jax.Arrays."""
        self.reading, t0 = step, time.perf_counter()
        local = self._rows.get(step)
        self.reading = None
        self.timing["data_s"] += time.perf_counter() - t0
        B = self.plan.global_batch_size
        return {
            k: jax.make_array_from_process_local_data(self.batch_sharding, v, (B,) + v.shape[1:])
            for k, v in local.items()
        }

    def close(self) -> None:
        self._rows.close()

    def compile(self, step: int, traced: jax.stages.Traced | None = None) -> dict:
        """Compile the step (from the persistent cache when warm); seconds of each phase.

        ``traced``: from :func:`trace_ahead` for this world's layout (tracing is then already
        done; it is lowered for this world's devices). ``load_s`` is XLA compiling, or loading
        the executable on a persistent-cache hit.
        """
        t0 = time.perf_counter()
        if traced is not None:
            self._step, phases = lower_and_compile(traced, self.mesh.devices)
            return {"trace_s": 0.0, **phases, "compile_s": time.perf_counter() - t0, "traced_ahead": True}
        traced = self._step.trace(self.state, self.global_batch_array(step), self.history)
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
        hits = cache_hits()
        self._step = lowered.compile()
        t3 = time.perf_counter()
        return {
            "trace_s": t1 - t0,
            "lower_s": t2 - t1,
            "load_s": t3 - t2,
            "compile_s": t3 - t0,
            "traced_ahead": False,
            "from_cache": cache_hits() > hits,
        }

    def dispatch(self, step: int) -> None:
        """Start step ``step`` and return before it has run (JAX dispatches asynchronously);
        :meth:`finish` reads it. The device queue then never drains between steps."""
        if self.speed_check_at is not None and step >= self.speed_check_at:
            self._check_speed(step)
        if self.flip is not None and len(self.flip) == 2:
            self.state, self.flip = flip_one_bit(self.state, *self.flip), (step,)
        t0 = time.perf_counter()
        batch = self.global_batch_array(step)
        # blocks while the step before holds the state
        self.state, metrics, self.history, *packed = self._step(self.state, batch, self.history)
        self.released.append((step, time.time()))
        self.packed = packed[0] if packed else None
        self._in_flight.append((step, metrics, t0))
        self.fingerprints.dispatched(step, self.state)
        self.dispatched = step

    def _check_speed(self, step: int) -> None:
        """Wait for the steps in flight (the devices idle), then time the fixed local program."""
        self.speed_check_at = None
        t0 = time.perf_counter()
        jax.block_until_ready(self.state)
        t1 = time.perf_counter()
        seconds = self.speed.seconds()
        self.timing["speed"] = (step, seconds)
        logger.info("speed check before step %d: %s s (after %.3f s for the step in flight)", step, seconds, t1 - t0)

    def in_flight(self) -> int:
        return len(self._in_flight)

    def finish(self) -> dict:
        """Wait for the oldest dispatched step: its metrics (``loss`` and what the task returns) and
        step time. The step time is the interval since the previous step finished (for the first,
        since it was dispatched): with steps in flight that is what a step costs the run, waits
        between chunks included. A bad step (``skipped``: why) was not applied; it ends the run
        (:class:`NonFiniteLossError`) with ``on_bad_step="raise"`` or past ``max_skipped_steps``."""
        step, metrics, t_dispatch = self._in_flight.popleft()
        values = _host_metrics(metrics)
        self.fingerprints.finished(step)
        self.timing["steps"] += 1
        verdict = int(values.pop("skipped"))
        if verdict:
            self._skip(step, values["loss"], verdict)
            values["skipped"] = WHY[verdict]
        now = time.perf_counter()
        since = t_dispatch if self._last_finish is None else self._last_finish
        self._last_finish = now
        return {**values, "step": step, "step_time_s": now - since}

    def _skip(self, step: int, loss: float, verdict: int) -> None:
        if not self.bad_steps.skip:
            raise NonFiniteLossError(bad_step_message(step, loss, verdict, self.bad_steps), step)
        self.skipped.append(step)
        logger.warning("step %d not kept (%s, loss %s): its batch is skipped", step, WHY[verdict], loss)
        over = too_many_skips(self.skipped, step, self.bad_steps)
        if over:
            raise NonFiniteLossError(too_many_message(over, self.bad_steps), step)

    def evaluate(self, num_batches: int) -> dict:
        """Mean of the task's eval metrics over eval batches ``0 .. num_batches-1``, as ``eval/<name>``.
        Same state, same numbers, whatever the world's size (each batch's metrics are means over it)."""
        if self._eval is None:
            self._eval = sp.eval_program(self.task, self.spec, self.state_shardings, self.mesh)
        E = self.eval_batches.batch_size
        lo, hi = self.eval_batches.process_rows(self.process_id, self.plan.num_processes)
        totals: dict = {}
        for i in range(num_batches):
            local = self.eval_batches.rows(i, lo, hi)
            batch = {
                k: jax.make_array_from_process_local_data(self.batch_sharding, v, (E,) + v.shape[1:])
                for k, v in local.items()
            }
            for k, v in _host_metrics(self._eval(self.state, batch)).items():
                totals[k] = totals.get(k, 0.0) + v
        return {f"eval/{k}": v / num_batches for k, v in totals.items()}

    def run(self, start_step: int, num_steps: int, in_flight: int = 1) -> list[dict]:
        """Run ``num_steps`` steps from ``start_step`` keeping ``in_flight`` more dispatched than read
        (0: blocking); per-step loss and step time."""
        out = []
        for s in range(start_step, start_step + num_steps):
            self.dispatch(s)
            while self.in_flight() > in_flight:
                out.append(self.finish())
        while self.in_flight():
            out.append(self.finish())
        return out

    def save_checkpoint(self, steps_done: int, metadata: dict) -> float:
        """Start an async save of the state as checkpoint ``steps_done``; seconds the step was blocked.

        The dispatched step is waited for first, outside the count: its time is the step's own (the
        device computes it either way); what the save costs the run is only what comes after."""
        jax.block_until_ready(self.state)
        return self.checkpointer.save(steps_done, self.state, metadata)

    def snapshot(self) -> dict:
        """Host copy of this process's part of the train state (params and optimizer state): per
        leaf the block (``leaves``) and its global index range (``ranges``). Waits for the state."""
        return host_blocks(jax.tree.leaves(self.state), self.leaf_paths)
