"""The notebook path, in a real Jupyter kernel: the quickstart notebook executed headless, and a
``fit`` interrupted from the kernel's stop button (SIGINT) that leaves nothing behind.

Each test starts its own kernel, which starts its own simulated cluster: the driver is the kernel.
"""

import os
import queue
import time

import nbformat
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

NOTEBOOK = os.path.join(os.path.dirname(__file__), "..", "examples", "quickstart.ipynb")


def _text(cell) -> str:
    out = []
    for o in cell.get("outputs", []):
        if o["output_type"] == "stream":
            out.append(o["text"])
        elif "data" in o and "text/plain" in o["data"]:
            out.append(o["data"]["text/plain"])
    return "".join(out)


def test_the_quickstart_notebook_runs_in_a_kernel(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert len(_text(code[1]).split("sim-v4-8-")) == 4, _text(code[1])  # three slices, named by the provider
    (record,) = [c for c in code if "steps_rewound=" in _text(c)]
    assert "steps=100 steps_rewound=0" in _text(record), _text(record)
    assert "lost sim-v4-8-" in _text(record)
    assert any("image/png" in o.get("data", {}) for c in code for o in c.get("outputs", [])), "no inline report"
    (llm,) = [c for c in code if "llm: loss" in _text(c)]  # the LLM example, annotated, with eval and metrics
    assert "accuracy" in _text(llm) and "eval loss" in _text(llm), _text(llm)
    assert not [o for c in code for o in c.get("outputs", []) if o["output_type"] == "error"]


class Kernel:
    """A Jupyter kernel and a way to run a cell in it and read what it printed."""

    def __init__(self, cwd: str):
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(cwd=cwd)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def run(self, code: str, timeout: float = 300, interrupt_when=None) -> tuple[str, dict]:
        """Execute ``code``; ``interrupt_when(printed_so_far)`` true: press the stop button (SIGINT).
        Returns what the cell printed and its reply."""
        msg_id = self.kc.execute(code)
        printed, interrupted, deadline = [], False, time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = self.kc.get_iopub_msg(timeout=1)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream":
                printed.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                printed.append(f"{msg['content']['ename']}: {msg['content']['evalue']}")
            elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                return "".join(printed), self.kc.get_shell_msg(timeout=30)["content"]
            if interrupt_when is not None and not interrupted and interrupt_when("".join(printed)):
                self.km.interrupt_kernel()
                interrupted = True
        raise TimeoutError(f"cell did not finish in {timeout}s; printed: {''.join(printed)[-2000:]}")

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)


SETUP = """
import os, time, ray
from ray_elastic import ElasticConfig, ElasticTrainer
from ray_elastic.examples.digits_mlp import DigitsMLPTask
from ray_elastic.sim.cluster import SimulatedTPUCluster
cluster = SimulatedTPUCluster(num_slices=2, log_to_driver=False, autoscaler=True, max_slices=2)
config = ElasticConfig(num_slices=2, global_batch_size=32, slice=cluster.slice_spec, steps_per_chunk=10,
                       standby_workers=1)
print("ready")
"""

LONG_FIT = """
def say_step(m):
    if m["step"] % 20 == 0:
        print("step", m["step"], flush=True)
ElasticTrainer(DigitsMLPTask(), config, progress=False, on_step=say_step).fit(100000)
"""

LEFT_BEHIND = """
deadline = time.monotonic() + 30
while True:
    groups = [g["state"] for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
    actors = [a["ActorClassName"] for a in ray._private.state.actors().values() if a["State"] != "DEAD"]
    if not groups and not actors or time.monotonic() > deadline:
        break
    time.sleep(0.5)
print("left behind:", groups, actors)
"""


def test_interrupting_fit_in_a_kernel_releases_everything_and_fit_works_again(tmp_path):
    kernel = Kernel(str(tmp_path))
    try:
        printed, reply = kernel.run(SETUP)
        assert reply["status"] == "ok" and "ready" in printed, printed
        printed, reply = kernel.run(LONG_FIT, interrupt_when=lambda out: "step 40" in out)
        assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", (reply, printed[-2000:])
        printed, reply = kernel.run(LEFT_BEHIND)
        assert "left behind: [] []" in printed, printed
        printed, reply = kernel.run(
            "r = ElasticTrainer(DigitsMLPTask(), config, progress=False).fit(20)\n"
            "print('second fit', len(r.steps), r.summary['slices'])"
        )
        assert reply["status"] == "ok" and "second fit 20 2" in printed, printed
    finally:
        try:
            kernel.run("cluster.shutdown()", timeout=120)
        finally:
            kernel.close()
