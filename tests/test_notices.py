"""Slices alive that should go leave at a step boundary: warned ones (drained hosts: a preemption
notice) and stragglers (every step waits for them).

The decisions are pure; the controller's planned exit is driven by the scripted fake backend
(``fake_backend.warn``: a host drained, as Ray marks it; ``straggle``: a straggler measured). The
simulated cluster's ``preempt_slice`` (a real drain through the GCS, the kill at the deadline) and
slow hosts are in ``test_recovery.py``.
"""

import pytest
from fake_backend import FakeBackend, add_capacity, straggle, warn_slice

from ray_elastic import ElasticConfig, ElasticTrainer, FailureConfig, SliceSpec
from ray_elastic.control import planned_exit
from ray_elastic.decide import Notice, leave_now, plan_exit, warned_slices
from ray_elastic.decide.device_checks import MAX_MUDDLED, DeviceChecks, Handover, Suspicion, later_steps
from ray_elastic.decide.notices import LEAVE_MARGIN_S
from ray_elastic.decide.stragglers import (
    Straggler,
    find_slow_device,
    find_straggler,
    speed_check_due,
    straggler_action,
    two_slices_slow,
    window_period,
    window_steps,
)
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
    # Given back once the next world has stepped (stopping its processes would slow the forming).
    (host, steps_run) = backend.freed[0]
    assert host == "s1" and steps_run > left["restored_from_step"] + 1, (backend.freed, left)


def test_pause_and_resume_goes_on_at_full_size_on_the_warned_slice_s_replacement():
    def warn_and_provision(backend, world):
        warn_slice(0)(backend, world)
        add_capacity(backend, world)  # the replacement (never on the drained host)

    backend = FakeBackend(faults={5: warn_and_provision})
    result = make(backend, mode="pause-and-resume").fit(STEPS)
    assert result.summary["failures"] == 0 and result.summary["steps_rewound"] == 0
    assert backend.formed[-1].plan.slice_names == ("s1", "s2", "s3")


def test_the_process_whose_calls_return_latest_is_the_one_the_world_waits_for():
    # 20 steps of a 0.5 s period: the world releases each step at once, slice b's call returns 0.4 s later.
    steps = range(100, 120)
    released = {
        0: {s: 0.5 * s for s in steps},
        1: {s: 0.5 * s + 0.4 for s in steps},
        2: {s: 0.5 * s + 0.001 for s in steps},
    }
    slice_of = {0: "a", 1: "b", 2: "c"}
    found = find_straggler(released, {0: 0.0, 1: 0.35, 2: 0.0}, slice_of, min_steps=20)
    assert (found.slice_name, found.process, found.data_bound, found.steps) == ("b", 1, True, 20)
    assert found.period_s == pytest.approx(0.5) and found.excess_s == pytest.approx(0.3995)
    assert found.slowdown == pytest.approx(0.5 / 0.1005)
    assert find_straggler(released, {}, slice_of, min_steps=21) is None  # the window is too short
    even = {p: {s: 0.5 * s for s in steps} for p in range(3)}
    assert find_straggler(even, {}, slice_of, min_steps=20).ratio == 0.0
    # Late by more than a period (blocked for part of the window): at most MAX_SLOWDOWN, never negative.
    stuck = {**released, 1: {s: 0.5 * s + 0.7 for s in steps}}
    assert find_straggler(stuck, {}, slice_of, min_steps=20).slowdown == pytest.approx(100.0)
    # A suspect is confirmed by a window half as long (at least 4 steps).
    assert (window_steps(10, False), window_steps(10, True), window_steps(5, True)) == (10, 5, 4)


def test_a_world_slowed_with_no_late_process_has_its_devices_timed_and_the_slow_one_named():
    # Every process returns at once (they all waited inside the step for the slow device): no late
    # process, but the period went from 0.1 s to 0.5 s, past (1 + factor) x the world's best.
    steps = range(10)
    even = {p: {s: 0.5 * s for s in steps} for p in range(4)}
    assert find_straggler(even, {}, {0: "a", 1: "a", 2: "b", 3: "c"}, min_steps=10).ratio == 0.0
    assert window_period(even) == pytest.approx(0.5) and window_period({0: {3: 1.0}}) == 0.0
    assert speed_check_due(0.13, 0.1, factor=1.0) and not speed_check_due(0.12, 0.1, factor=1.0)  # 1 + factor / 4
    assert not speed_check_due(0.5, 0.0, factor=1.0)  # no window judged yet
    slice_of = {0: "a", 1: "a", 2: "b", 3: "c"}
    found = find_slow_device({0: 0.004, 1: 0.021, 2: 0.0042, 3: 0.0039}, slice_of, 0.5, factor=1.0)
    assert (found.slice_name, found.process, found.seen_by, found.data_bound) == ("a", 1, "speed_check", False)
    assert found.slowdown == pytest.approx(0.021 / 0.00405)  # over the other slices' median (not slice a's process 0)
    assert found.ratio == pytest.approx(found.slowdown - 1)
    assert find_slow_device({0: 0.004, 1: 0.0075, 2: 0.0042, 3: 0.0039}, slice_of, 0.5, factor=1.0) is None
    assert find_slow_device({0: 0.004, 1: 0.021}, {0: "a", 1: "a"}, 0.5, factor=1.0) is None  # one slice
    # Two slices 2.4x slower than the third (the chaos bench's starved cores named one of them): the
    # slowest is 1.5x over the others' median but not over the next slowest: none is named.
    three = {0: "a", 1: "b", 2: "c"}
    assert find_slow_device({0: 0.0237, 1: 0.0612, 2: 0.0563}, three, 0.14, factor=0.5) is None
    assert find_slow_device({0: 0.0237, 1: 0.0612, 2: 0.0263}, three, 0.14, factor=0.5).process == 1
    assert find_slow_device({}, {}, 0.5, factor=1.0) is None


def test_device_checks_are_asked_when_the_world_slows_backed_off_when_clean_and_confirmed_twice():
    checks = DeviceChecks(factor=1.0, slice_of=lambda p: "abc"[p])
    checks.window(0.1, front=12)  # the world's first window: a check (a slow device from the start)
    assert checks.check_at == 13 and checks.ask_pending and checks.take_ask() == 13 and checks.take_ask() is None
    assert checks.answered([(13, 0.004), (12, 0.0)]) is None and checks.check_at == 13  # not all checked yet
    assert checks.answered([(13, 0.004), (13, None), (14, 0.0039)]) is None and checks.check_at is None  # not compiled
    checks.window(0.1, front=18)  # asked again
    assert checks.take_ask() == 19
    assert checks.answered([(19, 0.004), (19, 0.0041), (20, 0.0039)]) is None and checks.check_at is None
    # Nothing found: the next check waits a window, then two, ... (the period wanders on a busy host),
    # unless the world is slower than when that check found nothing.
    checks.recent(0.12, front=20)
    checks.window(0.12, front=24)
    assert checks.check_at is None  # held back one window
    checks.window(0.1, front=30)  # not slowed: no check
    checks.recent(0.5, front=34)  # the newest steps slowed past (1 + factor / 4) x the median window: asked at once
    assert checks.take_ask() == 35
    assert checks.answered([(35, 0.004), (35, 0.0041), (35, 0.0042)]) is None  # clean at 0.5 s: held 2 windows
    checks.recent(0.6, front=36)
    checks.window(0.6, front=40)
    assert checks.check_at is None  # slowed against the median, but not past the clean check's 0.5 s
    checks.recent(0.7, front=41)  # past 1.25 x 0.5 s: the hold yields
    assert checks.take_ask() == 42
    assert checks.answered([(42, 0.004), (42, 0.021), (43, 0.0042)]) is None
    assert checks.suspect == "b" and checks.take_ask() == 44  # named once: checked again at once
    found = checks.answered([(44, 0.004), (44, 0.02), (44, 0.0041)])
    assert (found.slice_name, found.process, found.seen_by) == ("b", 1, "speed_check") and checks.suspect is None
    assert found.slowdown == pytest.approx(0.02 / 0.00405) and found.period_s == 0.7
    assert found.evidence()["timings"] == [{"0": 0.004, "1": 0.021, "2": 0.0042}, {"0": 0.004, "1": 0.02, "2": 0.0041}]
    # The slowest timed its devices while it compiled ahead beside its steps: the round says nothing.
    for aside, suspect in ((frozenset({1}), None), (frozenset({0}), "b")):
        fresh = DeviceChecks(factor=1.0, slice_of=lambda p: "abc"[p])
        fresh.window(0.1, front=12)
        at = fresh.take_ask()
        assert fresh.answered([(at, 0.004), (at, 0.021), (at, 0.0042)], aside) is None and fresh.suspect == suspect
    # Process 0 compiles ahead for windows on end: the others' devices are still timed (a slow one
    # is named), the compile's slow windows join no median, and a round it was slowest in is dropped.
    busy = DeviceChecks(factor=1.0, slice_of=lambda p: "abc"[p])
    busy.start(0.1, front=10)
    busy.answered([(busy.take_ask(), 0.004)] * 3)
    for w in range(2, 6):
        busy.window(0.1, front=10 * w)
    busy.window(0.9, front=60, aside=True)  # slowed against the median: a check, though 0 works aside
    at = busy.take_ask()
    assert busy.answered([(at, 0.03), (at, 0.004), (at, 0.0041)], frozenset({0})) is None and busy.suspect is None
    busy.window(0.9, front=70, aside=True)
    at = busy.take_ask()
    assert at == 71 and busy._periods == [0.1] * 4
    assert busy.answered([(at, 0.01), (at, 0.021), (at, 0.0042)], frozenset({0})) is None and busy.suspect == "b"
    found = busy.answered([(busy.take_ask(), 0.01), (at + 1, 0.02), (at + 1, 0.0041)], frozenset({0}))
    assert found is not None and found.slice_name == "b"
    # A world that never slows is still checked every MAX_BACKOFF_WINDOWS windows.
    steady = DeviceChecks(factor=1.0, slice_of=lambda p: "abc"[p])
    steady.window(0.1, front=10)
    steady.answered([(11, 0.004)] * 3)
    asked = []
    for w in range(2, 30):
        steady.window(0.1, front=10 * w)
        if steady.check_at is not None:
            asked.append(w)
            steady.answered([(steady.take_ask(), 0.004)] * 3)
    assert asked == [9, 17, 25]  # 1 held, then MAX_BACKOFF_WINDOWS (8) apart
    # One check past the whole factor and the next (asked at once) past half of it, in either order
    # (a duty-cycled host's timings wander); twice only half as slow, or another slice slowest in
    # the second, names none.
    full, half, clean, other = [0.004, 0.0099, 0.0041], [0.004, 0.0066, 0.0042], [0.004] * 3, [0.004, 0.004, 0.0099]
    for first, second, named in (
        (full, half, "b"),
        (half, full, "b"),
        (half, half, None),
        (full, other, None),
        (full, clean, None),
    ):
        checks = DeviceChecks(factor=1.0, slice_of=lambda p: "abc"[p])
        checks.window(0.1, front=12)
        checks.answered([(13, t) for t in first])
        assert checks.suspect == "b" and checks.check_at == 14
        found = checks.answered([(14, t) for t in second])
        assert (found.slice_name if found else None) == named and checks.suspect is None
    checks = DeviceChecks(factor=1.0, slice_of=lambda p: "abc"[p])
    checks.window(0.1, front=12)
    checks.answered([(13, 0.004), (13, 0.0055), (13, 0.0042)])  # 1.36x: under half the factor
    assert checks.suspect is None and checks.check_at is None


def test_in_a_world_of_two_slices_or_for_a_newcomer_a_slow_device_is_named_only_when_a_later_check_agrees():
    # Two slices: no third one to show the cores were not starved for a moment (a chaos run named a
    # newcomer whose process was, 9x then 3.5x, in a world stepping at its usual pace). The pair of
    # checks asks a third one SECOND_LOOK_S later at the world's period: it names, or clears.
    assert later_steps(0.1) == 49 and later_steps(2.0) == 2 and later_steps(10.0) == 0
    for third, named in (
        ([0.004, 0.0099], "b"),
        ([0.004, 0.0066], "b"),
        ([0.004, 0.0041], None),
        ([0.0099, 0.004], None),
    ):
        checks = DeviceChecks(factor=1.0, slice_of=lambda p: "ab"[p])
        checks.window(0.1, front=12)
        assert checks.answered([(13, 0.004), (13, 0.0866)]) is None and checks.check_at == 14
        assert checks.answered([(14, 0.004), (14, 0.0475)]) is None
        assert checks.suspect == "b" and checks.check_at == 14 + 49 + 1 and checks.slowed is False
        checks.recent(0.5, front=20)  # the world slowing meanwhile asks no other check
        assert checks.answered([(30, 0.004), (30, 0.03)]) is None and checks.check_at == 64  # not there yet
        found = checks.answered([(64, t) for t in third])
        assert (found.slice_name if found else None) == named and checks.suspect is None
        if found:
            assert [t["1"] for t in found.evidence()["timings"]] == [0.0866, 0.0475, third[1]]
    # So for a slice new to its world (a chaos run named a newcomer starved in its first seconds),
    # not for one that was there before.
    for newcomers, named_at_once in ((frozenset({"b"}), False), (frozenset({"c"}), True)):
        checks = DeviceChecks(factor=1.0, slice_of=lambda p: "abc"[p], newcomers=newcomers)
        checks.window(0.1, front=12)
        checks.answered([(13, 0.018), (13, 0.0393), (13, 0.0201)])
        found = checks.answered([(14, 0.0653), (14, 0.1831), (14, 0.0672)])
        assert (found is not None) == named_at_once and (named_at_once or checks.check_at == 14 + 49 + 1)


def test_a_straggler_is_replaced_by_a_spare_evicted_when_the_world_is_faster_without_it_else_reported():
    slow = Straggler("b", 1, 0.5, 0.4, 4.0, False, 20)  # the others would step 5x faster
    mild = Straggler("b", 1, 0.5, 0.1, 0.25, False, 20)  # 1.25x: 3 slices at its pace beat 2 at theirs
    assert straggler_action(slow, 3, 1, spare_ready=True, on_straggler="auto") == "replace"
    assert straggler_action(slow, 3, 1, spare_ready=False, on_straggler="auto") == "evict"
    assert straggler_action(mild, 3, 1, spare_ready=False, on_straggler="auto") == "report"
    assert straggler_action(slow, 3, 3, spare_ready=False, on_straggler="auto") == "report"  # min_slices
    assert straggler_action(slow, 3, 1, spare_ready=True, on_straggler="report") == "report"


def test_a_straggler_is_evicted_through_the_planned_path_and_its_hosts_held():
    backend = FakeBackend(faults={5: straggle(1)})
    result = make(backend).fit(STEPS)
    assert result.steps == list(range(STEPS))
    assert sorted(s for _, s in backend.steps_run) == list(range(STEPS))
    s = result.summary
    assert (s["failures"], s["recoveries"], s["steps_rewound"]) == (0, 0, 0)
    (event,) = kinds(result, "straggler")
    assert (event["slice"], event["action"]) == ("s1", "evict") and event["slowdown"] == pytest.approx(5.0)
    # Its hosts are held (quarantined): the replacement asked for is never placed there again.
    assert [w.plan.slice_names for w in backend.formed[1:]] == [("s0", "s2")]


def test_an_evicted_straggler_s_replacement_joins_at_once_where_capacity_is_free_and_report_only_trains_on():
    backend = FakeBackend(slices=4, faults={5: straggle(0)})
    result = make(backend).fit(STEPS)
    (event,) = kinds(result, "straggler")
    assert event["action"] == "evict" and backend.formed[-1].plan.slice_names == ("s1", "s2", "s3")
    backend = FakeBackend(faults={5: straggle(0)})
    result = make(backend, failure=FailureConfig(on_straggler="report")).fit(STEPS)
    assert [e["action"] for e in kinds(result, "straggler")] == ["report"] and len(backend.formed) == 1


def test_a_straggler_confirmed_while_the_world_stops_to_grow_leaves_with_that_stop():
    """Not found again from scratch by the bigger world: the grow-back becomes its leaving, and the
    returned capacity replaces it."""
    from fake_backend import lose_slice

    def grow_and_straggle(backend, world):
        add_capacity(backend, world)
        backend.straggler_at_stop = Straggler(world.plan.slice_names[0], 0, 0.5, 0.4, 4.0, False, 0, "speed_check")

    backend = FakeBackend(faults={3: lose_slice(2), 8: grow_and_straggle})
    trainer = make(backend, mode="replica-resize", min_slices=1)
    result = trainer.fit(STEPS)
    (event,) = kinds(result, "straggler")
    assert (event["slice"], event["action"]) == ("s0", "replace")
    assert not kinds(result, "scale_up")  # no world formed with it again
    assert [w.plan.slice_names for w in backend.formed] == [("s0", "s1", "s2"), ("s0", "s1"), ("s1", "s3")]
    assert result.steps == list(range(STEPS)) and result.summary["steps_rewound"] == 0


def test_an_out_voted_replica_still_goes_when_a_failure_overtakes_its_leaving(tmp_path):
    """A process dies while the in-flight save commits at the boundary where the corrupt replica
    was to leave: the planned change becomes a failure, and the failure's recovery does not form
    the next world with the corrupt slice (nor restore its snapshot)."""
    from ray_elastic.decide.integrity import Mismatch

    def corrupt_and_fail_the_commit(backend, world):
        backend.finish_checkpoint_failures = 1
        backend.mismatch = Mismatch(step=9, corrupt=(world.plan.slice_names[1],), arrays=(0,), agreed_step=4)

    backend = FakeBackend(faults={10: corrupt_and_fail_the_commit})
    trainer = make(backend, checkpoint_dir=str(tmp_path / "ckpt"))
    result = trainer.fit(STEPS)
    assert result.steps == list(range(STEPS))
    (event,) = kinds(result, "replica_mismatch")
    assert (event["slices"], event["action"]) == (["s1"], "evict")
    assert "died while committing" in kinds(result, "failure")[0]["error"]
    assert all("s1" not in w.plan.slice_names for w in backend.formed[1:])

    # So for a straggler (a 100-fault chaos run kept one in the world its failed leave formed).
    def straggle_and_fail_the_commit(backend, world):
        backend.finish_checkpoint_failures = 1
        straggle(1)(backend, world)

    backend = FakeBackend(faults={10: straggle_and_fail_the_commit})
    result = make(backend, checkpoint_dir=str(tmp_path / "ckpt2")).fit(STEPS)
    assert result.steps == list(range(STEPS)) and kinds(result, "failure")
    assert [e["slice"] for e in kinds(result, "straggler")] == ["s1"]
    assert all("s1" not in w.plan.slice_names for w in backend.formed[1:]), [w.plan.slice_names for w in backend.formed]


def test_a_notice_read_before_its_slice_left_does_not_stop_the_next_world(monkeypatch):
    """Notices are read at most every NOTICE_POLL_S: the one that made a slice leave is not taken,
    from that cache, for the next world's (which would tear a healthy world down again)."""
    import time as real_time

    clock = [0.0]

    class Clock:  # the watch's clock stands still unless a fault moves it; the rest is real time
        monotonic = staticmethod(lambda: clock[0])
        time = staticmethod(real_time.time)
        perf_counter = staticmethod(real_time.perf_counter)

    monkeypatch.setattr(planned_exit, "NOTICE_POLL_S", 0.5)
    monkeypatch.setattr(planned_exit, "time", Clock)

    def warn_and_poll_again(backend, world):
        warn_slice(1)(backend, world)
        clock[0] += 1.0  # the next poll reads the cluster; the one after is 0.5 s away

    backend = FakeBackend(faults={5: warn_and_poll_again})
    result = make(backend).fit(STEPS)
    assert len(kinds(result, "slice_left")) == 1 and len(backend.formed) == 2
    assert backend.formed[-1].plan.slice_names == ("s0", "s2")


def test_a_warned_slice_waits_for_the_staying_slices_standbys_while_its_deadline_allows():
    """The staying slices' standbys still starting (their start-up would compete with the next
    world's forming for the CPUs): the world trains on until they have started, as a grow-back
    waits for its own, but never to within LEAVE_MARGIN_S of the deadline."""
    now = 1000.0
    far, near, open_ended = (
        Notice("s1", ("n1",), "drain", now + 30),
        Notice("s1", ("n1",), "drain", now + 4),
        Notice("s1", ("n1",), "drain", None),
    )
    assert leave_now([far], now, standbys_idle=True)
    assert not leave_now([far], now, standbys_idle=False)  # 30 s left: trains on while they start
    assert leave_now([near], now, standbys_idle=False)  # within the margin: goes now
    assert leave_now([far, near], now, standbys_idle=False)  # the earliest deadline counts
    assert leave_now([open_ended], now, standbys_idle=False)  # no deadline known: goes now

    steps_trained = {}
    for warms_after, notice_s in ((0, 30.0), (4, 30.0), (4, LEAVE_MARGIN_S - 1)):
        backend = FakeBackend(faults={5: warn_slice(1, notice_s)})
        backend.warms_after = warms_after  # the staying hosts' standbys answer warm after this many checks
        result = make(backend).fit(STEPS)
        s = result.summary
        assert (s["failures"], s["steps_rewound"], s["preemption_notices"]) == (0, 0, 1), s
        (notice,) = kinds(result, "preemption_notice")
        steps_trained[(warms_after, notice_s)] = notice["step"]
    assert steps_trained[(4, 30.0)] > steps_trained[(0, 30.0)], steps_trained  # it waited, training
    assert steps_trained[(4, LEAVE_MARGIN_S - 1)] == steps_trained[(0, 30.0)], steps_trained  # no time to wait


def test_a_slow_device_suspected_when_its_world_ends_is_named_by_the_next_world_s_first_check():
    # Under many faults a world lasts seconds: its first check asks at its first window, and a slice
    # one check of the world before found slow is named by the next one's first (the pair spans both).
    before = DeviceChecks(factor=1.0, slice_of=lambda p: "abc"[p])
    before.window(0.1, front=12)
    before.answered([(13, 0.004), (13, 0.0099), (13, 0.0041)])
    carried = before.suspicion()
    assert carried == Suspicion("b", True, ({0: 0.004, 1: 0.0099, 2: 0.0041},))
    assert carried.within(("a", "b", "d")) is carried and carried.within(("a", "c", "d")) is None  # b left
    handed = Handover(frozenset("abc"), carried)  # what the world's watch leaves the next one
    assert handed.carried(("a", "b", "d")) == (carried, frozenset("d"))  # d is new there
    assert handed.carried(("a", "c")) == (None, frozenset())
    after = DeviceChecks(factor=1.0, slice_of=lambda p: "dcb"[p], carried=carried)  # a new world, b is process 2
    assert after.suspect == "b" and after.check_at is None
    after.start(0.4, front=30)  # the first window (not judged) asks the world's first check
    found = after.answered([(31, 0.004), (31, 0.0042), (31, 0.0066)])  # half the factor now: with the full one, named
    assert (found.slice_name, found.process) == ("b", 2) and after.suspicion() is None
    assert [t[p] for t, p in zip(found.evidence()["timings"], ("1", "2"))] == [0.0099, 0.0066]
    # Where this world's checks alone would need a later look (two slices, a newcomer), nothing is
    # carried: a chaos run named a slice at the next world's start from a two-slice world's pair
    # and that start's check, all three on starved cores.
    for slices, newcomers in (("ab", frozenset()), ("abc", frozenset({"b"}))):
        weak = DeviceChecks(factor=1.0, slice_of=lambda p, names=slices: names[p], newcomers=newcomers)
        weak.window(0.1, front=12)
        weak.answered([(13, t) for t in (0.004, 0.0099, 0.0041)[: len(slices)]])
        assert weak.suspect == "b" and weak.suspicion() is None
    # A carried pair in a world of two slices: the check of this world is the later look.
    pair = Suspicion("b", True, ({0: 0.004, 1: 0.0099}, {0: 0.004, 1: 0.0066}))
    two = DeviceChecks(factor=1.0, slice_of=lambda p: "ab"[p], carried=pair)
    two.start(0.4, front=30)
    assert two.answered([(31, 0.004), (31, 0.0070)]).slice_name == "b"
    # Clean in the new world: cleared, and nothing goes on to the world after.
    clean = DeviceChecks(factor=1.0, slice_of=lambda p: "abc"[p], carried=carried)
    clean.start(0.4, front=30)
    assert clean.answered([(31, 0.004)] * 3) is None and clean.suspicion() is None
    none = DeviceChecks(factor=1.0, slice_of=lambda p: "abc"[p])
    none.start(0.0, front=30)  # no period measured: nothing asked
    assert none.check_at is None and none.suspicion() is None


def test_a_hold_yields_once_the_world_sped_up_and_a_later_look_counts_steps_at_the_world_s_pace_now():
    # A clean check at a slow moment (0.5 s steps: a standby starting beside the world, say) vouches
    # for no slower pace once the world steps at 0.1 s again: a slow host that brings it to 0.3 s is
    # timed at once, not after the hold (a chaos run's slow host waited 60 steps for it).
    checks = DeviceChecks(factor=1.0, slice_of=lambda p: "abc"[p])
    checks.window(0.1, front=12)
    checks.answered([(13, 0.004)] * 3)
    for front in (20, 28, 36):
        checks.window(0.1, front=front)
    checks.window(0.5, front=44)  # slowed: checked, clean, held two windows
    assert checks.answered([(checks.take_ask(), 0.004)] * 3) is None and checks.check_at is None
    checks.window(0.1, front=60)
    checks.recent(0.3, front=64)  # 3x the 0.1 s window since, under 1.25x the clean check's 0.5 s
    assert checks.take_ask() == 65
    # The later look of a two-slice world: SECOND_LOOK_S at the pace the world steps now (slowed by
    # the device it suspects), not at its usual one (5 s at 0.1 s steps took 18 s at 0.27 s).
    two = DeviceChecks(factor=1.0, slice_of=lambda p: "ab"[p])
    two.window(0.1, front=12)
    two.recent(0.4, front=13)  # slowed while the first check is out
    two.answered([(13, 0.004), (13, 0.0099)])
    two.answered([(14, 0.004), (14, 0.0066)])
    assert two.suspect == "b" and two.check_at == 14 + later_steps(0.4) + 1 == 27


def test_a_check_that_finds_two_slices_slow_at_once_is_asked_again_with_the_suspect_kept():
    # The suspect's second check found another slice starved too (a process starting beside it):
    # it names nothing and clears nothing; asked again at once (at most MAX_MUDDLED times in a row).
    assert two_slices_slow({0: 0.0469, 1: 0.032, 2: 0.015}, {0: "a", 1: "b", 2: "c"}, 0.5)
    assert not two_slices_slow({0: 0.0469, 1: 0.016, 2: 0.015}, {0: "a", 1: "b", 2: "c"}, 0.5)  # one slow: named
    assert not two_slices_slow({0: 0.0469, 1: 0.032}, {0: "a", 1: "b"}, 0.5)  # two slices: nothing to compare
    checks = DeviceChecks(factor=1.0, slice_of=lambda p: "abc"[p])
    checks.window(0.1, front=12)
    checks.answered([(13, 0.0585), (13, 0.0163), (13, 0.0156)])  # a: 3.6x
    assert checks.suspect == "a" and checks.check_at == 14
    assert checks.answered([(14, 0.0469), (14, 0.0321), (14, 0.0152)]) is None  # b starved too
    assert checks.suspect == "a" and checks.check_at == 15
    assert checks.answered([(15, 0.1001), (15, 0.0752), (15, 0.0192)]) is None  # again
    assert checks.suspect == "a" and checks.check_at == 16
    found = checks.answered([(16, 0.0722), (16, 0.0264), (16, 0.0267)])
    assert found.slice_name == "a" and len(found.timings) == 2
    # MAX_MUDDLED such checks in a row: the next one is judged as before (cleared, held).
    checks = DeviceChecks(factor=1.0, slice_of=lambda p: "abc"[p])
    checks.window(0.1, front=12)
    checks.answered([(13, 0.0585), (13, 0.0163), (13, 0.0156)])
    for step in range(14, 14 + MAX_MUDDLED):
        checks.answered([(step, 0.0469), (step, 0.0321), (step, 0.0152)])
    assert checks.answered([(16, 0.0469), (16, 0.0321), (16, 0.0152)]) is None
    assert checks.suspect is None and checks.check_at is None
