"""The failure policy: from the evidence of one failure, which slices are lost, and whether the run
may try again. It owns the run's retry counters, so the controller only reads evidence, asks, and
executes the answer."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from ray_elastic.decide.bad_steps import BadSteps
from ray_elastic.decide.failures import (
    ErrorKind,
    FailureVerdict,
    classify_failure,
    drop_repeat_offender,
    failures_exceeded,
)
from ray_elastic.decide.field_types import check_count, check_seconds, mistyped_fields
from ray_elastic.errors import ElasticRuntimeError, RetriesExhaustedError, StorageFailingError, TrainingCodeError


@dataclasses.dataclass(frozen=True)
class FailureConfig:
    """How a fault that kills nothing is seen, and when failures end the run (``ElasticConfig.failure``).

    Args:
        max_failures, failure_window_s: give up after more than ``max_failures`` failures within
            ``failure_window_s`` seconds.
        max_failures_in_a_row: give up after more than this many failures with no step finished in
            between, however long each attempt takes (a deterministic failure is not retried forever).
            A slice whose process fails first twice in a row that way is dropped as lost.
        max_save_failures_in_a_row: stop with ``StorageFailingError`` once checkpoint saves failed
            (or timed out) this many times in a row with none committed in between: a bucket that
            refuses writes, a full disk. Other failures in between start the count again.
        hang_timeout_factor, hang_timeout_min_s: the watchdog declares a hang when no step finished
            within max(min_s, factor x median step time).
        probe_timeout_s: a process that does not answer a health probe within this is hung.
        node_death_grace_s: after a process died, how long to wait for Ray to mark its node dead
            before deciding the slice itself is healthy (match Ray's health-check period x threshold).
        straggler_factor, straggler_window_steps: a slice that makes every step wait for it longer
            than ``straggler_factor`` x the others' own step time, over two windows in a row of at
            least ``straggler_window_steps`` steps (the second: half that, at least 4), is a
            straggler (always a ``straggler`` event).
        on_straggler: ``"auto"``: replace a straggler when a spare slice is ready, evict it when the
            world is faster without it, else report it; ``"report"``: only report.
        on_bad_step: ``"skip"``: a step whose loss (or ``grad_norm`` metric) is not finite, or a spike, is not
            kept, its batch skipped (a ``step_skipped`` event); ``"raise"``: it stops the run with
            ``NonFiniteLossError``.
        spike_factor: also a bad step: a loss over this x the median of the recent kept steps'
            (None: off; for losses above 0).
        max_skipped_steps, skipped_steps_window: more skips than this within the window's steps
            stop the run with ``NonFiniteLossError`` naming them (a diverging model, not a bad batch).
        integrity_every: every this many steps each process fingerprints its blocks of the state and
            the driver compares the replicas (a ``replica_mismatch``: the odd slice leaves, its
            snapshots discarded); 0: never.
    """

    max_failures: int = 30
    failure_window_s: float = 3600.0
    max_failures_in_a_row: int = 5
    max_save_failures_in_a_row: int = 3
    hang_timeout_factor: float = 20.0
    hang_timeout_min_s: float = 5.0
    probe_timeout_s: float = 2.0
    node_death_grace_s: float = 1.5
    straggler_factor: float = 1.0
    straggler_window_steps: int = 10
    on_straggler: str = "auto"
    on_bad_step: str = "skip"
    spike_factor: float | None = None
    max_skipped_steps: int = 5
    skipped_steps_window: int = 1000
    integrity_every: int = 100

    def __post_init__(self) -> None:
        for name in ("max_failures", "max_failures_in_a_row", "max_save_failures_in_a_row"):
            check_count(name, getattr(self, name), 1)
        for name in ("failure_window_s", "hang_timeout_factor", "hang_timeout_min_s", "probe_timeout_s"):
            check_seconds(name, getattr(self, name))
        check_seconds("node_death_grace_s", self.node_death_grace_s, zero_allowed=True)
        check_count("straggler_window_steps", self.straggler_window_steps, 2)
        if isinstance(self.straggler_factor, bool) or not (
            isinstance(self.straggler_factor, (int, float)) and 0 < self.straggler_factor < math.inf
        ):
            raise ValueError(f"straggler_factor must be a finite number > 0, got {self.straggler_factor!r}")
        if self.on_straggler not in ("auto", "report"):
            raise ValueError(f"on_straggler must be 'auto' or 'report', got {self.on_straggler!r}")
        if self.on_bad_step not in ("skip", "raise"):
            raise ValueError(f"on_bad_step must be 'skip' or 'raise', got {self.on_bad_step!r}")
        spike = self.spike_factor
        if spike is not None and not (
            isinstance(spike, (int, float)) and not isinstance(spike, bool) and 1 < spike < math.inf
        ):
            raise ValueError(f"spike_factor must be None (off) or a finite number > 1, got {spike!r}")
        check_count("max_skipped_steps", self.max_skipped_steps, 0)
        check_count("skipped_steps_window", self.skipped_steps_window, 1)
        check_count("integrity_every", self.integrity_every, 0)
        for name, want, value in mistyped_fields(self):
            raise ValueError(f"{name} must be {want}, got {value!r} ({type(value).__name__}): see FailureConfig's docs")

    def bad_steps(self) -> BadSteps:
        """What the slice processes need of it for bad steps."""
        return BadSteps(
            self.on_bad_step == "skip", self.spike_factor, self.max_skipped_steps, self.skipped_steps_window
        )


@dataclasses.dataclass(frozen=True)
class FailureEvidence:
    """What one failure showed: per-slice error kinds, the slices whose node is dead, the world's
    slices, the slice whose error came first, and the run's progress and saves at that moment."""

    kinds: dict[str, ErrorKind]
    dead_slices: set[str]
    world_slices: list[str]
    error_text: str  # the first error, one line
    origin: str | None = None
    forming: bool = False  # the world failed before its first step
    steps_run: int = 0  # every step run so far, rewound ones too: progress of any kind
    save_failed: str | None = None  # a checkpoint save failed (its error, one line)
    committed_step: int = -1  # the newest checkpoint committed so far
    checkpoint_dir: str | None = None


@dataclasses.dataclass(frozen=True)
class FailureDecision:
    """The verdict, and the error that ends the run (None: recover)."""

    verdict: FailureVerdict
    failures_in_a_row: int
    stop: ElasticRuntimeError | None = None


class FailurePolicy:
    """Classification, the repeat-offender rule and every retry limit of one run:
    ``max_failures`` per ``failure_window_s``, ``max_failures_in_a_row`` without progress,
    ``max_save_failures_in_a_row`` without a commit, and the user's ``retry_policy``."""

    def __init__(self, config: FailureConfig, retry_policy: Callable[[int, Exception], bool] | None = None):
        self.config, self.retry_policy = config, retry_policy
        self.failure_times: list[float] = []
        self.failures_in_a_row = 0
        self._steps_at_failure = 0
        self._last_origin: str | None = None
        self._save_failures, self._committed_at_save_failure = 0, -1

    def decide(self, ev: FailureEvidence, now: float, error: BaseException | None = None) -> FailureDecision:
        """One failure's decision (``now``: monotonic seconds; ``error``: the first error, for the
        retry policy)."""
        verdict = classify_failure(
            errors=ev.kinds, dead_slices=ev.dead_slices, world_slices=ev.world_slices, error_text=ev.error_text
        )
        if ev.forming and verdict.training_code:
            text = str(error) if error is not None else ev.error_text  # whole: Ray's first line names only the task
            bug = TrainingCodeError(f"forming a world failed in training code: {text}")
            return FailureDecision(verdict, self.failures_in_a_row, bug)
        progressed, self._steps_at_failure = ev.steps_run > self._steps_at_failure, ev.steps_run
        self.failures_in_a_row = 1 if progressed else self.failures_in_a_row + 1
        verdict = drop_repeat_offender(
            verdict,
            origin=ev.origin,
            previous_origin=self._last_origin,
            progressed=progressed,
            origin_kind=ev.kinds.get(ev.origin) if ev.origin is not None else None,
        )
        self._last_origin = ev.origin
        stop = self._save_limit(ev) or self._retry_limit(verdict, now, error)
        return FailureDecision(verdict, self.failures_in_a_row, stop)

    def _save_limit(self, ev: FailureEvidence) -> ElasticRuntimeError | None:
        """Saves that failed ``max_save_failures_in_a_row`` times with none committed in between:
        each retry replays a few steps (progress for the other limits) and fails the same save again."""
        if ev.save_failed is None:
            self._save_failures = 0
            return None
        committed = ev.committed_step > self._committed_at_save_failure
        self._save_failures = 1 if committed else self._save_failures + 1
        self._committed_at_save_failure = ev.committed_step
        limit = self.config.max_save_failures_in_a_row
        if self._save_failures < limit:
            return None
        return StorageFailingError(
            f"checkpoint saves to {ev.checkpoint_dir} failed {self._save_failures} times in a row with none "
            f"committed in between (max_save_failures_in_a_row={limit}); last: {ev.save_failed}. Check that the "
            "location is writable (permissions, quota, free space) and reachable, or raise save_timeout_s if "
            "saves are only slow"
        )

    def _retry_limit(
        self, verdict: FailureVerdict, now: float, error: BaseException | None
    ) -> ElasticRuntimeError | None:
        if not verdict.recoverable:
            error_cls = TrainingCodeError if verdict.training_code else ElasticRuntimeError
            return error_cls(f"not recoverable: {verdict.reason}")
        cfg = self.config
        self.failure_times.append(now)
        if failures_exceeded(self.failure_times, now, cfg.max_failures, cfg.failure_window_s):
            return RetriesExhaustedError(
                f"gave up after {len(self.failure_times)} failures within {cfg.failure_window_s:.0f}s "
                f"(max_failures={cfg.max_failures}); last: {verdict.reason}"
            )
        if self.failures_in_a_row > cfg.max_failures_in_a_row:
            return RetriesExhaustedError(
                f"gave up after {self.failures_in_a_row} failures in a row without a step finished "
                f"(max_failures_in_a_row={cfg.max_failures_in_a_row}); last: {verdict.reason}"
            )
        attempt = len(self.failure_times)
        if self.retry_policy is not None and not self.retry_policy(attempt, error):  # type: ignore[arg-type]  # the failure as it came
            return RetriesExhaustedError(f"retry_policy declined attempt {attempt} after {verdict.reason}")
        return None
