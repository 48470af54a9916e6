"""What holds a liveness beacon's connections (see :mod:`ray_elastic.detect.liveness`): standard library only.

Run as a script (``python -S beacon_holder.py HOST PARENT_PID``, the token on stdin) it is the tiny
child that a slice process's beacon lives in on Linux; :func:`serve` is also what the slice process
runs in a thread where the child cannot start.

Only the driver's connections are held: a connection must send the beacon's token (its first
``len(token)`` bytes) within ``AUTH_S`` or it is closed, and at most ``MAX_HELD`` authenticated and
``MAX_PENDING`` unauthenticated connections exist at once. A port scan or a stray client can then
neither exhaust the process's file descriptors nor close a connection that the driver holds (which
the driver would read as the process's death). A held connection that its driver closes is closed
here too, so one driver per world never adds up.
"""

import hmac
import selectors
import socket
import time

TOKEN_BYTES = 16
AUTH_S = 2.0  # a driver sends its token as soon as it is connected
MAX_HELD = 64  # the driver holds one per world it forms; older worlds' are closed by it
MAX_PENDING = 32  # connections that have not yet sent a token: beyond this the oldest is closed


def serve(
    server: socket.socket,
    token: bytes,
    *,
    max_held: int = MAX_HELD,
    max_pending: int = MAX_PENDING,
    auth_s: float = AUTH_S,
) -> None:
    """Accept on ``server`` forever: hold (never write to, never close) each connection that sent
    ``token``; close every other one. Returns when ``server`` is closed."""
    server.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(server, selectors.EVENT_READ)
    pending: dict = {}  # connection -> [deadline, bytes received]
    held: set = set()

    def close(conn) -> None:
        sel.unregister(conn)
        conn.close()
        pending.pop(conn, None)
        held.discard(conn)

    while True:
        now = time.monotonic()
        wait = min((d for d, _ in pending.values()), default=now + 60.0) - now
        for key, _ in sel.select(max(0.0, wait)):
            conn = key.fileobj
            if conn is server:
                try:
                    new, _ = server.accept()
                except BlockingIOError:
                    continue
                except OSError:
                    return  # the listening socket was closed
                if len(pending) >= max_pending:
                    close(min(pending, key=lambda c: pending[c][0]))  # the oldest stranger goes
                new.setblocking(False)
                pending[new] = [time.monotonic() + auth_s, b""]
                sel.register(new, selectors.EVENT_READ)
                continue
            try:
                data = conn.recv(TOKEN_BYTES)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:  # closed by its peer (a driver done with its world, or a stranger)
                close(conn)
            elif conn in pending:
                entry = pending[conn]
                entry[1] += data
                if len(entry[1]) < len(token):
                    continue
                if hmac.compare_digest(entry[1][: len(token)], token) and len(held) < max_held:
                    del pending[conn]
                    held.add(conn)
                else:
                    close(conn)
        now = time.monotonic()
        for conn in [c for c, (deadline, _) in pending.items() if deadline <= now]:
            close(conn)


if __name__ == "__main__":
    import ctypes
    import os
    import signal
    import sys

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != int(sys.argv[2]):
        sys.exit(0)  # the parent died before the line above
    secret = bytes.fromhex(sys.stdin.readline().strip())
    listener = socket.create_server((sys.argv[1], 0), backlog=16)
    sys.stdout.write(f"{listener.getsockname()[1]}\n")
    sys.stdout.flush()
    serve(listener, secret)
