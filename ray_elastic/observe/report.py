"""``ray-elastic report RUN_DIR``: a PNG timeline of a run from its event log.

:func:`timeline` turns events into plain series (what the picture shows, and what
tests check); :func:`render` draws them with matplotlib: slices alive, step rate
and loss over time with failures and recoveries marked, and the goodput breakdown.
"""

from __future__ import annotations

import dataclasses
import os

from ray_elastic.observe import event_types as ev
from ray_elastic.observe.events import read_lines
from ray_elastic.observe.goodput import BADPUT, Goodput, account, kept_and_rewound, last_run


@dataclasses.dataclass
class Timeline:
    """Series in seconds since the run started."""

    slices_alive: list[tuple[float, int]]  # (t, slices training) at every change
    step_rate: list[tuple[float, float]]  # (t, steps/s) per logged chunk
    losses: list[tuple[int, float]]  # (step, loss), last value per step
    failures: list[tuple[float, list[str]]]  # (t detected, slices lost)
    recoveries: list[tuple[float, float]]  # (t detected, t training again)
    waiting: list[tuple[float, float]]  # (t start, t end) of waiting for capacity
    grow_pauses: list[
        tuple[float, float]
    ]  # planned pauses (a grow-back, warned slices leaving): last step -> next world ready
    checkpoints: list[tuple[float, int]]  # (t, step) of committed checkpoints
    goodput: Goodput
    num_slices: int
    evals: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # (step, eval loss)
    skipped: dict[int, str] = dataclasses.field(default_factory=dict)  # bad steps not kept: step -> why

    def skipped_line(self) -> str:
        """The bad steps not kept, for the report's text (empty without any)."""
        if not self.skipped:
            return ""
        listed = ", ".join(f"{s} ({why})" for s, why in list(self.skipped.items())[:10])
        return f"steps skipped (not kept): {len(self.skipped)}: {listed}" + (" ..." if len(self.skipped) > 10 else "")


def load_events(run_dir: str) -> list[ev.Event]:
    """The run's ``events.jsonl``, typed (logs of earlier versions load too)."""
    path = os.path.join(run_dir, "events.jsonl")
    if not os.path.exists(path):
        raise ValueError(f"no events.jsonl in {run_dir!r}: pass the --run-dir of a run (ElasticTrainer(run_dir=...))")
    return [ev.parse(e) for e in read_lines(path)]


def timeline(events: list) -> Timeline:
    events = last_run(events)
    if not events:
        raise ValueError("the event log is empty")
    t0 = events[0].ts
    start = events[0]
    alive: list[tuple[float, int]] = [(0.0, 0)]
    rate, fails, recs, waits, grows, ckpts, evals, skipped = [], [], [], [], [], [], {}, {}
    prev_ts = None

    def set_alive(t: float, n: int) -> None:
        if n != alive[-1][1]:
            alive.append((t, n))

    for e in events:
        t = e.ts - t0
        if isinstance(e, ev.WorldFormed):
            set_alive(t, len(e.slices))
            prev_ts = e.ts
        elif isinstance(e, ev.FailureEvent):
            lost = list(e.lost_slices or [])
            set_alive(t, max(0, alive[-1][1] - len(lost)))
            fails.append((t, lost))
        elif isinstance(e, ev.Recovered):
            recs.append((e.detected_at - t0, e.ready_at - t0))
            if (e.wait_for_capacity_s or 0) > 0:
                waits.append((e.capacity_ready_at - t0 - e.wait_for_capacity_s, e.capacity_ready_at - t0))
        elif isinstance(e, ev.PlannedChange) and e.pause_s is not None:
            grows.append((e.ready_at - e.pause_s - t0, e.ready_at - t0))
        elif isinstance(e, ev.Steps):
            if prev_ts is not None and e.ts > prev_ts:
                rate.append((t, len(e.steps) / (e.ts - prev_ts)))
            prev_ts = e.ts
        elif isinstance(e, ev.CheckpointCommitted) and e.step is not None:
            ckpts.append((t, e.step))
        elif isinstance(e, ev.StepSkipped):
            skipped[e.step] = e.why
        elif isinstance(e, ev.Eval) and "eval/loss" in (e.metrics or {}):
            evals[e.step] = e.metrics["eval/loss"]
        elif isinstance(e, (ev.RunFinished, ev.Errored)):
            set_alive(t, 0)
    kept, _ = kept_and_rewound(events)
    losses = [(s, kept[s][0]) for s in sorted(kept) if s not in skipped]  # a skipped step's loss was not trained on
    return Timeline(
        alive,
        rate,
        losses,
        fails,
        recs,
        waits,
        grows,
        ckpts,
        account(events),
        start.num_slices if isinstance(start, ev.RunStarted) else 0,
        sorted(evals.items()),
        dict(sorted(skipped.items())),
    )


def render(run_dir: str, out: str | None = None, tl: Timeline | None = None) -> str:
    """Draw the timeline of the run in ``run_dir`` to ``out`` (default ``RUN_DIR/report.png``).

    ``tl``: the run's :func:`timeline` when the caller has it already (else read from ``run_dir``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = tl or timeline(load_events(run_dir))
    out = out or os.path.join(run_dir, "report.png")
    fig, axes = plt.subplots(4, 1, figsize=(11, 10), gridspec_kw={"height_ratios": [1, 1, 1, 0.55]})
    ax_sl, ax_rate, ax_loss, ax_gp = axes
    _draw_slices_and_rate(ax_sl, ax_rate, tl)
    _draw_losses(ax_loss, tl)
    _draw_goodput(ax_gp, tl.goodput)
    fig.suptitle(f"ray-elastic run: {os.path.abspath(run_dir)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _draw_slices_and_rate(ax_sl, ax_rate, tl: Timeline) -> None:
    """Slices training and the step rate over time, failures, recoveries, waits and checkpoints marked."""
    xs = [t for t, _ in tl.slices_alive]
    ys = [n for _, n in tl.slices_alive]
    ax_sl.step(xs, ys, where="post", color="tab:blue", linewidth=2)
    ax_sl.set_ylabel("slices training")
    ax_sl.set_ylim(-0.2, max(ys + [tl.num_slices]) + 0.5)
    ax_sl.set_yticks(range(0, max(ys + [tl.num_slices]) + 1))
    if tl.step_rate:
        # No line across a failure: the rate is unknown while no world trains.
        pts = sorted(tl.step_rate + [(t, float("nan")) for t, _ in tl.failures])
        ax_rate.plot([t for t, _ in pts], [r for _, r in pts], ".-", color="tab:green")
    ax_rate.set_ylabel("steps / s")
    for ax in (ax_sl, ax_rate):
        for t, _lost in tl.failures:
            ax.axvline(t, color="tab:red", linestyle="--", linewidth=1)
        for a, b in tl.recoveries:
            ax.axvspan(a, b, color="tab:orange", alpha=0.25)
        for a, b in tl.waiting:
            ax.axvspan(a, b, color="tab:purple", alpha=0.2)
        for a, b in tl.grow_pauses:
            ax.axvspan(a, b, color="tab:cyan", alpha=0.25)
        for t, _ in tl.checkpoints:
            ax.axvline(t, color="tab:gray", linestyle=":", linewidth=0.8)
    for t, lost in tl.failures:
        ax_sl.annotate(
            "lost " + ", ".join(lost),
            (t, ax_sl.get_ylim()[1] * 0.92),
            fontsize=8,
            color="tab:red",
            rotation=0,
            ha="left",
        )
    ax_rate.set_xlabel(
        "seconds since start  (red: failure, orange: recovery, purple: waiting for capacity, "
        "cyan: growing back or a warned slice leaving, gray: checkpoint)",
        fontsize=8,
    )


def _draw_losses(ax_loss, tl: Timeline) -> None:
    if tl.losses:
        ax_loss.plot([s for s, _ in tl.losses], [v for _, v in tl.losses], color="tab:blue", label="train loss")
    if tl.evals:
        ax_loss.plot([s for s, _ in tl.evals], [v for _, v in tl.evals], "o-", color="tab:orange", label="eval loss")
    for i, step in enumerate(tl.skipped):
        ax_loss.axvline(step, color="tab:red", linestyle=":", linewidth=0.8, label="skipped step" if i == 0 else None)
    if tl.evals or tl.skipped:
        ax_loss.legend(fontsize=8)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")


def _draw_goodput(ax_gp, gp: Goodput) -> None:
    """One bar: productive time and every badput category, in seconds."""
    names = ["productive"] + list(BADPUT)
    secs = [gp.productive_s] + [gp.badput_s[k] for k in BADPUT]
    colors = [
        "tab:green",
        "tab:gray",
        "tab:cyan",
        "tab:olive",
        "tab:red",
        "tab:purple",
        "tab:orange",
        "tab:brown",
        "lightgray",
    ]
    left = 0.0
    for name, sec, color in zip(names, secs, colors):
        if sec > 0:
            ax_gp.barh(0, sec, left=left, color=color, label=f"{name.replace('_', ' ')} {sec:.1f}s")
            left += sec
    ax_gp.set_yticks([])
    ax_gp.set_xlabel("seconds")
    ax_gp.set_title(f"goodput {gp.goodput:.1%} of {gp.total_s:.1f}s", fontsize=10)
    ax_gp.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=5, fontsize=8, frameon=False)
