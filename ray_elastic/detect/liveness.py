"""A process's death seen by the driver in milliseconds: a TCP connection that only the kernel closes.

Each slice process has a port of its node's address listened on (:class:`Beacon`; on Linux by a
tiny child that dies with it) and never writes or closes what it accepts. The driver connects to
every process of a world once (:class:`DeathWatch`) and waits for its connections to become
readable: one that does is at its end, because the process that held it is gone (the kernel
closes every socket of a process that exits, however it dies). Ray says the same through the
actor's death, but only after the raylet, the GCS and the owner have passed it on: a tenth of a
second on an idle machine, up to a second on loaded cores (``bench/recovery.py`` reports it). A stopped
(SIGSTOP) or hung process keeps its connections open: hangs stay the watchdog's. A host
that vanishes without closing anything (a VM gone) closes nothing either: that is the
raylets' and Ray's health checks' to see (:mod:`ray_elastic.detect.health`).

Like a raylet's refusal, only a connection the driver made proves anything: a process it
could not reach (a firewall, a driver outside the cluster's network) is left to Ray.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import select
import selectors
import socket
import subprocess
import sys
import threading
from collections.abc import Callable

from ray_elastic.detect import beacon_holder

logger = logging.getLogger(__name__)
CONNECT_S = 0.3  # a live process accepts in milliseconds (its own thread, whatever its steps do)
WATCH_S = 1.0  # the watch thread's longest single wait (it checks for stop between waits)
MAX_WATCHED = 4096  # beyond that many processes the driver's file descriptors are left to Ray's signal


HOLDER_START_S = 10.0  # a bare interpreter starts in tens of milliseconds, on loaded cores in a few seconds


class Beacon:
    """The slice process's side: a listening socket on ``host`` whose connections from the driver
    stay open (and silent) until the process dies. ``port`` and ``token`` are what the driver
    connects with: a connection that does not send ``token`` first is closed, and the
    connections held are bounded (:mod:`ray_elastic.detect.beacon_holder`).

    On Linux the socket belongs to a tiny child process (a bare interpreter, ~10 MB), not to the
    slice process: a process's sockets close only once its last thread has exited, and a slice
    process's 50-60 threads exit at its niceness (Ray's 15); on two saturated cores that took up
    to ~1 s after a SIGKILL. The child is killed (``PR_SET_PDEATHSIG``) when the thread that
    started it exits, one of the ~55 dying threads (only if it were the last, the one that tears
    the address space down, would the child die as late as the parent's sockets). That thread
    lives as long as the process, waiting on the child. Elsewhere, or if the child cannot start,
    the slice process listens itself."""

    def __init__(self, host: str):
        self.token = secrets.token_bytes(beacon_holder.TOKEN_BYTES)
        self.port = self._start_holder(host) if sys.platform.startswith("linux") else None
        if self.port is None:
            self._server = socket.create_server((host, 0), backlog=16)
            self.port = self._server.getsockname()[1]
            threading.Thread(
                target=beacon_holder.serve, args=(self._server, self.token), name="ray-elastic-beacon", daemon=True
            ).start()

    def _start_holder(self, host: str) -> int | None:
        started: queue.Queue = queue.Queue()

        def own() -> None:  # the child's death signal is tied to this thread: it must not end
            try:  # close_fds (Popen's default): the child holds no other socket of the slice process
                child = subprocess.Popen(
                    [sys.executable, "-I", "-S", beacon_holder.__file__, host, str(os.getpid())],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                )
                child.stdin.write(self.token.hex() + "\n")
                child.stdin.close()
            except OSError as e:
                started.put(e)
                return
            started.put(child)
            child.wait()  # reaps it should it ever die first (its connections end: seen as a death)

        threading.Thread(target=own, name="ray-elastic-beacon", daemon=True).start()
        child = started.get()
        if isinstance(child, OSError):
            logger.warning("beacon holder not started (the process listens itself): %r", child)
            return None
        ready, _, _ = select.select([child.stdout], [], [], HOLDER_START_S)
        line = child.stdout.readline() if ready else ""
        if not line.strip().isdigit():
            logger.warning("beacon holder did not start in %.0f s (the process listens itself)", HOLDER_START_S)
            child.kill()
            return None
        self._child = child
        return int(line)


class DeathWatch:
    """The driver's side, for one world: ``addresses[p]`` is process ``p``'s beacon as ``(host, port,
    token)`` (None: it has none). Connects to each from a thread of its own, started while the world forms so that it is
    connected before the first step (a process killed then would otherwise be seen only through
    Ray, later); :meth:`dead` lists the processes whose connection
    ended, and the callback given to :meth:`notify` is called at each."""

    def __init__(self, addresses: list[tuple[str, int, bytes] | None]):
        self._addresses = addresses
        self._on_death: Callable[[], None] | None = None
        self._dead: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._selector = selectors.DefaultSelector()
        if any(a is not None for a in addresses):
            threading.Thread(target=self._run, name="ray-elastic-death-watch", daemon=True).start()

    def dead(self) -> set[int]:
        with self._lock:
            return set(self._dead)

    def notify(self, on_death: Callable[[], None] | None) -> None:
        """Call ``on_death()`` at every death from now on (at once if one was seen already)."""
        with self._lock:
            self._on_death = on_death
            seen = bool(self._dead)
        if seen and on_death is not None:
            on_death()

    def stop(self) -> None:
        """Closes the connections (the processes do not mind) once the thread is out of its wait."""
        self._stop.set()

    def _run(self) -> None:
        try:
            self._connect()
            while not self._stop.is_set():
                for key, _ in self._selector.select(timeout=WATCH_S):
                    self._ended(key)
        finally:
            for key in list(self._selector.get_map().values()):
                key.fileobj.close()
            self._selector.close()

    def _connect(self) -> None:
        for p, address in enumerate(self._addresses[:MAX_WATCHED]):
            if address is None or self._stop.is_set():
                continue
            host, port, token = address
            try:
                conn = socket.create_connection((host, port), timeout=CONNECT_S)
                conn.sendall(token)
            except OSError as e:  # not reached: proves nothing (the process may be behind a firewall)
                logger.debug("beacon of process %d at %s:%d not reached: %r", p, host, port, e)
                continue
            conn.setblocking(False)
            self._selector.register(conn, selectors.EVENT_READ, p)

    def _ended(self, key: selectors.SelectorKey) -> None:
        try:
            data = key.fileobj.recv(1)
        except BlockingIOError:
            return
        except OSError:  # reset by the peer's kernel: gone too
            data = b""
        if data:
            return  # a beacon never writes; nothing to learn
        self._selector.unregister(key.fileobj)
        key.fileobj.close()
        with self._lock:
            self._dead.add(key.data)
            on_death = self._on_death
        if on_death is not None:
            on_death()
