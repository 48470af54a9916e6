"""Bad input fails with a clear ValueError before any Ray resource is taken."""

import pytest
import ray

from ray_elastic import AutoInterval, ElasticConfig, ElasticTrainer, FailureConfig, SliceSpec
from ray_elastic.cli import main as cli_main
from ray_elastic.examples.digits_mlp import DigitsMLPTask

SIM = SliceSpec("v4", "2x2x1", devices_per_host=2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_slices=0, global_batch_size=12), "num_slices must be a positive integer"),
        (dict(num_slices=2, min_slices=3, global_batch_size=12), "min_slices=3 must be between 1 and num_slices=2"),
        (dict(num_slices=2, global_batch_size=12, mode="shrink"), "unknown mode 'shrink'"),
        (dict(num_slices=2, global_batch_size=12, batch_policy="grow"), "unknown batch_policy"),
        (dict(num_slices=3, global_batch_size=16), "cannot be split evenly over 3 slice(s) x 2 device(s)"),
        (dict(num_slices=3, global_batch_size=18), "use a multiple of 12"),
        (dict(num_slices=2, global_batch_size=0), "global_batch_size must be a positive integer"),
        (dict(num_slices=2, global_batch_size=12, steps_per_chunk=0), "steps_per_chunk must be >= 1"),
        (dict(num_slices=2, global_batch_size=12, snapshot_every=-1), "snapshot_every must be >= 0"),
        (dict(num_slices=2, global_batch_size=12, snapshot_every="often"), "or a SnapshotPolicy"),
        (dict(num_slices=2, global_batch_size=12, snapshot_every="auto"), "is AutoInterval()"),
        (dict(num_slices=2, global_batch_size=12, snapshot_every=1.5), "snapshot_every must be an integer >= 0"),
        (dict(num_slices=2, global_batch_size=12, snapshot_every=AutoInterval(0)), "AutoInterval(budget=...) is"),
        (dict(num_slices=2, global_batch_size=12, worker_niceness=30), "worker_niceness must be None"),
        (dict(num_slices=2, global_batch_size=12, snapshot_every=AutoInterval(2)), "between 0 and 1"),
        (dict(num_slices=2, global_batch_size=12, checkpoint_every=0), "checkpoint_every must be >= 1"),
        (dict(num_slices=2, global_batch_size=12, snapshot_every=0), "snapshot_every=0 without a checkpoint_dir"),
        (dict(num_slices=2, global_batch_size=12, jax_init_timeout_s=None), "jax_init_timeout_s must be a number"),
        (dict(num_slices=2, global_batch_size=12, jax_init_timeout_s=0.5), "jax_init_timeout_s must be >= 1"),
        (
            dict(num_slices=2, global_batch_size=12, slice_timeout_s=0),
            "slice_timeout_s must be a number of seconds > 0",
        ),
        (dict(num_slices=2, global_batch_size=12, failure=dict(hang_timeout_factor=-1)), "hang_timeout_factor must be"),
        (dict(num_slices=2, global_batch_size=12, failure=dict(node_death_grace_s=None)), "node_death_grace_s must be"),
        (dict(num_slices=2, global_batch_size=12, failure=dict(max_failures=0)), "max_failures must be >= 1, got 0"),
        (dict(num_slices=2, global_batch_size=12, standby_workers=-1), "standby_workers must be an integer >= 0"),
        (dict(num_slices=2, global_batch_size=12, standby_workers=1.5), "standby_workers must be an integer >= 0"),
        (dict(num_slices=2, global_batch_size=12, max_to_keep=0), "max_to_keep must be >= 1"),
        (dict(num_slices=2, global_batch_size=12, checkpoint_dir=" "), "checkpoint_dir must be a local path"),
        (dict(num_slices=2, global_batch_size=12, megascale_port=0), "megascale_port must be a TCP port"),
        (dict(num_slices=2, global_batch_size=12, megascale_port="8081"), "megascale_port must be a TCP port"),
        (dict(num_slices=2, global_batch_size=12, orphan_timeout_s=0.01), "orphan_timeout_s must be between 5"),
        (dict(num_slices=2, global_batch_size=12, orphan_timeout_s=1e9), "orphan_timeout_s must be between 5"),
        (dict(num_slices=2, global_batch_size=16, seed=True), "seed must be a whole number, got True (bool)"),
        (
            dict(num_slices=2, global_batch_size=16, steps_per_chunk=True),
            "steps_per_chunk must be a whole number, got True (bool)",
        ),
        (
            dict(num_slices=2, global_batch_size=16, steps_per_chunk=None),
            "steps_per_chunk must be a whole number, got None",
        ),
    ],
)
def test_bad_config_raises_clear_value_error(kwargs, message):
    with pytest.raises(ValueError) as e:
        failure = kwargs.get("failure")  # the failure settings check themselves as they are made
        ElasticConfig(slice=SIM, **{**kwargs, **({"failure": FailureConfig(**failure)} if failure else {})})
    assert message in str(e.value)
    assert not ray.is_initialized(), "validation must not touch Ray"


def test_snapshots_off_needs_checkpoints_or_an_explicit_opt_in():
    ElasticConfig(num_slices=2, global_batch_size=12, slice=SIM, snapshot_every=0, checkpoint_dir="/tmp/ckpt")
    ElasticConfig(num_slices=2, global_batch_size=12, slice=SIM, snapshot_every=0, allow_restart_from_scratch=True)


@pytest.mark.parametrize(
    "accelerator, topology, message",
    [
        ("v9", "2x2x1", "unknown TPU accelerator 'v9'"),
        ("tpu-v99", "2x2", "unknown TPU accelerator"),
        ("v4", "3x3x3", "unknown topology '3x3x3' for TPU v4"),
        ("v6e", "2x2x2", "unknown topology '2x2x2' for TPU v6e"),
    ],
)
def test_unknown_accelerator_or_topology(accelerator, topology, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        SliceSpec(accelerator, topology)
    assert not ray.is_initialized()


def test_slice_spec_matches_ray_tpu_tables():
    assert SliceSpec("TPU-V4", "2x2x2").accelerator == "v4"
    s = SliceSpec("v4", "2x2x2")
    assert (s.pod_type, s.num_hosts, s.chips_per_host, s.host_devices) == ("v4-16", 2, 4, 4)
    assert SliceSpec.for_hosts("v4", 2, 2).topology == "2x2x2"
    assert SliceSpec.for_hosts("v4", 1, 2).devices_per_slice == 2
    assert SliceSpec("v6e", "2x4").num_hosts == 1


def test_pause_and_resume_only_needs_full_size_split():
    # 3 slices x 2 devices = 6 divides 18; smaller worlds never happen in pause-and-resume.
    cfg = ElasticConfig(num_slices=3, global_batch_size=18, slice=SIM, mode="pause-and-resume")
    assert cfg.world_sizes() == [3]
    # replica-resize down to 2 slices: 18 over 2 x 2 devices does not split.
    with pytest.raises(ValueError, match="2 slice"):
        ElasticConfig(num_slices=3, min_slices=2, global_batch_size=18, slice=SIM)


def test_trainer_rejects_bad_arguments_before_ray():
    cfg = ElasticConfig(num_slices=2, global_batch_size=12, slice=SIM)
    with pytest.raises(ValueError, match=r"task must be a ray_elastic.TrainTask"):
        ElasticTrainer(object(), cfg)
    with pytest.raises(ValueError, match="num_steps must be a positive integer"):
        ElasticTrainer(DigitsMLPTask(), cfg).fit(0)
    assert not ray.is_initialized()


def test_cli_bad_input_exits_2_without_starting_a_cluster(capsys):
    assert cli_main(["demo", "--num-slices", "0", "--no-progress"]) == 2
    assert "num_slices must be a positive integer" in capsys.readouterr().err
    assert cli_main(["train", "--topology", "5x5", "--no-progress"]) == 2
    assert "unknown topology '5x5'" in capsys.readouterr().err
    assert cli_main(["demo", "--example", "nope", "--no-progress"]) == 2
    assert "use an example name" in capsys.readouterr().err
    assert not ray.is_initialized()


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("failure.node_death_grace_s", float("inf"), "node_death_grace_s must be a finite number, got inf"),
        ("replacement_timeout_s", float("inf"), "replacement_timeout_s must be a finite number, got inf"),
        ("failure.max_failures_in_a_row", float("nan"), "max_failures_in_a_row must be a whole number, got nan"),
        ("steps_per_chunk", 2.5, "steps_per_chunk must be a whole number, got 2.5"),
        ("checkpoint_every", 10.0, "checkpoint_every must be a whole number, got 10.0"),
        ("min_slices", 1.5, "min_slices must be a whole number, got 1.5"),
        ("failure.hang_timeout_factor", float("nan"), "hang_timeout_factor must be a finite number, got nan"),
    ],
)
def test_nan_inf_and_fractional_counts_are_refused_before_anything_runs(field, value, message):
    with pytest.raises(ValueError, match=message):
        if field.startswith("failure."):
            FailureConfig(**{field.removeprefix("failure."): value})
        ElasticConfig(num_slices=3, global_batch_size=48, slice=SIM, **{field: value})


def test_a_checkpoint_path_with_tilde_or_relative_is_made_absolute_on_the_driver(tmp_path, monkeypatch):
    """``~`` was expanded where the path was checked but not where it was written and
    read, so the slice processes wrote under a literal ``~`` in their own working directory."""
    import os

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    cfg = ElasticConfig(num_slices=1, global_batch_size=2, slice=SIM, checkpoint_dir="~/runs/ckpt")
    assert cfg.checkpoint_dir == os.path.join(str(tmp_path), "runs", "ckpt")
    cfg = ElasticConfig(num_slices=1, global_batch_size=2, slice=SIM, checkpoint_dir="runs/rel")
    assert cfg.checkpoint_dir == os.path.join(str(tmp_path), "runs", "rel")
    assert (
        ElasticConfig(num_slices=1, global_batch_size=2, slice=SIM, checkpoint_dir="gs://b/p").checkpoint_dir
        == "gs://b/p"
    )
