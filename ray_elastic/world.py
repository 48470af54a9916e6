"""One generation of the JAX world: actors on reserved slices, joined and compiled.

Forming a world is one repeatable operation (:meth:`World.form`); the controller
replaces whole generations and never patches a running one, because a JAX world
cannot go on after a peer died mid-collective.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Optional

import ray

from ray_elastic.config import ElasticConfig
from ray_elastic.placement import SliceReservation
from ray_elastic.plan import WorldPlan, plan_world
from ray_elastic.worker import SliceWorker

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class FormationTimes:
    """Seconds spent in each phase of forming a world (for events and goodput)."""

    start_actors_s: float = 0.0
    jax_init_s: float = 0.0
    state_init_s: float = 0.0
    compile_s: float = 0.0
    total_s: float = 0.0


class World:
    """The actors of one generation, in process-id order, and their plan."""

    def __init__(self, plan: WorldPlan, workers: list, host_infos: list[dict], times: FormationTimes, join_infos: list[dict]):
        self.plan = plan
        self.workers = workers
        self.host_infos = host_infos
        self.times = times
        self.join_infos = join_infos

    @classmethod
    def form(
        cls,
        generation: int,
        reservations: list[SliceReservation],
        task_ref: ray.ObjectRef,
        config: ElasticConfig,
        start_step: int,
        global_batch_size: Optional[int] = None,
    ) -> "World":
        """Start one actor per host of each slice, join them into one JAX world, compile."""
        spec = config.slice
        t0 = time.perf_counter()
        actors, infos = [], []
        for res in reservations:
            slice_actors = [
                SliceWorker.options(
                    num_cpus=1,
                    resources={"TPU": spec.chips_per_host},
                    scheduling_strategy=res.host_strategy(h),
                ).remote(task_ref, config.seed, config.compilation_cache_dir, config.fsdp_min_size)
                for h in range(spec.num_hosts)
            ]
            actors.append(slice_actors)
        try:
            infos_nested = [ray.get([a.host_info.remote() for a in sa], timeout=config.jax_init_timeout_s) for sa in actors]
            # Order hosts inside a slice by TPU worker id: process ids follow the hardware.
            workers, host_infos = [], []
            for sa, si in zip(actors, infos_nested):
                order = sorted(range(len(sa)), key=lambda i: int(si[i]["tpu_worker_id"] or i))
                workers.append([sa[i] for i in order])
                host_infos.append([si[i] for i in order])
            names = [hi[0]["slice_name"] or f"slice-{i}" for i, hi in enumerate(host_infos)]
            plan = plan_world(
                generation, names, spec.num_hosts, spec.host_devices, global_batch_size or config.global_batch_size
            )
            times = FormationTimes(start_actors_s=time.perf_counter() - t0)

            coordinator = ray.get(workers[0][0].reserve_coordinator_port.remote(), timeout=config.jax_init_timeout_s)
            joins = ray.get(
                [
                    w.join_world.remote(plan, s, h, coordinator, config.jax_init_timeout_s)
                    for s, sw in enumerate(workers)
                    for h, w in enumerate(sw)
                ],
                timeout=config.jax_init_timeout_s * 2,
            )
            times.jax_init_s = max(j["init_s"] for j in joins)
            times.state_init_s = max(j["state_s"] for j in joins)
            flat = [w for sw in workers for w in sw]
            times.compile_s = max(ray.get([w.compile.remote(start_step) for w in flat], timeout=config.jax_init_timeout_s * 2))
            times.total_s = time.perf_counter() - t0
        except BaseException:
            for sa in actors:
                for a in sa:
                    ray.kill(a)
            raise
        logger.info("world %d formed in %.2fs: %s", generation, times.total_s, plan.mesh_shape)
        return cls(plan, flat, [i for hi in host_infos for i in hi], times, joins)

    def run_chunk(self, start_step: int, num_steps: int) -> list[ray.ObjectRef]:
        """Start a chunk of steps on every process; returns one future per process."""
        return [w.run_chunk.remote(start_step, num_steps) for w in self.workers]

    def teardown(self) -> None:
        """Stop every process of this generation (SIGKILL: a hung JAX worker ignores SIGTERM)."""
        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception as e:
                logger.debug("kill %s: %s", w, e)
