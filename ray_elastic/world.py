"""One generation of the JAX world: actors on reserved slices, joined, restored and compiled.

Forming a world is one repeatable operation (:meth:`World.form`); the controller
replaces whole generations and never patches a running one, because a JAX world
cannot go on after a peer died mid-collective. :class:`WorkerPool` keeps warm
standby processes on every reserved slice host so that forming the next
generation does not wait for Python and JAX to start.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Optional

import ray

from ray_elastic.config import ElasticConfig
from ray_elastic.errors import FormingError
from ray_elastic.placement import SliceReservation
from ray_elastic.plan import WorldPlan, plan_world
from ray_elastic.worker import SliceWorker

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class FormationTimes:
    """Seconds spent in each phase of forming a world (for events and goodput)."""

    start_actors_s: float = 0.0
    jax_init_s: float = 0.0
    state_load_s: float = 0.0
    compile_s: float = 0.0
    total_s: float = 0.0
    standbys_used: int = 0


class WorkerPool:
    """Slice actors for the next generation: standbys started ahead of need.

    Actors take no Ray resources of their own: the slice's placement group holds
    the host, and any number of processes can live in its bundle. On a real TPU
    host only the promoted process touches the TPU (JAX opens devices at
    ``jax.distributed.initialize``), so a standby does not compete for chips.
    """

    def __init__(self, task_ref: ray.ObjectRef, config: ElasticConfig, env: Optional[dict] = None):
        self.task_ref = task_ref
        self.config = config
        self.env = env or {}  # forwarded to every slice process (GCS endpoint and credentials)
        self._standby: dict[tuple[int, int], tuple] = {}  # (id(reservation), host) -> (actor, prepare ref)

    def _start(self, res: SliceReservation, host: int) -> tuple:
        options = {"num_cpus": 0, "scheduling_strategy": res.host_strategy(host)}
        if self.env:
            options["runtime_env"] = {"env_vars": self.env}
        actor = SliceWorker.options(**options).remote(self.task_ref, self.config)
        return actor, actor.prepare.remote()

    def take(self, res: SliceReservation, host: int) -> tuple[tuple, bool]:
        """An actor for (slice, host): the warm standby if there is one, else a new process."""
        got = self._standby.pop((id(res), host), None)
        return (got, True) if got is not None else (self._start(res, host), False)

    def replenish(self, reservations: list[SliceReservation]) -> None:
        """Start a standby for every host of these slices that has none."""
        if not self.config.standby_workers:
            return
        for res in reservations:
            for h in range(res.spec.num_hosts):
                if (id(res), h) not in self._standby:
                    self._standby[(id(res), h)] = self._start(res, h)

    def discard(self, res: SliceReservation) -> None:
        """The slice left: kill its standbys."""
        for h in range(res.spec.num_hosts):
            got = self._standby.pop((id(res), h), None)
            if got is not None:
                _kill(got[0])

    def shutdown(self) -> None:
        for actor, _ in self._standby.values():
            _kill(actor)
        self._standby.clear()


def _host_labels(reservations: list[SliceReservation]) -> Optional[list[list[dict]]]:
    """Per slice, per bundle: the TPU slice name and worker id of the node it is placed on.

    ``None`` when a node lacks the labels (the actors' own report is used instead).
    """
    node_labels = {n["NodeID"]: n.get("Labels") or {} for n in ray.nodes() if n["Alive"]}
    out = []
    for res in reservations:
        hosts = []
        for node in res.node_ids():
            lab = node_labels.get(node, {})
            if "ray.io/tpu-slice-name" not in lab:
                return None
            hosts.append({"slice_name": lab["ray.io/tpu-slice-name"], "tpu_worker_id": lab.get("ray.io/tpu-worker-id", "")})
        if len(hosts) != res.spec.num_hosts:
            return None
        out.append(hosts)
    return out


def _gather(refs: list, owners: list[str], timeout_s: float) -> list:
    """``ray.get(refs)``, but failing at the first error rather than after the slowest ref, and
    naming the slice it came from: when a peer dies while a world forms, the others would wait
    in ``jax.distributed.initialize`` or a collective until their timeout."""
    pending = dict(zip(refs, owners))
    deadline = time.monotonic() + timeout_s
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise FormingError(sorted(set(pending.values())), TimeoutError(
                f"no answer within {timeout_s:.0f}s while forming the world"))
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as e:  # noqa: BLE001 - the first error ends forming at once
                raise FormingError([pending[ref]], e) from e
            del pending[ref]
    return ray.get(refs)


def _kill(actor) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception as e:  # already gone
        logger.debug("kill %s: %s", actor, e)


class World:
    """The actors of one generation, in process-id order, and their plan."""

    def __init__(self, plan: WorldPlan, workers: list, host_infos: list[dict], times: FormationTimes,
                 join_infos: list[dict], reservations: list[SliceReservation]):
        self.plan = plan
        self.workers = workers
        self.host_infos = host_infos
        self.times = times
        self.join_infos = join_infos
        self.reservations = reservations  # plan order

    @classmethod
    def form(
        cls,
        *,
        generation: int,
        reservations: list[SliceReservation],
        pool: WorkerPool,
        config: ElasticConfig,
        start_step: int,
        global_batch_size: int,
        lr_scale: float = 1.0,
        restore: Optional[Callable[[str], Optional[list]]] = None,
        checkpoint_step: Optional[int] = None,
    ) -> "World":
        """Take one actor per host of each slice, join them into one JAX world, load state, compile.

        Args:
            restore: slice name -> per-host snapshot refs it loads (None: fresh parameters).
            checkpoint_step: every process loads this committed checkpoint instead (steps completed).
        """
        spec = config.slice
        t0 = time.perf_counter()
        taken = [[pool.take(res, h) for h in range(spec.num_hosts)] for res in reservations]
        actors = [[a for (a, _), _ in sa] for sa in taken]
        times = FormationTimes(standbys_used=sum(warm for sa in taken for _, warm in sa))
        prepared = [[p for (_, p), _ in sa] for sa in taken]
        try:
            # Slice names and host order come from the nodes' TPU labels when Ray has them, so a
            # new process that is still starting does not hold the others back: they begin
            # joining the JAX world at once and it catches up.
            labels = _host_labels(reservations)
            if labels is None:
                labels = [[{"slice_name": i["slice_name"], "tpu_worker_id": i["tpu_worker_id"]}
                           for i in ray.get(sp, timeout=config.jax_init_timeout_s)] for sp in prepared]
            # Order hosts inside a slice by TPU worker id: process ids follow the hardware.
            workers, host_prepared = [], []
            for sa, sp, sl in zip(actors, prepared, labels):
                order = sorted(range(len(sa)), key=lambda i: int(sl[i]["tpu_worker_id"] or i))
                workers.append([sa[i] for i in order])
                host_prepared.append([sp[i] for i in order])
            names = [sl[0]["slice_name"] or f"slice-{i}" for i, sl in enumerate(labels)]
            for res, name in zip(reservations, names):
                res.slice_name = name
            plan = plan_world(
                generation, names, spec.num_hosts, spec.host_devices, global_batch_size,
                data_stride=config.global_batch_size, lr_scale=lr_scale, snapshot_slices=config.snapshot_replicas,
            )
            times.start_actors_s = time.perf_counter() - t0

            coordinator = ray.get(workers[0][0].reserve_coordinator_port.remote(), timeout=config.jax_init_timeout_s)
            joins = []
            for s, sw in enumerate(workers):
                refs = restore(names[s]) if restore is not None else None
                for h, w in enumerate(sw):
                    src = [refs[h]] if refs is not None else None
                    joins.append(w.join_world.remote(
                        plan, slice_index=s, host_index=h, coordinator_address=coordinator,
                        timeout_s=config.jax_init_timeout_s, snapshot=src, checkpoint_step=checkpoint_step))
            owners = [n for n in names for _ in range(spec.num_hosts)]  # slice of each process, plan order
            joins = _gather(joins, owners, config.jax_init_timeout_s * 2)
            host_infos = [ray.get(sp, timeout=config.jax_init_timeout_s) for sp in host_prepared]
            times.jax_init_s = max(j["init_s"] for j in joins)
            times.state_load_s = max(j["snapshot_fetch_s"] + j["state_s"] for j in joins)
            flat = [w for sw in workers for w in sw]
            compiles = _gather([w.compile.remote(start_step) for w in flat], owners, config.jax_init_timeout_s * 2)
            times.compile_s = max(compiles)
            times.total_s = time.perf_counter() - t0
        except BaseException:
            for sa in actors:
                for a in sa:
                    _kill(a)
            raise
        logger.info("world %d formed in %.2fs: %s", generation, times.total_s, plan.mesh_shape)
        return cls(plan, flat, [i for hi in host_infos for i in hi], times, joins, list(reservations))

    def slice_of(self, process_id: int) -> str:
        return self.plan.slice_names[process_id // self.plan.hosts_per_slice]

    def slice_node_ids(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for pid, info in enumerate(self.host_infos):
            out.setdefault(self.slice_of(pid), []).append(info["node_id"])
        return out

    def run_chunk(self, start_step: int, num_steps: int, final_step: int) -> list:
        """Start a chunk of steps on every process; one streaming generator per process."""
        return [w.run_chunk.remote(start_step, num_steps, final_step) for w in self.workers]

    def finish_checkpoints(self, timeout_s: float) -> list:
        """Wait for every process's in-flight checkpoint save to commit (a planned stop, not a failure);
        returns process 0's newly committed (step, total seconds)."""
        return ray.get([w.finish_checkpoints.remote() for w in self.workers], timeout=timeout_s)[0]

    def teardown(self, confirm_s: float = 0.0) -> None:
        """Stop every process of this generation (SIGKILL: a hung JAX worker ignores SIGTERM).

        ``confirm_s`` > 0 waits up to that long until the processes are really gone, so
        nothing they still write (a checkpoint commit) can land after this returns.
        """
        for w in self.workers:
            _kill(w)
        if confirm_s > 0:
            pings = [w.probe.remote() for w in self.workers]
            ray.wait(pings, num_returns=len(pings), timeout=confirm_s)
