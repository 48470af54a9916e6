"""What a world's snapshot holders' keepers really hold, made the store's word.

During a run the store learns of snapshots from the holders' streams. At a grow and after a
failure the driver asks the keepers themselves: a stream item may never have arrived, a keeper
may have let a step go, and a failed world's survivors may still be writing. After a failure it
waits (briefly) until the newest reported step is held by every live holder, then seals the
world's rings, so what the next world restores cannot be overwritten meanwhile.
"""

from __future__ import annotations

import time
from typing import Any

from ray_elastic.ray_backend.world import World
from ray_elastic.state.snapshot_keeper import ask_keepers
from ray_elastic.state.snapshots import SnapshotRef, SnapshotStore

KEEPER_POLL_S = 0.05
KEEPER_ANSWER_S = 0.3  # a live keeper answers in milliseconds; one on a lost node may never
# Once a slice whose keepers answer holds the newest step, how long the other holders get to hand it
# over too (a writer takes milliseconds; one stuck behind a step that waits for a dead peer never does).
OTHER_HOLDERS_S = 1.0


class KeeperSync:
    """The store's view of ``world``'s holders' keepers (``holders``: their process ids)."""

    def __init__(self, world: World, store: SnapshotStore, holders: list[int]):
        self.world, self.store, self.holders = world, store, holders

    def sync(
        self,
        reported: int,
        processes: list[int] | None = None,
        timeout_s: float = 1.0,
        dead: set[Any] | None = None,
        seal: bool = False,
    ) -> list[int]:
        """Make the store say what these processes' keepers really hold (all holders by default),
        up to ``reported``, the newest step the run has the metrics of (later ones are run again).
        A keeper that does not answer (its node is gone) is left as the store has it: the slice's
        loss is decided elsewhere; one Ray reports dead holds nothing (its process goes into
        ``dead``). ``seal``: the world failed; its rings are frozen first, so what the store says
        stays held until the next world restores it. Returns the processes whose keepers answered."""
        plan = self.world.plan
        processes = self.holders if processes is None else processes
        dead_keepers: set[int] = set()
        sealing = (plan.generation, self.world.epoch) if seal else None
        answers = ask_keepers([self.world.keepers[p] for p in processes], timeout_s, dead_keepers, sealing=sealing)
        if dead is not None:
            dead.update(processes[i] for i in dead_keepers)
        for i, held in answers.items():
            p = processes[i]
            keeper = self.world.keepers[p]
            self.store.hold_only(
                self.world.slice_of(p),
                p % plan.hosts_per_slice,
                {step: SnapshotRef(keeper, generation, step) for generation, step in held if step <= reported},
            )
        return [processes[i] for i in answers]

    def settle(self, holders: list[int], failed: set[int], newest: int, reported: int, newest_s: float) -> None:
        """After a failure: ask ``holders``' keepers (on hosts not lost) what they hold, again for up
        to ``newest_s``, until each live holder holds its part of ``newest`` (the newest reported
        step a snapshot was due at), then seal their rings.

        A holder's writer thread hands a snapshot over even while its step loop is stuck in a
        collective with the dead peer, and more than one holder matters because the next world
        may lose one while it forms. Once some slice whose keepers answer holds the newest step,
        the others get only ``OTHER_HOLDERS_S`` (a copy not handed over by then waits behind a
        step that never ends). Survivors not stuck in a collective (a relay or a save failed) step
        on meanwhile: sealing keeps their writes from overwriting what the store lists.
        """
        deadline = time.monotonic() + newest_s
        while holders:
            dead: set[int] = set()
            answered = self.sync(reported, holders, timeout_s=KEEPER_ANSWER_S, dead=dead)
            live = [p for p in answered if p not in failed and p not in dead]  # a failed process, or one
            # whose keeper died, keeps nothing more
            if newest < 0 or time.monotonic() >= deadline:
                break
            if self._holds(holders, newest) and all(self._has_part(p, newest) for p in live):
                break
            if self._holds_confirmed(holders, [p for p in answered if p not in dead], newest):
                deadline = min(deadline, time.monotonic() + OTHER_HOLDERS_S)
            time.sleep(KEEPER_POLL_S)
        if holders:
            self.sync(reported, holders, timeout_s=KEEPER_ANSWER_S, seal=True)

    def _has_part(self, p: int, step: int) -> bool:
        """Process ``p``'s keeper holds its host's part of the snapshot of ``step``."""
        return self.store.has(self.world.slice_of(p), p % self.world.plan.hosts_per_slice, step)

    def _holds_confirmed(self, holders: list[int], answered: list[int], step: int) -> bool:
        """Some slice whose every holder's keeper answered just now has every host's part of
        ``step`` (a keeper on a lost node does not answer, and the store still lists what it held)."""
        silent = {self.world.slice_of(p) for p in holders if p not in answered}
        return any(self.store.complete(s, step) for s in {self.world.slice_of(p) for p in answered} - silent)

    def _holds(self, processes: list[int], step: int) -> bool:
        """Some slice of ``processes`` has every host's part of the snapshot of ``step``."""
        return any(self.store.complete(self.world.slice_of(p), step) for p in processes)
