"""What a run asks for: the slice shape, how many slices, and training settings.

All validation lives here (the slice's shape in :mod:`ray_elastic.tpu`) and runs before
any Ray resource is taken, so bad input fails fast with a message that says what to change.
"""

from __future__ import annotations

import dataclasses
import math

from ray_elastic.decide import WorldPlan, WorldShapes, batch_for_world, lr_scale
from ray_elastic.decide.field_types import check_count, check_seconds, check_whole, mistyped_fields
from ray_elastic.decide.layout import DEFAULT_SLICE_MESH, FSDP_AXIS, normalize_rules, resolve_slice_mesh
from ray_elastic.policy.failure import FailureConfig
from ray_elastic.policy.scaling import MODES, ScalingPolicy, scaling_policy  # noqa: F401 - MODES: the CLI's choices
from ray_elastic.policy.snapshots import AutoInterval, SnapshotPolicy, as_policy, check_snapshot_every, takes_snapshots
from ray_elastic.tpu import SliceSpec

BATCH_POLICIES = ("constant", "scale")
LR_RULES = (None, "linear", "sqrt")


ORPHAN_TIMEOUT_BOUNDS = (5.0, 86400.0)  # lease renewals come every 1-5 s; a lost run is freed within a day


@dataclasses.dataclass(frozen=True)
class ElasticConfig:
    """Settings of one elastic training run.

    Args:
        num_slices: slices to train on at full size.
        slice: shape of every slice.
        global_batch_size: examples per step, summed over all slices.
        min_slices: fewest slices training may continue on (replica-resize). Defaults to 1.
        mode: ``replica-resize`` (continue on survivors, grow back as replacements come),
            ``pause-and-resume`` (wait for a replacement) or ``resize-until-full`` (continue on
            survivors, grow back once full size can be restored at once); see ``policy/scaling.py``.
        batch_policy: ``constant`` keeps the global batch when slices are lost; ``scale`` shrinks it.
        steps_per_chunk: steps a worker runs per controller call (no driver round trip per step).
        seed: seeds parameter initialisation and the data order.
        fsdp_min_size: arrays with at least this many elements are sharded over the slice's
            ``fsdp`` axis; smaller ones stay replicated (for tiny arrays the collectives cost
            more than the memory saved).
        compilation_cache_dir: JAX persistent compilation cache (shared by all generations); ``None`` disables it.
        slice_timeout_s: how long to wait for the first slices to be reserved before giving up.
        jax_init_timeout_s: how long processes wait for each other in ``jax.distributed.initialize``.
        snapshot_every: how often the live state is snapshotted (to the host's keeper, off the
            step's critical path): a :class:`~ray_elastic.policy.snapshots.SnapshotPolicy`, or an
            int n for a snapshot after every n-th step (1 = zero rewind; 0 = none: a recovery
            restores the newest committed checkpoint). Default ``AutoInterval(budget=0.02)``: the
            smallest interval whose snapshots cost at most 2% of the step time, measured as the run
            goes (every step wherever a copy fits; a recovery rewinds at most interval - 1 steps,
            reported in events and the summary).
        snapshot_replicas: how many slices keep snapshots (replicas hold identical state). 3, so
            that losing any two slices at once (a shared failure domain, or a fault during a
            recovery) leaves a holder and rewinds nothing; the first slices of each world hold
            them, survivors before newcomers, so holders are re-picked at once after a loss.
        allow_restart_from_scratch: when every snapshot holder is lost and there is no checkpoint,
            start again from step 0 instead of failing with ``StateLostError``. Off by default: a
            run that silently restarts looks like one that went on.
        replacement_timeout_s: how long to wait for a replacement slice when the survivors are not
            enough (pause-and-resume: fewer than ``num_slices``; replica-resize: fewer than
            ``min_slices``); then ``CapacityTimeoutError``.
        fallback_to_resize: pause-and-resume: on timeout continue on the survivors (if >= min_slices)
            instead of failing.
        lr_rule: with ``batch_policy="scale"``, scale the optimizer's updates by ``linear``
            (active/total) or ``sqrt`` of it; ``None`` leaves them alone.
        failure: how a fault that kills nothing is seen (the hang watchdog, health probes) and
            when failures end the run (retry limits): a
            :class:`~ray_elastic.policy.failure.FailureConfig`.
        standby_workers: warm processes kept on every slice host for the next generations, so
            recovery does not wait for Python + JAX start-up. Two by default: a second fault
            while a recovery forms (which uses up the first) still finds a warm one. 0: none.
        checkpoint_dir: Orbax checkpoints go here: a local path (shared by all hosts on a
            multi-host cluster) or ``gs://bucket/prefix``. Every host writes its own shards. A run
            started on a directory that holds checkpoints resumes from the newest committed one.
            ``None``: no checkpoints (in-memory snapshots only).
        checkpoint_every: save after every this many steps (and after the last step).
        max_to_keep: committed checkpoints kept; older ones are deleted. ``None`` keeps all.
        save_timeout_s: how long one checkpoint save (or commit) may keep a world busy before it
            counts as a failed save and the world is recovered. ``None``: 10 x the slowest save
            the run has committed, at least 300 s.
        orphan_timeout_s: how long the snapshot keepers outlive a driver that stopped renewing
            their lease (it died): a rerun within it resumes from their snapshots; after it they
            free them and exit, so an abandoned run leaves nothing behind.
        async_checkpointing: write in the background; a step only waits for the device-to-host copy.
        worker_niceness: the slice processes' niceness. ``None`` keeps what Ray gives a
            ``num_cpus=0`` actor (``RAY_worker_niceness``, 15), which leaves Ray's own daemons
            ahead of training: on a small machine 0 delays the news of a lost node by seconds
            (``bench/overhead.py`` measures it).
        slice_mesh: the axes of one slice's devices and their sizes, in order, ``fsdp`` first
            (``-1``: whatever is left), e.g. ``{"fsdp": -1, "tensor": 2}``. The world's mesh is
            ``(replica, *slice_mesh)``, ``replica`` across slices. The batch is split over
            ``replica`` x ``fsdp``; the axes after ``fsdp`` must fit in one host.
        logical_axis_rules: ``[(logical name, mesh axis | (axes...) | None), ...]``: where the
            names a model annotates its parameters with go (``nnx.with_partitioning(init,
            ("embed", "mlp"))``), as Flax's and MaxText's ``logical_axis_rules``, e.g.
            ``[("embed", "fsdp"), ("mlp", "tensor")]``. A name that is a slice axis maps to it.
            Unannotated arrays, and those whose names have no rule, use the automatic FSDP rule.
        microbatch_size: examples per device per microbatch: each step accumulates gradients over
            per-device batch / microbatch_size microbatches inside the compiled step. A smaller
            world keeps the global batch by running more microbatches, so the memory a device
            needs stays the same across resizes. ``None``: one batch per step.
        eval_every: run an evaluation on the task's ``eval_dataset()`` after every this many
            steps (and after the last step); 0: never.
        eval_steps: batches per evaluation (its metrics are averaged over them).
        eval_batch_size: examples per eval batch (``None``: ``global_batch_size``).
        progress_metrics: names of metrics the loss returns (or ``eval/...``) to show in the
            progress bar beside the loss.
        megascale_port: the port libtpu's multi-slice coordinator listens on, on each world's
            first slice (``MEGASCALE_PORT``; Ray's default, 8081). Hosts of different slices must
            reach it (``ray-elastic check`` tries).
    """

    num_slices: int
    global_batch_size: int
    slice: SliceSpec = dataclasses.field(default_factory=SliceSpec)
    min_slices: int | None = None
    mode: str = "replica-resize"
    batch_policy: str = "constant"
    steps_per_chunk: int = 10
    seed: int = 0
    fsdp_min_size: int = 2**18
    compilation_cache_dir: str | None = "/tmp/ray-elastic-jax-cache"
    slice_timeout_s: float = 300.0
    jax_init_timeout_s: float = 120.0
    snapshot_every: int | SnapshotPolicy = dataclasses.field(default_factory=AutoInterval)
    snapshot_replicas: int = 3
    allow_restart_from_scratch: bool = False
    replacement_timeout_s: float = 300.0
    fallback_to_resize: bool = False
    lr_rule: str | None = None
    failure: FailureConfig = dataclasses.field(default_factory=FailureConfig)
    standby_workers: int = 2
    checkpoint_dir: str | None = None
    checkpoint_every: int = 100
    max_to_keep: int | None = 3
    async_checkpointing: bool = True
    save_timeout_s: float | None = None
    orphan_timeout_s: float = 300.0
    worker_niceness: int | None = None
    slice_mesh: dict = dataclasses.field(default_factory=lambda: dict(DEFAULT_SLICE_MESH))
    logical_axis_rules: tuple = ()
    microbatch_size: int | None = None
    eval_every: int = 0
    eval_steps: int = 1
    eval_batch_size: int | None = None
    progress_metrics: tuple = ()
    megascale_port: int = 8081

    def __post_init__(self):
        try:  # the fields' own checks say best what is wrong; what they miss, the types' check names
            for check in (self._check_number_types, self._check_world, self._check_state, self._check_timeouts):
                check()
            self._check_model_layout()
            self._check_batch_splits()
        except TypeError:  # a comparison of a mistyped value
            self._check_types()
            raise
        self._check_types()

    def _check_world(self) -> None:
        """The slices, the mode and batch policies, the processes per host."""
        if not isinstance(self.slice, SliceSpec):
            raise ValueError(f"slice must be a SliceSpec, got {type(self.slice).__name__}")
        if not isinstance(self.num_slices, int) or self.num_slices < 1:
            raise ValueError(f"num_slices must be a positive integer (at least 1 slice), got {self.num_slices!r}")
        min_slices = 1 if self.min_slices is None else self.min_slices
        object.__setattr__(self, "min_slices", min_slices)
        if not 1 <= min_slices <= self.num_slices:
            raise ValueError(
                f"min_slices={min_slices} must be between 1 and num_slices={self.num_slices}: "
                f"lower min_slices or raise num_slices"
            )
        self.scaling_policy()  # an unknown mode says which exist
        if self.batch_policy not in BATCH_POLICIES:
            raise ValueError(f"unknown batch_policy {self.batch_policy!r}: use one of {', '.join(BATCH_POLICIES)}")
        if self.lr_rule not in LR_RULES:
            raise ValueError(f"unknown lr_rule {self.lr_rule!r}: use None, 'linear' or 'sqrt'")
        if self.lr_rule is not None and self.batch_policy != "scale":
            raise ValueError("lr_rule only applies with batch_policy='scale'; remove it or set batch_policy='scale'")
        if not isinstance(self.standby_workers, int) or self.standby_workers < 0:
            raise ValueError(
                f"standby_workers must be an integer >= 0 (warm processes per host), got {self.standby_workers!r}"
            )
        object.__setattr__(self, "standby_workers", int(self.standby_workers))  # True/False read as 1/0
        if self.worker_niceness is not None and (
            isinstance(self.worker_niceness, bool)
            or not isinstance(self.worker_niceness, int)
            or not -20 <= self.worker_niceness <= 19
        ):
            raise ValueError(
                f"worker_niceness must be None (as Ray sets it) or an integer from -20 to 19, "
                f"got {self.worker_niceness!r}"
            )
        if (
            isinstance(self.megascale_port, bool)
            or not isinstance(self.megascale_port, int)
            or not 0 < self.megascale_port < 65536
        ):
            raise ValueError(f"megascale_port must be a TCP port (1-65535), got {self.megascale_port!r}")
        if self.steps_per_chunk < 1:
            raise ValueError(f"steps_per_chunk must be >= 1, got {self.steps_per_chunk}")
        if not isinstance(self.global_batch_size, int) or self.global_batch_size < 1:
            raise ValueError(f"global_batch_size must be a positive integer, got {self.global_batch_size!r}")

    def _check_state(self) -> None:
        """Snapshots, checkpoints and the failure limits: something to recover from, kept where it can be."""
        for name in ("snapshot_replicas", "checkpoint_every"):
            check_count(name, getattr(self, name), 1)
        check_snapshot_every(self.snapshot_every)
        if not self.snapshots_on and self.checkpoint_dir is None and not self.allow_restart_from_scratch:
            raise ValueError(
                "snapshot_every=0 without a checkpoint_dir keeps no state to recover from: any lost "
                "slice would restart training from step 0. Set checkpoint_dir, keep snapshots "
                "(snapshot_every >= 1), or set allow_restart_from_scratch=True"
            )
        if self.max_to_keep is not None and self.max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 (or None to keep every checkpoint), got {self.max_to_keep}")
        if self.checkpoint_dir is not None and (
            not isinstance(self.checkpoint_dir, str) or not self.checkpoint_dir.strip()
        ):
            raise ValueError(f"checkpoint_dir must be a local path or gs://bucket/prefix, got {self.checkpoint_dir!r}")
        if self.checkpoint_dir is not None:
            from ray_elastic.state.storage_locations import resolve

            object.__setattr__(self, "checkpoint_dir", resolve(self.checkpoint_dir.strip()))

    def _check_timeouts(self) -> None:
        """Every bound in seconds is a finite number above 0 (None would mean waiting forever)."""
        for name in ("replacement_timeout_s", "slice_timeout_s", "jax_init_timeout_s", "orphan_timeout_s"):
            check_seconds(name, getattr(self, name))
        if not ORPHAN_TIMEOUT_BOUNDS[0] <= self.orphan_timeout_s <= ORPHAN_TIMEOUT_BOUNDS[1]:
            raise ValueError(  # below, a healthy driver's keepers could expire between two lease renewals
                f"orphan_timeout_s must be between 5 and 86400 seconds, got {self.orphan_timeout_s!r}: shorter "
                "loses a healthy run's snapshots; longer holds a lost run's host memory for days"
            )
        if self.jax_init_timeout_s < 1:  # jax.distributed.initialize takes whole seconds
            raise ValueError(
                f"jax_init_timeout_s must be >= 1 (JAX counts it in whole seconds), got {self.jax_init_timeout_s!r}"
            )
        if self.save_timeout_s is not None:
            check_seconds("save_timeout_s (or None: 10 x the slowest save, at least 300 s)", self.save_timeout_s)

    def _check_types(self) -> None:
        """Every field holds its declared type: ``seed=True`` is not a seed, ``steps_per_chunk=None``
        not a chunk size (a bool is no number here; a list is taken for a tuple)."""
        for name, want, value in mistyped_fields(self):
            raise ValueError(f"{name} must be {want}, got {value!r} ({type(value).__name__}): see ElasticConfig's docs")

    def _check_number_types(self) -> None:
        """Whole numbers where a count is meant (the others say so in their own checks)."""
        for name in (
            "min_slices",
            "steps_per_chunk",
            "seed",
            "fsdp_min_size",
            "snapshot_replicas",
            "checkpoint_every",
            "max_to_keep",
        ):
            check_whole(name, getattr(self, name))

    def _check_model_layout(self) -> None:
        """The slice mesh, the logical axis rules, microbatches and eval settings."""
        if not isinstance(self.slice_mesh, dict):
            raise ValueError(f"slice_mesh must be a dict of axis name -> size, got {self.slice_mesh!r}")
        axes = resolve_slice_mesh(self.slice_mesh, self.slice.devices_per_slice, self.slice.host_devices)
        object.__setattr__(self, "slice_mesh", dict(axes))
        object.__setattr__(self, "logical_axis_rules", normalize_rules(self.logical_axis_rules, [a for a, _ in axes]))
        mb = self.microbatch_size
        if mb is not None and (isinstance(mb, bool) or not isinstance(mb, int) or mb < 1):
            raise ValueError(f"microbatch_size must be a positive integer (examples per device) or None, got {mb!r}")
        for name in ("eval_every", "eval_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "eval_every" else 1):
                raise ValueError(f"{name} must be an integer >= {0 if name == 'eval_every' else 1}, got {value!r}")
        eb = self.eval_batch_size
        if eb is not None and (isinstance(eb, bool) or not isinstance(eb, int) or eb < 1):
            raise ValueError(f"eval_batch_size must be a positive integer or None, got {eb!r}")
        if isinstance(self.progress_metrics, str) or not all(isinstance(m, str) for m in self.progress_metrics):
            raise ValueError(f"progress_metrics must be a list of metric names, got {self.progress_metrics!r}")
        object.__setattr__(self, "progress_metrics", tuple(self.progress_metrics))

    @property
    def fsdp_per_slice(self) -> int:
        return self.slice_mesh[FSDP_AXIS]

    @property
    def eval_batch(self) -> int:
        return self.eval_batch_size or self.global_batch_size

    @property
    def snapshot_policy(self) -> SnapshotPolicy:
        return as_policy(self.snapshot_every)

    @property
    def snapshots_on(self) -> bool:
        return takes_snapshots(self.snapshot_policy)

    def world_plan(self, generation: int, slice_names: list[str]) -> WorldPlan:
        """The layout of a world of these slices (mesh, batch and update scale for its size)."""
        return self.world_shapes([len(slice_names)]).plan(generation, slice_names)

    def world_shapes(self, sizes: list[int] | None = None) -> WorldShapes:
        """How a world of each of ``sizes`` slices (default: :meth:`world_sizes`) is laid out: the
        one definition, which the slice processes get too, so a step traced ahead fits the world."""
        return WorldShapes(
            self.slice.num_hosts,
            self.slice.host_devices,
            data_stride=self.global_batch_size,
            snapshot_slices=self.snapshot_replicas,
            slice_mesh=self.slice_mesh,
            microbatch_size=self.microbatch_size or 0,
            by_size={
                n: (
                    batch_for_world(n, self.num_slices, self.global_batch_size, self.batch_policy),
                    lr_scale(n, self.num_slices, self.lr_rule),
                )
                for n in (self.world_sizes() if sizes is None else sizes)
            },
        )

    def scaling_policy(self) -> ScalingPolicy:
        """The mode's policy: the next world after a failure, when to grow back, the world sizes."""
        return scaling_policy(self.mode, self.num_slices, self.min_slices, self.fallback_to_resize)

    def world_sizes(self) -> list[int]:
        """Slice counts the run may train on (the batch must split over each)."""
        return self.scaling_policy().world_sizes()

    def _check_batch_splits(self) -> None:
        dps = self.fsdp_per_slice  # devices of a slice that take their own rows of the batch
        self._check_microbatches(dps)
        if self.eval_every:
            bad_eval = [n for n in self.world_sizes() if self.eval_batch % (n * dps)]
            if bad_eval:
                need = math.lcm(*(n * dps for n in self.world_sizes()))
                raise ValueError(
                    f"eval_batch_size={self.eval_batch} cannot be split evenly over "
                    f"{', '.join(f'{n} slice(s) x {dps} device(s)' for n in bad_eval)}: use a multiple "
                    f"of {need}"
                )
        bad = [n for n in self.world_sizes() if self.global_batch_size % (n * dps)]
        if not bad:
            return
        if self.batch_policy == "constant":
            need = math.lcm(*(n * dps for n in self.world_sizes()))
            raise ValueError(
                f"global_batch_size={self.global_batch_size} cannot be split evenly over "
                f"{', '.join(f'{n} slice(s) x {dps} device(s)' for n in bad)}: "
                f"use a multiple of {need}, or raise min_slices"
            )
        # scale: the batch per device stays fixed; only full size must divide.
        if self.num_slices in bad:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} cannot be split over {self.num_slices} slices x "
                f"{dps} devices: use a multiple of {self.num_slices * dps}"
            )

    def _check_microbatches(self, dps: int) -> None:
        """Every world the run may form must split its per-device batch into whole microbatches."""
        mb = self.microbatch_size
        if not mb:
            return
        for n in self.world_sizes():
            batch = (
                batch_for_world(n, self.num_slices, self.global_batch_size, self.batch_policy)
                if self.batch_policy == "constant" or n == self.num_slices
                else None
            )
            if batch is None or batch % (n * dps):
                continue  # reported by the batch check
            per_device = batch // (n * dps)
            if per_device % mb:
                raise ValueError(
                    f"microbatch_size={mb} does not divide the per-device batch {per_device} of a world of {n} "
                    f"slice(s) (global_batch_size={batch} over {n} x {dps} data-parallel devices): choose a "
                    f"microbatch_size that divides it, or change min_slices"
                )
