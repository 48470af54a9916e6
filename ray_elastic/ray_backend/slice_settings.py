"""The slice processes' :class:`~ray_elastic.slice.settings.SliceSettings`, from the run's config."""

from __future__ import annotations

from ray_elastic.config import ElasticConfig
from ray_elastic.policy.snapshots import SnapshotCosts
from ray_elastic.slice.settings import SliceSettings


def slice_settings(config: ElasticConfig) -> SliceSettings:
    """What the slice processes of a run with ``config`` need to know (on the driver, once)."""
    c = config
    return SliceSettings(
        worlds=c.world_shapes(),
        global_batch_size=c.global_batch_size,
        seed=c.seed,
        batch_policy=c.batch_policy,
        fsdp_min_size=c.fsdp_min_size,
        logical_axis_rules=tuple(c.logical_axis_rules),
        scale_updates=c.lr_rule is not None,
        pack=c.snapshots_on,
        snapshot_every=c.snapshot_policy.interval(SnapshotCosts()),  # before anything is measured
        checkpoint_dir=c.checkpoint_dir,
        checkpoint_every=c.checkpoint_every,
        max_to_keep=c.max_to_keep,
        async_checkpointing=c.async_checkpointing,
        eval_every=c.eval_every,
        eval_batch=c.eval_batch,
        eval_steps=c.eval_steps,
        compilation_cache_dir=c.compilation_cache_dir,
        megascale_port=c.megascale_port,
        worker_niceness=c.worker_niceness,
        bad_steps=c.failure.bad_steps(),
        integrity_every=c.failure.integrity_every,
    )
