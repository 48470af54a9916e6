"""The observers a run starts with, wired in one place (the controller only says which it wants)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ray_elastic.observe.events import EventListener
from ray_elastic.observe.observers import ProgressBar, RayMetricsObserver, StandbyReplenisher, UntilDone
from ray_elastic.observe.tensorboard import TensorBoardWriter


def run_observers(
    events: list[Any],
    *,
    replenish: Callable[[], bool],
    donors_released: Callable[[], bool],
    metrics: Any,
    progress: tuple[int, int, Any] | None,
    tensorboard_dir: str | None,
) -> list[EventListener]:
    """The observers of one run: standbys replenished, snapshot donors released once done, Ray
    metrics (``metrics``: the backend's, or None), a progress bar (``progress``: total steps, the
    first step, the config) and TensorBoard."""
    out: list[EventListener] = [StandbyReplenisher(replenish), UntilDone(donors_released)]
    if metrics is not None:
        out.append(RayMetricsObserver(metrics, events))
    if progress is not None:
        total, first, config = progress
        out.append(ProgressBar(total, first, config.num_slices, config.progress_metrics))
    if tensorboard_dir:
        out.append(TensorBoardWriter(tensorboard_dir, events))
    return out
