"""Ray metrics of a run (``ray.util.metrics``): they appear on every node's Prometheus endpoint
and in the Ray dashboard's metrics view, tagged with the run's name.

Exported names (Ray adds the ``ray_`` prefix): ``ray_elastic_step``, ``ray_elastic_slices_alive``,
``ray_elastic_recoveries``, ``ray_elastic_goodput``, ``ray_elastic_loss``, and
``ray_elastic_metric{name=...}`` for every metric the task's loss returns (``eval/...`` too).
"""

from __future__ import annotations

import time


class RunMetrics:
    """Gauges and a counter updated by the controller; cheap to call every step."""

    MIN_INTERVAL_S = 0.5  # step gauges are set at most this often

    def __init__(self, run_name: str):
        from ray.util.metrics import Counter, Gauge

        tags = ("run",)
        self._tags = {"run": run_name}
        self.step = Gauge("elastic_step", "last finished training step", tag_keys=tags)
        self.loss = Gauge("elastic_loss", "loss of the last finished step", tag_keys=tags)
        self.slices_alive = Gauge("elastic_slices_alive", "slices in the training world", tag_keys=tags)
        self.goodput = Gauge("elastic_goodput", "productive share of the run's wall time so far", tag_keys=tags)
        self.recoveries = Counter("elastic_recoveries", "recoveries from lost slices", tag_keys=tags)
        self.metric = Gauge(
            "elastic_metric", "a metric the task returns (name tag), last value", tag_keys=tags + ("name",)
        )
        self._last = 0.0

    def on_step(self, step: int, loss: float, force: bool = False, metrics: dict | None = None) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.MIN_INTERVAL_S:
            return
        self._last = now
        self.step.set(step, tags=self._tags)
        self.loss.set(loss, tags=self._tags)
        self.on_metrics(metrics or {})

    def on_metrics(self, metrics: dict) -> None:
        for name, value in metrics.items():
            self.metric.set(value, tags={**self._tags, "name": name})

    def on_world(self, num_slices: int) -> None:
        self.slices_alive.set(num_slices, tags=self._tags)

    def on_recovery(self) -> None:
        self.recoveries.inc(1, tags=self._tags)

    def on_goodput(self, goodput: float) -> None:
        self.goodput.set(goodput, tags=self._tags)
