"""What Ray needs to run a head and many nodes as one machine's processes: fast health checks,
nodes started off the main thread, and every address on the loopback interface."""

from __future__ import annotations

import threading

# Fast failure detection for hosts that share one machine's cores. A killed host's raylet refuses
# connections, so each check fails at once: declared dead after 3 checks 200 ms apart, ~0.6 s
# instead of ~14 s. A host that does not answer gets 5 s per check: on a loaded 2-core machine
# compiles starve a live raylet for 5 s and more, and a 1.5 s timeout declared such hosts dead (a
# second failure nobody caused). A hung (SIGSTOPped) host is declared dead after ~15 s; the
# controller's watchdog and raylet probe find it first. On a real cluster the same keys go into
# `ray start --system-config` (see cluster/), with the 1.5 s timeout its own hosts allow.
FAST_HEALTH_CHECKS = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 200,
    "health_check_timeout_ms": 5000,
    "health_check_failure_threshold": 3,
}


def allow_nodes_from_any_thread() -> None:
    """Let Ray nodes be started off the main thread.

    Each ``ray._private.node.Node`` installs a SIGTERM handler, which Python only
    permits on the main thread. Off the main thread we skip that one call; the
    node's atexit hook and reaper process still clean it up, and
    :meth:`SimulatedTPUCluster.shutdown` stops it explicitly.
    """
    import ray._private.utils as ray_utils

    original = ray_utils.set_sigterm_handler
    if getattr(original, "_ray_elastic_wrapped", False):
        return

    def set_sigterm_handler(handler):
        if threading.current_thread() is threading.main_thread():
            original(handler)

    set_sigterm_handler._ray_elastic_wrapped = True
    ray_utils.set_sigterm_handler = set_sigterm_handler


LOOPBACK = "127.0.0.1"
HEAD_INSTANCE_ID = "sim-head-00000"  # the head's cloud instance id, as the autoscaler knows it
# Every simulated node's address is LOOPBACK: nothing of a local run listens on or sends to the
# machine's network address. Ray turns a loopback address given to ray.init (or a job driver's
# RAY_ADDRESS) into the machine's "reachable" address unless it is told the cluster is one machine,
# which is what this flag (named for Windows and macOS, where it is the default) says. Processes
# Ray starts read it from the environment; this process read it when it imported Ray.
ONE_MACHINE_FLAG = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def one_machine(on: bool) -> bool:
    """Tell this process's Ray whether the cluster is one machine; returns what it said before."""
    from ray._private import ray_constants

    before, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, not on
    return not before
