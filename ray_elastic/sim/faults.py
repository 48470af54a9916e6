"""The faults a simulated cluster offers: a slice or one host lost (SIGKILL), a slice hung (SIGSTOP),
a slice preempted with notice (drained, then killed at the deadline), a slow slice (its processes
duty-cycled), a bit flipped in a slice's replica of the state, and finding what of the cluster
still runs."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import psutil

from ray_elastic.sim.hosts import SimulatedHost, SimulatedSlice, process_children, send_signal

logger = logging.getLogger(__name__)


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def _alive_node_ids() -> set[str]:
    """The nodes Ray's node table lists alive."""
    import ray

    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


class SliceFaults:
    """Mixed into :class:`~ray_elastic.sim.cluster.SimulatedTPUCluster` (its ``_cluster``, ``temp_dir``,
    ``slice_by_name`` and ``alive_slices``)."""

    def processes(self) -> list[psutil.Process]:
        """Every live process of the cluster: the head's and each live slice host's, with children."""
        head = SimulatedHost(node_id=self._cluster.head_node.node_id, node=self._cluster.head_node)
        table = process_children()
        return [p for h in [head] + [h for sl in self.alive_slices() for h in sl.hosts] for p in h.processes(table)]

    def kill_slice(self, name: str) -> float:
        """A lost slice: SIGKILL every process of its hosts (and remove the nodes this process started).
        Returns the wall time of the first SIGKILL: when the loss happened, for whoever times its detection."""
        sl = self.slice_by_name(name)
        killed_at = self._kill_hosts(sl.hosts, name)
        sl.alive = False
        logger.info("simulated slice %s killed", name)
        return killed_at

    def kill_host(self, name: str, worker_id: int) -> float:
        """One host of a multi-host slice lost (the slice is unusable; ``reap_dead_slices`` clears the rest).
        Returns the wall time of the first SIGKILL."""
        killed_at = self._kill_hosts([self.slice_by_name(name).hosts[worker_id]], name)
        logger.info("simulated host %d of slice %s killed", worker_id, name)
        return killed_at

    def _kill_hosts(self, hosts: list[SimulatedHost], name: str) -> float:
        """SIGKILL these hosts' processes, all found first (one read of the process table) so the
        kills follow each other at once, as in a real host or slice loss; then remove the nodes this
        process started. Returns when the first SIGKILL went out: on loaded cores that can be long
        after the caller asked, so whoever times detection starts from this."""
        table = process_children()
        procs = [p for host in hosts for p in host.processes(table)]
        killed_at = time.time()
        send_signal(procs, signal.SIGKILL)
        for host in hosts:
            if host.node is None:
                continue  # an autoscaled host: the autoscaler retires its instance
            try:
                self._cluster.remove_node(host.node, allow_graceful=False)
            except Exception as e:  # noqa: BLE001 - already dead processes make remove_node's checks noisy
                logger.debug("remove_node(%s): %s", name, e)
                self._cluster.worker_nodes.discard(host.node)
        return killed_at

    def await_declared_dead(self, node_ids: list[str], timeout_s: float = 30.0) -> None:
        """Until Ray's node table marks these (killed) hosts' nodes dead: a killed node stays in the
        table, alive, until its health checks have failed (~0.6 s here), and what is placed on it
        meanwhile (a new driver's actor, a reservation) dies with it when it is marked."""
        deadline = time.monotonic() + timeout_s
        while set(node_ids) & _alive_node_ids():
            if time.monotonic() > deadline:
                raise TimeoutError(f"Ray still lists killed nodes alive after {timeout_s:.0f}s: {node_ids}")
            time.sleep(0.1)

    def reap_dead_slices(self) -> list[str]:
        """Kill and remove slices that Ray has declared dead (for example hung ones); returns their names."""
        alive = _alive_node_ids()
        dead = [s.name for s in self.alive_slices() if any(nid not in alive for nid in s.node_ids)]
        for name in dead:
            self.kill_slice(name)
        return dead

    def preempt_slice(self, name: str, notice_s: float) -> float:
        """A preemption with notice: every host of the slice drained through the GCS with reason
        ``DRAIN_NODE_REASON_PREEMPTION`` and a deadline ``notice_s`` from now (what a SIGTERMed
        ``ray start`` and autoscaler v2 do), then the slice killed at the deadline (a timer
        thread). Returns the deadline (wall clock)."""
        import ray
        from ray.core.generated import autoscaler_pb2

        sl = self.slice_by_name(name)
        deadline = time.time() + notice_s
        gcs = ray._raylet.GcsClient(address=self.address)
        reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
        for node in sl.node_ids:
            accepted, why = gcs.drain_node(node, reason, "simulated preemption", int(deadline * 1000))
            if not accepted:
                raise RuntimeError(f"the drain of {name}'s node {node} was refused: {why}")
        timer = threading.Timer(max(0.0, deadline - time.time()), self._kill_if_alive, args=(sl,))
        timer.daemon = True
        timer.start()
        self._timers.append(timer)
        logger.info("simulated slice %s drained; killed in %.1fs", name, notice_s)
        return deadline

    def await_preemptions(self) -> None:
        """Until every slice ``preempt_slice`` warned has been killed at its deadline."""
        for timer in self._timers:
            timer.join()

    def _kill_if_alive(self, sl: SimulatedSlice) -> None:
        """The preempted slice itself (not a replacement that reuses its name) killed at its deadline."""
        try:
            if sl.alive:
                self._kill_hosts(sl.hosts, sl.name)
                sl.alive = False
                logger.info("simulated slice %s killed at its preemption deadline", sl.name)
        except Exception as e:  # noqa: BLE001 - the cluster may be shutting down
            logger.debug("preempted slice %s not killed: %r", sl.name, e)

    def slow_slice(self, name: str, factor: float, period_s: float = 0.01) -> threading.Event:
        """A slow host: the slice's JAX processes (and any that start there later) run ``1/factor``
        of the time, stopped and continued (SIGSTOP/SIGCONT) every ``period_s``, as a degraded chip
        or a noisy neighbour slows every step. Set the returned event to end it."""
        sl, stop = self.slice_by_name(name), threading.Event()
        run_s = period_s / factor

        def duty_cycle() -> None:
            procs: list = []
            while not stop.is_set() and sl.alive:
                table = process_children()
                procs = [p for h in sl.hosts for p in h.processes(table) if "SliceWorker" in " ".join(_cmdline(p))]
                for _ in range(max(1, int(1.0 / period_s))):  # the processes looked up again each second
                    send_signal(procs, signal.SIGCONT)
                    if stop.wait(run_s):
                        break
                    send_signal(procs, signal.SIGSTOP)
                    time.sleep(period_s - run_s)
            send_signal(procs, signal.SIGCONT)

        threading.Thread(target=duty_cycle, name=f"slow-{name}", daemon=True).start()
        logger.info("simulated slice %s slowed %.1fx", name, factor)
        return stop

    def flip_bit(self, world, name: str, leaf: int = 0, bit: int = 20, timeout_s: float = 5.0) -> int | None:
        """Silent data corruption: one bit of train state array ``leaf`` flips on the first host of
        slice ``name`` of the running ``world`` (``trainer.world``) before its next step: its replica
        drifts from the others while every process runs on (``SliceWorker.flip_bit``, which only a
        simulated host accepts). Returns the step it flipped before, or None when the world stopped
        first (nothing flipped)."""
        import ray

        worker = world.workers[world.plan.slice_names.index(name) * world.plan.hosts_per_slice]
        ray.get(worker.flip_bit.remote(leaf, bit))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                step = ray.get(worker.flipped_before.remote(), timeout=timeout_s)
            except Exception:  # noqa: BLE001 - its world ended (the process is gone)
                return None
            if step is not None:
                return step
            time.sleep(0.02)
        return None

    def hang_slice(self, name: str) -> None:
        """A hung slice: SIGSTOP its hosts' processes (raylet and workers)."""
        self._signal_slice(self.slice_by_name(name), signal.SIGSTOP)

    def resume_slice(self, name: str) -> None:
        """Undo :meth:`hang_slice`."""
        self._signal_slice(self.slice_by_name(name), signal.SIGCONT)

    @staticmethod
    def _signal_slice(sl: SimulatedSlice, sig: int) -> None:
        table = process_children()
        send_signal([p for host in sl.hosts for p in host.processes(table)], sig)

    def stray_processes(self) -> list[psutil.Process]:
        """Processes of this cluster's slice hosts that are still running: their environment has our
        private ``RAY_TMPDIR`` and a ``TPU_NAME`` (what every host's raylet, agents and workers
        inherit). After :meth:`shutdown` this is empty. Found by environment because Ray's agents
        retitle themselves (``ray::DashboardAgent``) and outlive a SIGKILLed raylet."""
        out = []
        for p in psutil.process_iter(["pid"]):
            try:
                env = p.environ()
                exited = p.status() == psutil.STATUS_ZOMBIE  # gone, only not reaped yet by its parent
            except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
                continue
            if p.pid != os.getpid() and not exited and env.get("RAY_TMPDIR") == self.temp_dir and "TPU_NAME" in env:
                out.append(p)
        return out

    def restart_gcs(self, down_s: float) -> tuple[float, float]:
        """The head's GCS killed, and started again after ``down_s`` (needs ``gcs_fault_tolerance``:
        without Redis it would come back empty). Returns when it was killed and when it was up."""
        if getattr(self, "redis", None) is None:
            raise RuntimeError("restart_gcs needs SimulatedTPUCluster(gcs_fault_tolerance=True)")
        head = self._cluster.head_node
        killed_at = time.time()
        head.kill_gcs_server()
        time.sleep(down_s)
        # On the cluster's long-lived starter thread: a process Ray starts dies with the thread that
        # started it (fate sharing), and a caller's thread may end before the cluster does.
        self._starter.submit(head.start_gcs_server).result()
        return killed_at, time.time()
