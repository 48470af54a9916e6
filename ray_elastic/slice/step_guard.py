"""The step's guard: the update of a bad step (:mod:`~ray_elastic.decide.bad_steps`) is never applied.

It runs inside the step program, after the task's ``train_step``: when the loss (or a
``grad_norm`` metric the task returns) is not finite, or the loss spikes, the program returns the
state it was given. So the state after a skipped step is the state before it (parameters, optimizer state,
counters and RNG streams alike), the step dispatched after it computes from that state, no
snapshot or checkpoint can hold a bad update, and nothing is rolled back or replayed: the next step
reads its own batch, the bad one is skipped. A spike is judged against the median loss of the last
``HISTORY`` kept steps, held on the devices beside the train state (a new world starts it afresh).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ray_elastic.decide.bad_steps import KEPT, NON_FINITE, SPIKE, BadSteps

HISTORY = 32  # kept steps' losses a spike is judged against
MIN_HISTORY = 8  # kept steps before a spike is judged at all (the first losses fall fast)


def history_struct(mesh) -> jax.ShapeDtypeStruct:
    """The guard's device state: ``[kept steps seen (up to HISTORY), their losses, oldest first]``,
    replicated."""
    return jax.ShapeDtypeStruct((HISTORY + 1,), jnp.float32, sharding=NamedSharding(mesh, P()))


def new_history(mesh) -> jax.Array:
    return jax.jit(lambda: jnp.zeros((HISTORY + 1,), jnp.float32), out_shardings=NamedSharding(mesh, P()))()


def guard(new, old, loss, history, bad: BadSteps, grad_norm=None):
    """``(state to keep, history, verdict)``: ``new`` when the step is kept, else ``old`` (with
    ``bad.skip``; otherwise ``new`` either way and the verdict stops the run). Judged on the loss
    (and the ``grad_norm`` the task reports, if it does) alone: the selection then fuses into the
    update's own pass over the state, where a check of every new array would cost two more passes."""
    loss = jnp.asarray(loss, jnp.float32)
    finite = jnp.isfinite(loss)
    if grad_norm is not None:
        finite &= jnp.isfinite(jnp.asarray(grad_norm, jnp.float32))
    verdict = jnp.where(finite, KEPT, NON_FINITE)
    count, losses = history[0], history[1:]
    if bad.spike_factor is not None:
        seen = jnp.arange(HISTORY) >= HISTORY - count
        median = jnp.nanmedian(jnp.where(seen, losses, jnp.nan))
        spike = finite & (count >= MIN_HISTORY) & (median > 0) & (loss > bad.spike_factor * median)
        verdict = jnp.where(spike, SPIKE, verdict)
    kept = verdict == KEPT
    if bad.skip:
        new = jax.tree.map(lambda n, o: jnp.where(kept, n, o), new, old)
    grown = jnp.concatenate([jnp.minimum(count + 1, HISTORY)[None], jnp.roll(losses, -1).at[-1].set(loss)])
    return new, jnp.where(kept, grown, history), verdict
