"""Where every second of a run went, from its event log alone (pure: no Ray, no JAX).

The categories follow Google's ml-goodput-measurement: *productive* time is the
time of steps whose results were kept; everything else is *badput*, split by
cause. Computing it from ``events.jsonl`` means the same numbers come out at the
end of a run, in ``ray-elastic report`` and for a run that was killed.
"""

from __future__ import annotations

import dataclasses
import math

from ray_elastic.observe import event_types as ev

BADPUT = (
    "startup",  # reserving slices, starting processes, jax.distributed, first state
    "compilation",  # compiling the step (every world, from the persistent cache when warm)
    "checkpoint_blocking",  # steps waiting for a checkpoint save to start
    "failure_detection",  # last progress -> failure classified
    "waiting_for_capacity",  # pause-and-resume: waiting for a replacement slice
    "preemption",  # warned slices leaving at a step boundary: the last step -> the next world ready
    "world_reformation",  # teardown + forming the next world + loading its state
    "rewound_work",  # steps computed and then lost (recomputed later)
    "other",  # the rest: driver/stream overhead, data, snapshots
)


@dataclasses.dataclass
class Goodput:
    """Seconds per category over ``total_s`` (wall time of the run)."""

    total_s: float
    productive_s: float
    badput_s: dict[str, float]

    @property
    def goodput(self) -> float:
        return self.productive_s / self.total_s if self.total_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "total_s": round(self.total_s, 3),
            "productive_s": round(self.productive_s, 3),
            "goodput": round(self.goodput, 4),
            **{k: round(v, 3) for k, v in self.badput_s.items()},
        }

    def table(self) -> str:
        """A fixed-width table: one line per category, seconds and share of the run."""
        rows = [("productive steps", self.productive_s)] + [(k.replace("_", " "), v) for k, v in self.badput_s.items()]
        out = [f"goodput {self.goodput:.1%} of {self.total_s:.1f}s"]
        for name, sec in rows:
            share = sec / self.total_s if self.total_s > 0 else 0.0
            out.append(f"  {name:<22} {sec:9.2f}s {share:7.1%}")
        return "\n".join(out)


Span = tuple[float, float]  # (start, end), wall-clock seconds


def kept_and_rewound(events: list) -> tuple[dict[int, tuple[float, float]], float]:
    """Per step the (loss, step time) of its last run, and the seconds of runs later recomputed."""
    kept: dict[int, tuple[float, float]] = {}
    rewound = 0.0
    for s, loss, t, _, _ in _step_runs(ev.parse_all(events)):
        if s in kept:
            rewound += kept[s][1]
        kept[s] = (loss, t)
    return kept, rewound


def _step_runs(events: list[ev.Event]) -> list[tuple[int, float, float, float | None, int | None]]:
    """Every step run in log order: (step, loss, step time, finished at (wall clock) or None, world)."""
    runs: list = []
    for e in events:
        if isinstance(e, ev.Steps):
            ends = e.finished_at or [None] * len(e.steps)
            runs.extend(zip(e.steps, e.losses, e.step_time_s, ends, [e.generation] * len(e.steps)))
    return runs


def _step_spans(events: list[ev.Event]) -> tuple[list[Span], list[Span]]:
    """Kept and rewound step runs as disjoint spans of wall time.

    A step's time is the interval since the previous step finished on the process that
    reported it, and the first report of a step is the one kept: when the reporting process
    changes, two steps' intervals can overlap, so each span starts no earlier than the one
    before it ends (by finishing time). They can also leave a gap: the process that reports
    step s+1 finished step s a few milliseconds after the one that reported s (processes in
    lockstep still finish a step at slightly different times). Training went on in that gap,
    so a step that follows the step before it in the same world starts where that one ended
    (without this, ~3% of a 4-slice chaos run fell into ``other``).
    """
    runs = _step_runs(events)
    if any(run[3] is None for run in runs):
        return [], []
    last_run = {s: i for i, (s, *_rest) in enumerate(runs)}
    timed = sorted((run[3], i) for i, run in enumerate(runs))
    kept, rewound = [], []
    prev_end, prev = -math.inf, None
    for end, i in timed:
        step, _, t, _, world = runs[i]
        follows = prev is not None and (step, world) == (prev[0] + 1, prev[4])
        start = prev_end if follows else max(end - t, prev_end)
        prev_end, prev = max(prev_end, end), runs[i]
        if end > start:
            (kept if last_run[step] == i else rewound).append((start, end))
    return kept, rewound


def account(events: list) -> Goodput:
    """Goodput of the last run in ``events`` (a run directory may hold several, one per restart).

    Each second is counted once: steps first, then each phase whose place in time the log
    records (compiling, forming a world, detecting a failure, starting up) gets only what no
    step and no earlier phase already has. The rest of a phase's time is ``other``.
    """
    events = last_run(events)
    if not events:
        return Goodput(0.0, 0.0, {k: 0.0 for k in BADPUT})
    t0 = events[0].ts
    end = next((e for e in reversed(events) if isinstance(e, (ev.RunFinished, ev.Errored))), events[-1])
    total = max(0.0, end.ts - t0)
    bad = {k: 0.0 for k in BADPUT}
    timeline = _Timeline(t0, end.ts)
    kept, rewound = _step_spans(events)
    if kept or rewound:
        productive = timeline.claim(kept)
        bad["rewound_work"] = timeline.claim(rewound)
    else:  # a log without finishing times (older runs): step times as they are
        times, bad["rewound_work"] = kept_and_rewound(events)
        productive = sum(t for _, t in times.values())
    formed = [e for e in events if isinstance(e, ev.WorldFormed)]
    for e in events:
        if isinstance(e, ev.SliceLeft):  # the whole pause, compiling and re-forming included
            bad["preemption"] += timeline.claim([(e.ready_at - e.pause_s, e.ready_at)])
    for i, w in enumerate(formed):
        compile_s = w.times.get("compile_s", 0.0)
        bad["compilation"] += timeline.claim([(w.ts - compile_s, w.ts)])
        if i > 0:
            bad["world_reformation"] += timeline.claim([(w.ts - w.times.get("total_s", 0.0), w.ts - compile_s)])
    for e in events:
        if isinstance(e, ev.CheckpointSave):  # the save's blocking part lies inside a step's interval
            blocking = min(e.blocking_s or 0.0, productive)
            bad["checkpoint_blocking"] += blocking
            productive -= blocking
        elif isinstance(e, ev.FailureEvent):
            detection = (e.since_last_progress_s or 0.0) + (e.classify_s or 0.0)
            bad["failure_detection"] += timeline.claim([(e.ts - detection, e.ts)])
        elif isinstance(e, ev.Recovered):  # between the failure and the next world's formation: no steps run
            bad["waiting_for_capacity"] += e.wait_for_capacity_s or 0.0
            bad["world_reformation"] += e.teardown_s or 0.0
    if formed:
        bad["startup"] += timeline.claim([(t0, formed[0].ts - formed[0].times.get("compile_s", 0.0))])
    bad["other"] = max(0.0, total - productive - sum(v for k, v in bad.items() if k != "other"))
    return Goodput(total, productive, bad)


class _Timeline:
    """The run's wall time, handed out once: ``claim`` returns how much of some spans was still free."""

    def __init__(self, start: float, end: float):
        self.start, self.end = start, end
        self.taken: list[Span] = []  # disjoint, sorted

    def claim(self, spans: list[Span]) -> float:
        spans = _merge([(max(a, self.start), min(b, self.end)) for a, b in spans])
        free = sum(b - a for a, b in spans) - _overlap(spans, self.taken)
        self.taken = _merge(self.taken + spans)
        return max(0.0, free)


def _merge(spans: list[Span]) -> list[Span]:
    out: list[Span] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _overlap(xs: list[Span], ys: list[Span]) -> float:
    """Total overlap of two sorted lists of disjoint spans."""
    total, i, j = 0.0, 0, 0
    while i < len(xs) and j < len(ys):
        total += max(0.0, min(xs[i][1], ys[j][1]) - max(xs[i][0], ys[j][0]))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def last_run(events: list) -> list[ev.Event]:
    """The events of the last ``run_started`` (a rerun appends to the same log), typed."""
    events = ev.parse_all(events)
    starts = [i for i, e in enumerate(events) if isinstance(e, ev.RunStarted)]
    return events[starts[-1] :] if starts else list(events)
