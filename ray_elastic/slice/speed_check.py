"""How fast this process's devices compute, timed on a fixed local program.

A slow chip (or a host whose processes run only part of the time) slows every step of a synchronous
world, but every process then waits for it inside the step's collectives: each one's step ends at
the same moment, and its step times cannot say which one it was. A fixed program with no
collective, run on each local device while the device is idle, takes longer only where the device
(or its host) is slow. The driver asks for a check when the world's steps have slowed without a
process returning late (:mod:`ray_elastic.ray_backend.straggler_watch`) and compares processes.
"""

from __future__ import annotations

import statistics
import threading
import time

import jax
import jax.numpy as jnp

SIZE = 256  # a (SIZE, SIZE) float32 matrix multiplied ITERATIONS times: a few ms on one CPU core
ITERATIONS = 24
REPEATS = 3  # the median of this many timed runs: one late wake-up does not name a process slow


@jax.jit
def _local_program(x: jax.Array) -> jax.Array:
    def body(_, y):
        return jnp.tanh(y @ x)

    return jax.lax.fori_loop(0, ITERATIONS, body, x)


class SpeedCheck:
    """The fixed program on ``devices`` (this process's), timed on request. Its inputs are placed and
    the program compiled in the background (:meth:`prepare_in_background`, after the world's first
    chunk, or at the first check, which then times nothing)."""

    def __init__(self, devices: list):
        self._devices = devices
        self._ready = threading.Event()
        self._started = False
        self._inputs: list[jax.Array] = []
        self.running = False  # timing the devices now (the probe says so: behind the others, not stuck)

    def prepare_in_background(self) -> None:
        if not self._started:
            self._started = True
            threading.Thread(target=self._prepare, name="speed-check-compile", daemon=True).start()

    def _prepare(self) -> None:
        try:
            x = jnp.full((SIZE, SIZE), 1.0 / SIZE, jnp.float32)
            self._inputs = [jax.device_put(x, d) for d in self._devices]
            jax.block_until_ready([_local_program(x) for x in self._inputs])
        finally:
            self._ready.set()

    def seconds(self) -> float | None:
        """The slowest local device's median over ``REPEATS`` runs of the program, the devices
        timed one after the other (on a simulated host they share its cores). The caller has
        waited for its steps: the devices are idle. None while the program is not compiled yet:
        a check never stalls the world on a compile (on a starved host that took seconds)."""
        self.prepare_in_background()
        if not self._ready.is_set():
            return None
        slowest, self.running = 0.0, True
        try:
            for x in self._inputs:
                runs = []
                for _ in range(REPEATS):
                    t0 = time.perf_counter()
                    _local_program(x).block_until_ready()
                    runs.append(time.perf_counter() - t0)
                slowest = max(slowest, statistics.median(runs))
        finally:
            self.running = False
        return slowest
