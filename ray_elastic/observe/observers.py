"""Everything that watches a run without steering it, as :class:`~ray_elastic.observe.events.EventListener` s.

The controller only emits events, steps and state changes; these turn them into a
progress bar, Ray metrics, the user's callbacks and warm standby processes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ray_elastic.observe import event_types as ev
from ray_elastic.observe import goodput
from ray_elastic.observe.events import EventListener
from ray_elastic.observe.step_ledger import STEP_FIELDS

GOODPUT_EVERY_S = 10.0


class ProgressBar(EventListener):
    """tqdm.auto (a widget in notebooks): step, loss, slices training and the controller's state."""

    def __init__(self, total: int, initial: int, num_slices: int, shown: tuple = ()):
        from tqdm.auto import tqdm

        self.num_slices = num_slices
        self.shown = shown  # metric names shown beside the loss (``ElasticConfig.progress_metrics``)
        self.values: dict = {}
        self.slices: int | None = None
        self.state = None
        self.loss: float | None = None
        self.waiting: str | None = None  # what a wait for slices still misses
        self.bar = tqdm(total=total, initial=initial, desc="ray-elastic", unit="step", dynamic_ncols=True)

    def postfix(self) -> str:
        parts = [f"loss={self.loss:.4f}"] if self.loss is not None else []
        parts += [f"{k}={self.values[k]:.4g}" for k in self.shown if k in self.values]
        if self.slices is not None:
            parts.append(f"slices={self.slices}/{self.num_slices}")
        if self.state is not None:
            parts.append(f"state={self.state.value}")
        if self.waiting is not None:
            parts.append(self.waiting)
        return ", ".join(parts)

    def on_step(self, metrics: dict) -> None:
        self.loss = metrics["loss"]
        self.values.update((k, v) for k, v in metrics.items() if k in self.shown)
        self.bar.update(1)
        self.bar.set_postfix_str(self.postfix(), refresh=False)

    def on_state(self, old, new) -> None:
        self.state = new
        self.bar.set_postfix_str(self.postfix(), refresh=True)

    def on_event(self, event: ev.Event) -> None:
        if isinstance(event, ev.WorldFormed):
            self.slices, self.waiting = len(event.slices), None
        elif isinstance(event, ev.Waiting):
            self.waiting = f"slices ready {event.ready}/{event.asked} ({event.waited_s:.0f}s)"
            self.bar.set_postfix_str(self.postfix(), refresh=True)
        elif isinstance(event, (ev.Recovered, ev.ScaleUp)) and event.steps_rewound:
            self.bar.update(-event.steps_rewound)
        elif isinstance(event, ev.Eval):
            self.values.update((k, v) for k, v in event.metrics.items() if k in self.shown)

    def close(self) -> None:
        self.bar.close()


class RayMetricsObserver(EventListener):
    """Feeds :class:`~ray_elastic.observe.metrics.RunMetrics`: step and loss (throttled), slices, recoveries, goodput."""

    def __init__(self, metrics, events: list[ev.Event]):
        self.metrics = metrics
        self.events = events  # the log's own list, for goodput so far
        self._goodput_at = 0.0
        self._last: dict | None = None

    def on_step(self, m: dict) -> None:
        self._last = m
        self.metrics.on_step(m["step"], m["loss"], metrics=own_metrics(m))

    def on_event(self, event: ev.Event) -> None:
        if isinstance(event, ev.WorldFormed):
            self.metrics.on_world(len(event.slices))
        elif isinstance(event, ev.Failure):
            self.metrics.on_world(event.world_slices - len(event.lost_slices))
        elif isinstance(event, ev.Recovered):
            self.metrics.on_recovery()
        elif isinstance(event, ev.Steps) and time.monotonic() - self._goodput_at > GOODPUT_EVERY_S:
            self._goodput_at = time.monotonic()
            self.metrics.on_goodput(goodput.account(self.events).goodput)
        elif isinstance(event, ev.Eval):
            self.metrics.on_metrics(event.metrics)
        elif isinstance(event, ev.RunFinished) and self._last is not None:
            self.metrics.on_step(self._last["step"], self._last["loss"], force=True, metrics=own_metrics(self._last))

    def close(self) -> None:
        self.metrics.on_goodput(goodput.account(self.events).goodput)


class UserCallbacks(EventListener):
    """The user's ``on_step`` (every finished step's metrics) and ``on_event`` (the elastic events)."""

    def __init__(
        self,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        on_event: Callable[[ev.Event], None] | None = None,
    ) -> None:
        for arg, cb in (("on_step", on_step), ("on_event", on_event)):
            if cb is not None and not callable(cb):
                raise ValueError(f"{arg} must be callable, got {type(cb).__name__}")
        self.on_step_cb, self.on_event_cb = on_step, on_event

    def on_step(self, metrics: dict) -> None:
        if self.on_step_cb is not None:
            self.on_step_cb(metrics)

    def on_event(self, event: ev.Event) -> None:
        if self.on_event_cb is not None and isinstance(event, ev.ELASTIC):
            self.on_event_cb(event)


class UntilDone(EventListener):
    """Calls ``step()`` at every ``steps`` line of the log until it returns True (the controller
    frees a lost driver's keepers so, once the new world holds a snapshot of its own)."""

    def __init__(self, step: Callable[[], bool]):
        self.step, self.done = step, False

    def on_event(self, event: ev.Event) -> None:
        if not self.done and isinstance(event, ev.Steps):
            self.done = self.step()


class StandbyReplenisher(EventListener):
    """Starts warm standby processes once a new world has finished its first step: starting
    processes earlier competes for the CPUs that forming and the first steps need. The pool
    starts one per host at a time, so it is asked again, every ``every_s`` of steps, until
    every host has them all."""

    def __init__(self, replenish: Callable[[], bool], every_s: float = 0.5):
        self.replenish = replenish
        self.every_s = every_s
        self._pending = False
        self._next = 0.0

    def on_event(self, event: ev.Event) -> None:
        if isinstance(event, ev.WorldFormed):
            self._pending, self._next = True, 0.0

    def on_step(self, metrics: dict) -> None:
        if self._pending and time.monotonic() >= self._next:
            self._pending = not self.replenish()
            self._next = time.monotonic() + self.every_s


def own_metrics(step_metrics: dict) -> dict:
    """The task's own metrics of a step (what its loss or train_step returned besides the loss)."""
    return {k: v for k, v in step_metrics.items() if k not in STEP_FIELDS}
