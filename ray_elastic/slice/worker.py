"""The slice actor: one Ray actor per slice host, a thin shell around ``jax_world``.

It owns one JAX process for the lifetime of one world generation. It can be
started ahead of need (a *standby*: Python, JAX and the task's data already
loaded) and promoted when the next generation forms. The controller never sends
it per-step work: it asks for chunks of steps. One step is always in flight (the
next is dispatched before the last one's loss is read); snapshot-keeping processes
copy their snapshots into the host keeper's shared-memory ring from a background thread
and stream their metrics a few times a second, each step only once its snapshot is kept.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time

import ray

from ray_elastic.decide import WorldPlan
from ray_elastic.detect.liveness import Beacon
from ray_elastic.slice import background
from ray_elastic.slice.chunk_running import ChunkRunning
from ray_elastic.slice.process import set_niceness, world_errors
from ray_elastic.slice.settings import SliceSettings
from ray_elastic.slice.stack import StepThread
from ray_elastic.slice.step_reports import StepReports
from ray_elastic.slice.stop_gate import StopGate
from ray_elastic.slice.tpu_env import clear_stale_lock, megascale_env, set_world_env, wait_until_gone
from ray_elastic.state.snapshot_writer import SnapshotWriter
from ray_elastic.state.snapshots import SnapshotRef

logger = logging.getLogger(__name__)
TRACE_AHEAD_WORLDS = 3  # world sizes a standby traces the step for: full size and the next smaller ones


@ray.remote(max_restarts=0, max_task_retries=0, concurrency_groups={"health": 1, "ahead": 1})
class SliceWorker(ChunkRunning):
    """One process of the JAX world, pinned to one host of one slice.

    Args:
        task: the user's TrainTask.
        settings: what the process needs of the run's settings (:class:`SliceSettings`, made on the driver).
    """

    def __init__(self, task, settings: SliceSettings):
        set_niceness(settings.worker_niceness)
        try:  # the driver's connection to it ends when this process does (liveness.DeathWatch)
            self._beacon: Beacon | None = Beacon(ray.util.get_node_ip_address())
        except OSError as e:
            logger.warning("no liveness beacon (its death is then seen through Ray only): %r", e)
            self._beacon = None
        self.task = task
        self.settings = settings
        self.plan: WorldPlan | None = None
        self.process_id: int | None = None
        self.loop = None
        self.batches = None
        self.eval_batches = None
        self.traced: dict = {}  # program key -> future of the step traced ahead for worlds of that layout
        self._tracing: list = []  # the same futures, for ``traced_ahead`` (``compile`` pops ``traced``)
        self._prepared = threading.Event()
        self.last_step = -1
        self.saving_since: float | None = None  # inside a checkpoint save since: not a hang (save_timeout_s)
        self.evaluating = False  # inside an eval (no step finishes meanwhile: not a hang)
        self._port_holder = None  # process 0: the coordinator's port, held until JAX binds it
        self.writer: SnapshotWriter | None = None  # snapshot holders: copies snapshots to the keeper's ring
        self._snapshots = None  # and what packs them (``slice.snapshotting``), one per world
        self.reports = StepReports()  # finished steps and kept snapshots, until streamed
        self._snapshot_step = -1  # the newest step handed to the writer
        self._compiled_ahead = False  # once per world, after its first chunk (process 0)
        self.gate = StopGate()  # a stop at a step boundary the controller proposes (one world per process)
        self.stepping = StepThread()  # where the step loop is: named with a stuck process

    def prepare(self, for_world: int | None = None) -> dict:
        """Everything that does not need the world: import JAX, load the task's data. Then, in the
        background, trace the step for the worlds this process may join (``for_world``: the size of
        the one it was started for; a process joins one world only, and the others' traces took CPU
        from the world's forming): joining one then only lowers and loads it."""
        t0 = time.perf_counter()
        try:
            from ray_elastic.slice import jax_world
            from ray_elastic.slice.compile_cache import enable_compilation_cache
            from ray_elastic.slice.data import EvalBatches, StepBatches

            c = self.settings
            enable_compilation_cache(c.compilation_cache_dir)
            self.batches = StepBatches(self.task.dataset(), c.global_batch_size, c.seed)
            if c.eval_every:
                self.eval_batches = EvalBatches(self.task.eval_dataset(), c.eval_batch)
            tracer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trace-ahead")
            for plan in self._likely_plans(for_world):
                self.traced[jax_world.program_key(plan)] = tracer.submit(
                    jax_world.trace_for, self.task, c, plan, self.batches
                )
            self._tracing = list(self.traced.values())
            tracer.shutdown(wait=False)
        finally:
            self._prepared.set()
        return self.host_info() | {"prepare_s": time.perf_counter() - t0}

    @ray.method(concurrency_group="ahead")
    def traced_ahead(self) -> None:
        """Returns once ``prepare`` is done and its traces are finished (or cancelled, or failed):
        a standby is warm only then, so a world formed on it only lowers and loads, and its
        tracing threads do not compete with the world's first steps for the CPUs."""
        self._prepared.wait()
        concurrent.futures.wait(self._tracing)

    def _likely_plans(self, for_world: int | None = None) -> list[WorldPlan]:
        """Layouts of the largest worlds this run may form (``ElasticConfig.world_plan``, as forming does),
        or of the one world of ``for_world`` slices."""
        c = self.settings
        sizes = [for_world] if for_world else sorted(c.worlds.sizes(), reverse=True)[:TRACE_AHEAD_WORLDS]
        return [c.worlds.plan(0, [f"s{i}" for i in range(n)]) for n in sizes]

    def host_info(self) -> dict:
        """Where this process really runs (for placement checks and event logs)."""
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "slice_name": os.environ.get("TPU_NAME", ""),
            "tpu_worker_id": os.environ.get("TPU_WORKER_ID", ""),
            "pid": os.getpid(),
            "ip": ray.util.get_node_ip_address(),
            "beacon_port": self._beacon.port if self._beacon is not None else None,
            "beacon_token": self._beacon.token.hex() if self._beacon is not None else None,
        }

    @ray.method(concurrency_group="health")
    def probe(self, speed_check_at: int | None = None, where: bool = False) -> dict:
        """Answered on its own thread even while a step is blocked in a collective. With
        ``speed_check_at``, the step loop times its devices before that step (or its next one);
        with ``where``, the answer says where the step loop is (the watchdog's, to name a stuck one)."""
        since = self.saving_since
        loop = self.loop
        if loop is not None and speed_check_at is not None:
            loop.speed_check_at = speed_check_at
        return {
            "pid": os.getpid(),
            "last_step": self.last_step,
            "dispatched": loop.dispatched if loop is not None else -1,  # a stuck process is behind the others
            "reading": loop.reading if loop is not None else None,  # ... and says whether it waits for its data
            # steps, waits and this clock: the driver's straggler watch compares processes over a window
            "timing": {**loop.timing, "at": time.monotonic()} if loop is not None else None,
            "released": list(loop.released) if loop is not None else [],
            "fingerprints": dict(loop.fingerprints.done) if loop is not None else {},  # step -> one per array
            "saving": since is not None,
            "saving_s": time.monotonic() - since if since is not None else 0.0,
            "evaluating": self.evaluating,
            "checking": loop is not None and loop.speed.running,  # timing its devices: behind, not stuck
            "background": background.activity(),  # compiling ahead: behind the others, not stuck or slow
            "where": self.stepping.where() if where else None,
        }

    @ray.method(concurrency_group="health")
    def propose_stop(self, step: int) -> dict:
        """Stop before ``step`` (:class:`~ray_elastic.slice.stop_gate.StopGate`): accepted unless this
        process has started it; then it holds before it until :meth:`decide_stop`."""
        return self.gate.propose(step)

    @ray.method(concurrency_group="health")
    def decide_stop(self, stop: bool) -> None:
        """Every process accepted the proposed stop (``stop``), or one refused it (go on)."""
        self.gate.decide(stop)

    @ray.method(concurrency_group="health")
    def flip_bit(self, leaf: int, bit: int) -> None:
        """Silent data corruption, for the simulated cluster alone: one bit of this process's block
        of state array ``leaf`` flips before its next step (:meth:`flipped_before` says which)."""
        if "SIM_TPU_HOST" not in os.environ:
            raise RuntimeError("flip_bit is a fault of the simulated cluster: refused on a real host")
        self.loop.flip = (leaf, bit)

    @ray.method(concurrency_group="health")
    def flipped_before(self) -> int | None:
        """The step before which :meth:`flip_bit`'s bit flipped (None: not yet)."""
        flip = self.loop.flip if self.loop is not None else None
        return flip[0] if flip is not None and len(flip) == 1 else None

    def reserve_coordinator_port(self) -> str:
        """Process 0 hosts the JAX coordination service: a free port on its node's address, held
        until ``join_world`` has initialised JAX (see ``mesh.hold_port``)."""
        from ray_elastic.slice.mesh import hold_port

        ip = ray.util.get_node_ip_address()
        self._port_holder = hold_port(ip)
        return f"{ip}:{self._port_holder.getsockname()[1]}"

    def join_world(
        self,
        plan: WorldPlan,
        *,
        slice_index: int,
        host_index: int,
        coordinator_address: str,
        timeout_s: float,
        snapshot: SnapshotRef | None = None,
        checkpoint_step: int | None = None,
        checkpoint_dir: str | None = None,
        keeper=None,
        epoch: int | None = None,
        chip_owners: tuple = (),
    ) -> dict:
        """``jax.distributed.initialize``, mesh, and the state: fresh, from a snapshot or from a checkpoint.

        ``snapshot`` names a snapshot from the same host position of an earlier world (fetched from
        its keeper here, so the load is timed). ``checkpoint_step`` names a committed Orbax
        checkpoint (steps completed) to load, from ``checkpoint_dir`` when given (another run's
        directory, read only) else the run's own. ``keeper``: this host's
        :class:`~ray_elastic.state.snapshot_keeper.SnapshotKeeper`, for a process that keeps snapshots.
        ``chip_owners``: (node id, pid) of earlier processes that may still hold a host's chips;
        the TPU backend starts once those on this host are gone, with this world's ``MEGASCALE_*`` set.
        """
        # Long: its keyword arguments (here and to TrainLoop); each phase of the join is one call.
        from ray_elastic.slice import jax_world as jw
        from ray_elastic.slice import mesh as world_mesh

        c = self.settings
        if self.batches is None:
            self.prepare()
        if self.loop is not None:
            self.loop.close()
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        self.plan = plan
        ours = jw.program_key(plan)
        for key, ahead in self.traced.items():
            if key != ours:
                ahead.cancel()  # one world per process: the other layouts' traces would only take CPU from the join
        self.process_id = plan.process_id(slice_index, host_index)
        set_world_env(megascale_env(coordinator_address, plan.num_slices, slice_index, c.megascale_port))
        owners = [pid for node, pid in chip_owners if node == ray.get_runtime_context().get_node_id()]
        with world_errors("waiting for the host's previous TPU owner to exit", everything=True):
            t_chips = wait_until_gone(owners, timeout_s)
        clear_stale_lock(owners)
        t_init = self._initialize(coordinator_address, timeout_s)
        checkpointer, source = self._checkpointers(checkpoint_step, checkpoint_dir)
        blocks, t_fetch = self._fetch(snapshot, epoch or 0)
        t2 = time.perf_counter()
        mesh = world_mesh.build_mesh(plan)
        with world_errors("building the train state"):  # runs the task's code: only JAX's slice-down errors
            self.loop = jw.TrainLoop(
                self.task,
                plan,
                self.process_id,
                c.seed,
                mesh,
                c.fsdp_min_size,
                self.batches,
                restore=blocks,
                scale_updates=c.scale_updates,
                checkpointer=checkpointer,
                checkpoint_step=checkpoint_step,
                restore_from=source,
                rules=c.logical_axis_rules,
                eval_batches=self.eval_batches,
                pack=c.pack,
                bad_steps=c.bad_steps,
                integrity_every=c.integrity_every,
            )
        if source is not checkpointer:
            source.close()
        if checkpoint_step is not None:
            self.last_step = checkpoint_step - 1
        if keeper is not None and plan.takes_snapshots(self.process_id):
            from ray_elastic.slice.snapshotting import Snapshots

            self._snapshots = Snapshots(keeper, plan.generation, epoch, self.loop, lambda: self.reports.streamed)
            self.writer = self._snapshots.writer
        return {
            "chips_wait_s": t_chips,
            "init_s": t_init,
            "snapshot_fetch_s": t_fetch,
            "snapshots_in_place": self.writer.in_place if self.writer is not None else None,
            "state_s": time.perf_counter() - t2,
            "checkpoint_metadata": self.loop.restored_metadata,
            "mesh_shape": dict(mesh.shape),
            "local_devices": len(mesh.local_devices),
            "row_range": self.loop.row_range,
            "sharded_params": self.loop.sharded_params,
        }

    def _initialize(self, coordinator_address: str, timeout_s: float) -> float:
        """Join the JAX world (process 0's held port is let go once the service has bound it)."""
        from ray_elastic.slice import mesh as world_mesh

        t0 = time.perf_counter()
        try:
            with world_errors("jax.distributed.initialize", everything=True):  # a peer or the coordinator
                world_mesh.initialize(coordinator_address, self.plan, self.process_id, timeout_s)
        finally:
            if self._port_holder is not None:
                self._port_holder.close()
                self._port_holder = None
        return time.perf_counter() - t0

    def _checkpointers(self, checkpoint_step: int | None, checkpoint_dir: str | None) -> tuple:
        """The run's checkpointer (None without ``checkpoint_dir``), and the one to restore from:
        the same, or another run's directory, read only."""
        from ray_elastic.state.checkpoints import Checkpointer

        c = self.settings
        own = Checkpointer(c.checkpoint_dir, c.max_to_keep, c.async_checkpointing) if c.checkpoint_dir else None
        if checkpoint_step is not None and checkpoint_dir not in (None, c.checkpoint_dir):
            return own, Checkpointer(checkpoint_dir, None, read_only=True)
        return own, own

    def _fetch(self, snapshot: SnapshotRef | None, epoch: int) -> tuple[dict | None, float]:
        """This host's part of ``snapshot`` from the keeper holding it, and the seconds it took."""
        if snapshot is None:
            return None, 0.0
        t0 = time.perf_counter()
        with world_errors("fetching the snapshot from its donor", everything=True):  # the donor died
            snap = ray.get(snapshot.keeper.fetch.remote(snapshot.generation, snapshot.step, epoch))
        self.last_step = snap["step"]
        return {k: snap.get(k) for k in ("leaves", "ranges", "paths")}, time.perf_counter() - t0

    def compile(self, step: int) -> dict:
        from ray_elastic.slice import jax_world as jw

        ahead = self.traced.pop(jw.program_key(self.plan), None)  # the others were cancelled by ``join_world``
        traced = None
        if ahead is not None and ahead.cancel() is False:  # started or done: its result comes sooner
            try:
                traced = ahead.result()
            except Exception as e:  # noqa: BLE001 - the world's own trace raises it where it counts
                logger.warning("tracing ahead failed: %r", e)
        with world_errors("compiling the step"):
            phases = self.loop.compile(step, traced)
        self.loop.fingerprints.warm(self.loop.state)
        return phases
