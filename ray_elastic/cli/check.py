"""``ray-elastic check``: is this Ray cluster ready for multi-slice training? Run it before the
first job (``ray job submit -- ray-elastic check ...``): it finds the TPU hosts and their slices
from Ray's node labels and says what is wrong and what to change:

- every TPU host carries the slice labels (name, worker id, pod type, topology);
- each slice is whole (as many hosts as its topology has), its workers numbered 0..n-1, and its
  worker 0 holds the ``TPU-<pod type>-head`` resource that slice placement groups ask for;
- the megascale port (libtpu's multi-slice coordinator) on each slice's first host is reachable
  from the hosts of the other slices;
- the checkpoint location is writable from every host (each host writes its own shards);
- jax, jaxlib, libtpu, ray and ray-elastic have the same versions on every host.
"""

from __future__ import annotations

import dataclasses
import socket
from importlib import metadata

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_elastic.tpu import POD_TYPE_LABEL, SLICE_NAME_LABEL, TOPOLOGY_LABEL, WORKER_ID_LABEL, SliceSpec

PACKAGES = ("jax", "jaxlib", "libtpu", "ray", "ray-elastic", "orbax-checkpoint")
LABELS = (SLICE_NAME_LABEL, WORKER_ID_LABEL, POD_TYPE_LABEL, TOPOLOGY_LABEL)


@dataclasses.dataclass(frozen=True)
class Finding:
    """One line of the report: ``ok``, or a problem (``error`` stops training, ``warning`` may not)."""

    level: str  # "ok" | "warning" | "error"
    what: str
    fix: str = ""

    def line(self) -> str:
        mark = {"ok": "ok     ", "warning": "WARNING", "error": "ERROR  "}[self.level]
        return f"{mark} {self.what}" + (f"\n        -> {self.fix}" if self.fix else "")


@dataclasses.dataclass(frozen=True)
class Host:
    node_id: str
    ip: str
    labels: dict
    resources: dict

    @property
    def slice(self) -> str | None:
        return self.labels.get(SLICE_NAME_LABEL)

    @property
    def worker_id(self) -> int | None:
        raw = self.labels.get(WORKER_ID_LABEL)
        return int(raw) if raw is not None and raw.isdigit() else None


def tpu_hosts() -> list[Host]:
    """Alive nodes that have TPU chips or carry any TPU slice label."""
    out = []
    for n in ray.nodes():
        labels = n.get("Labels") or {}
        if n["Alive"] and (n["Resources"].get("TPU", 0) > 0 or any(k in labels for k in LABELS)):
            out.append(Host(n["NodeID"], n["NodeManagerAddress"], labels, n["Resources"]))
    return out


def check_labels_and_slices(hosts: list[Host]) -> list[Finding]:
    """Labels on every host; each slice whole, numbered, with its head resource (no Ray calls)."""
    found: list[Finding] = []
    if not hosts:
        return [
            Finding(
                "error",
                "no TPU hosts in the cluster (no node has a TPU resource or a ray.io/tpu-slice-name label)",
                "start Ray on the TPU VMs (KubeRay TPU worker groups, or `ray start` on each host), see docs/tpu.md",
            )
        ]
    slices: dict[str, list[Host]] = {}
    for h in hosts:
        missing = [k for k in LABELS if not h.labels.get(k)]
        if missing:
            found.append(
                Finding(
                    "error",
                    f"TPU host {h.ip} (node {h.node_id[:12]}) lacks the label(s) {', '.join(missing)}",
                    "Ray sets them from TPU_NAME, TPU_WORKER_ID and the GCE metadata; on KubeRay use a TPU worker "
                    "group (GKE sets them); else `ray start --labels ray.io/tpu-slice-name=...,...`",
                )
            )
        if h.slice:
            slices.setdefault(h.slice, []).append(h)
    for name, members in sorted(slices.items()):
        found.extend(_check_slice(name, members))
    return found


def _check_slice(name: str, members: list[Host]) -> list[Finding]:
    first = members[0].labels
    pod, topology = first.get(POD_TYPE_LABEL), first.get(TOPOLOGY_LABEL)
    accelerator = (pod or "").split("-")[0]
    try:
        expected = SliceSpec(accelerator, topology or "").num_hosts
    except ValueError as e:
        return [Finding("error", f"slice {name}: pod type {pod!r}, topology {topology!r}: {e}", "fix the labels")]
    out = []
    ids = sorted(h.worker_id for h in members if h.worker_id is not None)
    if len(members) != expected:
        out.append(
            Finding(
                "error",
                f"slice {name} ({pod}, {topology}) has {len(members)} of its {expected} hosts",
                "wait for its hosts to join, or replace the slice: a slice trains only whole",
            )
        )
    if ids != list(range(len(members))):
        out.append(
            Finding(
                "error",
                f"slice {name}: worker ids {ids}, expected 0..{len(members) - 1}",
                "each host of a slice needs its own TPU_WORKER_ID (ray.io/tpu-worker-id), from 0",
            )
        )
    head = f"TPU-{pod}-head"
    holders = [h for h in members if h.resources.get(head, 0) > 0]
    if [h.worker_id for h in holders] != [0]:
        out.append(
            Finding(
                "error",
                f"slice {name}: the {head} resource is on worker(s) {[h.worker_id for h in holders]}, expected 0 only",
                "Ray adds it to worker 0 of each slice; a node started by hand needs --resources '{\""
                + head
                + "\": 1}'",
            )
        )
    if not out:
        out.append(Finding("ok", f"slice {name}: {pod} {topology}, {len(members)} host(s), workers numbered, {head}"))
    return out


@ray.remote(num_cpus=0, max_retries=0)
def _host_facts(checkpoint_dir: str | None) -> dict:
    """On one host: package versions, and whether the checkpoint location is writable from here."""
    versions = {}
    for p in PACKAGES:
        try:
            versions[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            versions[p] = None
    error = None
    if checkpoint_dir:
        from ray_elastic.state.storage_locations import check_location

        try:
            check_location(checkpoint_dir)
        except Exception as e:  # noqa: BLE001 - what the host saw is the finding
            error = str(e) or repr(e)
    return {"versions": versions, "checkpoint_error": error}


@ray.remote(num_cpus=0, max_restarts=0)
class _Listener:
    """Listens on the megascale port on a slice's first host (where libtpu's coordinator will)."""

    def __init__(self, port: int):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.error = None
        try:
            self.sock.bind(("0.0.0.0", port))
            self.sock.listen(64)
        except OSError as e:
            self.error = f"cannot listen on port {port}: {e}"

    def status(self) -> str | None:
        return self.error


@ray.remote(num_cpus=0, max_retries=0)
def _connect(ip: str, port: int, timeout_s: float) -> str | None:
    try:
        with socket.create_connection((ip, port), timeout=timeout_s):
            return None
    except OSError as e:
        return str(e)


def _on(host: Host) -> dict:
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(host.node_id, soft=False)}


def check_hosts(hosts: list[Host], checkpoint_dir: str | None, env: dict, timeout_s: float) -> list[Finding]:
    """Versions and checkpoint writes, one task per host."""
    opts = {"runtime_env": {"env_vars": env}} if env else {}
    refs = [_host_facts.options(**_on(h), **opts).remote(checkpoint_dir) for h in hosts]
    facts: list[dict | None] = []
    out = []
    for h, ref in zip(hosts, refs):
        try:
            facts.append(ray.get(ref, timeout=timeout_s))
        except Exception as e:  # noqa: BLE001
            facts.append(None)
            out.append(Finding("error", f"host {h.ip} ({h.slice}) did not answer: {e!r}"[:300], "is its raylet up?"))
    answered = [(h, f) for h, f in zip(hosts, facts) if f is not None]
    alike = True
    for p in PACKAGES:
        seen: dict = {}
        for h, f in answered:
            seen.setdefault(f["versions"][p], []).append(f"{h.slice}/{h.worker_id}")
        if len(seen) > 1:
            alike = False
            detail = "; ".join(f"{v or 'not installed'} on {', '.join(sorted(w)[:4])}" for v, w in seen.items())
            out.append(Finding("error", f"{p} differs across hosts: {detail}", f"install one {p} version everywhere"))
    if answered and alike:
        v = answered[0][1]["versions"]
        out.append(Finding("ok", "same versions on every host: " + ", ".join(f"{p} {v[p]}" for p in PACKAGES if v[p])))
    if checkpoint_dir:
        bad = [(h, f["checkpoint_error"]) for h, f in answered if f["checkpoint_error"]]
        for h, err in bad:
            out.append(
                Finding(
                    "error",
                    f"checkpoint location {checkpoint_dir} is not writable from {h.ip} ({h.slice}/{h.worker_id}): {err}"[
                        :500
                    ],
                    "every host writes its own shards: give the hosts' service account write access "
                    "(roles/storage.objectUser) or pick another location",
                )
            )
        if not bad and answered:
            out.append(Finding("ok", f"checkpoint location {checkpoint_dir} writable from all {len(answered)} hosts"))
    return out


def check_megascale_port(hosts: list[Host], port: int, timeout_s: float) -> list[Finding]:
    """Each slice's first host listens on ``port``; every host of another slice connects to it."""
    firsts = {h.slice: h for h in hosts if h.slice and h.worker_id == 0}
    if len(firsts) < 2:
        return [Finding("ok", "megascale port: fewer than 2 slices, nothing crosses the data-center network")]
    listeners: dict[str, tuple] = {}  # ip -> (actor, host): hosts sharing an address share one listener
    for h in firsts.values():
        if h.ip not in listeners:
            listeners[h.ip] = (_Listener.options(**_on(h)).remote(port), h)
    out = []
    try:
        for ip, (actor, h) in listeners.items():
            err = ray.get(actor.status.remote(), timeout=timeout_s)
            if err:
                out.append(
                    Finding(
                        "warning",
                        f"megascale port on {ip} ({h.slice}): {err}",
                        "a training job may be using it now; else free the port or set megascale_port",
                    )
                )
        probes = [
            (src, dst, _connect.options(**_on(src)).remote(dst.ip, port, timeout_s))
            for dst in firsts.values()
            for src in hosts
            if src.slice and src.slice != dst.slice
        ]
        bad = []
        for src, dst, ref in probes:
            err = ray.get(ref, timeout=timeout_s + 10)
            if err:
                bad.append(f"{src.ip} ({src.slice}) -> {dst.ip}:{port} ({dst.slice}): {err}")
        for line in bad[:10]:
            out.append(
                Finding(
                    "error",
                    f"megascale port not reachable: {line}",
                    f"allow TCP {port} between the TPU hosts (GKE: a NetworkPolicy; GCE: a firewall rule on the VPC)",
                )
            )
        if not bad:
            out.append(Finding("ok", f"megascale port {port} reachable across slices ({len(probes)} connections)"))
    finally:
        for actor, _ in listeners.values():
            ray.kill(actor)
    return out


def run_checks(checkpoint_dir: str | None, megascale_port: int, timeout_s: float) -> list[Finding]:
    """Every check, on the cluster ``ray`` is connected to."""
    from ray_elastic.state.storage_locations import gcs_env

    hosts = tpu_hosts()
    findings = check_labels_and_slices(hosts)
    if hosts:
        findings += check_hosts(hosts, checkpoint_dir, gcs_env(), timeout_s)
        findings += check_megascale_port(hosts, megascale_port, timeout_s)
    return findings


def cmd_check(args) -> int:
    """Print every finding; exit 1 when any is an error (what to change is under it)."""
    from ray_elastic.config import ElasticConfig

    port = args.megascale_port if args.megascale_port is not None else ElasticConfig.megascale_port
    if not 0 < port < 65536:
        raise ValueError(f"--megascale-port must be a TCP port (1-65535), got {port}")
    connect = not ray.is_initialized()  # a notebook (or a test) may be connected already
    if connect:
        ray.init(address=args.address or "auto", log_to_driver=False)
    try:
        findings = run_checks(args.checkpoint_dir, port, args.timeout)
    finally:
        if connect:
            ray.shutdown()
    for f in findings:
        print(f.line())
    errors = sum(f.level == "error" for f in findings)
    print(f"\n{errors} problem(s)" if errors else "\nready: nothing to change")
    return 1 if errors else 0


def add_check_parser(sub) -> None:
    """``ray-elastic check``'s options (``sub``: the CLI's subparsers)."""
    check = sub.add_parser(
        "check", help="before training on a real cluster: TPU slices whole, megascale port open, checkpoints writable"
    )
    check.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS, or the job's cluster)")
    check.add_argument("--checkpoint-dir", default=None, help="the run's checkpoint location (gs://... or a path)")
    check.add_argument(
        "--megascale-port", type=int, default=None, help="libtpu's multi-slice coordinator port (default 8081)"
    )
    check.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for each host's answer")
    check.set_defaults(func=cmd_check)
