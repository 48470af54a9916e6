"""A stand-in for the TPU runtime (libtpu) on simulated TPU hosts: the rules a real TPU VM
enforces when a process opens its chips, enforced on the CPU devices that stand for them.

JAX loads this module as a plugin (the ``jax_plugins`` entry point in ``pyproject.toml``) in
every process, and :func:`initialize` does nothing unless the process runs on a simulated TPU
host (``SIM_TPU_HOST`` in its environment, set by :func:`ray_elastic.sim.hosts.tpu_host`).
There it wraps the CPU backend's factory, so whatever opens the backend (the slice process
joining a world, a standby tracing too eagerly, user code) goes through :func:`open_chips`:

1. the ``MEGASCALE_*`` variables libtpu reads at start-up are present and agree with the
   JAX world the process is in: the same slice count and coordinator in every process, one
   slice id per slice, ids ``0..n-1`` in the world's replica (process) order, as many slices as
   the ids say (a value left over from an earlier world does not), the coordinator on slice 0;
2. one process per host owns the chips: an exclusive lock on the host's ``libtpu_lockfile``,
   held until the process exits, refused (as libtpu refuses) while another live process holds it;
3. opening the chips and loading an executable take time: the delay in ``startup.json``.

A broken rule is a *breach*: appended to ``breaches.jsonl`` (what the tests check after each
test) and raised, so the backend does not start, as on hardware.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import socket
import tempfile
import time

HOST_ENV = "SIM_TPU_HOST"  # "<slice name>/<worker id>" on a simulated TPU host's processes
MEGASCALE_KEYS = ("MEGASCALE_COORDINATOR_ADDRESS", "MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID", "MEGASCALE_PORT")
PEERS_TIMEOUT_MS = 120_000  # a world's processes open their backends together, after jax.distributed.initialize
_lock_fd: int | None = None  # the chips' lock, held for the life of the process (as libtpu holds it)


class TPURuntimeBreach(RuntimeError):
    """A process broke a rule the TPU runtime enforces: on a real TPU host it would not start."""


@dataclasses.dataclass(frozen=True)
class StartupCost:
    """Seconds a real TPU host spends opening its chips and loading a step's executable, added
    once per process when its backend starts (see docs/tpu.md for the figures behind defaults)."""

    open_s: float = 0.0
    load_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.open_s + self.load_s


def runtime_dir() -> str:
    """Where the simulated hosts of this cluster keep their chip locks and the breach log (under
    the cluster's private ``RAY_TMPDIR``, which every process it starts inherits)."""
    return os.path.join(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir(), "sim-tpu-runtime")


def set_startup_cost(cost: StartupCost, directory: str | None = None) -> None:
    """Every backend opened from now on, on every simulated host, waits ``cost`` first."""
    d = directory or runtime_dir()
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, "startup.json.tmp")
    with open(tmp, "w") as f:
        json.dump(dataclasses.asdict(cost), f)
    os.replace(tmp, os.path.join(d, "startup.json"))


def startup_cost(directory: str | None = None) -> StartupCost:
    try:
        with open(os.path.join(directory or runtime_dir(), "startup.json")) as f:
            return StartupCost(**json.load(f))
    except FileNotFoundError:
        return StartupCost()


def breaches(directory: str | None = None) -> list[dict]:
    """Every breach recorded so far (one dict per line of ``breaches.jsonl``)."""
    return _read(directory, "breaches.jsonl")


def openings(directory: str | None = None) -> list[dict]:
    """Every backend the stand-in let start: host, pid and the ``MEGASCALE_*`` values it had."""
    return _read(directory, "opened.jsonl")


def _read(directory: str | None, name: str) -> list[dict]:
    try:
        with open(os.path.join(directory or runtime_dir(), name)) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def _append(name: str, record: dict) -> None:
    d = runtime_dir()
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "a") as f:  # one short line per write: appends do not interleave
        f.write(json.dumps({"host": os.environ.get(HOST_ENV), "pid": os.getpid(), "at": time.time(), **record}) + "\n")


def _breach(rule: str, message: str) -> TPURuntimeBreach:
    _append("breaches.jsonl", {"rule": rule, "message": message})
    return TPURuntimeBreach(f"TPU runtime ({rule}): {message}")


# ---------------------------------------------------------------- rule 1: MEGASCALE_*
def _own_record() -> dict:
    missing = [k for k in MEGASCALE_KEYS if not os.environ.get(k)]
    if missing:
        raise _breach(
            "megascale",
            f"{', '.join(missing)} not set when the TPU backend started: libtpu cannot join the "
            "multi-slice world (set MEGASCALE_* for every world before the backend starts)",
        )
    name, _, worker = os.environ[HOST_ENV].partition("/")
    return {
        "coordinator": os.environ["MEGASCALE_COORDINATOR_ADDRESS"],
        "port": os.environ["MEGASCALE_PORT"],
        "num_slices": int(os.environ["MEGASCALE_NUM_SLICES"]),
        "slice_id": int(os.environ["MEGASCALE_SLICE_ID"]),
        "slice": name,
        "worker": worker,
        "ip": _own_ip(),
    }


def _own_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray: the loopback stands for this host
        return socket.gethostbyname("localhost")


def check_world(records: list[dict]) -> str | None:
    """What is wrong with one world's MEGASCALE_* values (``records`` in process order), or None."""
    first = records[0]
    for p, r in enumerate(records):
        if (r["num_slices"], r["coordinator"], r["port"]) != (first["num_slices"], first["coordinator"], first["port"]):
            return (
                f"process {p} has MEGASCALE_NUM_SLICES={r['num_slices']}, coordinator {r['coordinator']}:{r['port']}; "
                f"process 0 has {first['num_slices']}, {first['coordinator']}:{first['port']}"
            )
    slices: list[str] = []  # slice names in process (replica) order
    for r in records:
        if r["slice"] not in slices:
            slices.append(r["slice"])
    if len(slices) != first["num_slices"]:
        return (
            f"MEGASCALE_NUM_SLICES={first['num_slices']} but the world has {len(slices)} slices "
            f"({', '.join(slices)}): a value left from an earlier world makes libtpu wait for slices that are gone"
        )
    for p, r in enumerate(records):
        want = slices.index(r["slice"])
        if r["slice_id"] != want:
            return (
                f"process {p} (slice {r['slice']}) has MEGASCALE_SLICE_ID={r['slice_id']}, "
                f"but that slice is number {want} in the world's replica order"
            )
    if first["coordinator"] != first["ip"]:  # process 0 is slice 0's first host
        return f"MEGASCALE_COORDINATOR_ADDRESS={first['coordinator']} is not slice 0's first host ({first['ip']})"
    return None


def _check_megascale() -> None:
    from jax._src import distributed

    state = distributed.global_state
    if state.client is None:
        raise _breach(
            "megascale",
            "the TPU backend started outside a JAX world (jax.distributed.initialize was not called): "
            "only the process a world was formed on may open the chips",
        )
    own = _own_record()
    client, me, n = state.client, state.process_id, state.num_processes
    generation = os.environ["MEGASCALE_COORDINATOR_ADDRESS"]  # one key space per coordination service
    client.key_value_set(f"sim_tpu/{generation}/{me}", json.dumps(own))
    records = []
    for p in range(n):
        try:
            records.append(json.loads(client.blocking_key_value_get(f"sim_tpu/{generation}/{p}", PEERS_TIMEOUT_MS)))
        except Exception as e:  # a peer that never opened its backend (it died): the world's fault
            raise RuntimeError(f"TPU runtime: process {p} of the world did not start its TPU backend: {e}") from e
    wrong = check_world(records)
    if wrong:
        raise _breach("megascale", wrong)
    _append("opened.jsonl", {"process": me, **own})


# ---------------------------------------------------------------- rule 2: one owner
def _host_dir() -> str:
    d = os.path.join(runtime_dir(), "hosts", os.environ[HOST_ENV].replace("/", "-"))
    os.makedirs(d, exist_ok=True)
    return d


def _take_chips() -> None:
    global _lock_fd
    if _lock_fd is not None:
        return
    path = os.path.join(_host_dir(), "libtpu_lockfile")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise _breach(
            "one-owner",
            f"The TPU is already in use by process with pid {holder}. Not attempting to load libtpu.so in this "
            f"process (host {os.environ[HOST_ENV]}): a host's chips have one owner until it exits",
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    _lock_fd = fd  # never closed: the kernel lets go when the process exits, however it exits


def _check_visibility() -> None:
    """An actor with no TPU resource inherits the host's environment: no chip mask. A mask that
    names no chip (Ray's override on zero) would leave the owner without chips."""
    if os.environ.get("TPU_VISIBLE_CHIPS") == "":
        raise _breach("visibility", "TPU_VISIBLE_CHIPS is empty: the process would see no chips")


def open_chips() -> None:
    """What libtpu does when this process's backend starts; raises :class:`TPURuntimeBreach`."""
    _check_visibility()
    _take_chips()
    _check_megascale()
    cost = startup_cost()
    if cost.total_s > 0:
        time.sleep(cost.total_s)


def initialize() -> None:
    """The ``jax_plugins`` hook: on a simulated TPU host, the CPU backend opens through the stand-in."""
    if not os.environ.get(HOST_ENV):
        return
    from jax._src import xla_bridge

    def factory():
        open_chips()
        return xla_bridge.make_cpu_client()

    xla_bridge.register_backend_factory("cpu", factory, priority=0, fail_quietly=False)
