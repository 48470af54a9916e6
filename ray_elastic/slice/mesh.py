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
    """A (replica, *slice axes) mesh: one row per slice, that slice's devices along its own axes.

    On real multi-slice TPUs the devices carry ``slice_index`` and the hybrid
    (ICI x DCN) helper lays them out; on CPU processes are grouped by process id,
    which ``plan`` numbers slice-major.
    """
    return Mesh(device_grid(plan), tuple(plan.mesh_shape))


def device_grid(plan: WorldPlan):
    """The devices of ``plan``'s mesh, laid out (replica, *slice axes), from this world's first
    ``plan.num_slices`` slices: all of them for this world's own plan; for a smaller layout,
    the devices (and so the device ids) a world of that many slices will have."""
    sizes = tuple(plan.mesh_shape.values())
    inner = sizes[1:]
    devices = jax.devices()
    if devices[0].platform == "tpu" and plan.num_slices > 1:
        from jax.experimental import mesh_utils

        devices = [d for d in devices if getattr(d, "slice_index", 0) < plan.num_slices]
        return mesh_utils.create_hybrid_device_mesh(
            (1,) + inner, (plan.num_slices,) + (1,) * len(inner), devices=devices
        )
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))[: int(np.prod(sizes))]
    return np.array(ordered).reshape(sizes)
