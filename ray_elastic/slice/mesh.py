"""The multi-controller JAX world a slice process joins, and the (replica, *slice axes) mesh over it."""

from __future__ import annotations

import socket
import time

import jax
import numpy as np
from jax.sharding import Mesh

from ray_elastic.decide import WorldPlan


def initialize(coordinator_address: str, plan: WorldPlan, process_id: int, timeout_s: float) -> None:
    """Join the multi-controller JAX world of ``plan`` (gloo collectives on CPU).

    A process that connects before process 0 has started the coordination service is
    retried after about a second and holds the whole world back that long, so every other
    process first waits until the coordinator's port accepts connections.
    """
    if process_id != 0:
        _wait_for_port(coordinator_address, timeout_s)
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=plan.num_processes,
        process_id=process_id,
        initialization_timeout=int(timeout_s),
        # The coordination service listens on the node's address only, not on every interface.
        coordinator_bind_address=coordinator_address if process_id == 0 else None,
    )
    expected = plan.num_processes * plan.devices_per_host
    if jax.device_count() != expected:
        raise RuntimeError(
            f"JAX world has {jax.device_count()} devices, plan expects {expected} "
            f"({plan.num_processes} processes x {plan.devices_per_host}); check devices_per_host"
        )


def hold_port(host: str) -> socket.socket:
    """A free port on ``host``, held until the coordination service binds it: the socket is bound
    with SO_REUSEPORT and never listens, so gRPC (which sets SO_REUSEPORT) can bind the same port
    while any other process is refused. Picking a port and closing it would leave a window in
    which something else takes it. Close it once ``initialize`` has returned."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind((host, 0))
    return s


def _wait_for_port(address: str, timeout_s: float, poll_s: float = 0.005) -> None:
    """Until ``host:port`` accepts a TCP connection (or the timeout: initialize then says why)."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, int(port)), timeout=0.1):
                return
        except OSError:
            time.sleep(poll_s)


def build_mesh(plan: WorldPlan) -> Mesh:
    """A (replica, *slice axes) mesh: one row per slice, that slice's devices along its own axes,
    laid out by the hybrid (ICI x DCN) helper from each device's slice index."""
    return Mesh(device_grid(plan), tuple(plan.mesh_shape))


class _SlicedDevice:
    """A CPU device standing for a TPU one: it carries the ``slice_index`` libtpu gives the chips
    of a host from its ``MEGASCALE_SLICE_ID``, which is the process's slice in the world's replica
    order (the simulated TPU runtime checks exactly that), so the mesh is laid out as on TPUs."""

    def __init__(self, device, slice_index: int):
        self.device, self.slice_index = device, slice_index

    def __getattr__(self, name):
        return getattr(self.device, name)


def slice_index(device, hosts_per_slice: int) -> int:
    """The slice ``device`` belongs to: libtpu's ``slice_index`` on TPUs; on other platforms (whose
    devices all say 0) the same number derived from the process (process ids are slice-major)."""
    return device.slice_index if device.platform == "tpu" else device.process_index // hosts_per_slice


def device_grid(plan: WorldPlan):
    """The devices of ``plan``'s mesh, laid out (replica, *slice axes), from this world's first
    ``plan.num_slices`` slices: all of them for this world's own plan; for a smaller layout,
    the devices (and so the device ids) a world of that many slices will have."""
    from jax.experimental import mesh_utils

    inner = tuple(plan.mesh_shape.values())[1:]
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if devices[0].platform != "tpu":
        devices = [_SlicedDevice(d, slice_index(d, plan.hosts_per_slice)) for d in devices]
    devices = [d for d in devices if d.slice_index < plan.num_slices]
    grid = mesh_utils.create_hybrid_device_mesh((1,) + inner, (plan.num_slices,) + (1,) * len(inner), devices=devices)
    return np.vectorize(lambda d: getattr(d, "device", d), otypes=[object])(grid)
