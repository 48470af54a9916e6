"""A TPU slice's shape, checked against Ray's own TPU tables (the ones ``SlicePlacementGroup``
uses), and the node labels Ray puts on TPU hosts."""

from __future__ import annotations

import dataclasses


def _ray_tpu():
    """Ray's TPU tables (pure functions, no cluster needed)."""
    from ray._private.accelerators import tpu as ray_tpu

    return ray_tpu


# The labels Ray puts on a TPU host's node (``ray.util.tpu``), and what the simulated hosts carry.
SLICE_NAME_LABEL = "ray.io/tpu-slice-name"
WORKER_ID_LABEL = "ray.io/tpu-worker-id"
POD_TYPE_LABEL = "ray.io/tpu-pod-type"
TOPOLOGY_LABEL = "ray.io/tpu-topology"
ACCELERATOR_LABEL = "ray.io/accelerator-type"


@dataclasses.dataclass(frozen=True)
class SliceSpec:
    """The shape of one TPU slice.

    Args:
        accelerator: TPU generation as Ray names it: v4, v5p, v5litepod, v6e, v7x (``TPU-V4`` also accepted).
        topology: chip topology, e.g. ``2x2x1`` (v4-8, one host) or ``2x2x2`` (v4-16, two hosts).
        devices_per_host: JAX devices one host's process sees. ``None`` means one per
            chip, as on real TPU VMs; the simulated cluster sets it to its CPU device count.
    """

    accelerator: str = "v4"
    topology: str = "2x2x1"
    devices_per_host: int | None = None

    def __post_init__(self):
        ray_tpu = _ray_tpu()
        raw = self.accelerator.strip()
        acc = raw.lower()
        if acc.startswith("tpu-"):
            acc = acc[4:]
        if acc not in ray_tpu.VALID_TPU_TYPES:
            raise ValueError(
                f"unknown TPU accelerator {raw!r}: use one of {', '.join(ray_tpu.VALID_TPU_TYPES)} "
                "(for example accelerator='v4')"
            )
        object.__setattr__(self, "accelerator", acc)
        topo = self.topology.strip().lower()
        object.__setattr__(self, "topology", topo)
        if not ray_tpu.TPUAcceleratorManager.is_valid_tpu_accelerator_topology(acc, topo):
            valid = sorted(ray_tpu.VALID_TPU_TOPOLOGY.get(acc, ()), key=lambda t: (len(t), t))[:8]
            raise ValueError(f"unknown topology {self.topology!r} for TPU {acc}: use one of {', '.join(valid)}, ...")
        if self.devices_per_host is not None and self.devices_per_host < 1:
            raise ValueError(f"devices_per_host must be >= 1 (or None for one per chip), got {self.devices_per_host}")

    @classmethod
    def for_hosts(cls, accelerator: str, num_hosts: int, devices_per_host: int | None = None) -> SliceSpec:
        """The smallest valid topology of ``accelerator`` with ``num_hosts`` hosts."""
        ray_tpu = _ray_tpu()
        acc = cls(accelerator=accelerator, topology=_first_topology(accelerator)).accelerator
        for topo in sorted(ray_tpu.VALID_TPU_TOPOLOGY[acc], key=ray_tpu.get_num_chips_from_topology):
            spec = cls(acc, topo, devices_per_host)
            if spec.num_hosts == num_hosts:
                return spec
        raise ValueError(f"no {acc} topology has exactly {num_hosts} host(s); try 1, 2, 4 or 8 hosts")

    @property
    def chips_per_host(self) -> int:
        return _ray_tpu().get_chips_per_host(self.topology, self.accelerator)

    @property
    def num_chips(self) -> int:
        return _ray_tpu().get_num_chips_from_topology(self.topology)

    @property
    def num_hosts(self) -> int:
        return max(1, self.num_chips // self.chips_per_host)

    @property
    def pod_type(self) -> str:
        """Ray's pod type name, e.g. ``v4-8`` (cores, not chips, for v4/v5p)."""
        return _ray_tpu().infer_tpu_pod_type_from_topology(self.topology, self.accelerator)

    @property
    def host_devices(self) -> int:
        return self.devices_per_host if self.devices_per_host is not None else self.chips_per_host

    @property
    def devices_per_slice(self) -> int:
        return self.num_hosts * self.host_devices


def _first_topology(accelerator: str) -> str:
    ray_tpu = _ray_tpu()
    acc = accelerator.strip().lower().removeprefix("tpu-")
    topos = ray_tpu.VALID_TPU_TOPOLOGY.get(acc)
    if not topos:
        raise ValueError(f"unknown TPU accelerator {accelerator!r}: use one of {', '.join(ray_tpu.VALID_TPU_TYPES)}")
    return min(topos, key=ray_tpu.get_num_chips_from_topology)
