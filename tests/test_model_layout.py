"""The model's own layout and step, without a cluster: logical axis rules, gradient accumulation,
a custom train step, and bad input reported on the driver before any slice is reserved."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from ray_elastic import ElasticConfig, ElasticTrainer, SliceSpec, TrainingCodeError
from ray_elastic.decide.layout import partition
from ray_elastic.examples.digits_mlp import DigitsMLPTask
from ray_elastic.examples.llm import LOGICAL_AXIS_RULES, DecoderLMTask

MESH = {"replica": 2, "fsdp": 2, "tensor": 2}
RULES = (("embed", ("fsdp",)), ("mlp", ("tensor",)))


def test_rules_map_logical_names_to_mesh_axes_and_unknown_names_fall_back_to_fsdp():
    assert partition("w", (64, 128), ("embed", "mlp"), RULES, MESH, 1) == ("fsdp", "tensor")
    assert partition("w", (64, 128), ("fsdp", None), (), MESH, 1) == ("fsdp", None)  # a mesh axis as a name
    assert partition("w", (64, 128), ("vocab", "heads"), RULES, MESH, 1) == (None, "fsdp")  # no rule: auto FSDP
    assert partition("w", (64, 128), None, RULES, MESH, 1) == (None, "fsdp")
    assert partition("w", (64, 128), ("embed", "mlp"), (("embed", ("fsdp", "tensor")),), MESH, 1) == (
        ("fsdp", "tensor"),
        None,
    )


def test_a_dimension_the_mesh_axis_does_not_divide_names_the_parameter():
    with pytest.raises(ValueError, match=r"parameter blocks/0/mlp of shape \(64, 30\).*'mlp' \(30\)"):
        partition("blocks/0/mlp", (64, 30), ("embed", "mlp"), (("mlp", ("tensor",)),), {"fsdp": 2, "tensor": 4}, 1)


def _config(**kw) -> ElasticConfig:
    return ElasticConfig(
        **{"num_slices": 2, "global_batch_size": 32, "slice": SliceSpec("v4", "2x2x1", 4), "standby_workers": 0, **kw}
    )


def test_a_rule_naming_a_mesh_axis_that_does_not_exist_is_refused():
    with pytest.raises(ValueError, match="rule 'mlp' -> 'model' names no axis of the slice mesh"):
        _config(logical_axis_rules=[("mlp", "model")])
    with pytest.raises(ValueError, match="never split across slices"):
        _config(logical_axis_rules=[("embed", "replica")])


def test_a_slice_mesh_that_does_not_fit_the_slice_is_refused():
    with pytest.raises(ValueError, match="needs a multiple of 8 devices per slice; a slice has 4"):
        _config(slice_mesh={"fsdp": 2, "tensor": 4})
    with pytest.raises(ValueError, match="more than fit evenly in one host"):
        ElasticConfig(
            num_slices=1,
            global_batch_size=8,
            slice=SliceSpec.for_hosts("v4", 2, 2),
            slice_mesh={"fsdp": -1, "tensor": 4},
        )


def test_a_microbatch_size_that_does_not_divide_every_worlds_per_device_batch_is_refused():
    # 3 slices x 4 devices: 48 = 4 per device at full size, 6 at two slices, 12 at one: 4 does not divide 6.
    with pytest.raises(ValueError, match=r"microbatch_size=4 does not divide the per-device batch 6 of a world of 2"):
        _config(num_slices=3, global_batch_size=48, microbatch_size=4)
    assert _config(num_slices=3, global_batch_size=48, microbatch_size=2).microbatch_size == 2


class ShortEval(DigitsMLPTask):
    def eval_dataset(self):
        return self.dataset()[:20]


class TupleOfThree(DigitsMLPTask):
    def loss(self, model, batch):
        return super().loss(model, batch), 1.0, 2.0


class TooWide(DecoderLMTask):
    """d_ff 30 cannot split over a tensor axis of 4."""


def _fails_before_reserving(task, config, error, match):
    """``fit`` raises on the driver: no Ray cluster is running or reached (address unreachable)."""
    trainer = ElasticTrainer(task, config, progress=False, address="127.0.0.1:1")
    with pytest.raises(error, match=match):
        trainer.fit(5)


def test_bad_input_is_reported_on_the_driver_before_any_slice_is_reserved():
    _fails_before_reserving(
        ShortEval(),
        _config(eval_every=5, eval_steps=2),
        ValueError,
        r"eval_dataset\(\) has 20 examples, fewer than eval_steps=2 x eval_batch_size=32",
    )
    _fails_before_reserving(
        TupleOfThree(),
        _config(),
        TrainingCodeError,
        r"loss returned a tuple of 3 \(array\(\), float, float\); expected a scalar loss or "
        r"\(loss, metrics\)",
    )
    _fails_before_reserving(
        TooWide(d_ff=30, num_kv_heads=4, max_chars=20_000),
        _config(slice_mesh={"fsdp": 1, "tensor": 4}, logical_axis_rules=LOGICAL_AXIS_RULES),
        ValueError,
        r"parameter \[0\]\['blocks'\]\[0\]\['mlp'\]\['down'\]\['kernel'\] of shape \(30, 64\)",
    )


def _subprocess(fn: str, *args) -> dict:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    code = f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import test_model_layout as t; t.{fn}(*sys.argv[1:])"
    out = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


class ClippedEMA(DigitsMLPTask):
    """A custom step: clipped gradients, a grad-norm metric and an EMA copy of the weights."""

    def create_model(self, rngs):
        model = super().create_model(rngs)
        model.ema = nnx.Variable(jnp.zeros(()))  # EMA of the output bias mean: extra NNX state
        return model

    def train_step(self, model, optimizer, batch):
        metrics, grads = self.value_and_grad(model, batch)
        norm = optax.global_norm(grads)
        grads = jax_tree_scale(grads, jnp.minimum(1.0, 1.0 / (norm + 1e-6)))
        optimizer.update(model, grads)
        model.ema[...] = 0.9 * model.ema[...] + 0.1 * model.out.bias[...].mean()
        return {**metrics, "grad_norm": norm, "ema": model.ema[...]}


def jax_tree_scale(tree, s):
    import jax

    return jax.tree.map(lambda g: g * s, tree)


def _train(task_name: str, microbatch: str) -> None:
    """4 devices as one slice of (fsdp 2, tensor 2): 6 steps, metrics per step."""
    from ray_elastic.decide import plan_world
    from ray_elastic.slice import jax_world
    from ray_elastic.slice import mesh as world_mesh
    from ray_elastic.slice.data import StepBatches

    task = {
        "digits": DigitsMLPTask(),
        "custom": ClippedEMA(),
        # float32 compute: in bfloat16 the sums of microbatches differ from the whole batch's by bf16 rounding
        "llm": DecoderLMTask(seq_len=16, d_model=32, d_ff=64, num_layers=1, max_chars=30_000, compute_dtype="float32"),
    }[task_name]
    plan = plan_world(0, ["s0"], 1, 4, 16, slice_mesh={"fsdp": 2, "tensor": 2}, microbatch_size=int(microbatch))
    loop = jax_world.TrainLoop(
        task, plan, 0, 0, world_mesh.build_mesh(plan), 1, StepBatches(task.dataset(), 16, 0), rules=LOGICAL_AXIS_RULES
    )
    print(json.dumps({"microbatches": plan.num_microbatches, "steps": loop.run(0, 6)}))


@pytest.mark.cluster  # compiles and runs real JAX steps (seconds)
@pytest.mark.parametrize("task", ["digits", "llm"])
def test_gradient_accumulation_matches_the_whole_batch_to_float32_rounding(task):
    whole, micro = _subprocess("_train", task, "0"), _subprocess("_train", task, "2")
    assert (whole["microbatches"], micro["microbatches"]) == (1, 4)
    a, b = np.array([m["loss"] for m in whole["steps"]]), np.array([m["loss"] for m in micro["steps"]])
    assert np.max(np.abs(a - b) / a) < 2e-5, (a, b)
    assert a[-1] < a[0]


@pytest.mark.cluster  # compiles and runs real JAX steps (seconds)
def test_a_custom_train_step_reports_its_metrics_and_carries_its_state():
    out = _subprocess("_train", "custom", "2")["steps"]
    assert all({"loss", "grad_norm", "ema"} <= set(m) for m in out)
    assert out[0]["ema"] != 0.0 and out[-1]["ema"] != out[0]["ema"]  # the EMA state carried from step to step


def _checkpoint_of(task, directory: str, steps_done: int = 2) -> None:
    """A committed checkpoint of ``task`` written as a one-process world writes it."""
    from ray_elastic.decide import plan_world
    from ray_elastic.slice import jax_world
    from ray_elastic.slice import mesh as world_mesh
    from ray_elastic.slice.data import StepBatches
    from ray_elastic.state.checkpoints import Checkpointer

    plan = plan_world(0, ["s0"], 1, 1, 16)
    ckpt = Checkpointer(directory, 3)
    loop = jax_world.TrainLoop(
        task, plan, 0, 0, world_mesh.build_mesh(plan), 1, StepBatches(task.dataset(), 16, 0), checkpointer=ckpt
    )
    loop.run(0, steps_done)
    loop.save_checkpoint(steps_done, {"step": steps_done, "task": task.name(), "seed": 0, "data_stride": 16})
    ckpt.wait()
    ckpt.close()


def test_a_rerun_with_a_changed_model_is_refused_before_any_slice_is_reserved(tmp_path):
    """The checkpoint of a narrower model failed to load on every world, was set aside as
    a storage fault, and the run trained from step 0 while it said it resumed."""
    directory = str(tmp_path / "ckpt")
    _checkpoint_of(DigitsMLPTask(hidden=32), directory)
    config = ElasticConfig(
        num_slices=1,
        global_batch_size=16,
        slice=SliceSpec("v4", "2x2x1", 1),
        standby_workers=0,
        checkpoint_dir=directory,
    )
    _fails_before_reserving(
        DigitsMLPTask(hidden=48),
        config,
        ValueError,
        r"checkpoint 2 in .* was written by a model of another shape: it has .*\[64, 32\]",
    )
    # The model that wrote it passes the same check.
    from ray_elastic.ray_backend.backend import RayBackend
    from ray_elastic.state.checkpoints import latest_checkpoint

    RayBackend.check_task(DigitsMLPTask(hidden=32), config, latest_checkpoint(directory))


def test_the_snapshot_identity_changes_when_parameters_are_renamed_or_settings_differ():
    """A rerun restores a lost driver's snapshots only under the same identity: a rename that swaps
    two same-shaped leaves' order, another learning rate (a task field) or another seed is another run."""
    from ray_elastic import ElasticConfig, SliceSpec
    from ray_elastic.examples.digits_mlp import DigitsMLPTask
    from ray_elastic.ray_backend.preflight import run_settings, snapshot_layout

    cfg = ElasticConfig(num_slices=2, global_batch_size=48, slice=SliceSpec("v4", "2x2x1"))
    task = DigitsMLPTask()
    paths = [a[0] for a in snapshot_layout(task, cfg)[0]]
    assert any("l1" in p for p in paths) and any("l2" in p for p in paths), paths  # named, in restore order
    assert run_settings(task, cfg) == run_settings(DigitsMLPTask(), cfg)
    other = DigitsMLPTask()
    other.learning_rate = 0.5
    assert run_settings(other, cfg) != run_settings(task, cfg)
    import dataclasses

    assert run_settings(task, dataclasses.replace(cfg, seed=1)) != run_settings(task, cfg)
