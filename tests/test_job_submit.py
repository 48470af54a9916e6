"""``ray job submit -- ray-elastic train ...`` on a cluster started with ``ray start``, a slice killed mid-job.

The head and every simulated slice host are ``ray start --block`` processes of this test, on
free ports and a private temp dir; a slice is killed by SIGKILLing its process tree, and at the
end only those trees are stopped.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from ray_elastic.sim.hosts import free_port, tpu_host, wait_for_job_server
from ray_elastic.sim.one_machine import FAST_HEALTH_CHECKS
from ray_elastic.tpu import SliceSpec

BIN_DIR = os.path.dirname(sys.executable)
RAY = os.path.join(BIN_DIR, "ray")
STEPS, KILL_AFTER = 80, 20


def _ports(*names) -> list[str]:
    return [a for n in names for a in (f"--{n}", str(free_port()))]


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a ``ray start --block`` process and everything it started."""
    try:
        root = psutil.Process(proc.pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


class RayStartCluster:
    """A head and slice hosts, each a ``ray start --block`` child process."""

    NODE_PORTS = (
        "node-manager-port",
        "object-manager-port",
        "metrics-export-port",
        "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port",
        "runtime-env-agent-port",
    )

    def __init__(self):
        self.temp_dir = tempfile.mkdtemp(prefix="rel-job-", dir="/tmp")
        # RAY_AUTH_MODE=disabled: the cluster listens on 127.0.0.1 only, and without it a token file
        # another Ray run left in ~/.ray/auth_token switches `ray start` to token auth, which the
        # test's job client does not carry (seen: "Missing authentication token").
        self.env = {
            **os.environ,
            "PATH": BIN_DIR + os.pathsep + os.environ.get("PATH", ""),
            "RAY_TMPDIR": self.temp_dir,
            "RAY_AUTH_MODE": "disabled",
            # A SIGTERMed `ray start` marks its node draining for this long before it stops (a notice).
            "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "20",
        }
        self.env.pop("RAY_ADDRESS", None)
        self.gcs_port, self.dashboard_port = free_port(), free_port()
        self.logs = open(os.path.join(self.temp_dir, "ray-start.log"), "ab")
        self.head = self._start(
            [
                "--head",
                "--port",
                str(self.gcs_port),
                "--dashboard-port",
                str(self.dashboard_port),
                "--include-dashboard",
                "true",
                "--dashboard-host",
                "127.0.0.1",
                "--num-cpus",
                "1",
                "--system-config",
                json.dumps(FAST_HEALTH_CHECKS),
                *_ports("ray-client-server-port"),
            ],
            self.env,
        )
        self.slices: dict[str, subprocess.Popen] = {}
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        try:
            wait_for_job_server(self.dashboard)
        except BaseException:  # the fixture never gets the cluster to stop: stop the head here
            self.shutdown()
            raise

    def _start(self, args, env) -> subprocess.Popen:
        cmd = [
            RAY,
            "start",
            "--block",
            "--temp-dir",
            os.path.join(self.temp_dir, "ray"),
            *_ports(*self.NODE_PORTS),
            *args,
        ]
        return subprocess.Popen(cmd, env=env, stdout=self.logs, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def add_slice(self, name: str, spec: SliceSpec, devices_per_host: int = 2) -> None:
        """Start a one-host slice and wait until Ray lists it (one at a time: on a loaded 2-core
        machine, nodes started together can time out registering; a timed-out start is retried)."""
        host = tpu_host(spec, name, 0, devices_per_host)
        want = self.alive_tpu_nodes() + 1
        for _ in range(3):
            self.slices[name] = self._start(
                ["--address", f"127.0.0.1:{self.gcs_port}", "--num-cpus", "2", *host.ray_start_args()],
                {**self.env, **host.env},
            )
            deadline = time.monotonic() + 90
            while self.slices[name].poll() is None and time.monotonic() < deadline:
                if self.alive_tpu_nodes() >= want:
                    return
                time.sleep(0.5)
            _kill_tree(self.slices[name])
        raise TimeoutError(f"slice host {name} did not join the cluster")

    def ensure_slices(self, n: int) -> None:
        """At least ``n`` live slice hosts: what an earlier test killed (or Ray declared dead) is added back."""
        spec = SliceSpec("v4", "2x2x1", devices_per_host=2)
        while self.alive_tpu_nodes() < n:
            self.add_slice(f"job-slice-{len(self.slices)}", spec)

    def _nodes(self) -> list:
        from ray.util.state import list_nodes

        # Filtered in Python: with a dead node in the table, a state filter reads as truncated output.
        return list_nodes(address=self.dashboard, detail=True)

    def alive_tpu_nodes(self) -> int:
        return sum(1 for n in self._nodes() if n.state == "ALIVE" and "TPU" in (n.resources_total or {}))

    def dead_nodes(self) -> list[str]:
        """Why each dead node died, as Ray says (for a failed assertion's message)."""
        return [f"{n.node_name}: {n.state_message}" for n in self._nodes() if n.state != "ALIVE"]

    def kill_slice(self, name: str) -> None:
        _kill_tree(self.slices[name])

    def shutdown(self) -> None:
        for proc in list(self.slices.values()) + [self.head]:
            _kill_tree(proc)
        self.logs.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    @staticmethod
    def _wait(fn, timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                got = fn()
                if got:
                    return got
            except AssertionError:  # what the test checks while it waits (the job has not failed)
                raise
            except Exception:  # noqa: BLE001 - not up yet
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not ready after {timeout_s}s")
            time.sleep(0.5)


@pytest.fixture(scope="module")
def cluster():
    c = RayStartCluster()
    try:
        spec = SliceSpec("v4", "2x2x1", devices_per_host=2)
        for i in range(3):
            c.add_slice(f"job-slice-{i}", spec)
        yield c
    finally:
        c.shutdown()


def _assert_not_ended_badly(client, job_id: str) -> None:
    """Checked while a test waits for a job's steps: a failed or stopped job fails the test at once, with its logs."""
    from ray.job_submission import JobStatus

    assert client.get_job_status(job_id) not in (JobStatus.FAILED, JobStatus.STOPPED), client.get_job_logs(job_id)[
        -3000:
    ]


def _events(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "events.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_ray_job_submit_recovers_from_a_killed_slice(cluster, tmp_path):
    from ray.job_submission import JobStatus, JobSubmissionClient

    cluster.ensure_slices(3)
    run_dir = str(tmp_path / "job-run")
    job_id = f"ray-elastic-{int(time.time())}"
    submit = subprocess.run(
        [
            RAY,
            "job",
            "submit",
            "--address",
            cluster.dashboard,
            "--submission-id",
            job_id,
            "--no-wait",
            "--",
            "ray-elastic",
            "train",
            "--example",
            "mlp",
            "--num-slices",
            "3",
            "--topology",
            "2x2x1",
            "--devices-per-host",
            "2",
            "--steps",
            str(STEPS),
            "--global-batch",
            "48",
            "--steps-per-chunk",
            "5",
            "--run-dir",
            run_dir,
            "--json",
        ],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert submit.returncode == 0, submit.stdout[-2000:] + submit.stderr[-2000:]
    client = JobSubmissionClient(cluster.dashboard)

    def trained_past_kill_point():
        done = [s for e in _events(run_dir) if e["kind"] == "steps" for s in e["steps"]]
        _assert_not_ended_badly(client, job_id)
        return done and max(done) >= KILL_AFTER

    cluster._wait(trained_past_kill_point, 180, "the job's first steps")
    formed = next(e for e in _events(run_dir) if e["kind"] == "world_formed")
    victim = formed["slices"][-1]
    cluster.kill_slice(victim)

    cluster._wait(lambda: client.get_job_status(job_id) in (JobStatus.SUCCEEDED, JobStatus.FAILED), 240, "job end")
    logs = client.get_job_logs(job_id)
    assert client.get_job_status(job_id) == JobStatus.SUCCEEDED, logs[-4000:]

    summary = json.loads([ln for ln in logs.splitlines() if ln.startswith("{")][-1])
    failures = [e for e in _events(run_dir) if e["kind"] == "failure"]
    assert summary["steps"] == STEPS and summary["recoveries"] == 1, (summary, failures, cluster.dead_nodes())
    assert summary["steps_rewound"] <= summary["max_rewind_steps"]  # the default AutoInterval: bounded
    assert summary["slices"] == 2  # replica-resize: continued on the survivors
    events = _events(run_dir)
    (failure,) = [e for e in events if e["kind"] == "failure"]
    assert failure["lost_slices"] == [victim]
    assert [e["kind"] for e in events][-1] == "run_finished"
    done = sorted({s for e in events if e["kind"] == "steps" for s in e["steps"]})
    assert done == list(range(STEPS))


def _submit(cluster, job_id: str, entrypoint: list[str]) -> None:
    cmd = [RAY, "job", "submit", "--address", cluster.dashboard, "--submission-id", job_id, "--no-wait", "--"]
    submit = subprocess.run(cmd + entrypoint, env=cluster.env, capture_output=True, text=True, timeout=120)
    assert submit.returncode == 0, submit.stdout[-2000:] + submit.stderr[-2000:]


def test_a_resubmitted_job_resumes_from_the_lost_driver_s_keepers(cluster, tmp_path):
    """The job's driver SIGKILLed between two checkpoints (an OOM on the head, say), then the same
    entrypoint submitted again (what a KubeRay RayJob does with backoffLimit): the new driver takes
    the keepers over and resumes at the lost driver's last logged step."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    run_dir = str(tmp_path / "job-run")
    entrypoint = [
        "ray-elastic", "train", "--example", "mlp", "--num-slices", "2", "--topology", "2x2x1",
        "--devices-per-host", "2", "--steps", str(STEPS), "--global-batch", "48", "--steps-per-chunk", "5",
        "--snapshot-every", "1", "--standby-workers", "0", "--run-id", "job-r1", "--run-dir", run_dir, "--json",
    ]  # fmt: skip
    client = JobSubmissionClient(cluster.dashboard)
    cluster.ensure_slices(2)
    first = f"ray-elastic-first-{int(time.time())}"
    _submit(cluster, first, entrypoint)

    def driver():
        _assert_not_ended_badly(client, first)
        steps = [s for e in _events(run_dir) if e["kind"] == "steps" for s in e["steps"]]
        if not steps or max(steps) < KILL_AFTER:
            return None
        # the driver's Python process (its arguments one by one), not the shell the job started it with
        procs = psutil.process_iter(["cmdline"])
        return next((p for p in procs if {"train", run_dir} <= set(p.info["cmdline"] or [])), None)

    proc = cluster._wait(driver, 180, "the first driver's steps")
    proc.send_signal(signal.SIGKILL)
    cluster._wait(lambda: client.get_job_status(first) in (JobStatus.FAILED, JobStatus.STOPPED), 60, "job failed")
    last = max(s for e in _events(run_dir) if e["kind"] == "steps" for s in e["steps"])

    second = f"ray-elastic-second-{int(time.time())}"
    _submit(cluster, second, entrypoint)
    cluster._wait(lambda: client.get_job_status(second) in (JobStatus.SUCCEEDED, JobStatus.FAILED), 240, "job end")
    logs = client.get_job_logs(second)
    assert client.get_job_status(second) == JobStatus.SUCCEEDED, logs[-4000:]
    summary = json.loads([ln for ln in logs.splitlines() if ln.startswith("{")][-1])
    assert summary["resumed_from_snapshot"] == last and summary["steps_rewound_on_resume"] == 0, summary
    assert summary["steps"] == STEPS - last - 1


def test_a_sigtermed_slice_host_drains_and_the_job_moves_off_it_without_a_failure(cluster, tmp_path):
    """A slice host's ``ray start --block`` gets SIGTERM (Kubernetes deleting the pod, a spot VM's
    shutdown): Ray marks the node draining with a deadline (``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S``)
    before it stops. The job sees the notice and the slice leaves at a step boundary: no failure,
    nothing rewound, the job succeeds on the other slices."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    cluster.ensure_slices(3)
    run_dir = str(tmp_path / "job-run")
    job_id = f"ray-elastic-drained-{int(time.time())}"
    _submit(
        cluster,
        job_id,
        [
            "ray-elastic", "train", "--example", "mlp", "--num-slices", "3", "--topology", "2x2x1",
            "--devices-per-host", "2", "--steps", str(STEPS), "--global-batch", "48", "--steps-per-chunk", "5",
            "--standby-workers", "0", "--run-dir", run_dir, "--json",
        ],
    )  # fmt: skip
    client = JobSubmissionClient(cluster.dashboard)

    def past_kill_point():
        done = [s for e in _events(run_dir) if e["kind"] == "steps" for s in e["steps"]]
        _assert_not_ended_badly(client, job_id)
        return done and max(done) >= KILL_AFTER

    cluster._wait(past_kill_point, 180, "the job's first steps")
    formed = next(e for e in _events(run_dir) if e["kind"] == "world_formed")
    victim = formed["slices"][-1]
    cluster.slices[victim].send_signal(signal.SIGTERM)  # the `ray start --block` process alone, as a pod's PID 1

    cluster._wait(lambda: client.get_job_status(job_id) in (JobStatus.SUCCEEDED, JobStatus.FAILED), 240, "job end")
    logs = client.get_job_logs(job_id)
    assert client.get_job_status(job_id) == JobStatus.SUCCEEDED, logs[-4000:]
    summary = json.loads([ln for ln in logs.splitlines() if ln.startswith("{")][-1])
    assert (summary["failures"], summary["steps_rewound"], summary["preemption_notices"]) == (0, 0, 1), summary
    assert summary["steps"] == STEPS and summary["slices"] == 2
    (notice,) = [e for e in _events(run_dir) if e["kind"] == "preemption_notice"]
    assert notice["slice"] == victim and notice["seconds_left"] > 0, notice
