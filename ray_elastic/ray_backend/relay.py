"""Fanning a chunk out to many quiet processes, so the driver's work per chunk does not grow with them.

A process that keeps no snapshot runs each chunk as one plain task whose only news is its end
or its error. In a world of a thousand processes, submitting those tasks was most of the
driver's CPU per step (Ray's Python per submission). A :class:`ChunkRelay`, an
actor on the driver's node, submits one chunk to a group of them and answers once, when all
have finished it or with the errors of the first to fail: the driver submits one call per
group and waits on one ref per group. A death still reaches the driver at once (one hop more).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

RELAY_MIN_QUIET = 16  # fewer quiet processes than this: the driver submits their chunks itself
# (a relay halves the driver's work per step from a few dozen processes on: bench/scale.py)
PROCESSES_PER_RELAY = 128  # a relay is a process that costs CPU even idle, so few of them
RELAY_CONCURRENCY = 4  # chunks a relay has in flight at once (the driver queues two)
ORDER_TIMEOUT_S = 60.0  # a chunk waits this long for the one before it to be submitted


Target = tuple[Any, ...]  # (process id, actor handle, method name, leading args)


@ray.remote(num_cpus=0, max_concurrency=RELAY_CONCURRENCY)  # type: ignore[call-overload]
class ChunkRelay:
    """Runs each chunk on its group of processes of one world generation (given by :meth:`prepare`)."""

    def __init__(self) -> None:
        self.targets: dict[int, list[Target]] = {}
        self._turn = threading.Condition()
        self._next = 0  # the index of the next chunk of the prepared generation to submit

    def prepare(self, generation: int, targets: Sequence[Target]) -> None:
        with self._turn:
            self.targets = {generation: list(targets)}  # an older generation is torn down by now
            self._next = 0
            self._turn.notify_all()

    def run(self, generation: int, index: int, *args: Any) -> dict[int, BaseException]:
        """Submit chunk ``index`` of the generation to every process; ``{}`` when all finished it,
        else the errors of the ones that failed first (by process id): a failed world is torn
        down, the rest are news to nobody.

        Chunks are submitted in their order (the calls run on threads, in any order): a process
        must run them in the order the others do, or their collectives would pair different steps.
        """
        with self._turn:
            if (
                not self._turn.wait_for(
                    lambda: generation not in self.targets or self._next == index, timeout=ORDER_TIMEOUT_S
                )
                or generation not in self.targets
            ):
                raise RuntimeError(f"relay: chunk {index} of generation {generation} came out of turn")
            refs = {
                getattr(actor, method).remote(*lead, *args): p for p, actor, method, lead in self.targets[generation]
            }
            self._next += 1
            self._turn.notify_all()
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            if pending:
                more, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
                done += more
            try:
                ray.get(done)  # one call for the batch; one per ref only to name who failed
            except Exception:  # noqa: BLE001
                failed: dict[int, BaseException] = {}
                for ref in done:
                    try:
                        ray.get(ref, timeout=0)
                    except Exception as e:  # noqa: BLE001 - the process's error, for the controller to classify
                        failed[refs[ref]] = e
                return failed
        return {}


def channels(processes: Sequence[int], quiet: Sequence[int]) -> list[tuple[list[int], bool]]:
    """How the driver reaches each process, as ``(processes, relayed)`` per channel: a channel of
    its own for each snapshot holder and, while quiet processes are fewer than ``RELAY_MIN_QUIET``,
    for each quiet one; else groups of ``PROCESSES_PER_RELAY`` quiet processes, each served by a
    relay (pure: which processes share one)."""
    quiet = list(quiet)
    own = [([p], False) for p in processes if p not in set(quiet)]
    if len(quiet) < RELAY_MIN_QUIET:
        return own + [([p], False) for p in quiet]
    return own + [(quiet[i : i + PROCESSES_PER_RELAY], True) for i in range(0, len(quiet), PROCESSES_PER_RELAY)]


class RelayPool:
    """The run's relays, on the driver's node, started when a world first needs them and kept for
    the next worlds (a relay's process start would otherwise add to every formation)."""

    def __init__(self) -> None:
        self.relays: list[Any] = []

    def assign(self, generation: int, groups: list[list[Target]], timeout_s: float = 60.0) -> list[Any]:
        """A relay for each group of ``generation``'s targets, ready to run its chunks. A kept relay
        that died or does not answer in ``timeout_s`` is replaced by a new one."""
        self.relays += [self._start() for _ in range(len(groups) - len(self.relays))]
        for attempt in range(2):
            refs = [r.prepare.remote(generation, g) for r, g in zip(self.relays, groups)]
            dead = []
            for i, ref in enumerate(refs):
                try:
                    ray.get(ref, timeout=timeout_s)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    dead.append(i)
            if not dead:
                break
            if attempt:
                raise RuntimeError(f"relays {dead} died as soon as they were started")
            for i in dead:
                _kill(self.relays[i])  # a hung one too
                self.relays[i] = self._start()
        return self.relays[: len(groups)]

    @staticmethod
    def _start() -> Any:
        strategy = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
        return ChunkRelay.options(scheduling_strategy=strategy).remote()  # type: ignore[attr-defined]

    def reach(
        self, generation: int, processes: int, quiet: Sequence[int], target: Callable[[int], tuple[Any, ...]]
    ) -> tuple[list[list[int]], list[Any]]:
        """A world's channels (:func:`channels`) and the relay serving each (None: the driver's own);
        ``target(p)`` is what a relay calls for quiet process p: ``(actor, method name, leading args)``."""
        chans = channels(range(processes), quiet)
        groups = [procs for procs, relayed in chans if relayed]
        assigned = iter(self.assign(generation, [[(p, *target(p)) for p in g] for g in groups]) if groups else [])
        return [procs for procs, _ in chans], [next(assigned) if relayed else None for _, relayed in chans]

    def shutdown(self) -> None:
        for r in self.relays:
            _kill(r)
        self.relays = []


def _kill(relay: Any) -> None:
    try:
        ray.kill(relay, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        pass
