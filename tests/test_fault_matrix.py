"""Every state the controller can be in, with a fault or a Ctrl-C delivered there (scripted fake backend).

One journey passes through every state: a slice lost (recovering, a smaller world), capacity back
(resizing, growing back), two slices lost at once (waiting for capacity below ``min_slices``), and
the final checkpoint. A fault injected at the entry of each state must end in a recovery or in one
of the documented errors, never ``InvalidTransition``, a hang or a bare exception; a
``KeyboardInterrupt`` there must leave no reservation held; and no path may continue from fresh
parameters once steps were done. The real-cluster counterparts are in ``test_recovery.py``.
"""

import pytest
from fake_backend import FakeBackend, ProcessDied, add_capacity, lose_slice

from ray_elastic import ElasticConfig, ElasticTrainer, SliceSpec
from ray_elastic.control.states import ControllerState as S
from ray_elastic.control.states import OutcomeKind, RunOutcome
from ray_elastic.errors import (
    CapacityTimeoutError,
    RetriesExhaustedError,
    StateLostError,
    StorageFailingError,
    TrainingCodeError,
)
from ray_elastic.examples.digits_mlp import DigitsMLPTask

STEPS = 20
STATES = [S.SCHEDULING, S.FORMING_WORLD, S.RUNNING, S.RECOVERING, S.WAITING_FOR_CAPACITY, S.RESIZING]
DOCUMENTED = (TrainingCodeError, RetriesExhaustedError, CapacityTimeoutError, StateLostError, StorageFailingError)


def lose_two(backend, world):
    """Two of the three slices' hosts die at once."""
    for name in world.plan.slice_names[:2]:
        backend.kill(name)
    return RunOutcome(OutcomeKind.FAILURE, {0: ProcessDied("actor died"), 1: ProcessDied("actor died")})


def journey(tmp_path, on_state=None, **cfg):
    """A run through every state: returns (trainer, backend, states entered)."""
    backend = FakeBackend(slices=3, faults={5: lose_slice(1), 8: add_capacity, 12: lose_two})

    def on_event(e):
        if e["kind"] == "waiting_for_capacity":  # the autoscaler brings two slices back
            backend.add_slice()
            backend.add_slice()

    config = ElasticConfig(
        **{
            "num_slices": 3,
            "min_slices": 2,
            "global_batch_size": 48,
            "slice": SliceSpec("v4", "2x2x1"),
            "replacement_timeout_s": 5.0,
            "checkpoint_dir": str(tmp_path / "ckpt"),
            "checkpoint_every": 5,
            **cfg,
        }
    )
    trainer = ElasticTrainer(DigitsMLPTask(), config, progress=False, on_event=on_event)
    trainer.backend_cls = backend
    entered = []

    def seen(old, new):
        entered.append(new)
        if on_state is not None:
            on_state(trainer, backend, new, entered.count(new))

    trainer.callbacks.on_state = seen  # the controller calls its listeners at every transition
    return trainer, backend, entered


def fresh_restarts(trainer) -> list:
    """Worlds after the first that started from fresh parameters though steps were done."""
    return [w.generation for w in trainer.worlds[1:] if str(w.restore_source) == "fresh"]


def assert_released(backend):
    assert backend.reserved == set(), f"reservations left held: {backend.reserved}"
    assert all(r.cancelled or r.res is None or r.res.released for r in backend.requests)


def test_the_journey_passes_through_every_state(tmp_path):
    trainer, backend, entered = journey(tmp_path)
    result = trainer.fit(STEPS)
    assert result.steps == list(range(STEPS)) and result.summary["steps_rewound"] == 0
    assert set(STATES) <= set(entered) and entered[-1] is S.FINISHED, entered
    assert fresh_restarts(trainer) == []
    assert_released(backend)


@pytest.mark.parametrize("state", STATES, ids=[s.value for s in STATES])
def test_ctrl_c_in_every_state_releases_everything(tmp_path, state):
    def interrupt(trainer, backend, new, nth):
        if new is state and nth == 1:
            raise KeyboardInterrupt

    trainer, backend, entered = journey(tmp_path, interrupt)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(STEPS)
    assert trainer.state is S.ERRORED and state in entered
    assert [e["kind"] for e in trainer.events.events][-1] == "errored"
    assert_released(backend)


def _fault_at(state, fired: list):
    """At the first entry of ``state``: what can go wrong there."""

    def inject(trainer, backend, new, nth):
        if state == "final_checkpoint":  # the last world's final save: a process dies while it commits
            if new is S.RUNNING and trainer.worlds[-1].start_step >= 12 and not fired:
                backend.finish_checkpoint_failures = 1
                fired.append(state)
            return
        if new is not state or nth != 1:
            return
        fired.append(state)
        if state is S.SCHEDULING:  # a slice's host dies before it is reserved: too few are left
            backend.kill(backend.hosts[0])
        elif state is S.RUNNING:  # during the steps: the next one fails
            backend.faults[trainer.worlds[-1].start_step + 1] = lose_slice(0)
        elif state is S.RESIZING:  # a process dies while the in-flight save commits before the grow
            backend.finish_checkpoint_failures = 1
        else:  # forming, recovering, waiting: the host of a slice held for the next world dies
            live = [r for r in trainer.gens.members if r.host in backend.alive]
            backend.kill(live[-1].host)

    return inject


@pytest.mark.parametrize(
    "state", STATES + ["final_checkpoint"], ids=[getattr(s, "value", s) for s in STATES] + ["final_checkpoint"]
)
def test_a_fault_in_every_state_is_recovered_or_ends_with_a_documented_error(tmp_path, state):
    fired = []
    trainer, backend, _entered = journey(tmp_path, _fault_at(state, fired))
    try:
        result = trainer.fit(STEPS)
    except DOCUMENTED:
        assert trainer.state is S.ERRORED
    else:
        assert result.steps == list(range(STEPS))
        if state in (S.RESIZING, "final_checkpoint"):
            assert any("died while committing" in e["error"] for e in result.events if e["kind"] == "failure")
    assert fired == [state]
    assert fresh_restarts(trainer) == [], "a world started from fresh parameters after steps were done"
    assert_released(backend)


def test_a_rerun_restores_only_a_step_every_host_of_a_slice_still_holds():
    """Keepers an earlier driver left disagree (each host hands its snapshots over on its own
    clock): the first world restores the newest step that every host of some slice holds, and
    never a fresher checkpoint's rival from memory that is incomplete."""
    from ray_elastic.control.generations import Generations
    from ray_elastic.control.takeover import file_taken_over
    from ray_elastic.decide import RestoreSource
    from ray_elastic.ray_backend.keepers import TakenOver

    config = ElasticConfig(num_slices=2, global_batch_size=48, slice=SliceSpec("v4", "2x2x2"))  # 2 hosts a slice
    gens = Generations(config, FakeBackend(slices=2))
    found = [
        TakenOver(object(), "n0", ("a", 0), [40, 41, 42]),
        TakenOver(object(), "n1", ("a", 1), [39, 40, 41]),  # host 1 of "a" never got 42
        TakenOver(object(), "n2", ("b", 0), [38, 39, 40]),
        TakenOver(object(), "n3", ("b", 1), [38, 39, 40]),
        TakenOver(object(), "n4", None, [50]),  # never placed in a world: holds nothing usable
    ]
    held, refused, _ = file_taken_over(gens, found, logged=42)
    assert held == {"a": {0: [40, 41, 42], 1: [39, 40, 41]}, "b": {0: [38, 39, 40], 1: [38, 39, 40]}}
    assert refused == [] and gens.taken_over_step == 41
    plan = gens.restore_plan([], None, last_step=-1)  # the rerun's members are not named yet
    assert (plan.source, plan.step, plan.holders) == (RestoreSource.SNAPSHOT, 41, ("a",))
    # The lost driver's log ends at step 40: the steps after it have no metrics any more, so the
    # rerun resumes at 40 (both slices hold it) and runs 41 and 42 again: the record stays whole.
    logged = Generations(config, FakeBackend(slices=2))
    assert file_taken_over(logged, found, logged=40)[1] == [41, 42]
    assert logged.taken_over_step == 40
    assert logged.restore_plan([], None, last_step=-1).holders == ("a", "b")


def test_a_rerun_offers_only_steps_whose_losses_were_logged_as_finite():
    """A snapshot reaches its keeper before its loss is checked: a rerun restores only steps the
    lost driver logged with a finite loss; with no log at all, none past the newest checkpoint."""
    from ray_elastic.control.generations import Generations
    from ray_elastic.control.takeover import file_taken_over
    from ray_elastic.ray_backend.keepers import TakenOver

    config = ElasticConfig(num_slices=1, global_batch_size=48, slice=SliceSpec("v4", "2x2x1"))
    found = [TakenOver(object(), "n0", ("a", 0), [40, 41, 42])]
    early = Generations(config, FakeBackend(slices=1))  # a log that ended long before (a NaN at 21)
    _held, refused, why = file_taken_over(early, found, logged=20)
    assert early.taken_over_step == -1 and refused == [40, 41, 42] and "finite loss" in why
    unlogged = Generations(config, FakeBackend(slices=1))  # no run_dir: checkpoint 42 covers steps 0..41
    assert file_taken_over(unlogged, found, logged=None, committed=42)[1] == [42]
    assert unlogged.taken_over_step == 41
    nothing = Generations(config, FakeBackend(slices=1))
    assert file_taken_over(nothing, found)[1] == [40, 41, 42] and nothing.taken_over_step == -1


def test_the_log_of_a_lost_run_counts_steps_up_to_its_first_non_finite_loss(tmp_path):
    import json

    from ray_elastic.observe.results import PreviousRun, previous_run

    lines = [
        {"kind": "run_started"},
        {"kind": "steps", "steps": [0, 1, 2], "losses": [2.0, 1.5, 1.2]},
        {"kind": "steps", "steps": [3, 4, 5], "losses": [1.1, float("nan"), 0.9]},
        {"kind": "run_started"},
    ]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    assert previous_run(str(tmp_path)) == PreviousRun(3, False)
    # An older driver still alive logs steps after this run's start: they are the lost run's too.
    (tmp_path / "events.jsonl").write_text(
        "".join(
            json.dumps(e) + "\n"
            for e in lines[:2] + lines[3:] + [{"kind": "steps", "steps": [3, 4], "losses": [1.0, 0.9]}]
        )
    )
    assert previous_run(str(tmp_path)) == PreviousRun(4, False)
    # A run that ended after training: nothing of it is lost.
    (tmp_path / "events.jsonl").write_text(
        "".join(json.dumps(e) + "\n" for e in lines[:2] + [{"kind": "run_finished"}, lines[3]])
    )
    assert previous_run(str(tmp_path)) == PreviousRun(2, True)


@pytest.mark.parametrize("state", STATES, ids=[s.value for s in STATES])
def test_a_driver_superseded_in_every_state_stops_before_its_next_effect(tmp_path, state):
    """A rerun took the run over while this driver was in ``state`` (it learned it from a refused
    lease renewal): it stops with SupersededError, writes no event line, asks for no slice, forms
    no world and saves no checkpoint after it learned."""
    from ray_elastic.errors import SupersededError

    marks = {}

    def supersede(trainer, backend, new, nth):
        if new is state and nth == 1:
            backend.superseded = True
            marks["effects"] = (len(backend.requests), len(backend.formed), backend.saved)
            marks["lines"] = len((tmp_path / "run" / "events.jsonl").read_text().splitlines())

    trainer, backend, entered = journey(tmp_path, supersede)
    trainer.run_dir = str(tmp_path / "run")
    with pytest.raises(SupersededError):
        trainer.fit(STEPS)
    assert state in entered and trainer.state is S.ERRORED
    assert (len(backend.requests), len(backend.formed), backend.saved) == marks["effects"]
    assert len((tmp_path / "run" / "events.jsonl").read_text().splitlines()) == marks["lines"]
    assert_released(backend)


def test_a_lost_driver_s_keepers_are_freed_only_once_the_new_world_holds_a_snapshot(tmp_path):
    """The first world after a takeover restores from the lost driver's keepers; they are freed
    once that world holds a snapshot of its own, not when it forms (a failure in its first steps
    would otherwise rewind to a checkpoint, or lose the state)."""
    import json

    from ray_elastic.ray_backend.keepers import TakenOver

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    log = [{"kind": "run_started"}, {"kind": "steps", "steps": list(range(8)), "losses": [1.0] * 8}]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in log))
    backend = FakeBackend(slices=2)
    backend.left_behind = [TakenOver(object(), "gone", ("old-slice", 0), [5, 6, 7])]
    config = ElasticConfig(num_slices=2, global_batch_size=48, slice=SliceSpec("v4", "2x2x1"))
    trainer = ElasticTrainer(DigitsMLPTask(), config, progress=False, run_dir=str(run_dir))
    trainer.backend_cls = backend
    result = trainer.fit(STEPS)
    assert result.summary["resumed_from_snapshot"] == 7 and result.steps == list(range(8, STEPS))
    assert backend.released_after_steps is not None and backend.released_after_steps >= 1


def test_a_rerun_at_the_run_s_last_step_trains_nothing_and_says_so(tmp_path, caplog):
    """The lost driver had trained every step: the rerun resumes after the last one, trains none
    and returns a result (no IndexError from an empty loss list)."""
    import json

    from ray_elastic.ray_backend.keepers import TakenOver

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    log = [{"kind": "run_started"}, {"kind": "steps", "steps": list(range(STEPS)), "losses": [1.0] * STEPS}]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in log))
    backend = FakeBackend(slices=2)
    backend.left_behind = [TakenOver(object(), "gone", ("old-slice", 0), [STEPS - 2, STEPS - 1])]
    config = ElasticConfig(num_slices=2, global_batch_size=48, slice=SliceSpec("v4", "2x2x1"))
    trainer = ElasticTrainer(DigitsMLPTask(), config, progress=False, run_dir=str(run_dir))
    trainer.backend_cls = backend
    result = trainer.fit(STEPS)
    assert result.steps == [] and result.summary["resumed_from_snapshot"] == STEPS - 1
    assert result.summary["final_loss"] is None and "trains none" in caplog.text
    with pytest.raises(ValueError, match="already trained step"):
        backend.left_behind = [TakenOver(object(), "gone", ("old-slice", 0), [STEPS + 5])]
        log[1] = {"kind": "steps", "steps": list(range(STEPS + 6)), "losses": [1.0] * (STEPS + 6)}
        (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in log))
        again = ElasticTrainer(DigitsMLPTask(), config, progress=False, run_dir=str(run_dir))
        again.backend_cls = backend
        again.fit(STEPS)
