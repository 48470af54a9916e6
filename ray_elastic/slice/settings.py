"""What a slice process needs of the run's settings: computed once on the driver from the
``ElasticConfig`` (:func:`ray_elastic.ray_backend.slice_settings.slice_settings`) and sent to every
slice and standby process instead of the config, so a process re-derives nothing (the layout of
each world size, whether snapshots are on, the first snapshot interval)."""

from __future__ import annotations

import dataclasses

from ray_elastic.decide import WorldShapes
from ray_elastic.decide.bad_steps import DEFAULT_BAD_STEPS, BadSteps


@dataclasses.dataclass(frozen=True)
class SliceSettings:
    worlds: WorldShapes  # every world size the run may train on, and its layout
    global_batch_size: int  # the full world's: the data order's stride
    seed: int  # parameters and data order
    batch_policy: str  # recorded with every checkpoint
    fsdp_min_size: int
    logical_axis_rules: tuple
    scale_updates: bool  # the learning rate follows the world's size (``lr_rule``)
    pack: bool  # snapshots are on: the step packs its new state for the snapshot writer
    snapshot_every: int  # a chunk's snapshot interval when the controller names none
    checkpoint_dir: str | None
    checkpoint_every: int
    max_to_keep: int | None
    async_checkpointing: bool
    eval_every: int
    eval_batch: int
    eval_steps: int
    compilation_cache_dir: str | None
    megascale_port: int
    worker_niceness: int | None
    bad_steps: BadSteps = DEFAULT_BAD_STEPS  # what the step program does with a non-finite loss or a spike
    integrity_every: int = 0  # fingerprint the state every this many steps (0: never)
