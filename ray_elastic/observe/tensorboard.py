"""TensorBoard scalars of a run, written on the driver with ``tensorboardX`` (no TensorFlow)."""

from __future__ import annotations

import os
import time

from ray_elastic.observe import event_types as ev
from ray_elastic.observe import goodput
from ray_elastic.observe.events import EventListener
from ray_elastic.observe.observers import GOODPUT_EVERY_S, own_metrics


def _gcs_writer_factory():
    """tensorboardX's GCS record writer uploads the whole file on every flush and once more from
    ``__del__``, at interpreter exit, when the storage may be gone (a 120 s retry then). This one
    uploads only what is new since the last upload, and nothing at garbage collection."""
    from tensorboardX import record_writer

    class GCSRecordWriter(record_writer.GCSRecordWriter):
        _uploaded = -1

        def flush(self):
            size = self.buffer.tell()
            if size != self._uploaded:
                super().flush()
                self._uploaded = size

        def __del__(self):
            pass

    class Factory(record_writer.GCSRecordWriterFactory):
        def open(self, path):
            return GCSRecordWriter(path)

    return Factory()


class TensorBoardWriter(EventListener):
    """Train and eval metrics, step time, slices alive, recoveries, rewound steps and goodput as
    TensorBoard scalars (``tensorboardX``; a ``gs://`` directory is written through its GCS writer).

    Train scalars go under ``train/`` (the loss and what the task returns), evals under ``eval/``,
    the run's elastic state under ``elastic/``. A step recomputed after a rewind is written again:
    TensorBoard shows the newest value of a step."""

    def __init__(self, logdir: str, events: list[ev.Event], flush_s: float = 10.0):
        from tensorboardX import SummaryWriter, record_writer

        if logdir.startswith("gs://"):
            record_writer.register_writer_factory("gs", _gcs_writer_factory())

        self.writer = SummaryWriter(logdir=logdir, flush_secs=flush_s)
        self.events = events  # the log's own list, for goodput so far
        self._step = 0
        self._recoveries = 0
        self._skipped: set[int] = set()
        self._goodput_at = 0.0

    def on_step(self, m: dict) -> None:
        step = self._step = m["step"]
        self.writer.add_scalar("train/loss", m["loss"], step)
        for k, v in own_metrics(m).items():
            self.writer.add_scalar(f"train/{k}", v, step)
        self.writer.add_scalar("elastic/step_time_s", m["step_time_s"], step)

    def on_event(self, event: ev.Event) -> None:
        if isinstance(event, ev.Eval):
            for k, v in event.metrics.items():
                self.writer.add_scalar(k, v, event.step)
        elif isinstance(event, ev.WorldFormed):
            self.writer.add_scalar("elastic/slices_alive", len(event.slices), self._step)
        elif isinstance(event, (ev.Recovered, ev.ScaleUp)):
            if isinstance(event, ev.Recovered):
                self._recoveries += 1
                self.writer.add_scalar("elastic/recoveries", self._recoveries, self._step)
            self.writer.add_scalar("elastic/steps_rewound", event.steps_rewound, self._step)
        elif isinstance(event, ev.StepSkipped):
            self._skipped.add(event.step)  # a replayed step skipped again is one step
            self.writer.add_scalar("elastic/steps_skipped", len(self._skipped), event.step)
        elif isinstance(event, ev.Steps) and time.monotonic() - self._goodput_at > GOODPUT_EVERY_S:
            self._goodput_at = time.monotonic()
            self.writer.add_scalar("elastic/goodput", goodput.account(self.events).goodput, self._step)

    def close(self) -> None:
        self.writer.add_scalar("elastic/goodput", goodput.account(self.events).goodput, self._step)
        self.writer.close()


def tensorboard_location(given, run_dir: str | None) -> str | None:
    """Where a run's scalars go: ``given`` (a local path or ``gs://``), else ``RUN_DIR/tensorboard``
    with a run directory; ``False``: nowhere."""
    if given is None and run_dir:
        given = os.path.join(run_dir, "tensorboard")
    if given is not False and given is not None and (not isinstance(given, str) or not given.strip()):
        raise ValueError(f"tensorboard_dir must be a local path, gs://bucket/prefix or False, got {given!r}")
    return given or None
