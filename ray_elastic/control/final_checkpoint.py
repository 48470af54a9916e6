"""The run's last checkpoint commits before ``fit`` returns (and the in-flight save before a grow)."""

from __future__ import annotations

import time

from ray_elastic.control.backend import WorldHandle
from ray_elastic.control.run_checkpoints import RunCheckpoints
from ray_elastic.control.states import OutcomeKind, RunOutcome
from ray_elastic.errors import ProcessFailed
from ray_elastic.observe.step_ledger import StepLedger


def finish_checkpoints(
    run: RunCheckpoints, world: WorldHandle | None, ledger: StepLedger, save_step: int | None = None
) -> None:
    """Wait for the in-flight save of ``world`` to commit (first saving ``save_step``)."""
    if run.own and world is not None:
        ledger.saves_committed(world.finish_checkpoints(ledger.save_limit_s(), save_step))


def final_checkpoint(run: RunCheckpoints, world: WorldHandle | None, ledger: StepLedger, num_steps: int) -> RunOutcome:
    """The run's last checkpoint is committed: its in-flight save finishes, or, when the world that
    was writing it failed (the state came back from a snapshot), ``world`` saves it again. A
    process dying meanwhile is one more failure (FAILURE), not the end."""
    if not run.own or world is None:
        return RunOutcome(OutcomeKind.DONE)
    try:
        finish_checkpoints(run, world, ledger)
        if ledger.committed_step < num_steps:
            info = run.newest_own()  # reported or not, what is there
            if info is None or info.step < num_steps:
                finish_checkpoints(run, world, ledger, save_step=num_steps)
            else:  # the failed world's save committed before its process died: it is the run's last
                ledger.saves_committed([(info.step, None)])
    except ProcessFailed as e:
        return RunOutcome(OutcomeKind.FAILURE, {e.process: e.cause}, time.time())
    return RunOutcome(OutcomeKind.DONE)
