"""When things happen in a run: snapshot, eval and checkpoint steps, the automatic snapshot
interval, chunk lengths, and the watchdog's and a save's time bounds."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def is_snapshot_step(step: int, every: int) -> bool:
    """Snapshots are taken after steps every-1, 2*every-1, ... (after every step when every=1; never when 0)."""
    return every > 0 and (step + 1) % every == 0


def is_fingerprint_step(step: int, every: int) -> bool:
    """The state is fingerprinted after the same steps an interval of ``every`` snapshots (``integrity_every``):
    the processes decide by it which steps they fingerprint, the driver which snapshots may become agreed."""
    return is_snapshot_step(step, every)


MAX_SNAPSHOT_EVERY = 1000  # the longest interval AutoInterval picks
REPORT_EVERY_S = 5.0  # how often a wait (for slices, for a world's processes) says what it still waits for


def snapshot_interval(
    snapshot_s: list[float],
    step_s: list[float],
    budget: float,
    current: int = 1,
    max_every: int = MAX_SNAPSHOT_EVERY,
    step_cost: float | None = None,
) -> int:
    """``AutoInterval``: the smallest interval at which snapshots cost at most ``budget`` of
    the run's time. A snapshot costing ``c`` seconds every ``k`` steps of ``t`` seconds costs
    ``c / (k t)``; ``c`` is the larger of what it cost its process (see ``SnapshotWriter``: the
    writer thread's CPU time for the copy into the keeper's ring, and any wait of the step loop) and what it cost the steps
    (``step_cost``, :func:`snapshot_cost_in_steps`). Medians of the recent measurements; ``current``
    until both exist, and while the new interval is within an eighth of it. The rewind this allows
    is at most ``k - 1`` steps."""
    if not snapshot_s or not step_s:
        return current
    c, t = max(statistics.median(snapshot_s), step_cost or 0.0), statistics.median(step_s)
    if t <= 0:
        return current
    every = max(1, min(max_every, math.ceil(c / (budget * t) - 1e-9)))
    return current if abs(every - current) <= current // 8 else every  # noise does not flip it every chunk


SNAPSHOT_SPREAD = 4  # steps from a snapshot on that its copies may slow (it is written in the background)


def snapshot_cost_in_steps(
    timed: Sequence[tuple[int, float]], every: int, spread: int = SNAPSHOT_SPREAD, min_samples: int = 3
) -> float | None:
    """What one snapshot taken every ``every`` steps costs the step loop, read from the step times
    ``timed`` ((step, seconds) pairs): the extra time of the ``spread`` steps from a snapshot step
    on, over the median of the steps farther from one (per distance, medians: a stray slow step
    is not a snapshot). It sees what the writing process's own clock cannot: the keeper's and
    the object store's copies and the memory traffic on the cores the step shares. None while it cannot tell (an interval too short to leave steps without a
    snapshot near, or too few steps)."""
    if every < spread + 2:
        return None
    near: list[list[float]] = [[] for _ in range(spread)]
    far: list[float] = []
    for step, seconds in timed:
        d = (step + 1) % every  # 0: the snapshot step itself (its state is copied after it)
        (near[d] if d < spread else far).append(seconds)
    if min(map(len, near)) < min_samples or len(far) < min_samples * 2:
        return None
    base = statistics.median(far)
    return max(0.0, sum(statistics.median(ts) - base for ts in near))


def newest_snapshot_step(step: int, every: int) -> int:
    """The newest step at or before ``step`` after which a snapshot is taken (-1: none)."""
    return step - (step + 1) % every if every > 0 else -1


def newest_due_snapshot(step: int, intervals: list[tuple[int, int]]) -> int:
    """The newest step at or before ``step`` after which a snapshot was due, given the intervals
    a world ran with (``(first step, interval)`` from each change on, oldest first; -1: none).

    Each interval counts from step 0 (``is_snapshot_step``) but holds only from its first step:
    after a change from 11 to 8 at step 60, step 60's newest is 54, not 55."""
    for i in range(len(intervals) - 1, -1, -1):
        first, every = intervals[i]
        last = step if i + 1 == len(intervals) else min(step, intervals[i + 1][0] - 1)
        if last >= first and (due := newest_snapshot_step(last, every)) >= first:
            return due
    return -1


def is_eval_step(step: int, every: int, final_step: int) -> bool:
    """Evaluations run after steps every-1, 2*every-1, ... and after the last step (never when 0)."""
    return every > 0 and ((step + 1) % every == 0 or step == final_step)


def is_checkpoint_step(step: int, every: int, final_step: int) -> bool:
    """Checkpoint after steps every-1, 2*every-1, ... and after the run's last step."""
    return (step + 1) % every == 0 or step == final_step


def watchdog_timeout(step_times: Sequence[float], factor: float, min_s: float) -> float:
    """How long without a finished step before the world is suspected hung."""
    recent = sorted(step_times[-50:])
    if not recent:
        return min_s
    return max(min_s, factor * recent[len(recent) // 2])


SAVE_TIMEOUT_MIN_S = 300.0  # the automatic bound on one save: never below this
SAVE_TIMEOUT_FACTOR = 10.0  # ... and this many times the slowest save the run committed


def save_timeout(configured: float | None, save_seconds: Sequence[float]) -> float:
    """How long one checkpoint save may keep a world busy before it counts as failed:
    ``configured`` (``save_timeout_s``), else ``SAVE_TIMEOUT_FACTOR`` x the slowest committed save
    so far, at least ``SAVE_TIMEOUT_MIN_S``."""
    if configured is not None:
        return float(configured)
    return max(SAVE_TIMEOUT_MIN_S, SAVE_TIMEOUT_FACTOR * max(save_seconds, default=0.0))


# Each process costs the driver one task submission per chunk (a fraction of a millisecond): a chunk
# is at least processes / PROCESSES_PER_CHUNK_STEP steps, so that cost per step stays flat as the
# world grows, but lasts at most MAX_CHUNK_S by the recent step time (a grow-back waits for the
# chunks already queued, and with slow steps the submissions are cheap per step anyway).
PROCESSES_PER_CHUNK_STEP = 10
MAX_CHUNK_S = 10.0
# While a straggler is suspected, chunks last about SUSPECT_CHUNK_S (at least SUSPECT_CHUNK_STEPS
# steps): once it is confirmed, it leaves after the few steps queued.
SUSPECT_CHUNK_S, SUSPECT_CHUNK_STEPS = 0.3, 2


def chunk_steps(steps_per_chunk: int, processes: int, step_times: Sequence[float] = (), suspect: bool = False) -> int:
    """Steps in the next chunk: the configured number, longer for a world of many processes while
    a chunk stays within ``MAX_CHUNK_S`` (never shorter than configured); about ``SUSPECT_CHUNK_S``
    of the newest 10 steps' time while a straggler is ``suspect``."""
    n = max(steps_per_chunk, -(-processes // PROCESSES_PER_CHUNK_STEP))
    if step_times:
        step_s = statistics.median(step_times)
        if step_s > 0:
            n = min(n, max(steps_per_chunk, int(MAX_CHUNK_S / step_s)))
    if suspect:
        step_s = statistics.median(step_times[-10:]) if step_times else 0.0
        n = min(n, max(SUSPECT_CHUNK_STEPS, int(SUSPECT_CHUNK_S / max(step_s, 1e-3))))
    return n


STOP_LEAD_S = 0.15  # what a proposal's round trip may take (a health-thread call)
STOP_LEAD_MIN_STEPS = 2


def stop_lead_steps(step_times: Sequence[float], lag_s: float) -> int:
    """Steps ahead of the newest step the driver has heard of at which to propose a stop at a
    step boundary (``slice.stop_gate``): what runs while the driver hears of a step (``lag_s``,
    a process streams its steps that often) and while the proposal travels (``STOP_LEAD_S``),
    plus the step in flight. Too few and a process refuses (it started the step), costing a retry;
    too many and the world runs steps it need not."""
    step_s = statistics.median(step_times[-10:]) if step_times else 0.0
    if step_s <= 0:
        return STOP_LEAD_MIN_STEPS + 8
    return STOP_LEAD_MIN_STEPS + math.ceil((lag_s + STOP_LEAD_S) / step_s)
