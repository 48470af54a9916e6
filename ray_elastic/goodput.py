"""Where every second of a run went, from its event log alone (pure: no Ray, no JAX).

The categories follow Google's ml-goodput-measurement: *productive* time is the
time of steps whose results were kept; everything else is *badput*, split by
cause. Computing it from ``events.jsonl`` means the same numbers come out at the
end of a run, in ``ray-elastic report`` and for a run that was killed.
"""

from __future__ import annotations

import dataclasses

BADPUT = (
    "startup",               # reserving slices, starting processes, jax.distributed, first state
    "compilation",           # compiling the step (every world, from the persistent cache when warm)
    "checkpoint_blocking",   # steps waiting for a checkpoint save to start
    "failure_detection",     # last progress -> failure classified
    "waiting_for_capacity",  # pause-and-resume: waiting for a replacement slice
    "world_reformation",     # teardown + forming the next world + loading its state
    "rewound_work",          # steps computed and then lost (recomputed later)
    "other",                 # the rest: driver/stream overhead, data, snapshots
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
        return {"total_s": round(self.total_s, 3), "productive_s": round(self.productive_s, 3),
                "goodput": round(self.goodput, 4), **{k: round(v, 3) for k, v in self.badput_s.items()}}

    def table(self) -> str:
        """A fixed-width table: one line per category, seconds and share of the run."""
        rows = [("productive steps", self.productive_s)] + [(k.replace("_", " "), v) for k, v in self.badput_s.items()]
        out = [f"goodput {self.goodput:.1%} of {self.total_s:.1f}s"]
        for name, sec in rows:
            share = sec / self.total_s if self.total_s > 0 else 0.0
            out.append(f"  {name:<22} {sec:9.2f}s {share:7.1%}")
        return "\n".join(out)


def kept_and_rewound(events: list[dict]) -> tuple[dict[int, tuple[float, float]], float]:
    """Per step the (loss, step time) of its last run, and the seconds of runs later recomputed."""
    kept: dict[int, tuple[float, float]] = {}
    rewound = 0.0
    for e in events:
        if e["kind"] != "steps":
            continue
        for s, loss, t in zip(e["steps"], e["losses"], e["step_time_s"]):
            if s in kept:
                rewound += kept[s][1]
            kept[s] = (loss, t)
    return kept, rewound


def account(events: list[dict]) -> Goodput:
    """Goodput of the last run in ``events`` (a run directory may hold several, one per restart)."""
    events = last_run(events)
    if not events:
        return Goodput(0.0, 0.0, {k: 0.0 for k in BADPUT})
    t0 = events[0]["ts"]
    end = next((e for e in reversed(events) if e["kind"] in ("run_finished", "errored")), events[-1])
    total = max(0.0, end["ts"] - t0)
    bad = {k: 0.0 for k in BADPUT}
    formed = [e for e in events if e["kind"] == "world_formed"]
    for i, w in enumerate(formed):
        bad["compilation"] += w.get("compile_s", 0.0)
        if i == 0:
            bad["startup"] += max(0.0, w["ts"] - t0 - w.get("compile_s", 0.0))
        else:
            bad["world_reformation"] += max(0.0, w.get("total_s", 0.0) - w.get("compile_s", 0.0))
    for e in events:
        k = e["kind"]
        if k == "checkpoint_save":
            bad["checkpoint_blocking"] += e.get("blocking_s", 0.0)
        elif k == "failure":
            bad["failure_detection"] += e.get("since_last_progress_s", 0.0) + e.get("classify_s", 0.0)
        elif k == "recovered":
            bad["waiting_for_capacity"] += e.get("wait_for_capacity_s", 0.0)
            bad["world_reformation"] += e.get("teardown_s", 0.0)
    kept, bad["rewound_work"] = kept_and_rewound(events)
    productive = sum(t for _, t in kept.values())
    bad["other"] = max(0.0, total - productive - sum(v for k, v in bad.items() if k != "other"))
    return Goodput(total, productive, bad)


def last_run(events: list[dict]) -> list[dict]:
    """The events of the last ``run_started`` (a rerun appends to the same log)."""
    starts = [i for i, e in enumerate(events) if e["kind"] == "run_started"]
    return events[starts[-1]:] if starts else list(events)
