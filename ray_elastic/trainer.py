"""``ElasticTrainer``: the controller (:mod:`ray_elastic.control`) wired to its backend on a Ray
cluster (:mod:`ray_elastic.ray_backend`). The one module that sees both."""

from __future__ import annotations

from ray_elastic.control.controller import Controller
from ray_elastic.ray_backend.backend import RayBackend

__all__ = ["ElasticTrainer"]


class ElasticTrainer(Controller):
    """Train ``task`` on ``config.num_slices`` TPU slices of a Ray cluster, surviving lost slices.

    A trainer can ``fit`` more than once; each call is a new run (fresh worlds, events
    and records; with ``checkpoint_dir`` it resumes from the newest checkpoint).

    Args:
        task: model, optimizer, loss and data (runs inside the slice actors).
        config: slices, batch and elastic settings; validated here, before Ray is touched.
        address: Ray cluster to connect to when this process is not connected yet
            (``None``: ``RAY_ADDRESS`` or the job's cluster, as ``ray.init`` decides).
        progress: show a tqdm progress bar (terminal or notebook).
        on_step: called with each finished step's metrics dict (``step``, ``loss``, ``step_time_s``).
        retry_policy: ``(attempt, error) -> bool``, asked before every recovery (as in
            ``pathwaysutils.elastic.Manager.elastic_retry``); ``None`` retries within
            ``config.failure.max_failures`` per ``config.failure.failure_window_s``.
        pre_callback: called before every world is formed, the first one included (as
            pathwaysutils calls it before every attempt).
        on_event: called with each elastic event and eval (:data:`~ray_elastic.observe.event_types.ELASTIC`).
        run_dir: where ``events.jsonl`` is written (``None``: events kept in memory only);
            ``ray-elastic report RUN_DIR`` draws it.
        name: the run's name in Ray metrics (default: the run directory's name, else ``ray-elastic``).
        run_id: what makes a rerun the same run (its snapshot keepers outlive a lost driver for
            ``config.orphan_timeout_s``, and the rerun resumes from them). Default: the run
            directory, else the checkpoint directory; without either a run is never resumed so.
        tensorboard_dir: where TensorBoard scalars go (a local path or ``gs://``); default
            ``RUN_DIR/tensorboard`` with a ``run_dir``, else none. ``False``: none.
    """

    backend_cls = RayBackend
