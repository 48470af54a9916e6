"""What a slice process must settle before its TPU backend starts (libtpu reads it once, then):
the multi-slice coordination variables of the world it joins, and that it alone owns its host's
chips. No JAX here: it runs before JAX opens anything."""

from __future__ import annotations

import os
import time

import psutil
from ray.util.tpu import get_tpu_coordinator_env_vars

LIBTPU_LOCKFILE = "/tmp/libtpu_lockfile"  # libtpu's lock on a TPU VM's chips
MASK_KEYS = ("TPU_VISIBLE_CHIPS", "TPU_CHIPS_PER_PROCESS_BOUNDS", "TPU_PROCESS_BOUNDS")
POLL_S = 0.005


def megascale_env(coordinator_address: str, num_slices: int, slice_index: int, port: int) -> dict[str, str]:
    """The ``MEGASCALE_*`` variables of one process of a world: the world's slice count, this
    slice's index in the world's replica order, the coordinator on the world's first slice
    (``coordinator_address``: its host, with or without the JAX coordinator's port)."""
    host = coordinator_address.rsplit(":", 1)[0] if ":" in coordinator_address else coordinator_address
    return get_tpu_coordinator_env_vars(host, num_slices, slice_index, str(port))


def set_world_env(env: dict[str, str]) -> None:
    """Overwrite the coordination variables (never keep values an earlier world left: libtpu would
    wait for slices that are gone, ray-project/ray#62893) and drop a chip mask that names no chip.

    The process owns every chip of its host: it takes no ``TPU`` resource from Ray (its standbys
    share the host's bundle), so Ray sets no ``TPU_VISIBLE_CHIPS`` for it and libtpu opens all of
    them; an empty mask (Ray's override-on-zero setting) would leave it none, so it is removed."""
    os.environ.update(env)
    if os.environ.get("TPU_VISIBLE_CHIPS") == "":
        for key in MASK_KEYS:
            os.environ.pop(key, None)


def wait_until_gone(pids: list[int], timeout_s: float) -> float:
    """Block until none of ``pids`` (earlier owners of this host's chips) is alive; the seconds
    waited. libtpu refuses a second process while the first holds the chips. Raises
    ``TimeoutError`` naming the ones still alive."""
    t0 = time.monotonic()
    alive = [p for p in pids if p != os.getpid()]
    while True:
        alive = [p for p in alive if _running(p)]
        if not alive:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"the host's previous TPU owner(s) {alive} did not exit within {timeout_s:.0f}s")
        time.sleep(POLL_S)


def _running(pid: int) -> bool:
    """Alive, or still exiting: a killed multi-threaded process shows its first thread as a zombie
    while its other threads still exit, and its files (the chips, their lock) are let go only
    when the last one has."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z" or len(os.listdir(f"/proc/{pid}/task")) > 1
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:  # no /proc: ask psutil
        return psutil.pid_exists(pid)


def clear_stale_lock(previous_owners: list[int], path: str = LIBTPU_LOCKFILE) -> bool:
    """Remove libtpu's lock file once the host's previous owners are gone: a process killed hard can
    leave it behind, and libtpu then refuses the next one (marin-community/levanter#1113, which removes
    it after killing its task). Only when there were previous owners (they are gone: the caller waited),
    so a host whose chips someone else holds is left alone. True when a file was removed."""
    if not previous_owners or not os.path.exists(path):
        return False
    try:
        os.remove(path)
        return True
    except OSError:
        return False
