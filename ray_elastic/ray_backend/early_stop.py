"""A requested stop at a step boundary, agreed with the processes so that the chunks already
queued need not run (:class:`~ray_elastic.slice.stop_gate.StopGate` is the processes' half)."""

from __future__ import annotations

import logging
from typing import Any

import ray

logger = logging.getLogger(__name__)
ANSWER_WITHIN_S = 2.0  # health-thread calls: a process that does not answer in this long has its own failure
TRIES = 3  # proposals, each past the newest step a refusing process had started


def agree_stop(workers: list[Any], first: int, lead: int, queued_to: int) -> int | None:
    """Propose a stop before step ``first`` to every process, then past the newest step one had
    started (``lead`` steps on) when one refused; the step the world stops before, once every
    process accepted, or None (they go on with the queued chunks, up to ``queued_to``): no step
    before ``queued_to`` is left that every process can still agree on, or a process did not answer."""
    target = first
    for _ in range(TRIES):
        if target >= queued_to:
            break
        try:
            answers = ray.get([w.propose_stop.remote(target) for w in workers], timeout=ANSWER_WITHIN_S)
        except Exception as e:  # noqa: BLE001 - a process died or hangs: the failure path sees it
            logger.debug("a proposed stop before step %d was not answered: %r", target, e)
            break
        if all(a["accepted"] for a in answers):
            _decide(workers, True)
            return target
        target = max(a["started"] for a in answers) + lead
    _decide(workers, False)
    return None


def _decide(workers: list[Any], stop: bool) -> None:
    for w in workers:
        try:
            w.decide_stop.remote(stop)
        except Exception as e:  # noqa: BLE001 - a dead actor: nothing holds in it
            logger.debug("decide_stop: %r", e)
