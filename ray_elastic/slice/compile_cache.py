"""JAX's persistent compilation cache, shared by every process of a world, and compiling ahead:
a re-formed world loads its step from disk instead of compiling it."""

from __future__ import annotations

import os
import time

import jax

from ray_elastic.decide import WorldPlan
from ray_elastic.slice.mesh import device_grid


def enable_compilation_cache(cache_dir: str | None) -> None:
    """Persistent compilation cache: a new generation recompiles from disk, not from scratch."""
    if not cache_dir:
        return
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    _share_cpu_cache_entries()
    _count_cache_hits()


def _share_cpu_cache_entries() -> None:
    """Let every process of a multi-process CPU world hit the entry process 0 wrote.

    JAX writes persistent-cache entries from process 0 only and expects the other
    processes to compute the same key. On TPU they do (the key hashes the slice's
    topology); on CPU the topology fingerprint is per process, so processes 1.. would miss
    every time and recompile after each re-formation. For CPU devices the key hashes what is the same
    everywhere (device kinds and count) instead; other platforms keep JAX's own key.
    """
    from jax._src import cache_key

    original = cache_key._hash_accelerator_config
    if getattr(original, "_ray_elastic", False):
        return

    def hash_accelerator_config(hash_obj, accelerators):
        devices = list(accelerators.flat)
        if devices and all(d.platform == "cpu" for d in devices):
            hash_obj.update(f"cpu:{len(devices)}:{devices[0].device_kind}".encode())
        else:
            original(hash_obj, accelerators)

    hash_accelerator_config._ray_elastic = True
    cache_key._hash_accelerator_config = hash_accelerator_config


def compile_ahead(traced: jax.stages.Traced, plan: WorldPlan) -> None:
    """Compile the step traced for a smaller layout (``plan``) for the devices a world of that
    layout will have, so that the persistent cache holds it before that world exists: its
    first forming then loads the executable instead of compiling it. Run in process 0 (JAX writes cache entries
    from process 0 only); with no persistent cache it would be wasted work."""
    lower_and_compile(traced, device_grid(plan))


def lower_and_compile(traced: jax.stages.Traced, grid) -> tuple:
    """Lower a step traced ahead for the devices of ``grid`` and compile (or load) it: the one
    definition for a forming world and for :func:`compile_ahead`, whose persistent-cache keys must
    be the same. Returns the executable and the seconds of each phase (and whether it was a hit)."""
    t0 = time.perf_counter()
    lowered = traced.lower(lowering_platforms=(grid.flat[0].platform,))
    t1 = time.perf_counter()
    hits = _cache_hits[0]
    executable = lowered.compile(device_assignment=tuple(grid.flat))
    return executable, {"lower_s": t1 - t0, "load_s": time.perf_counter() - t1, "from_cache": _cache_hits[0] > hits}


_cache_hits = [0]  # persistent-cache hits in this process (jax.monitoring)


def cache_hits() -> int:
    """Persistent-cache hits in this process so far (a compile that raised it loaded from disk)."""
    return _cache_hits[0]


def _count_cache_hits() -> None:
    if getattr(_count_cache_hits, "registered", False):
        return
    jax.monitoring.register_event_listener(
        lambda event, **kw: (
            _cache_hits.__setitem__(0, _cache_hits[0] + 1) if event == "/jax/compilation_cache/cache_hits" else None
        )
    )
    _count_cache_hits.registered = True
