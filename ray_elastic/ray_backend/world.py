"""One generation of the JAX world: actors on reserved slices, joined, restored and compiled.

Forming a world is one repeatable operation (:meth:`World.form`); the controller
replaces whole generations and never patches a running one, because a JAX world
cannot go on after a peer died mid-collective. :class:`~ray_elastic.ray_backend.pool.WorkerPool`
keeps warm standby processes on every reserved slice host so that forming the next
generation does not wait for Python and JAX to start.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import ray

from ray_elastic.config import ElasticConfig
from ray_elastic.control.backend import FormationTimes, slice_name
from ray_elastic.decide import WorldPlan
from ray_elastic.detect import health
from ray_elastic.detect.liveness import DeathWatch
from ray_elastic.errors import FormingError, HostLost, ProcessFailed, ProcessGone, RayletGone
from ray_elastic.ray_backend.placement import SliceReservation, host_labels
from ray_elastic.ray_backend.pool import WorkerPool, kill
from ray_elastic.state.snapshots import SnapshotRef

logger = logging.getLogger(__name__)


WATCH_S = 0.25  # how often a wait while forming looks at the members' placements


def _gather(
    refs: list[Any],
    owners: list[Any],
    timeout_s: float,
    error: Callable[[list[Any], BaseException], Exception] = FormingError,
    what: str = "while forming the world",
    watch: Callable[[], None] | None = None,
) -> list[Any]:
    """``ray.get(refs)``, but failing at the first error rather than after the slowest ref, and
    naming whose it was (``error(owners, cause)``): when a peer dies, the others would wait in
    ``jax.distributed.initialize``, a collective or a checkpoint commit until their timeout.
    ``watch`` is called every ``WATCH_S`` while waiting; what it raises ends the wait."""
    pending = dict(zip(refs, owners))
    deadline = time.monotonic() + timeout_s
    while pending:
        left = max(0.0, deadline - time.monotonic())
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=min(left, WATCH_S) if watch else left)
        if not ready:
            if watch is None or time.monotonic() >= deadline:
                raise error(sorted(set(pending.values())), TimeoutError(f"no answer within {timeout_s:.0f}s {what}"))
            watch()
            continue
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as e:
                raise error([pending[ref]], e) from e
            del pending[ref]
    return ray.get(refs)


def _placed(reservations: list[SliceReservation], names: list[str]) -> Callable[[], None]:
    """A ``watch`` that fails forming when a member's host has lost its node. No ref need fail
    then: the member's own call may have returned already while a peer still waits on it (a
    newcomer fetching its snapshot from it waited out ``jax_init_timeout_s``), or its process may
    never have started (Ray places the bundle again instead of failing the actor)."""
    hosts = [res.node_ids() for res in reservations]  # where the processes are: Ray may move a bundle

    def check() -> None:
        raylets = health.raylet_addresses(
            {n for nodes in hosts for n in nodes}
        )  # alive in the table; UNPLACED never is
        gone = health.refusing(raylets)  # dead, though the table may not say so yet
        for nodes, name in zip(hosts, names):
            if not set(nodes) <= raylets.keys():
                raise FormingError([name], HostLost(f"a host of slice {name} lost its node while the world formed"))
            if gone & set(nodes):
                raise FormingError(
                    [name],
                    RayletGone(
                        f"the raylet of a host of slice {name} refuses connections "
                        "while the world forms: its node is gone"
                    ),
                )

    return check


def _alive(watch: Callable[[], None], deaths: DeathWatch, owners: list[str]) -> Callable[[], None]:
    """``watch``, and a process whose liveness connection closed ends the wait too."""

    def check() -> None:
        gone = deaths.dead()
        if gone:
            p = min(gone)
            raise FormingError(
                [owners[p]],
                ProcessGone(
                    f"process {p} of slice {owners[p]} is gone while the world forms: its liveness connection closed"
                ),
            )
        watch()

    return check


def _beacon(info: dict[Any, Any]) -> tuple[str, int, bytes] | None:
    """Where a process's liveness beacon listens, and its token (None: it has none)."""
    return (info["ip"], info["beacon_port"], bytes.fromhex(info["beacon_token"])) if info.get("beacon_port") else None


class _Hosts:
    """The processes taken for a world, per slice and host, and the phases of joining them."""

    def __init__(self, reservations: list[SliceReservation], taken: list[list[Any]], num_hosts: int):
        self.reservations, self.num_hosts = reservations, num_hosts
        self.actors = [[a for (a, _), _ in sa] for sa in taken]  # as taken; ``workers``: in host order
        self.prepared = [[p for (_, p), _ in sa] for sa in taken]
        self.standbys_used = sum(warm for sa in taken for _, warm in sa)
        flat = [p for sp in self.prepared for p in sp]
        started, _ = ray.wait(flat, num_returns=len(flat), timeout=0)
        self.starting = len(flat) - len(started)
        self.workers: list[list[Any]] = []
        self.keepers: list[list[Any]] = []
        self.names: list[str] = []

    @classmethod
    def take(cls, pool: WorkerPool, reservations: list[SliceReservation], num_hosts: int) -> _Hosts:
        """One process per host of each slice: a warm standby where there is one."""
        taken = [[pool.take(res, h, len(reservations)) for h in range(num_hosts)] for res in reservations]
        return cls(reservations, taken, num_hosts)

    @property
    def owners(self) -> list[str]:
        """The slice of each process, in plan order."""
        return [n for n in self.names for _ in range(self.num_hosts)]

    def order(self, pool: WorkerPool, timeout_s: float) -> None:
        """Name the slices and order each one's hosts by TPU worker id (process ids follow the hardware).

        The names and ids come from the nodes' TPU labels when Ray has them, so a process that is
        still starting does not hold the others back; else from the processes' own reports."""
        labels = host_labels(self.reservations)
        if labels is None:
            known = [slice_name(res, i) for i, res in enumerate(self.reservations)]
            flat = [p for sp in self.prepared for p in sp]
            infos = _gather(
                flat,
                [n for n in known for _ in range(self.num_hosts)],
                timeout_s,
                watch=_placed(self.reservations, known),
            )
            labels = [
                [
                    {"slice_name": i["slice_name"], "tpu_worker_id": i["tpu_worker_id"]}
                    for i in infos[s * self.num_hosts : (s + 1) * self.num_hosts]
                ]
                for s in range(len(known))
            ]
        prepared = []
        for res, sa, sp, sl in zip(self.reservations, self.actors, self.prepared, labels):
            order = sorted(range(len(sa)), key=lambda i: int(sl[i]["tpu_worker_id"] or i))
            self.workers.append([sa[i] for i in order])
            prepared.append([sp[i] for i in order])
            self.keepers.append([pool.keeper(res, i) for i in order])  # each process's own host's
        self.prepared = prepared
        self.names = [sl[0]["slice_name"] or f"slice-{i}" for i, sl in enumerate(labels)]
        for res, name in zip(self.reservations, self.names):
            res.slice_name = name

    def join(
        self,
        plan: WorldPlan,
        pool: WorkerPool,
        timeout_s: float,
        watch: Callable[[], None],
        *,
        epoch: int,
        start_step: int,
        restore: Callable[[str], list[SnapshotRef] | None] | None,
        checkpoint_step: int | None,
        checkpoint_dir: str | None,
    ) -> list[dict[Any, Any]]:
        """Every process joins the JAX world and loads its state; returns what each reported."""
        # Steps from start_step on are run again: what earlier worlds kept of them is dropped.
        begun = [
            k.begin.remote(plan.generation, start_step, (self.names[s], h), epoch)
            for s, ks in enumerate(self.keepers)
            for h, k in enumerate(ks)
        ]
        first = self.workers[0][0]
        (coordinator,) = _gather([first.reserve_coordinator_port.remote()], self.names[:1], timeout_s, watch=watch)
        owners = pool.chip_owners()  # each process waits for the earlier ones on its own host
        joins = []
        for s, sw in enumerate(self.workers):
            refs = restore(self.names[s]) if restore is not None else None
            for h, w in enumerate(sw):
                joins.append(
                    w.join_world.remote(
                        plan,
                        slice_index=s,
                        host_index=h,
                        coordinator_address=coordinator,
                        timeout_s=timeout_s,
                        snapshot=refs[h] if refs is not None else None,
                        checkpoint_step=checkpoint_step,
                        checkpoint_dir=checkpoint_dir,
                        keeper=self.keepers[s][h],
                        epoch=epoch,
                        chip_owners=owners,
                    )
                )
        pool.claim_chips([p for sp in self.prepared for p in sp])  # the next world's processes wait for these
        if not all(_gather(begun, self.owners, timeout_s, watch=watch)):  # a keeper a newer driver owns
            pool.run_keepers.superseded.set()
            pool.run_keepers.check()
        pool.confirm_keepers([k for ks in self.keepers for k in ks])
        return _gather(joins, self.owners, timeout_s * 2, watch=watch)

    def compile(self, start_step: int, timeout_s: float, watch: Callable[[], None], times: FormationTimes) -> None:
        """Every process compiles its step (or loads it from the persistent cache); the slowest counts."""
        flat = [w for sw in self.workers for w in sw]
        compiles = _gather([w.compile.remote(start_step) for w in flat], self.owners, timeout_s * 2, watch=watch)
        for phase in ("trace_s", "lower_s", "load_s", "compile_s"):
            setattr(times, phase, max(c[phase] for c in compiles))
        times.compiled_from_cache = sum(bool(c.get("from_cache")) for c in compiles)


class World:
    """The actors of one generation, in process-id order, and their plan."""

    def __init__(
        self,
        plan: WorldPlan,
        workers: list[Any],
        host_infos: list[dict[Any, Any]],
        times: FormationTimes,
        join_infos: list[dict[Any, Any]],
        reservations: list[SliceReservation],
        keepers: list[Any],
        channels: list[list[int]] | None = None,
        relays: list[Any] | None = None,
        deaths: DeathWatch | None = None,
    ):
        self.plan = plan
        self.deaths = deaths or DeathWatch([])  # the driver's connections to its processes' beacons
        # How the driver reaches the processes: one channel per process, or a relay per group of
        # quiet ones (relay.channels); ``relays[c]`` serves channel c when it is a group.
        self.channels = channels or [[p] for p in range(len(workers))]
        self.relays = relays or [None] * len(self.channels)
        self._chunks_sent = 0
        self.workers = workers
        self.keepers = keepers  # per process: its host's snapshot keeper
        self.host_infos = host_infos
        self.times = times
        self.join_infos = join_infos
        self.reservations = reservations  # plan order
        self.epoch = 0  # the driver's, on every keeper call (a newer driver's keepers refuse it)

    @classmethod
    def form(
        cls,
        *,
        generation: int,
        reservations: list[SliceReservation],
        pool: WorkerPool,
        config: ElasticConfig,
        start_step: int,
        restore: Callable[[str], list[SnapshotRef] | None] | None = None,
        checkpoint_step: int | None = None,
        checkpoint_dir: str | None = None,
        epoch: int = 0,
    ) -> World:
        """Take one actor per host of each slice, join them into one JAX world, load state, compile.

        Args:
            restore: slice name -> per-host snapshots it loads (:class:`SnapshotRef`; None: fresh parameters).
            checkpoint_step: every process loads this committed checkpoint instead (steps completed),
                from ``checkpoint_dir`` when given (else the run's own).
        """
        t0 = time.perf_counter()
        hosts = _Hosts.take(pool, reservations, config.slice.num_hosts)
        times = FormationTimes(standbys_used=hosts.standbys_used, processes_starting=hosts.starting)
        deaths: DeathWatch | None = None
        try:
            hosts.order(pool, config.jax_init_timeout_s)
            plan = config.world_plan(generation, hosts.names)
            times.start_actors_s = (t_join := time.perf_counter()) - t0
            watch = _placed(reservations, hosts.names)
            joins = hosts.join(
                plan,
                pool,
                config.jax_init_timeout_s,
                watch,
                epoch=epoch,
                start_step=start_step,
                restore=restore,
                checkpoint_step=checkpoint_step,
                checkpoint_dir=checkpoint_dir,
            )
            host_infos = [i for sp in hosts.prepared for i in ray.get(sp, timeout=config.jax_init_timeout_s)]
            deaths = DeathWatch([_beacon(i) for i in host_infos])
            times.joined(joins)
            times.join_wall_s = (t_compile := time.perf_counter()) - t_join
            flat = [w for sw in hosts.workers for w in sw]
            hosts.compile(start_step, config.jax_init_timeout_s, _alive(watch, deaths, hosts.owners), times)
            times.compile_wall_s = time.perf_counter() - t_compile
            chans, relays = pool.relays.reach(
                generation,
                len(flat),
                [p for p in range(len(flat)) if not plan.takes_snapshots(p)],
                lambda p: (flat[p], "run_chunk_quiet", ()),
            )
            times.total_s = time.perf_counter() - t0
        except BaseException:
            if deaths is not None:
                deaths.stop()
            for sa in hosts.actors:
                for a in sa:
                    kill(a)
            raise
        logger.info("world %d formed in %.2fs: %s", generation, times.total_s, plan.mesh_shape)
        keepers = [k for ks in hosts.keepers for k in ks]
        world = cls(plan, flat, host_infos, times, joins, list(reservations), keepers, chans, relays, deaths)
        world.epoch = epoch
        return world

    def slice_of(self, process_id: int) -> str:
        return self.plan.slice_names[process_id // self.plan.hosts_per_slice]

    def slice_node_ids(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for pid, info in enumerate(self.host_infos):
            out.setdefault(self.slice_of(pid), []).append(info["node_id"])
        return out

    def run_chunk(
        self, start_step: int, num_steps: int, final_step: int, snapshot_every: int, eval_before: bool = False
    ) -> list[Any]:
        """Start a chunk of steps on every process; one ref per channel: a streaming generator for
        each snapshot holder, a plain task (one result at the chunk's end) for each other process,
        or a relay's call (``{}``, or the errors by process) for each group of them."""
        args = (start_step, num_steps, final_step, snapshot_every, eval_before)
        refs = []
        for procs, relay in zip(self.channels, self.relays):
            if relay is not None:
                refs.append(relay.run.remote(self.plan.generation, self._chunks_sent, *args))
            else:
                (p,) = procs
                w = self.workers[p]
                refs.append((w.run_chunk if self.plan.takes_snapshots(p) else w.run_chunk_quiet).remote(*args))
        self._chunks_sent += 1
        return refs

    def finish_checkpoints(self, timeout_s: float, save_step: int | None = None) -> list[Any]:
        """Wait for every process's in-flight checkpoint save to commit (a planned stop, not a failure);
        with ``save_step``, first save the current state as that checkpoint. Returns process 0's newly
        committed (step, total seconds). Raises :class:`ProcessFailed` naming the first process that failed."""
        refs = [w.finish_checkpoints.remote(save_step) for w in self.workers]
        # A dead process fails its ref at once; the others would wait in the commit for it.
        committed: list[Any] = _gather(
            refs,
            list(range(len(refs))),
            timeout_s,
            lambda procs, e: ProcessFailed(procs[0], e),
            "while checkpoints committed",
        )[0]
        return committed

    def teardown(self, confirm_s: float = 0.0) -> None:
        """Stop every process of this generation (SIGKILL: a hung JAX worker ignores SIGTERM).

        ``confirm_s`` > 0 waits up to that long until the processes are really gone, so
        nothing they still write (a checkpoint commit) can land after this returns.
        """
        self.deaths.stop()
        for w in self.workers:
            kill(w)
        if confirm_s > 0:
            pings = [w.probe.remote() for w in self.workers]
            ray.wait(pings, num_returns=len(pings), timeout=confirm_s)
