"""Failure detection: what an error means, which nodes are dead, which processes are hung.

The Ray-side evidence the pure :func:`ray_elastic.decide.classify_failure` decides on.
"""

from __future__ import annotations

import socket
import time

import ray

from ray_elastic.decide import ErrorKind
from ray_elastic.errors import FormingError, HostLost, ProcessGone, RayletGone, SliceDownError, StorageError


def error_kind(exc: BaseException) -> ErrorKind:
    """What an exception from a slice actor says about its slice."""
    if isinstance(exc, FormingError):
        return error_kind(exc.cause)
    if isinstance(exc, RayletGone):
        return ErrorKind.NODE_DIED  # proof, not suspicion: nothing listens where its raylet did
    if isinstance(exc, ProcessGone):
        return ErrorKind.PROCESS_DIED  # its connection closed: the process is gone; is its host? (vouching)
    if isinstance(exc, HostLost):
        return ErrorKind.ACTOR_DIED  # its process is gone or never came: the node table decides
    if isinstance(exc, StorageError):
        return ErrorKind.STORAGE  # seen by the driver itself (a save past save_timeout_s)
    if isinstance(exc, TimeoutError):
        return ErrorKind.HANG  # a process that did not answer in time
    if isinstance(exc, ray.exceptions.ActorUnavailableError):
        return ErrorKind.UNAVAILABLE  # maybe dead: the node check decides
    if isinstance(exc, ray.exceptions.RayActorError):
        # Ray's GCS says why the actor died; the text is the only place it says it.
        text = str(exc)
        if "because its node has died" in text:
            return ErrorKind.NODE_DIED
        if "because its worker process has died" in text:
            return ErrorKind.PROCESS_DIED
        if "error raised in its creation task" in text:
            return ErrorKind.TASK_ERROR  # the task could not be unpickled or set up there: the user's code
        return ErrorKind.ACTOR_DIED
    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = exc.cause if hasattr(exc, "cause") else None
        if isinstance(cause, StorageError) or isinstance(exc, StorageError):
            return ErrorKind.STORAGE
        if isinstance(cause, SliceDownError) or isinstance(exc, SliceDownError):
            return ErrorKind.SLICE_DOWN
        return ErrorKind.TASK_ERROR
    if isinstance(exc, (ray.exceptions.ObjectLostError, ray.exceptions.GetTimeoutError)):
        return ErrorKind.ACTOR_DIED
    return ErrorKind.TASK_ERROR


REFUSAL_PROBE_S = 0.05  # a refusal comes back at once; a silent host proves nothing either way
ANSWER_S = 0.3  # a live raylet accepts a connection in milliseconds


def error_text(exc: BaseException, limit: int = 300) -> str:
    """One line saying what failed: the slice process's own exception for a Ray task error (whose
    first line only names the task), else the error's first line."""
    cause = getattr(exc, "cause", None) if isinstance(exc, ray.exceptions.RayTaskError) else None
    if isinstance(exc, FormingError):
        return error_text(exc.cause, limit)
    text = f"{type(cause).__name__}: {cause}" if cause is not None else str(exc)
    return (text.splitlines()[0] if text else "")[:limit]


def raylet_addresses(node_ids) -> dict[str, tuple[str, int]]:
    """Where each live node's raylet listens (nodes the table has marked dead are left out)."""
    nodes = {n["NodeID"]: n for n in ray.nodes()}
    return {
        i: (nodes[i]["NodeManagerAddress"], nodes[i]["NodeManagerPort"])
        for i in node_ids
        if i in nodes and nodes[i]["Alive"]
    }


# Raylets this driver has connected to. Only such a raylet proves its node dead by refusing: one
# that refused from the start may be behind a firewall or out of this driver's network. Node ids
# are never reused, so a record never goes stale.
_reached: set[str] = set()


def _raylet_state(node_id: str, address: tuple[str, int], timeout_s: float) -> str:
    """'answers', 'refuses' (nothing listens: the raylet process is gone, so is its Ray node) or
    'silent' (no answer in time: a host that is unreachable, or only slow)."""
    try:
        with socket.create_connection(address, timeout=timeout_s):
            _reached.add(node_id)
            return "answers"
    except ConnectionRefusedError:
        return "refuses"
    except OSError:
        return "silent"


def answering(addresses: dict[str, tuple[str, int]], timeout_s: float = ANSWER_S) -> set[str]:
    """The nodes whose raylet accepts a TCP connection: hosts that are up, whatever happened to a
    process on them."""
    return {n for n, addr in addresses.items() if _raylet_state(n, addr, timeout_s) == "answers"}


def _raylet_replies(node_id: str, address: tuple[str, int], timeout_s: float) -> bool:
    """The raylet answers a request (its cheapest RPC, ``GetSystemConfig``). Stronger than a
    connection accepted: the kernel accepts connections on a killed raylet's port until its last
    thread has exited (for milliseconds after the SIGKILL, answering no request), and a slice process's death is seen sooner than that
    (``liveness``): a lost host would read as a process crash on a live host."""
    try:  # Ray's own channel (TLS and token auth as the cluster has them); private, so guarded
        from ray._private.grpc_utils import init_grpc_channel
        from ray.core.generated import node_manager_pb2, node_manager_pb2_grpc
    except ImportError:  # another Ray layout: an accepted connection is the best evidence left
        return _raylet_state(node_id, address, timeout_s) == "answers"
    channel = init_grpc_channel(f"{address[0]}:{address[1]}")
    try:
        node_manager_pb2_grpc.NodeManagerServiceStub(channel).GetSystemConfig(
            node_manager_pb2.GetSystemConfigRequest(), timeout=timeout_s
        )
        _reached.add(node_id)
        return True
    except Exception:  # noqa: BLE001 - refused, reset or no reply in time: nothing vouches for it
        return False
    finally:
        channel.close()


def raylets_answer(node_ids: list[str], timeout_s: float = ANSWER_S) -> bool:
    """True when the raylet of every node answers a request: the hosts are alive, whatever happened
    to a process on them. A lost host refuses (its raylet died with it), stays silent, or (its raylet
    still dying) accepts a connection but never replies."""
    addresses = raylet_addresses(node_ids)
    return (
        bool(node_ids)
        and addresses.keys() >= set(node_ids)
        and all(_raylet_replies(n, addresses[n], timeout_s) for n in node_ids)
    )


def refusing(addresses: dict[str, tuple[str, int]], timeout_s: float = REFUSAL_PROBE_S) -> set[str]:
    """The nodes whose raylet, reached by this driver before, now refuses a connection: dead Ray
    nodes, seen before Ray's health checks have failed often enough to mark them (three checks
    apart, or one that runs into its timeout)."""
    return {n for n, addr in addresses.items() if _raylet_state(n, addr, timeout_s) == "refuses" and n in _reached}


def dead_slices(
    slice_nodes: dict[str, list[str]], suspects: set[str], grace_s: float, poll_s: float = 0.05
) -> set[str]:
    """Slices with a dead host: marked dead in the node table, or (for a suspect) its raylet refusing.

    A suspect slice (one whose process failed and whose host nothing vouches for) whose
    hosts all still look alive is watched for ``grace_s``: when a host is killed its
    processes die first and Ray marks the node dead a health-check period later; a refusing
    raylet says so sooner. With no suspects this is one look at the node table.
    """
    deadline = time.monotonic() + grace_s
    while True:
        raylets = raylet_addresses({n for nodes in slice_nodes.values() for n in nodes})  # the live ones
        dead = {s for s, nodes in slice_nodes.items() if not raylets.keys() >= set(nodes)}
        gone = refusing({n: raylets[n] for s in suspects - dead for n in slice_nodes.get(s, ()) if n in raylets})
        dead |= {s for s in suspects if gone.intersection(slice_nodes.get(s, ()))}
        if suspects <= dead or time.monotonic() >= deadline:
            return dead
        time.sleep(poll_s)


def draining_nodes(timeout_s: float = 2.0) -> dict[str, tuple[float | None, str]]:
    """Nodes Ray marks draining (a preemption warning from a SIGTERMed ``ray start``, the
    autoscaler, ``ray drain-node``): node id -> (deadline as wall-clock seconds, None when it has
    none; why). One GCS call (what Ray Serve polls to move replicas off a node before it goes)."""
    gcs = ray._private.worker.global_worker.gcs_client
    return {
        node: (deadline_ms / 1000.0 if deadline_ms else None, "drained by Ray (a preemption or termination notice)")
        for node, deadline_ms in gcs.get_draining_nodes(timeout=timeout_s).items()
    }


def probe(workers: list, timeout_s: float, where: bool = False) -> list:
    """Each worker's answer to a health probe (its own concurrency group), or None when it did not
    answer within ``timeout_s`` (hung, stopped or dead); ``where``: with where its step loop is."""
    refs = [w.probe.remote(where=where) for w in workers]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    ready = set(ready)
    answers = []
    for r in refs:
        try:
            answers.append(ray.get(r) if r in ready else None)
        except Exception:  # noqa: BLE001 - dead
            answers.append(None)
    return answers


def unresponsive(workers: list, timeout_s: float) -> set[int]:
    """Indices of workers that do not answer a health probe in time."""
    return {i for i, a in enumerate(probe(workers, timeout_s)) if a is None}


def busy(answers: list, last_seen_step: int) -> bool:
    """After the watchdog fired, from every worker's probe answer: the world is slow, not hung.

    Some process finished a step the driver has not seen (its report is still on the way): every
    process took part in that step's collectives, so one that did not answer in time is starved,
    not stopped (a world beside processes still starting on few cores). Or every process answered and one is inside a
    checkpoint save (a synchronous save, a slow bucket) or an eval (no step finishes during one;
    its first run compiles the eval step). The caller passes the newest step seen
    by earlier probes too, so a world that stops for good is found at the next watch."""
    answered = [a for a in answers if a is not None]
    if any(a.get("last_step", -1) > last_seen_step for a in answered):
        return True
    return len(answered) == len(answers) and any(a.get("saving") or a.get("evaluating") for a in answered)


def stuck_saves(answers: list, limit_s: float) -> dict[int, float]:
    """Processes (by index) whose probe answer says they have been inside one checkpoint save for
    longer than ``limit_s``, with how long: a save that never ends is a failed save, not a slow one."""
    return {
        p: a["saving_s"]
        for p, a in enumerate(answers)
        if a is not None and a.get("saving") and a.get("saving_s", 0.0) > limit_s
    }


def stuck_processes(answers: list) -> dict[int, dict]:
    """After the watchdog fired with the world not busy: the processes (by index) that never reached
    the step the others wait in (their newest dispatched step is behind the newest any dispatched),
    with their answer. Empty when every answering process is at the same step (a hang inside a
    step is the world's, not one process's). When some of those behind wait for their own rows
    (``reading``), only they are: the others behind the front are one dispatch short of it, waiting
    in a step's collective for them like the rest."""
    answered = {p: a for p, a in enumerate(answers) if a is not None and "dispatched" in a}
    front = max((a["dispatched"] for a in answered.values()), default=-1)
    behind = {p: a for p, a in answered.items() if a["dispatched"] < front}
    reading = {p: a for p, a in behind.items() if a.get("reading") is not None}
    return reading or behind


def working_aside(answers: list) -> bool:
    """Some process runs work beside its steps (compiling the next world's step ahead:
    :mod:`~ray_elastic.slice.background`): on a host's shared CPUs any process may fall behind the
    others meanwhile, neither stuck nor a straggler."""
    return any(_background(a)[1] for a in answers)


def worked_aside(answers: list, started_before: list[int] | None) -> set[int]:
    """The processes (by index) that run work beside their steps now, or started some since the
    previous round (``started_before``: each one's count of such jobs then; None: the world's
    first round, none before it)."""
    started, before = background_started(answers), started_before or [0] * len(answers)
    return {p for p, a in enumerate(answers) if a is not None and (_background(a)[1] or started[p] != before[p])}


def background_started(answers: list) -> list[int]:
    """Each process's count of jobs started beside its steps so far (0 when it did not answer)."""
    return [_background(a)[0] for a in answers]


def _background(answer: dict | None) -> tuple[int, int]:
    """A probe answer's (jobs started beside the steps, running now); (0, 0) when it did not answer."""
    started, running = (answer or {}).get("background") or (0, 0)
    return started, running


def stuck_early(answers: list) -> dict[int, dict]:
    """For the stuck bound, before the hang bound: :func:`stuck_processes`, but while some process
    works aside (:func:`working_aside`) only those waiting for their own rows (the others may be
    behind for that while; the hang bound still judges them)."""
    behind = stuck_processes(answers)
    if working_aside(answers):
        return {p: a for p, a in behind.items() if a.get("reading") is not None}
    return behind


def newest_step(answers: list) -> int:
    """The newest step any probed process finished (-1: none answered)."""
    return max((a.get("last_step", -1) for a in answers if a is not None), default=-1)
