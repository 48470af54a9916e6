"""The controller's loop driven by a scripted fake backend: recovery sequences in milliseconds.

The controller, ``Generations``, ``plan`` and the observers run for real; only the Ray
effects are scripted (``fake_backend.py``). The real-cluster fault tests in
``test_recovery.py`` check the same paths end to end.
"""

import itertools
import time

import pytest
from fake_backend import (
    FakeBackend,
    NodeDied,
    ProcessDied,
    TaskBug,
    add_capacity,
    crash_process,
    hang_slice,
    lose_coordinator_survivor_reports_first,
    lose_slice,
    task_bug,
)

from ray_elastic import ElasticConfig, ElasticTrainer, FailureConfig, SliceSpec
from ray_elastic.control.states import ControllerState as S
from ray_elastic.control.states import InvalidTransition, OutcomeKind, RunOutcome, check_transition
from ray_elastic.errors import (
    CapacityTimeoutError,
    ElasticRuntimeError,
    FormingError,
    RetriesExhaustedError,
    StateLostError,
    StorageError,
    TrainingCodeError,
)
from ray_elastic.examples.digits_mlp import DigitsMLPTask

STEPS = 20


def make(backend: FakeBackend, **kw):
    trainer_kw = {k: kw.pop(k) for k in ("retry_policy", "pre_callback", "on_event", "on_step") if k in kw}
    cfg = ElasticConfig(
        **{
            "num_slices": 3,
            "global_batch_size": 48,
            "slice": SliceSpec("v4", "2x2x1"),
            "replacement_timeout_s": 5.0,
            **kw,
        }
    )
    trainer = ElasticTrainer(DigitsMLPTask(), cfg, progress=False, **trainer_kw)
    trainer.backend_cls = backend
    return trainer


def kinds(result, kind):
    return [e for e in result.events if e["kind"] == kind]


def assert_every_step_once_no_rewind(result, backend):
    assert result.steps == list(range(STEPS))
    assert result.summary["steps_rewound"] == 0
    assert sorted(s for _, s in backend.steps_run) == list(range(STEPS))  # no step computed twice


def test_process_crash_reforms_the_same_slices_from_snapshots():
    backend = FakeBackend(faults={5: crash_process(1)})
    result = make(backend).fit(STEPS)
    assert_every_step_once_no_rewind(result, backend)
    (rec,) = result.recoveries
    assert (rec.slices, rec.added_slices, rec.restore_source, rec.restored_from_step) == (3, 0, "snapshot", 4)
    assert backend.formed[1].plan.slice_names == backend.formed[0].plan.slice_names
    # Every slice loads its own snapshot when it has one; the non-holder loads a holder's.
    assert backend.formed[1].restored == {"s0": 4, "s1": 4, "s2": 4}
    (failure,) = kinds(result, "failure")
    assert failure["crashed_slices"] == ["s1"] and failure["lost_slices"] == [] and failure["cause"] == "failure"


def test_a_crash_on_a_live_host_is_vouched_for_and_a_lost_host_is_suspect():
    backend = FakeBackend(faults={5: crash_process(1), 9: lose_slice(2)})
    result = make(backend).fit(STEPS)
    assert_every_step_once_no_rewind(result, backend)
    # The crash's host answers: no grace period; the lost host does not.
    assert backend.suspects_seen == [set(), {"s2"}]
    assert [f["vouched_slices"] for f in kinds(result, "failure")] == [["s1"], []]


def test_a_lost_host_that_reported_nothing_is_found_when_a_survivor_dies_first():
    # The coordinator's host dies; a survivor's aborted process is the first error seen.
    backend = FakeBackend(faults={5: lose_coordinator_survivor_reports_first(1)})
    trainer = make(backend)
    result = trainer.fit(STEPS)
    assert_every_step_once_no_rewind(result, backend)
    (failure,) = kinds(result, "failure")  # not a second one while forming on the dead host
    assert failure["lost_slices"] == ["s0"] and failure["crashed_slices"] == ["s1"]
    assert backend.suspects_seen == [{"s0"}]  # the silent host is worth the grace period; s1 is vouched for
    assert [w.slices for w in trainer.worlds] == [["s0", "s1", "s2"], ["s1", "s2"]]


def test_lost_slice_shrinks_the_world_and_asks_for_a_replacement():
    backend = FakeBackend(faults={5: lose_slice(2)})
    trainer = make(backend)
    result = trainer.fit(STEPS)
    assert_every_step_once_no_rewind(result, backend)
    assert [w.mesh["replica"] for w in trainer.worlds] == [3, 2]
    assert len(backend.requests) == 1 and backend.requests[0].cancelled  # the demand, given back at the end
    (resize,) = kinds(result, "resize")
    assert (resize["from_slices"], resize["to_slices"]) == (3, 2)


def test_failure_while_forming_is_another_turn_of_the_loop():
    # The first re-formation fails with every host alive (a process died while joining).
    def die_while_joining(backend):
        raise ProcessDied("replacement process died in jax.distributed.initialize")

    backend = FakeBackend(faults={5: crash_process(0)}, form_script=[None, die_while_joining])
    trainer = make(backend)
    result = trainer.fit(STEPS)
    assert_every_step_once_no_rewind(result, backend)
    assert backend.form_attempts == 3 and len(trainer.worlds) == 2
    causes = [e["cause"] for e in kinds(result, "failure")]
    assert causes == ["failure", "forming_failed"]
    (rec,) = result.recoveries
    assert rec.slices == 3 and "failure while forming" in rec.reason
    # One recovery, timed from the first failure's detection.
    assert rec.detected_at == pytest.approx(kinds(result, "failure")[0]["ts"], abs=1.0)


def test_second_failure_while_forming_loses_another_slice():
    def lose_s1(backend):
        backend.kill("s1")

    backend = FakeBackend(faults={5: lose_slice(2)}, form_script=[None, lose_s1])
    trainer = make(backend)
    result = trainer.fit(STEPS)
    assert_every_step_once_no_rewind(result, backend)
    failures = kinds(result, "failure")
    assert [f["lost_slices"] for f in failures] == [["s2"], ["s1"]]
    assert [w.slices for w in trainer.worlds] == [["s0", "s1", "s2"], ["s0"]]
    assert len(backend.requests) == 2
    assert backend.formed[-1].restored == {"s0": 4}


def test_a_node_death_while_forming_that_names_no_slice_loses_only_the_dead_slice():
    def lose_s0_at_the_coordinator(backend):
        backend.kill("s0")
        raise NodeDied("the coordinator's actor died because its node has died")  # no slice named

    backend = FakeBackend(faults={5: lose_slice(2)}, form_script=[None, lose_s0_at_the_coordinator])
    trainer = make(backend)
    result = trainer.fit(STEPS)
    assert_every_step_once_no_rewind(result, backend)
    assert [f["lost_slices"] for f in kinds(result, "failure")] == [["s2"], ["s0"]]
    assert trainer.worlds[-1].slices == ["s1"] and backend.formed[-1].restored == {"s1": 4}


def test_a_slice_that_fails_twice_in_a_row_without_progress_is_dropped():
    def s1_dies_while_joining(backend):
        raise FormingError(["s1"], ProcessDied("s1's process died in jax.distributed.initialize"))

    backend = FakeBackend(faults={5: crash_process(1)}, form_script=[None, s1_dies_while_joining])
    trainer = make(backend)
    result = trainer.fit(STEPS)
    assert_every_step_once_no_rewind(result, backend)
    failures = kinds(result, "failure")
    assert [(f["origin"], f["lost_slices"], f["failures_in_a_row"]) for f in failures] == [
        ("s1", [], 1),
        ("s1", ["s1"], 2),
    ]
    assert failures[1]["quarantined_slices"] == ["s1"]
    # A replacement is asked for, and the quarantined slice is held so it cannot be that replacement.
    assert trainer.worlds[-1].slices == ["s0", "s2"] and len(backend.requests) == 1
    assert backend.requests[0].res is None


def test_an_unreadable_checkpoint_is_said_once_and_never_blames_the_host():
    def checkpoint_damaged(backend):
        raise FormingError(["s1"], StorageError("restoring checkpoint 10 failed: truncated", 10))

    backend = FakeBackend(faults={5: crash_process(1)}, form_script=[None, checkpoint_damaged, checkpoint_damaged])
    trainer = make(backend)
    result = trainer.fit(STEPS)
    assert_every_step_once_no_rewind(result, backend)
    assert [e["step"] for e in kinds(result, "checkpoint_unreadable")] == [10]
    assert trainer.checkpoints.unreadable == {10}
    # The same slice first failed twice in a row without progress, but storage is not its host's fault.
    assert all(f["quarantined_slices"] == [] and f["lost_slices"] == [] for f in kinds(result, "failure"))
    assert trainer.worlds[-1].slices == ["s0", "s1", "s2"]


def test_failures_in_a_row_without_progress_are_bounded():
    def dies_while_joining(backend):
        raise ProcessDied("a process died while joining")  # names no slice: nothing to drop

    backend = FakeBackend(faults={5: crash_process(1)}, form_script=[None] + [dies_while_joining] * 10)
    trainer = make(backend, failure=FailureConfig(max_failures_in_a_row=3))
    with pytest.raises(RetriesExhaustedError, match="4 failures in a row without a step finished"):
        trainer.fit(STEPS)
    assert backend.form_attempts == 4  # the first world, then three attempts after the crash


def test_pause_and_resume_waits_then_times_out():
    backend = FakeBackend(faults={5: lose_slice(1)})
    events = []
    trainer = make(backend, mode="pause-and-resume", replacement_timeout_s=0.3, on_event=events.append)
    with pytest.raises(CapacityTimeoutError, match="no replacement slice arrived in time"):
        trainer.fit(STEPS)
    assert trainer.state is S.ERRORED
    assert [e["kind"] for e in events] == ["failure", "waiting_for_capacity"]


def test_replica_resize_below_min_slices_waits_then_times_out():
    backend = FakeBackend(faults={5: lose_slice(1)})
    trainer = make(backend, min_slices=3, replacement_timeout_s=0.3)
    with pytest.raises(CapacityTimeoutError, match=r"fewer than min_slices=3.*lower min_slices"):
        trainer.fit(STEPS)
    assert trainer.state is S.ERRORED


def lose_both_holders(backend, world):
    for name in world.plan.slice_names[:2]:  # the snapshot holders (with snapshot_replicas=2)
        backend.kill(name)
    return RunOutcome(OutcomeKind.FAILURE, {0: ProcessDied("actor died"), 1: ProcessDied("actor died")})


def test_losing_every_snapshot_holder_without_a_checkpoint_is_not_a_silent_restart():
    backend = FakeBackend(slices=4, faults={5: lose_both_holders})
    trainer = make(backend, num_slices=4, global_batch_size=48, snapshot_replicas=2)
    with pytest.raises(StateLostError, match=r"restart training from step 0 .5 steps done.*allow_restart_from_scratch"):
        trainer.fit(STEPS)
    assert len(backend.formed) == 1  # nothing formed on fresh parameters


def test_restart_from_scratch_when_allowed():
    backend = FakeBackend(slices=4, faults={5: lose_both_holders})
    trainer = make(backend, num_slices=4, global_batch_size=48, snapshot_replicas=2, allow_restart_from_scratch=True)
    result = trainer.fit(STEPS)
    assert result.summary["steps_rewound"] == 5 and trainer.worlds[-1].restore_source == "fresh"


@pytest.mark.parametrize("lost", list(itertools.combinations(range(4), 2)))
def test_any_two_slices_lost_at_once_leave_a_snapshot_holder(lost):
    """The default holders (3) outlast any two lost slices: nothing is rewound."""

    def lose_two(backend, world):
        for i in lost:
            backend.kill(world.plan.slice_names[i])
        return RunOutcome(OutcomeKind.FAILURE, {i: ProcessDied("actor died") for i in lost})

    backend = FakeBackend(slices=4, faults={5: lose_two})
    trainer = make(backend, num_slices=4, global_batch_size=48, min_slices=2)
    result = trainer.fit(STEPS)
    assert_every_step_once_no_rewind(result, backend)
    assert trainer.worlds[-1].restore_source == "snapshot" and len(trainer.worlds[-1].slices) == 2


def test_a_lost_holder_is_replaced_by_a_survivor_at_once():
    backend = FakeBackend(faults={5: lose_slice(0)})
    make(backend).fit(STEPS)
    new = backend.formed[-1].plan
    assert [new.slice_names[p] for p in range(new.num_processes) if new.takes_snapshots(p)] == ["s1", "s2"]


def test_pause_and_resume_waits_for_the_replacement():
    backend = FakeBackend(faults={5: lose_slice(1)})
    trainer = make(
        backend,
        mode="pause-and-resume",
        replacement_timeout_s=10.0,
        on_event=lambda e: e["kind"] == "waiting_for_capacity" and backend.add_slice(),
    )
    result = trainer.fit(STEPS)
    assert_every_step_once_no_rewind(result, backend)
    (rec,) = result.recoveries
    assert (rec.slices, rec.added_slices) == (3, 1) and rec.wait_for_capacity_s > 0
    assert trainer.worlds[-1].slices == ["s0", "s2", "s3"]
    assert backend.formed[-1].restored["s3"] == 4  # the newcomer loads a survivor's snapshot


def test_a_survivor_lost_while_waiting_is_replaced_at_once_not_found_by_forming():
    """Pause-and-resume waits for a replacement; a survivor's host dies meanwhile. It is dropped and
    its replacement asked for while waiting, so the next world forms once, on live slices, with no
    failed formation and no grace period spent on it."""
    backend = FakeBackend(faults={5: lose_slice(1)})
    seen = []

    def on_event(e):
        if e["kind"] == "waiting_for_capacity" and not seen:
            seen.append(e)
            backend.kill("s2")  # a survivor, while the replacement is awaited
        elif e["kind"] == "failure" and e["cause"] == "lost_while_waiting":
            backend.add_slice()
            backend.add_slice()

    trainer = make(backend, mode="pause-and-resume", replacement_timeout_s=10.0, on_event=on_event)
    result = trainer.fit(STEPS)
    assert_every_step_once_no_rewind(result, backend)
    lost = [e for e in kinds(result, "failure") if e["cause"] == "lost_while_waiting"]
    assert [e["lost_slices"] for e in lost] == [["s2"]]
    assert backend.form_attempts == len(backend.formed) == 2  # no formation failed on the dead slice
    assert len(backend.requests) == 2  # s1's replacement, then s2's, asked for while waiting
    (rec,) = result.recoveries
    assert (rec.slices, rec.added_slices) == (3, 2)
    assert trainer.worlds[-1].slices == ["s0", "s3", "s4"]
    assert backend.formed[-1].restored == {"s0": 4, "s3": 4, "s4": 4}  # all from s0's snapshot


def test_replica_resize_grows_back_at_a_step_boundary():
    backend = FakeBackend(faults={5: lose_slice(2), 10: add_capacity})
    trainer = make(backend)
    result = trainer.fit(STEPS)
    assert_every_step_once_no_rewind(result, backend)
    assert [w.mesh["replica"] for w in trainer.worlds] == [3, 2, 3]
    (up,) = kinds(result, "scale_up")
    assert (up["from_slices"], up["to_slices"], up["steps_rewound"]) == (2, 3, 0)
    assert result.summary["scale_ups"] == 1 and result.summary["recoveries"] == 1


def test_growing_back_waits_for_the_newcomers_process_while_training_goes_on():
    backend = FakeBackend(faults={5: lose_slice(2), 8: add_capacity})
    backend.warms_after = 4  # the newcomer's process takes four step boundaries to start
    trainer = make(backend)
    result = trainer.fit(STEPS)
    assert_every_step_once_no_rewind(result, backend)
    (_up,) = kinds(result, "scale_up")
    grown = trainer.worlds[-1]
    assert grown.slices == ["s0", "s1", "s3"] and grown.start_step >= 13  # not at step 9: trained on while warming
    assert "s3" in backend.standby_checks  # the newcomer's process was started before the switch


def test_max_failures_within_the_window():
    backend = FakeBackend(faults={3: crash_process(0), 6: crash_process(1), 9: crash_process(2)})
    with pytest.raises(RetriesExhaustedError, match=r"gave up after 3 failures.*max_failures=2"):
        make(backend, failure=FailureConfig(max_failures=2)).fit(STEPS)


def test_retry_policy_declining_stops_with_its_error():
    calls = {"policy": [], "pre": 0}

    def policy(attempt, error):
        calls["policy"].append((attempt, type(error).__name__))
        return attempt < 2

    def pre():
        calls["pre"] += 1

    backend = FakeBackend(faults={3: crash_process(0), 6: crash_process(1)})
    trainer = make(backend, retry_policy=policy, pre_callback=pre)
    with pytest.raises(RetriesExhaustedError, match="retry_policy declined attempt 2"):
        trainer.fit(STEPS)
    assert calls["policy"] == [(1, "ProcessDied"), (2, "ProcessDied")]
    assert calls["pre"] == 2  # before the first world and before the one recovery


def test_training_code_error_is_not_retried():
    backend = FakeBackend(faults={4: task_bug()})
    with pytest.raises(TrainingCodeError, match="bug in the loss"):
        make(backend).fit(STEPS)
    assert backend.form_attempts == 1


def test_training_code_error_while_forming_is_not_retried():
    def bug(backend):
        raise TaskBug("bug in the model's init")

    backend = FakeBackend(form_script=[bug])
    with pytest.raises(TrainingCodeError, match="bug in the model's init"):
        make(backend).fit(STEPS)
    assert backend.form_attempts == 1


def test_hang_is_classified_and_recovered():
    backend = FakeBackend(faults={7: hang_slice(1)})
    result = make(backend).fit(STEPS)
    assert_every_step_once_no_rewind(result, backend)
    (failure,) = kinds(result, "failure")
    assert failure["cause"] == "hang" and failure["kinds"] == {"s1": "hang"}


def test_fit_twice_starts_clean():
    backend = FakeBackend(faults={5: crash_process(0)})
    trainer = make(backend)
    first = trainer.fit(STEPS)
    second = trainer.fit(10)
    assert first.summary["recoveries"] == 1 and second.summary["recoveries"] == 0
    assert second.steps == list(range(10)) and len(trainer.worlds) == 1
    assert [e["kind"] for e in second.events].count("run_started") == 1
    assert trainer.state is S.FINISHED


def test_callbacks_see_steps_and_elastic_events_only():
    steps, events = [], []
    backend = FakeBackend(faults={5: lose_slice(1)})
    result = make(backend, on_step=lambda m: steps.append(m["step"]), on_event=events.append).fit(STEPS)
    assert steps == result.steps
    assert [e["kind"] for e in events] == ["failure", "recovered", "resize"]


def test_one_name_for_each_callback():
    """At 0.1 there is one way to do each thing: the old callback names are refused, not aliased."""
    for old in ("on_chunk", "on_elastic_event_callback"):
        with pytest.raises(TypeError, match=old):
            ElasticTrainer(DigitsMLPTask(), ElasticConfig(num_slices=2, global_batch_size=48), **{old: print})


# Every path a run can take, as the controller walks it; any other step is refused.
FLOWS = [
    [S.INITIALIZING, S.SCHEDULING, S.FORMING_WORLD, S.RUNNING, S.FINISHED],  # no failure
    [S.RUNNING, S.RECOVERING, S.FORMING_WORLD, S.RUNNING],  # a failure, recovered at once
    [S.RECOVERING, S.WAITING_FOR_CAPACITY, S.FORMING_WORLD],  # waiting for a replacement
    [S.FORMING_WORLD, S.RECOVERING],  # a failure while forming
    [S.RUNNING, S.RESIZING, S.FORMING_WORLD],  # growing back
    [S.RUNNING, S.RESIZING, S.RECOVERING],  # a process lost while the world stops to grow back
    [S.RUNNING, S.RESIZING, S.WAITING_FOR_CAPACITY, S.FORMING_WORLD],  # warned slices left: wait for replacements
]
LEGAL = {(a, b) for flow in FLOWS for a, b in itertools.pairwise(flow)}


@pytest.mark.parametrize("old,new", list(itertools.product(S, S)), ids=lambda s: s.value)
def test_check_transition(old, new):
    allowed = (old, new) in LEGAL or (new is S.ERRORED and not old.is_terminal)  # any live state may error
    if allowed:
        check_transition(old, new)
    else:
        with pytest.raises(InvalidTransition, match=f"from {old.value} to {new.value}"):
            check_transition(old, new)


def test_a_raylet_port_nothing_listens_on_is_proof_of_a_lost_node_and_a_listening_one_is_not():
    """What the step loop decides on when steps stall (``health.refusing``), on real sockets: a port
    with a listener answers, the same port once closed refuses; a refusal is a node death, but only
    from a raylet this driver has reached before."""
    import socket

    from ray_elastic.decide import ErrorKind
    from ray_elastic.detect import health
    from ray_elastic.errors import RayletGone

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    addresses = {"live": ("127.0.0.1", port)}
    assert health.refusing(addresses) == set()
    listener.close()
    assert health.refusing(addresses) == {"live"}
    # A raylet never reached (a firewall, another network) proves nothing by refusing.
    assert health.refusing({"never-reached": ("127.0.0.1", port)}) == set()
    assert health.error_kind(RayletGone("refuses")) is ErrorKind.NODE_DIED


_BEACON_CHILD = """
import sys, time
from ray_elastic.detect.liveness import Beacon
b = Beacon("127.0.0.1")
print(b.port, b.token.hex(), flush=True)
time.sleep(600)
"""


@pytest.mark.cluster  # starts processes
def test_a_process_death_closes_its_beacon_connection_and_a_stopped_process_does_not():
    """What the step loop sees a process's death by (``liveness.DeathWatch``), on real processes: a
    SIGKILL ends the connection within milliseconds, a SIGSTOP does not (a hang is the watchdog's),
    and a beacon never reached proves nothing."""
    import signal
    import subprocess
    import sys
    import threading

    from ray_elastic.decide import ErrorKind
    from ray_elastic.detect import health
    from ray_elastic.detect.liveness import DeathWatch
    from ray_elastic.errors import ProcessGone

    children = [
        subprocess.Popen([sys.executable, "-c", _BEACON_CHILD], stdout=subprocess.PIPE, text=True) for _ in range(2)
    ]
    try:
        beacons = [c.stdout.readline().split() for c in children]
        ports = [int(port) for port, _ in beacons]
        tokens = [bytes.fromhex(token) for _, token in beacons]
        holders = []
        if sys.platform.startswith("linux"):  # the socket is a child's, which dies with the thread that started it
            import psutil

            holders = psutil.Process(children[0].pid).children()
            assert any(
                c.status == "LISTEN" and c.laddr.port == ports[0] for h in holders for c in h.net_connections("tcp")
            )
        unreached = _port_nobody_listens_on()
        seen = threading.Event()
        watch = DeathWatch(
            [
                ("127.0.0.1", ports[0], tokens[0]),
                ("127.0.0.1", ports[1], tokens[1]),
                ("127.0.0.1", unreached, tokens[0]),
                None,
            ]
        )
        watch.notify(seen.set)
        time.sleep(0.3)  # connected
        children[1].send_signal(signal.SIGSTOP)
        time.sleep(0.3)
        assert watch.dead() == set() and not seen.is_set()
        killed_at = time.monotonic()
        children[0].kill()
        assert seen.wait(5.0), "the killed process's connection never ended"
        assert time.monotonic() - killed_at < 2.0
        assert watch.dead() == {0}  # not the stopped one, not the one never reached
        watch.stop()
        if holders:
            assert not psutil.wait_procs(holders, timeout=5)[1], "the killed process's beacon holder outlived it"
    finally:
        for c in children:
            c.send_signal(signal.SIGCONT)
            c.kill()
            c.wait()
    assert health.error_kind(ProcessGone("closed")) is ErrorKind.PROCESS_DIED


def _port_nobody_listens_on() -> int:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_a_process_lost_while_the_world_grows_back_is_recovered_not_the_end(tmp_path):
    """Resizing -> recovering was not an allowed transition, so a process dying while the
    in-flight save committed before a grow-back ended fit with InvalidTransition."""

    def grow_and_fail_the_commit(backend, world):
        backend.finish_checkpoint_failures = 1
        return add_capacity(backend, world)

    backend = FakeBackend(faults={5: lose_slice(2), 10: grow_and_fail_the_commit})
    trainer = make(backend, checkpoint_dir=str(tmp_path / "ckpt"))
    result = trainer.fit(STEPS)
    assert result.steps == list(range(STEPS))
    failures = kinds(result, "failure")
    assert len(failures) == 2 and "died while committing" in failures[1]["error"]
    assert result.summary["recoveries"] == 2


def test_replacements_taken_for_a_world_that_never_forms_are_given_back():
    """A replacement taken for the next world joined the members only once the world
    formed, so anything raising in between (here ``pre_callback``) left its reservation held."""
    calls = []

    def pre_callback():
        calls.append(1)
        if len(calls) == 2:  # the world after the failure, which takes the spare slice s3
            raise RuntimeError("pre_callback failed")

    backend = FakeBackend(slices=4, faults={5: lose_slice(1)})
    trainer = make(backend, mode="pause-and-resume", pre_callback=pre_callback)
    with pytest.raises(ElasticRuntimeError, match="pre_callback failed"):
        trainer.fit(STEPS)
    assert backend.reserved == set(), f"reservations left held: {backend.reserved}"


def _failing_save(step: int):
    """Every time ``step`` runs, its checkpoint save fails (a bucket that refuses writes)."""

    def fire(backend, world):
        backend.faults[step] = fire  # and again when the step is run again
        return RunOutcome(OutcomeKind.FAILURE, {0: StorageError(f"saving checkpoint {step + 1} failed: 403")})

    return fire


@pytest.mark.parametrize("snapshot_every", [0, 4])
def test_a_save_that_keeps_failing_stops_the_run_naming_the_storage(tmp_path, snapshot_every):
    """Each retry replays a few steps, which counted as progress, so a save failing
    the same way every time was retried until ``max_failures`` (30 an hour). It now stops after
    ``max_save_failures_in_a_row`` with an error that names the storage problem."""
    from ray_elastic.errors import StorageFailingError

    backend = FakeBackend(faults={10: _failing_save(10)})
    trainer = make(
        backend,
        checkpoint_dir=str(tmp_path / "ckpt"),
        snapshot_every=snapshot_every,
        allow_restart_from_scratch=snapshot_every == 0,
        failure=FailureConfig(max_save_failures_in_a_row=3),
    )
    with pytest.raises(StorageFailingError, match=r"saves to .*ckpt failed 3 times in a row.*403.*writable"):
        trainer.fit(STEPS)
    assert len([e for e in trainer.events.events if e["kind"] == "failure"]) == 3
    assert backend.reserved == set()


def test_save_failures_between_other_failures_or_commits_start_the_count_again(tmp_path):
    """Not in a row: a save failing, then a lost slice, then the save failing again is two runs of
    one; the run goes on."""
    from ray_elastic.errors import failed_save

    assert failed_save(FormingError(["s0"], StorageError("saving checkpoint 5 failed")))
    assert not failed_save(StorageError("restoring checkpoint 5 failed", 5))
    backend = FakeBackend(slices=4, faults={6: _once_failing_save(6), 8: lose_slice(1), 12: _once_failing_save(12)})
    result = make(
        backend, checkpoint_dir=str(tmp_path / "ckpt"), failure=FailureConfig(max_save_failures_in_a_row=2)
    ).fit(STEPS)
    assert result.steps == list(range(STEPS)) and result.summary["recoveries"] == 3


def _once_failing_save(step: int):
    def fire(backend, world):
        return RunOutcome(OutcomeKind.FAILURE, {0: StorageError(f"saving checkpoint {step + 1} failed: 503")})

    return fire


@pytest.mark.cluster  # starts processes
def test_a_beacon_holds_only_the_drivers_connections_and_a_bounded_number_of_strangers():
    """The beacon accepted every connection and held it forever, so a port scan or a
    stray client could exhaust its file descriptors. Strangers (no token, a wrong token, silence) are
    closed; their number open at once is bounded; the driver's connection stays and still sees the death."""
    import socket
    import subprocess
    import sys
    import threading

    from ray_elastic.detect import beacon_holder
    from ray_elastic.detect.liveness import DeathWatch

    child = subprocess.Popen([sys.executable, "-c", _BEACON_CHILD], stdout=subprocess.PIPE, text=True)
    try:
        port, token = child.stdout.readline().split()
        port, token = int(port), bytes.fromhex(token)
        seen = threading.Event()
        watch = DeathWatch([("127.0.0.1", port, token)])
        watch.notify(seen.set)
        time.sleep(0.3)  # connected

        def ended(conn: socket.socket, within_s: float) -> bool:
            conn.settimeout(within_s)
            try:
                return conn.recv(1) == b""
            except ConnectionResetError:
                return True
            except TimeoutError:
                return False

        wrong = socket.create_connection(("127.0.0.1", port))
        wrong.sendall(b"x" * len(token))
        assert ended(wrong, 2.0), "a connection with the wrong token was held"
        silent = socket.create_connection(("127.0.0.1", port))
        assert ended(silent, beacon_holder.AUTH_S + 2.0), "a connection that never sent a token was held"
        strangers = [socket.create_connection(("127.0.0.1", port)) for _ in range(3 * beacon_holder.MAX_PENDING)]
        time.sleep(0.5)
        closed = sum(ended(s, 0.05) for s in strangers)
        assert closed >= len(strangers) - beacon_holder.MAX_PENDING, "strangers are not bounded"
        for s in strangers + [wrong, silent]:
            s.close()
        assert watch.dead() == set() and not seen.is_set(), "the driver's connection was closed by strangers"
        child.kill()
        assert seen.wait(5.0) and watch.dead() == {0}, "the driver no longer sees the process's death"
        watch.stop()
    finally:
        child.kill()
        child.wait()


def test_a_process_behind_the_step_the_others_wait_in_is_stuck_and_one_step_for_all_is_not():
    """What the watchdog names from its probe's answers (``health.stuck_processes``): the processes
    whose newest dispatched step is behind the newest any process dispatched."""
    from ray_elastic.detect import health

    at = [{"dispatched": 23, "reading": None}, {"dispatched": 22, "reading": 23}, {"dispatched": 23, "reading": None}]
    assert health.stuck_processes(at) == {1: at[1]}
    assert health.stuck_processes([{"dispatched": 23}, {"dispatched": 23}]) == {}  # the world's hang, not one's
    assert health.stuck_processes([None, {"dispatched": 4}]) == {}  # silence is judged apart
    # One process's rows never come: two more are a dispatch behind the front, waiting in a
    # collective for it; only the one waiting for its rows is stuck.
    at = [{"dispatched": 24, "reading": None}, {"dispatched": 23, "reading": None}, {"dispatched": 23, "reading": 24}]
    assert health.stuck_processes(at) == {2: at[2]}
    at = [{"dispatched": 24}, {"dispatched": 23, "reading": None}]  # behind, not reading (compiling, say)
    assert health.stuck_processes(at) == {1: at[1]} == health.stuck_early(at)
    # While a process compiles ahead beside its steps, before the hang bound only a process
    # waiting for its own rows is named (the hang bound still names the others).
    aside = [{"dispatched": 24, "background": (3, 1)}, {"dispatched": 23, "reading": None, "background": (2, 0)}]
    assert health.working_aside(aside) and health.stuck_early(aside) == {} and health.stuck_processes(aside)
    aside[1]["reading"] = 24
    assert health.stuck_early(aside) == {1: aside[1]}
    assert not health.working_aside([{"background": (3, 0)}, None, {}])
    # The straggler windows: which processes worked aside since the previous round.
    now = [{"background": (3, 0)}, {"background": (2, 1)}, None, {"background": (4, 0)}]
    assert health.worked_aside(now, [3, 2, 0, 3]) == {1, 3} and health.background_started(now) == [3, 2, 0, 4]
    assert health.worked_aside(now, None) == {0, 1, 3}  # a world's first round: since it began
    assert health.worked_aside([{"background": (0, 0)}, {}], None) == set()
