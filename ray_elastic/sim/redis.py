"""A private Redis server (Debian's ``redis-server``) for Ray's GCS fault tolerance: the head's
GCS keeps its tables there, so a GCS that is killed and started again finds the cluster as it was."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

from ray_elastic.sim.hosts import free_port


class RedisServer:
    """``redis-server`` on 127.0.0.1, in memory only, stopped by its pid."""

    def __init__(self, work_dir: str, timeout_s: float = 10.0):
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "GCS fault tolerance needs Redis: install Debian's redis-server (apt-get install redis-server)"
            )
        self.port = free_port()
        self.dir = os.path.join(work_dir, "redis")
        os.makedirs(self.dir, exist_ok=True)
        self._proc = subprocess.Popen(
            [
                binary,
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--dir",
                self.dir,
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + timeout_s
        while not self.ping():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=10)


def _die_with_parent() -> None:
    """In the child: SIGKILL it when the process (the thread) that started it ends, however it ends."""
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
