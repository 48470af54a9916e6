"""Models as TPU users write them, on slices of 4 devices (2 fsdp x 2 tensor): sharding annotations
and logical axis rules, (loss, metrics), eval, gradient accumulation, dropout, TensorBoard, and a
non-finite loss, on a real simulated cluster with real multi-process JAX."""

import os
import time

import numpy as np
import pytest
from conftest import reference_losses
from faults import FaultPlan, ensure_slices, in_thread, kill_process_of_slice, max_rel_err

from ray_elastic import ElasticConfig, ElasticTrainer, FailureConfig, TrainingCodeError
from ray_elastic.examples.digits_mlp import DigitsMLPTask
from ray_elastic.examples.llm import LOGICAL_AXIS_RULES, DecoderLMTask
from ray_elastic.slice.data import StepBatches
from ray_elastic.state.checkpoints import latest_checkpoint

SIM_CLUSTER = {"num_slices": 4, "devices_per_host": 4}
STEPS, KILL_AT = 24, 13


def llm_task(**kw) -> DecoderLMTask:
    return DecoderLMTask(
        **{
            "seq_len": 16,
            "d_model": 32,
            "num_heads": 4,
            "num_kv_heads": 2,
            "d_ff": 64,
            "num_layers": 1,
            "max_chars": 60_000,
            "dropout": 0.1,
            **kw,
        }
    )


def llm_config(cluster, num_slices=3, **kw) -> ElasticConfig:
    base = dict(
        num_slices=num_slices,
        global_batch_size=48,
        slice=cluster.slice_spec,
        steps_per_chunk=6,
        seed=1,
        slice_mesh={"fsdp": -1, "tensor": 2},
        logical_axis_rules=LOGICAL_AXIS_RULES,
        eval_every=8,
        eval_steps=2,
        eval_batch_size=24,
        snapshot_every=1,
        microbatch_size=4,
        standby_workers=0,
        failure=FailureConfig(hang_timeout_min_s=5.0),
        slice_timeout_s=120.0,
        progress_metrics=("accuracy", "eval/loss"),
    )
    return ElasticConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def llm_runs(sim_cluster, tmp_path_factory):
    """The LLM example with dropout, eval and TensorBoard: failure-free, and with a slice's process
    SIGKILLed after step KILL_AT (its host lives: the world re-forms with the same shape)."""
    ensure_slices(sim_cluster, 4)
    out = {}
    for name, faults in (("clean", {}), ("killed", {KILL_AT: lambda t: kill_process_of_slice(t, 1)})):
        run_dir = str(tmp_path_factory.mktemp(name))
        seen: list[dict] = []
        plan = FaultPlan(faults)
        trainer = ElasticTrainer(
            llm_task(),
            llm_config(sim_cluster),
            progress=False,
            run_dir=run_dir,
            on_step=lambda m, plan=plan, seen=seen: (seen.append(m), plan.on_step(m)),
        )
        plan.trainer = trainer
        result = trainer.fit(STEPS)
        assert not plan.faults
        out[name] = (trainer, result, seen, run_dir)
    return out


def test_an_annotated_model_is_laid_out_over_fsdp_and_tensor(llm_runs):
    trainer, result, _, _ = llm_runs["clean"]
    assert result.summary["mesh"] == {"replica": 3, "fsdp": 2, "tensor": 2}
    for j in trainer.world.join_infos:
        assert j["mesh_shape"] == {"replica": 3, "fsdp": 2, "tensor": 2} and j["local_devices"] == 4
        assert j["sharded_params"] > 0
    assert result.losses[-1] < result.losses[0]


def test_a_lost_process_is_recovered_with_no_step_rewound_and_dropout_losses_equal(llm_runs):
    _, clean, _, _ = llm_runs["clean"]
    _, killed, _, _ = llm_runs["killed"]
    assert killed.steps == list(range(STEPS))
    assert killed.summary["recoveries"] == 1 and killed.summary["steps_rewound"] == 0
    # The dropout RNG streams are part of the state: the recovered run draws the same masks.
    assert max_rel_err(killed.losses, clean.losses) <= 1e-6
    assert killed.metrics["accuracy"] == pytest.approx(clean.metrics["accuracy"], rel=1e-6)


def test_metrics_reach_on_step_the_event_log_and_the_result(llm_runs):
    _, result, seen, _ = llm_runs["killed"]
    assert all({"accuracy", "perplexity"} <= set(m) for m in seen)
    # The mean over 2 microbatches of exp(loss): at least exp(mean loss) (Jensen), and close to it.
    ppl, exp_loss = np.array([m["perplexity"] for m in seen]), np.exp([m["loss"] for m in seen])
    assert np.all(ppl >= exp_loss * (1 - 1e-6)) and np.allclose(ppl, exp_loss, rtol=0.05)
    logged = [e for e in result.events if e["kind"] == "steps"]
    assert logged and all(len(e["metrics"]["accuracy"]) == len(e["steps"]) for e in logged)
    assert len(result.metrics["accuracy"]) == STEPS


def test_evals_run_every_eval_every_steps_and_after_the_last(llm_runs):
    _, clean, _, _ = llm_runs["clean"]
    _, killed, _, _ = llm_runs["killed"]
    assert sorted(clean.evals) == [7, 15, 23]
    assert set(clean.evals[7]) == {"eval/loss", "eval/accuracy", "eval/perplexity"}
    assert clean.evals[23]["eval/loss"] < clean.evals[7]["eval/loss"]
    assert sorted(killed.evals) == [7, 15, 23]
    for s in killed.evals:
        assert killed.evals[s] == pytest.approx(clean.evals[s], rel=1e-6)


def test_the_report_draws_the_eval_loss_beside_the_train_loss(llm_runs):
    from ray_elastic.observe import report

    _, result, _, run_dir = llm_runs["killed"]
    tl = report.timeline(report.load_events(run_dir))
    assert [s for s, _ in tl.evals] == [7, 15, 23]
    assert tl.evals[-1][1] == pytest.approx(result.evals[23]["eval/loss"])
    assert os.path.getsize(report.render(run_dir)) > 10_000


def test_tensorboard_holds_train_eval_and_elastic_scalars(llm_runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, result, _, run_dir = llm_runs["killed"]
    acc = EventAccumulator(os.path.join(run_dir, "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {
        "train/loss",
        "train/accuracy",
        "train/perplexity",
        "eval/loss",
        "eval/accuracy",
        "elastic/step_time_s",
        "elastic/slices_alive",
        "elastic/recoveries",
        "elastic/goodput",
    } <= tags
    loss = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert sorted(loss) == list(range(STEPS))
    assert loss[STEPS - 1] == pytest.approx(result.losses[-1], rel=1e-6)
    assert [e.step for e in acc.Scalars("eval/loss")] == [7, 15, 23]
    assert acc.Scalars("elastic/recoveries")[-1].value == 1


def test_an_annotated_model_resizes_onto_fewer_slices_from_their_snapshots(sim_cluster):
    """A slice's host lost: the world goes on with 2 slices (replica-resize), each restoring its
    fsdp x tensor shards from a snapshot; the losses stay those of the failure-free run."""
    runs = {}
    lose_a_host = {10: lambda t: in_thread(sim_cluster.kill_slice, t.world.plan.slice_names[2])}
    for name, faults in (("clean", {}), ("resized", lose_a_host)):
        ensure_slices(sim_cluster, 3)
        plan = FaultPlan(faults)
        cfg = llm_config(sim_cluster, eval_every=0, microbatch_size=None, standby_workers=1)
        trainer = ElasticTrainer(
            llm_task(dropout=0.0, compute_dtype="float32"), cfg, progress=False, on_step=plan.on_step
        )
        plan.trainer = trainer
        runs[name] = trainer.fit(20)
        assert not plan.faults
    resized = runs["resized"]
    assert resized.summary["recoveries"] == 1 and resized.summary["steps_rewound"] == 0
    assert resized.summary["mesh"] == {"replica": 2, "fsdp": 2, "tensor": 2}
    assert max_rel_err(resized.losses, runs["clean"].losses) <= 1e-4


def test_eval_numbers_equal_on_two_and_four_slices(sim_cluster, tmp_path):
    """The checkpoint written by a 4-slice world is evaluated again by a 2-slice world that resumes it.

    The rule: a world whose first step s follows an eval step s-1 this run has not recorded redoes
    that eval before step s (``StepStreams._eval_lost``), also when s is past the run's last step.
    An eval is work, not a hang: the watchdog's probe sees a process evaluating as busy
    (``health.busy``), so a slow first eval on a loaded machine no longer ends the world and loses
    the redone eval with it (the restore then came from the checkpoint of step 10, past the eval)."""
    ensure_slices(sim_cluster, 4)
    directory = str(tmp_path / "ckpt")
    kw = dict(
        eval_every=10,
        eval_batch_size=16,
        global_batch_size=32,
        checkpoint_dir=directory,
        checkpoint_every=10,
        snapshot_every=0,
    )
    four = ElasticTrainer(
        llm_task(dropout=0.0), llm_config(sim_cluster, num_slices=4, min_slices=4, **kw), progress=False
    ).fit(10)
    two = ElasticTrainer(
        llm_task(dropout=0.0), llm_config(sim_cluster, num_slices=2, min_slices=2, **kw), progress=False
    ).fit(11)
    assert four.summary["mesh"]["replica"] == 4 and two.summary["mesh"]["replica"] == 2
    assert two.summary["resumed_from_checkpoint"] == 10
    assert two.summary["failures"] == 0, two.recoveries  # one world, which redid the eval first
    assert 9 in two.evals, f"the eval of step 9 was not redone: {sorted(two.evals)}"
    assert two.evals[9] == pytest.approx(four.evals[9], rel=1e-5)
    assert 10 in two.evals


def nan_at_row(row: int, how: str = "nan") -> DigitsMLPTask:
    """Digits with one example whose features are NaN (``how="nan"``: the step that reads it has a
    NaN loss), a thousand times too large and mislabelled (``"spike"``: its loss spikes), or left out (``"drop"``)
    (a class defined here: the slice processes get it by value, as a notebook's)."""

    class NaNAtRow(DigitsMLPTask):
        def dataset(self):
            base = super().dataset()
            if how == "drop":
                return base[:row] + base[row + 1 :]
            if how == "nan":
                bad = {"x": np.full_like(base[row]["x"], np.nan)}
            else:  # scaled and mislabelled: the model is sure of the wrong class
                bad = {"x": base[row]["x"] * 1000.0, "y": (base[row]["y"] + 1) % 10}
            return [dict(ex, **bad) if i == row else ex for i, ex in enumerate(base)]

    return NaNAtRow()


def _nan_config(sim_cluster, tmp_path, **failure) -> ElasticConfig:
    return ElasticConfig(
        num_slices=2,
        global_batch_size=32,
        slice=sim_cluster.slice_spec,
        seed=0,
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_every=1,
        standby_workers=0,
        snapshot_every=1,
        slice_timeout_s=120.0,
        failure=FailureConfig(**failure),
    )


def _bad_step(row: int) -> int:
    batches = StepBatches(nan_at_row(row).dataset(), 32, 0)
    bad = next(s for s in range(100) if np.isnan(batches.global_batch(s)["x"]).any())
    assert bad > 0
    return bad


def test_a_nan_loss_stops_the_run_naming_the_step_before_it_is_checkpointed(sim_cluster, tmp_path):
    """``on_bad_step="raise"``: the run stops at the bad step, with the state before it checkpointed."""
    ensure_slices(sim_cluster, 4)
    task = nan_at_row(123)
    bad = _bad_step(123)
    with pytest.raises(TrainingCodeError, match=f"loss of step {bad} is nan"):
        ElasticTrainer(task, _nan_config(sim_cluster, tmp_path, on_bad_step="raise"), progress=False).fit(bad + 5)
    info = latest_checkpoint(str(tmp_path / "ckpt"))
    assert info is not None and info.step == bad  # the state after step bad-1: the last good one


@pytest.mark.parametrize("how, failure, why", [("nan", {}, "non_finite"), ("spike", {"spike_factor": 5.0}, "spike")])
def test_a_poisoned_record_is_skipped_and_the_run_ends_as_if_it_was_left_out(sim_cluster, tmp_path, how, failure, why):
    """The default: the step that reads the NaN record (or, with ``spike_factor``, the one whose loss
    it makes spike) is not kept (its update never applied, no rollback), the run goes on to the
    end, and its final losses are within noise of a run whose dataset leaves that record out
    (noise: how far the run on the clean dataset ends from that one)."""
    ensure_slices(sim_cluster, 4)
    task, steps = nan_at_row(123, how), 60
    bad = _bad_step(123)  # step 9: a spike is judged once 8 steps are known
    config = _nan_config(sim_cluster, tmp_path, **failure)
    result = ElasticTrainer(task, config, progress=False, run_dir=str(tmp_path / "run")).fit(steps)
    assert result.steps == list(range(steps))
    (skip,) = [e for e in result.events if e["kind"] == "step_skipped"]
    assert (skip["step"], skip["why"]) == (bad, why), skip
    assert not np.isfinite(skip["loss"]) if how == "nan" else skip["loss"] > 5.0 * np.median(result.losses[:bad])
    assert result.summary["steps_skipped"] == 1 and result.summary["failures"] == 0
    assert all(np.isfinite(result.losses[s]) for s in range(steps) if s != bad)
    assert latest_checkpoint(str(tmp_path / "ckpt")).step == steps  # every checkpoint after it too
    if how == "nan":  # in the report and TensorBoard
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        from ray_elastic.observe import report

        run_dir = str(tmp_path / "run")
        tl = report.timeline(report.load_events(run_dir))
        assert tl.skipped == {bad: "non_finite"} and bad not in dict(tl.losses)
        acc = EventAccumulator(os.path.join(run_dir, "tensorboard"))
        acc.Reload()
        assert [(e.step, e.value) for e in acc.Scalars("elastic/steps_skipped")] == [(bad, 1.0)]
    # The loss of one step is its batch's: compare the means of the last 20 steps.
    left_out = reference_losses(nan_at_row(123, "drop"), 32, 0, steps)[-20:].mean()
    clean = reference_losses(DigitsMLPTask(), 32, 0, steps)[-20:].mean()
    ours = float(np.mean(result.losses[-20:]))
    assert abs(ours - left_out) <= 2 * abs(clean - left_out), (ours, left_out, clean)


def slow_eval(delay_s: float) -> DigitsMLPTask:
    """Digits with held-out data read slowly, so an eval lasts long enough to lose a process in it."""

    class SlowEval(DigitsMLPTask):
        def eval_dataset(self):
            import time

            base = super().dataset()[-256:]

            class Slow:
                def __len__(self):
                    return len(base)

                def __getitem__(self, i):
                    time.sleep(delay_s)
                    return base[i]

            return Slow()

    return SlowEval()


def test_a_process_lost_during_an_eval_is_recovered_and_the_eval_redone_with_no_step_rewound(sim_cluster):
    ensure_slices(sim_cluster, 4)
    cfg = ElasticConfig(
        num_slices=2,
        global_batch_size=32,
        slice=sim_cluster.slice_spec,
        seed=0,
        standby_workers=0,
        snapshot_every=1,
        slice_timeout_s=120.0,
        eval_every=10,
        eval_steps=2,
        eval_batch_size=32,
    )
    plan = FaultPlan({9: lambda t: kill_process_of_slice(t, 1)})  # step 9 is streamed, then its eval starts
    trainer = ElasticTrainer(slow_eval(0.05), cfg, progress=False, on_step=plan.on_step)
    plan.trainer = trainer
    result = trainer.fit(20)
    assert not plan.faults and result.steps == list(range(20))
    (failure,) = [e for e in result.events if e["kind"] == "failure"]
    assert "evaluating after step 9" in failure["error"] or failure["last_step"] == 9, failure
    assert result.summary["recoveries"] == 1 and result.summary["steps_rewound"] == 0
    assert sorted(result.evals) == [9, 19]
    assert [e["step"] for e in result.events if e["kind"] == "eval"] == [9, 19]  # once each, the redone one included


def test_ctrl_c_while_slices_are_reserved_leaves_no_placement_group(sim_cluster):
    """A KeyboardInterrupt while reserving (more slices asked for than exist) left the
    groups made so far pending, asking the autoscaler for slices for as long as the driver lived."""
    import ray

    ensure_slices(sim_cluster, 4)

    def interrupt(event):
        if event["kind"] == "waiting":  # reserving: 4 of 6 ready
            raise KeyboardInterrupt

    cfg = ElasticConfig(
        num_slices=6,
        min_slices=6,
        global_batch_size=48,
        slice=sim_cluster.slice_spec,
        standby_workers=0,
        slice_timeout_s=120.0,
    )
    with pytest.raises(KeyboardInterrupt):
        ElasticTrainer(DigitsMLPTask(), cfg, progress=False, on_event=interrupt).fit(5)
    live = {pg_id: t["state"] for pg_id, t in ray.util.placement_group_table().items() if t["state"] != "REMOVED"}
    assert not live, live
    deadline = time.monotonic() + 10  # Ray gives a removed group's resources back asynchronously
    while ray.available_resources().get("TPU", 0) < ray.cluster_resources()["TPU"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("TPU", 0) == ray.cluster_resources()["TPU"]
