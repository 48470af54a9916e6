"""Slices warned they will be taken (drained hosts: a preemption notice) leave at a step boundary.

The decisions are pure; the controller's planned exit is driven by the scripted fake backend
(``fake_backend.warn``: a host drained, as Ray marks it). The simulated cluster's
``preempt_slice`` (a real drain through the GCS, the kill at the deadline) is in
``test_recovery.py``.
"""

import pytest
from fake_backend import FakeBackend, add_capacity, warn_slice

from ray_elastic import ElasticConfig, ElasticTrainer, SliceSpec
from ray_elastic.control import planned_exit
from ray_elastic.decide import plan_exit, warned_slices
from ray_elastic.examples.digits_mlp import DigitsMLPTask

STEPS = 20


@pytest.fixture(autouse=True)
def poll_every_step(monkeypatch):
    """The fake runs a step in microseconds: look for notices at every step boundary."""
    monkeypatch.setattr(planned_exit, "NOTICE_POLL_S", 0.0)


def make(backend: FakeBackend, **kw):
    cfg = ElasticConfig(
        num_slices=3, global_batch_size=48, slice=SliceSpec("v4", "2x2x1"), replacement_timeout_s=5.0, **kw
    )
    trainer = ElasticTrainer(DigitsMLPTask(), cfg, progress=False)
    trainer.backend_cls = backend
    return trainer


def kinds(result, kind):
    return [e for e in result.events if e["kind"] == kind]


def test_a_slice_with_any_host_drained_is_warned_with_its_earliest_deadline():
    nodes = {"a": ["a0", "a1"], "b": ["b0", "b1"], "c": ["c0"]}
    draining = {"a1": (200.0, "preemption"), "b0": (None, "idle"), "b1": (150.0, "preemption"), "x": (1.0, "")}
    warned = warned_slices(nodes, draining)
    assert set(warned) == {"a", "b"}
    assert warned["a"].hosts == ("a1",) and warned["a"].deadline == 200.0
    assert warned["b"].deadline == 150.0 and warned["b"].seconds_left(140.0) == 10.0
    assert warned_slices(nodes, {}) == {}


def test_the_state_leaves_with_staying_holders_else_through_a_checkpoint():
    members = ["a", "b", "c", "d"]
    assert plan_exit(members, {"b"}, ["a", "b", "c"], False).state_kept_by == "snapshots"
    every = plan_exit(members, set(members), ["a", "b", "c"], True)
    assert (every.leaving, every.staying, every.checkpoint_first, every.state_kept_by) == (
        tuple(members),
        (),
        True,
        "checkpoint",
    )
    holders_gone = plan_exit(members, {"a", "b", "c"}, ["a", "b", "c"], False)
    assert holders_gone.staying == ("d",) and holders_gone.state_kept_by == "nothing"


def test_a_warned_slice_leaves_at_a_step_boundary_no_failure_no_rewind():
    backend = FakeBackend(faults={5: warn_slice(1)})
    result = make(backend).fit(STEPS)
    assert result.steps == list(range(STEPS))
    assert sorted(s for _, s in backend.steps_run) == list(range(STEPS))  # no step computed twice
    s = result.summary
    assert (s["failures"], s["recoveries"], s["steps_rewound"], s["preemption_notices"]) == (0, 0, 0, 1)
    (notice,) = kinds(result, "preemption_notice")
    assert notice["slice"] == "s1" and notice["state_kept_by"] == "snapshots" and 0 < notice["seconds_left"] <= 30
    (left,) = kinds(result, "slice_left")
    assert (left["from_slices"], left["to_slices"], left["steps_rewound"]) == (3, 2, 0)
    assert backend.formed[-1].plan.slice_names == ("s0", "s2")
    assert len(backend.requests) == 1  # its replacement was asked for (the autoscaler's demand)


def test_pause_and_resume_goes_on_at_full_size_on_the_warned_slice_s_replacement():
    def warn_and_provision(backend, world):
        warn_slice(0)(backend, world)
        add_capacity(backend, world)  # the replacement (never on the drained host)

    backend = FakeBackend(faults={5: warn_and_provision})
    result = make(backend, mode="pause-and-resume").fit(STEPS)
    assert result.summary["failures"] == 0 and result.summary["steps_rewound"] == 0
    assert backend.formed[-1].plan.slice_names == ("s1", "s2", "s3")
