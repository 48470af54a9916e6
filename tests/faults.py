"""Fault injection for recovery tests: real kills, hangs and removals on the simulated cluster."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np


def ensure_slices(cluster, n: int) -> None:
    """Exactly ``n`` live, running slices (add new ones; kill surplus and hung ones), the killed ones
    already marked dead by Ray (nothing the test starts next is placed on them)."""
    cluster.reap_dead_slices()
    killed = []
    for sl in cluster.alive_slices()[n:]:
        killed += sl.node_ids
        cluster.kill_slice(sl.name)
    cluster.await_declared_dead(killed)
    while len(cluster.alive_slices()) < n:
        cluster.add_slice()


def in_thread(fn, *args, delay: float = 0.0) -> threading.Thread:
    """Run a fault off the driver's thread (the controller keeps running meanwhile)."""

    def run():
        if delay:
            time.sleep(delay)
        fn(*args)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


class FaultPlan:
    """Calls ``faults[step](trainer)`` once, when step ``step`` has finished (from ``on_step``).

    A fault run off the driver's thread (its function returns the thread, :func:`in_thread`) must
    land before the run ends: at ``settle_by`` (a step) the driver waits for it, so a kill slowed by
    loaded cores cannot arrive after the last step (a run with no failure to see). Likewise a
    grow-back expected after ``grow_by`` (a step): from there each step waits ``GROW_PACE_S`` until
    the run grew back (a ``scale_up`` event), so the end of the run cannot come first however long
    the newcomer takes to start (a run with no grow-back to see)."""

    GROW_PACE_S = 0.2

    def __init__(self, faults: dict, settle_by: int | None = None, grow_by: int | None = None):
        self.faults = dict(faults)
        self.trainer = None
        self.fired: list[tuple[int, float]] = []
        self.settle_by = settle_by
        self.grow_by = grow_by
        self._threads: list[threading.Thread] = []

    def on_step(self, m: dict) -> None:
        fault = self.faults.pop(m["step"], None)
        if fault is not None:
            self.fired.append((m["step"], time.time()))
            started = fault(self.trainer)
            if isinstance(started, threading.Thread):
                self._threads.append(started)
        if self.settle_by is not None and m["step"] >= self.settle_by:
            for t in self._threads:
                t.join()
        if self.grow_by is not None and m["step"] >= self.grow_by and not self._grown():
            time.sleep(self.GROW_PACE_S)

    def _grown(self) -> bool:
        return any(e["kind"] == "scale_up" for e in self.trainer.events.events)


def kill_process_of_slice(trainer, slice_index: int) -> None:
    """SIGKILL the JAX process (only) of a slice of the current world: its host stays up."""
    pid = trainer.world.host_infos[slice_index * trainer.world.plan.hosts_per_slice]["pid"]
    os.kill(pid, signal.SIGKILL)


def stop_process_of_slice(trainer, slice_index: int) -> int:
    """SIGSTOP the JAX process (only) of a slice: a hung process on a healthy host."""
    pid = trainer.world.host_infos[slice_index * trainer.world.plan.hosts_per_slice]["pid"]
    os.kill(pid, signal.SIGSTOP)
    return pid


def slice_name(trainer, slice_index: int) -> str:
    return trainer.world.plan.slice_names[slice_index]


def max_rel_err(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b) / np.abs(b)))


OURS = ("SliceWorker", "SnapshotKeeper", "ChunkRelay")  # the actor classes ray-elastic starts


def cluster_state() -> tuple[set, set, set]:
    """The live placement groups, the live actors of ray-elastic's classes (ids), and the processes
    of its dead actors that still run (pids)."""
    import psutil
    import ray

    groups = {pg for pg, g in ray.util.placement_group_table().items() if g["state"] != "REMOVED"}
    ours = [
        (aid, a) for aid, a in ray._private.state.actors().items() if a["ActorClassName"].rsplit(".", 1)[-1] in OURS
    ]
    actors = {aid for aid, a in ours if a["State"] != "DEAD"}
    running = set()
    live = {a.get("Pid") for _, a in ours if a["State"] != "DEAD"}
    for _, a in ours:
        if a["State"] == "DEAD" and a.get("Pid") and a["Pid"] not in live:
            try:
                proc = psutil.Process(a["Pid"])
                # The actor's own process (``ray::SliceWorker``, ``ray::SnapshotKeeper.keep``), not a
                # reused pid (a long suite wraps the pid space: a DashboardAgent took one), and not
                # on a host the test froze (SIGSTOP: nothing there runs until it is killed or resumed).
                cls = a["ActorClassName"].rsplit(".", 1)[-1]
                if proc.cmdline()[0].startswith(f"ray::{cls}") and proc.status() != psutil.STATUS_STOPPED:
                    running.add(a["Pid"])
            except (psutil.Error, IndexError):
                pass
    return groups, actors, running


def left_behind(before: tuple[set, set, set], timeout_s: float = 30.0) -> dict:
    """What outlives a run, compared with ``before`` (:func:`cluster_state`): placement groups,
    ray-elastic's actors, and processes of its actors that are gone. Waits up to ``timeout_s`` for
    Ray's asynchronous removals. Empty when nothing is left."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = cluster_state()
        left = {
            name: sorted(str(x) for x in n - b)
            for name, n, b in zip(("placement_groups", "actors", "processes"), now, before)
        }
        if not any(left.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if left["processes"]:  # say what they are: a leaked process's class and what it runs
        left["processes"] = [_describe(int(pid)) for pid in left["processes"]]
    return {k: v for k, v in left.items() if v}


def chips_held(timeout_s: float = 30.0) -> list[str]:
    """The simulated TPU hosts whose chips a live process still holds (``host: pid (what it runs)``),
    after waiting up to ``timeout_s`` for killed owners to exit: a process still exiting when the
    next test starts would make that test's first world on the host refused (one owner per host).
    A frozen process (SIGSTOP, a hung host the test made) is not counted."""
    import fcntl
    import glob

    import psutil

    from ray_elastic.sim.tpu_runtime import runtime_dir

    deadline = time.monotonic() + timeout_s
    while True:
        held = []
        for path in glob.glob(os.path.join(runtime_dir(), "hosts", "*", "libtpu_lockfile")):
            fd = os.open(path, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
            except BlockingIOError:
                pid = os.pread(fd, 64, 0).decode(errors="replace").strip()
                try:
                    if psutil.Process(int(pid)).status() == psutil.STATUS_STOPPED:
                        continue
                except (psutil.Error, ValueError):
                    pass
                held.append(
                    f"{os.path.basename(os.path.dirname(path))}: {_describe(int(pid)) if pid.isdigit() else pid}"
                )
            finally:
                os.close(fd)
        if not held or time.monotonic() > deadline:
            return held
        time.sleep(0.2)


def _describe(pid: int) -> str:
    import psutil

    try:
        proc = psutil.Process(pid)
        return f"{pid} {proc.cmdline()[:1]} parent {proc.ppid()} ({psutil.Process(proc.ppid()).cmdline()[:1]})"
    except (psutil.Error, IndexError):
        return f"{pid} (gone)"
