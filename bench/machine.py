"""How fast this machine is right now, recorded beside a bench's figures.

The machine the benches run on is shared: the same pure-Python loop has taken 0.8-0.97 s in
normal hours and 1.6-3.4 s in slow ones, and every multi-process figure moves with it. A bench
that prints ``cpu_probe_s`` (seconds for that loop, at its start and at its end) says which
kind of hour its other figures come from, so two runs are compared only when it agrees.
"""

from __future__ import annotations

import statistics
import time

PROBE_LOOP = 20_000_000  # the loop of bench/README.md's calibrations: 0.8-0.97 s in a normal hour here
NORMAL_S = 0.97  # the slowest probe seen in a normal hour


def cpu_probe_s(loops: int = PROBE_LOOP) -> float:
    """Wall seconds of a pure-Python loop in this process (one core, no Ray, no JAX): bench/README.md's
    ``python3 -c "s=0\nfor i in range(20_000_000): s+=i"``, run the same way (module-level names,
    which a function's locals would make ~2x faster)."""
    t0 = time.perf_counter()
    exec(f"s = 0\nfor i in range({loops}): s += i", {})
    return round(time.perf_counter() - t0, 3)


def hour(probes: list[float]) -> str:
    """'normal' when every probe was within a normal hour's range, else 'slow (x N)'."""
    worst = max(probes)
    return "normal" if worst <= NORMAL_S else f"slow (x{worst / NORMAL_S:.1f} of a normal hour's slowest probe)"


ROLES = {  # the actors' process titles name their class; Ray Train's workers and controller too
    "SliceWorker": "slices",
    "SnapshotKeeper": "keepers",
    "RayTrainWorker": "slices",
    "TrainController": "driver",
}


def cpu_seconds_by_role() -> dict[str, float]:
    """CPU seconds (user + system) used so far by this run's processes, by role: ``driver`` (this
    process, and Ray Train's controller actor), ``slices`` (the JAX processes: the slices'
    and standbys', or Ray Train's workers), ``keepers``, and ``ray`` (every other Ray process:
    raylets, the GCS, agents, idle workers). Differences over a window of steps say where a
    configuration's CPU goes, far more steadily than wall-clock step times on a shared machine."""
    import psutil

    me = psutil.Process().pid
    out = {"driver": 0.0, "slices": 0.0, "keepers": 0.0, "ray": 0.0}
    for p in psutil.process_iter(["cmdline", "cpu_times"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            t = p.info["cpu_times"]
        except (psutil.Error, TypeError):
            continue
        if t is None:
            continue
        role = "driver" if p.pid == me else next((r for k, r in ROLES.items() if k in cmd), None)
        if role is None and ("ray::" in cmd or "raylet" in cmd or "gcs_server" in cmd or "/ray/" in cmd):
            role = "ray"
        if role is not None:
            out[role] += t.user + t.system
    return out


def cpu_ms_per_step(before: dict[str, float], after: dict[str, float], steps: int) -> dict[str, float]:
    """CPU ms per step by role between two :func:`cpu_seconds_by_role` readings ``steps`` apart
    (empty when either reading is missing)."""
    return {k: round((after[k] - before[k]) / steps * 1e3, 2) for k in after} if before and after else {}


def median_cpu_by_role(runs: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per configuration: the median over its repetitions of each role's CPU ms per step, and
    ``all`` (their sum); printed as the bench's ``median CPU ms/step`` line."""
    out = {k: {role: round(statistics.median(r[role] for r in v), 2) for role in v[0]} for k, v in runs.items() if v[0]}
    for by_role in out.values():
        by_role["all"] = round(sum(by_role.values()), 2)
    print("median CPU ms/step: " + "; ".join(f"{k} {v}" for k, v in out.items()))
    return out
