"""A bad step (a non-finite loss or state, a loss spike) is never kept: the step program does not
apply its update, the driver counts it, and too many stop the run. The guard runs here in one
process on CPU; end to end (a poisoned record on the simulated cluster) in ``test_user_contract.py``."""

import json

import jax
import numpy as np
import pytest

from ray_elastic import FailureConfig
from ray_elastic.decide.bad_steps import KEPT, NON_FINITE, SPIKE, BadSteps, too_many_skips
from ray_elastic.observe.results import previous_run


def _run_guard(losses, bad: BadSteps, skip_new: bool = True):
    """Feed ``losses`` through the guard with a one-array state that each step moves by 1: per step
    (kept state, verdict)."""
    import jax
    import jax.numpy as jnp

    from ray_elastic.slice.step_guard import guard, new_history

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    history = new_history(mesh)
    step = jax.jit(lambda state, loss, h: guard({"w": state["w"] + 1.0}, state, loss, h, bad))
    state, out = {"w": jnp.zeros(3)}, []
    for loss in losses:
        state, history, verdict = step(state, jnp.float32(loss), history)
        out.append((float(state["w"][0]), int(verdict)))
    return out


@pytest.mark.cluster  # compiles a JAX program
def test_a_non_finite_loss_or_a_spike_keeps_the_state_before_the_step():
    out = _run_guard([1.0, float("nan"), 0.9, float("inf"), 0.8], BadSteps())
    assert out == [(1.0, KEPT), (1.0, NON_FINITE), (2.0, KEPT), (2.0, NON_FINITE), (3.0, KEPT)]
    # Spikes are judged once 8 kept steps are known, against their median (a skipped one is not one of them).
    losses = [1.0] * 8 + [3.5, 2.9, 3.5, 1.0]
    verdicts = [v for _, v in _run_guard(losses, BadSteps(spike_factor=3.0))]
    assert verdicts == [KEPT] * 8 + [SPIKE, KEPT, SPIKE, KEPT]
    assert [v for _, v in _run_guard([1.0, 9.0], BadSteps(spike_factor=3.0))] == [KEPT, KEPT]  # too early to tell
    assert [v for _, v in _run_guard(losses, BadSteps())] == [KEPT] * 12  # spikes off


@pytest.mark.cluster  # compiles a JAX program
def test_on_bad_step_raise_applies_the_update_and_leaves_the_verdict_to_stop_the_run():
    out = _run_guard([1.0, float("nan")], BadSteps(skip=False))
    assert out == [(1.0, KEPT), (2.0, NON_FINITE)]


def test_more_skips_than_allowed_within_the_window_stop_the_run():
    bad = BadSteps(max_skipped=2, window=100)
    assert too_many_skips([5, 50], 60, bad) is None
    assert too_many_skips([5, 50, 60], 60, bad) == [5, 50, 60]
    assert too_many_skips([5, 50, 60], 110, bad) is None  # step 5 is out of the window
    assert too_many_skips([7], 7, BadSteps(max_skipped=0)) == [7]  # every skip stops the run


def test_bad_step_settings_are_checked():
    assert FailureConfig().bad_steps() == BadSteps(True, None, 5, 1000)
    assert FailureConfig(on_bad_step="raise", spike_factor=4).bad_steps() == BadSteps(False, 4, 5, 1000)
    for bad, match in (
        ({"on_bad_step": "ignore"}, "on_bad_step must be 'skip' or 'raise'"),
        ({"spike_factor": 1.0}, "spike_factor must be None"),
        ({"spike_factor": float("inf")}, "spike_factor must be None"),
        ({"max_skipped_steps": -1}, "max_skipped_steps must be >= 0"),
        ({"skipped_steps_window": 0}, "skipped_steps_window must be >= 1"),
    ):
        with pytest.raises(ValueError, match=match):
            FailureConfig(**bad)


def test_a_rerun_restores_past_a_skipped_step_but_not_past_a_non_finite_one_it_kept(tmp_path):
    """A lost driver's rerun resumes from the newest step logged: a skipped step's NaN loss is not
    its state (the update was not applied); a NaN loss that was kept (``on_bad_step="raise"``
    logged it before stopping) taints every step after it."""

    def log(skipped):
        lines = [
            {"kind": "run_started", "ts": 0.0, "num_slices": 2},
            {
                "kind": "steps",
                "ts": 1.0,
                "generation": 0,
                "steps": [0, 1, 2, 3],
                "losses": [1.0, float("nan"), 0.9, 0.8],
                "step_time_s": [0.1] * 4,
                "skipped": skipped,
            },
            {"kind": "run_started", "ts": 2.0, "num_slices": 2},  # the rerun, reading the log
        ]
        (tmp_path / "events.jsonl").write_text("\n".join(json.dumps(e) for e in lines) + "\n")
        return previous_run(str(tmp_path)).last_step

    assert log([1]) == 3
    assert log([]) == 0


@pytest.mark.cluster  # compiles and runs real JAX steps
def test_past_max_skipped_steps_the_step_loop_stops_the_run_naming_them():
    """A model that diverges every step is a bug, not a bad batch: the third skip within the window
    stops the run (each skipped step's state was the one before it)."""
    from ray_elastic.decide import plan_world
    from ray_elastic.examples.digits_mlp import DigitsMLPTask
    from ray_elastic.slice import jax_world
    from ray_elastic.slice import mesh as world_mesh
    from ray_elastic.slice.data import StepBatches

    class Diverging(DigitsMLPTask):
        def dataset(self):
            return [dict(ex, x=ex["x"] * np.nan) for ex in super().dataset()]

    task = Diverging()
    plan = plan_world(0, ["s0"], 1, 1, 16)
    batches = StepBatches(task.dataset(), 16, 0)
    loop = jax_world.TrainLoop(
        task, plan, 0, 0, world_mesh.build_mesh(plan), 1, batches, bad_steps=BadSteps(max_skipped=2, window=10)
    )
    before = [np.asarray(x).copy() for x in jax.tree.leaves(loop.state)]
    with pytest.raises(jax_world.NonFiniteLossError, match=r"steps \[0, 1, 2\] were bad and skipped within 10 steps"):
        loop.run(0, 6)
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(before, jax.tree.leaves(loop.state)))
