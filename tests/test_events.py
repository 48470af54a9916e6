"""The typed event log: what a run writes to ``events.jsonl`` reads back as the same events,
logs of earlier versions still load, and callbacks get typed events that read like dicts."""

import json

from fake_backend import FakeBackend, add_capacity, lose_slice

from ray_elastic import ElasticConfig, ElasticTrainer, SliceSpec
from ray_elastic.examples.digits_mlp import DigitsMLPTask
from ray_elastic.observe import event_types as ev
from ray_elastic.observe import goodput, report
from ray_elastic.observe.results import unexplained_rewinds


def fake_run(tmp_path, on_event=None):
    """Three slices: one lost at step 5 (a recovery), capacity back at step 8 (a grow-back)."""
    backend = FakeBackend(slices=3, faults={5: lose_slice(1), 8: add_capacity})
    config = ElasticConfig(
        num_slices=3,
        min_slices=2,
        global_batch_size=48,
        slice=SliceSpec("v4", "2x2x1"),
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_every=5,
    )
    trainer = ElasticTrainer(DigitsMLPTask(), config, progress=False, run_dir=str(tmp_path / "run"), on_event=on_event)
    trainer.backend_cls = backend
    return trainer, trainer.fit(16)


def test_every_logged_event_reads_back_as_the_same_typed_event(tmp_path):
    trainer, result = fake_run(tmp_path)
    logged = report.load_events(str(tmp_path / "run"))
    assert logged == result.events  # same classes, same fields
    kinds = {type(e) for e in logged}
    assert {ev.RunStarted, ev.WorldFormed, ev.Failure, ev.Recovered, ev.Resize, ev.ScaleUp, ev.Steps} <= kinds
    assert {ev.ChunkRun, ev.RunFinished} <= kinds
    assert not any(isinstance(e, ev.UnknownEvent) for e in logged)
    lines = (tmp_path / "run" / "events.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [json.loads(json.dumps(e.to_json(), default=str)) for e in logged]
    formed = [e for e in logged if isinstance(e, ev.WorldFormed)]
    assert formed == trainer.worlds and formed[1]["restored_from_step"] == formed[1].start_step - 1
    assert result.recoveries == [e for e in logged if isinstance(e, ev.Recovered)]


def test_callbacks_get_typed_events_that_read_like_dicts(tmp_path):
    got = []
    fake_run(tmp_path, on_event=got.append)
    assert {type(e) for e in got} == {ev.Failure, ev.Recovered, ev.Resize, ev.ScaleUp}
    failure = next(e for e in got if isinstance(e, ev.Failure))
    assert failure["kind"] == "failure" and failure.get("lost_slices") == failure.lost_slices
    assert "world_slices" in failure and dict(failure)["cause"] == failure.cause


# Lines as earlier versions wrote them: no finishing times, no restore evidence, no drain time,
# a failure without the world's fields, and a kind this version does not know.
OLD_LOG = [
    {"ts": 100.0, "kind": "run_started", "num_steps": 6, "num_slices": 2, "mode": "replica-resize"},
    {
        "ts": 101.0,
        "kind": "world_formed",
        "generation": 0,
        "slices": ["s0", "s1"],
        "mesh": {"replica": 2},
        "global_batch_size": 8,
        "restored_from_step": -1,
        "restore_source": "fresh",
        "snapshot_donors": {},
        "total_s": 1.0,
        "compile_s": 0.5,
    },
    {
        "ts": 103.0,
        "kind": "steps",
        "steps": [0, 1, 2, 3],
        "losses": [4.0, 3.0, 2.5, 2.0],
        "step_time_s": [0.5, 0.5, 0.5, 0.5],
    },
    {
        "ts": 104.0,
        "kind": "failure",
        "generation": 0,
        "cause": "failure",
        "lost_slices": ["s1"],
        "kinds": {"s1": "node_died"},
        "last_step": 3,
        "classify_s": 0.1,
        "since_last_progress_s": 0.4,
    },
    {"ts": 104.5, "kind": "snapshot_gc", "dropped": 3},
    {
        "ts": 106.0,
        "kind": "world_formed",
        "generation": 1,
        "slices": ["s0"],
        "mesh": {"replica": 1},
        "global_batch_size": 8,
        "restored_from_step": 2,
        "restore_source": "snapshot",
        "snapshot_donors": {},
        "total_s": 1.5,
        "compile_s": 0.5,
    },
    {
        "ts": 106.0,
        "kind": "recovered",
        "generation": 1,
        "reason": "node died",
        "mode": "replica-resize",
        "slices": 1,
        "added_slices": 0,
        "restored_from_step": 2,
        "restore_source": "snapshot",
        "steps_rewound": 1,
        "since_last_progress_s": 0.4,
        "classify_s": 0.1,
        "teardown_s": 0.2,
        "wait_for_capacity_s": 0.0,
        "world_formation_s": 1.0,
        "state_load_s": 0.0,
        "compile_s": 0.5,
        "recovery_s": 2.0,
        "detected_at": 104.0,
        "capacity_ready_at": 104.3,
        "ready_at": 106.0,
    },
    {"ts": 108.0, "kind": "steps", "steps": [3, 4, 5], "losses": [2.0, 1.8, 1.7], "step_time_s": [0.5, 0.5, 0.5]},
    {"ts": 108.1, "kind": "run_finished", "steps": 6, "wall_s": 8.1},
]


def test_a_log_of_an_earlier_version_still_loads(tmp_path):
    run = tmp_path / "old"
    run.mkdir()
    (run / "events.jsonl").write_text("".join(json.dumps(line) + "\n" for line in OLD_LOG))
    events = report.load_events(str(run))
    assert events[0].to_json() == {**OLD_LOG[0], "checkpoint_dir": None, "resume_from_checkpoint": None}
    steps = events[2]
    assert isinstance(steps, ev.Steps) and steps.finished_at is None and steps.generation is None  # absent: None
    failure = next(e for e in events if isinstance(e, ev.FailureEvent))
    assert isinstance(failure, ev.Failure) and failure.lost_slices == ["s1"] and failure.world_slices is None
    assert failure.seen_at == 104.0 - 0.1  # no drain time in that log
    unknown = next(e for e in events if isinstance(e, ev.UnknownEvent))
    assert unknown["kind"] == "snapshot_gc" and unknown["dropped"] == 3  # kept, not dropped
    assert events[5].start_step == 3 and events[5].times == {"total_s": 1.5, "compile_s": 0.5}
    tl = report.timeline(events)
    assert [n for _, n in tl.slices_alive] == [0, 2, 1, 0] and tl.failures == [(4.0, ["s1"])]
    assert [s for s, _ in tl.losses] == [0, 1, 2, 3, 4, 5] and tl.num_slices == 2
    gp = goodput.account(events)
    assert 0 < gp.productive_s < gp.total_s and gp.badput_s["rewound_work"] == 0.5  # step 3 ran twice
    # the raw lines work too: the only snapshot holder (s0) survived, yet a step was rewound
    assert unexplained_rewinds(OLD_LOG, replicas=1) == 1


def test_a_torn_last_line_is_repaired_and_every_rerun_reads_past_it(tmp_path):
    """A driver killed while writing leaves a partial last line: the next run starts on a line of
    its own (the torn one is skipped with a warning, not a JSONDecodeError for every rerun)."""
    _trainer, _first = fake_run(tmp_path)
    path = tmp_path / "run" / "events.jsonl"
    with open(path, "a") as f:
        f.write('{"kind": "steps", "steps": [16, 17], "los')  # SIGKILL mid-line
    _trainer, second = fake_run(tmp_path)
    assert second.summary["num_steps"] == 16  # no JSONDecodeError: checkpoint 16 covers them all
    lines = path.read_text().splitlines()
    assert sum(1 for ln in lines if ln.startswith('{"kind": "steps", "steps": [16, 17], "los')) == 1
    assert '"kind": "run_started"' in lines[lines.index('{"kind": "steps", "steps": [16, 17], "los') + 1]
    runs = [e for e in report.load_events(str(tmp_path / "run")) if isinstance(e, ev.RunStarted)]
    assert len(runs) == 2
