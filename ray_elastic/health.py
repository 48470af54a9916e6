"""Failure detection: what an error means, which nodes are dead, which processes are hung.

The Ray-side evidence the pure :func:`ray_elastic.plan.classify_failure` decides on.
"""

from __future__ import annotations

import time

import ray

from ray_elastic.errors import SliceDownError
from ray_elastic.plan import ErrorKind


def error_kind(exc: BaseException) -> ErrorKind:
    """What an exception from a slice actor says about its slice."""
    if isinstance(exc, ray.exceptions.ActorUnavailableError):
        return ErrorKind.UNAVAILABLE  # maybe dead: the node check decides
    if isinstance(exc, ray.exceptions.RayActorError):
        return ErrorKind.ACTOR_DIED
    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = exc.cause if hasattr(exc, "cause") else None
        if isinstance(cause, SliceDownError) or isinstance(exc, SliceDownError):
            return ErrorKind.SLICE_DOWN
        return ErrorKind.TASK_ERROR
    if isinstance(exc, (ray.exceptions.ObjectLostError, ray.exceptions.GetTimeoutError)):
        return ErrorKind.ACTOR_DIED
    return ErrorKind.TASK_ERROR


def alive_nodes() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def dead_slices(slice_nodes: dict[str, list[str]], suspects: set[str], grace_s: float, poll_s: float = 0.05) -> set[str]:
    """Slices with a dead host.

    A suspect slice (one whose process failed) whose hosts all still look alive is
    watched for ``grace_s``: when a host is killed its processes die first and Ray
    marks the node dead a health-check period later.
    """
    deadline = time.monotonic() + grace_s
    while True:
        alive = alive_nodes()
        dead = {s for s, nodes in slice_nodes.items() if any(n not in alive for n in nodes)}
        if suspects <= dead or time.monotonic() >= deadline:
            return dead
        time.sleep(poll_s)


def unresponsive(workers: list, timeout_s: float) -> set[int]:
    """Indices of workers that do not answer a health probe (their own concurrency group) in time."""
    refs = {w.probe.remote(): i for i, w in enumerate(workers)}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    answered = set()
    for r in ready:
        try:
            ray.get(r)
            answered.add(refs[r])
        except Exception:
            pass
    return set(range(len(workers))) - answered
