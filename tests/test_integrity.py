"""Replicas of the train state must hold the same bits: fingerprints, the vote, and the flip the
simulated cluster injects (one process, CPU). The cluster path (a flipped bit found, its slice
evicted) is in ``test_recovery.py``."""

import numpy as np
import pytest

from ray_elastic.decide.integrity import Mismatch, compare

PLACE = {0: ("a", 0), 1: ("b", 0), 2: ("c", 0), 3: ("a", 1), 4: ("b", 1), 5: ("c", 1)}  # 3 slices x 2 hosts


def test_the_slice_out_voted_at_any_host_position_is_corrupt():
    same = {p: (1, 2, 3) if PLACE[p][1] == 0 else (4, 5, 6) for p in PLACE}
    assert compare(9, same, PLACE) is None
    # Host 1 of slice b disagrees on array 2: b is out-voted by a and c (host 0's agree: only that host drifted).
    assert compare(9, {**same, 4: (4, 5, 7)}, PLACE) == Mismatch(9, ("b",), (2,))
    # Two replicas, or a three-way split: no majority, no slice named.
    two = {p: fp for p, fp in same.items() if PLACE[p][0] != "c"}
    assert compare(9, {**two, 4: (4, 5, 7)}, PLACE) == Mismatch(9, (), (2,))
    assert compare(9, {**same, 4: (4, 5, 7), 5: (4, 0, 6)}, PLACE) == Mismatch(9, (), (1, 2))


def test_copies_of_a_donor_follow_its_vote_until_the_restored_state_is_compared():
    """After a failure, holders a and b restored their own snapshots and c a copy of a's, taken
    since the last check. A bit flipped in a before its snapshot is in c too: counted one by one,
    a and c would out-vote the clean b. A copy follows its donor's vote instead: a against b, no
    majority (back to the step last compared)."""
    place = {0: ("a", 0), 1: ("b", 0), 2: ("c", 0)}
    corrupt, clean = (1, 9), (1, 2)
    donors = {"a": "a", "b": "b", "c": "a"}
    assert compare(9, {0: corrupt, 1: clean, 2: corrupt}, place) == Mismatch(9, ("b",), (1,))
    assert compare(9, {0: corrupt, 1: clean, 2: corrupt}, place, donors) == Mismatch(9, (), (1,))
    # A copy that drifted from its donor since is out-voted as before.
    assert compare(9, {0: clean, 1: clean, 2: corrupt}, place, donors) == Mismatch(9, ("c",), (1,))
    assert compare(9, {0: clean, 1: clean, 2: clean}, place, donors) is None
    # With a third holder, the majority holds: the corrupt donor and its copy both go.
    place4, donors4 = {**place, 3: ("d", 0)}, {**donors, "d": "d"}
    assert compare(9, {0: corrupt, 1: clean, 2: corrupt, 3: clean}, place4, donors4) == Mismatch(9, ("a", "c"), (1,))


@pytest.mark.cluster  # runs JAX programs
def test_a_fingerprint_is_the_same_for_the_same_bits_and_changes_with_one_flipped_bit():
    import jax
    import jax.numpy as jnp

    from ray_elastic.slice.integrity import Fingerprints, flip_one_bit

    state = {"w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4), "h": jnp.ones(5, jnp.bfloat16), "k": jnp.uint32(7)}

    def fingerprint(s, step=4):
        f = Fingerprints(every=5)
        f.dispatched(step, s)
        f.finished(step)
        return f.done[step]

    base = fingerprint(state)
    assert len(base) == 3 and base == fingerprint(jax.tree.map(jnp.copy, state))
    for leaf in range(3):
        flipped = fingerprint(flip_one_bit(state, leaf, 3))
        assert [a != b for a, b in zip(base, flipped)] == [i == leaf for i in range(3)]
    assert Fingerprints(every=5).dispatched(3, state) is None  # not a fingerprinted step
    changed = np.asarray(flip_one_bit(state, 2, 0)["w"])  # leaves in key order: h, k, w
    assert np.count_nonzero(changed != np.asarray(state["w"])) == 1


@pytest.mark.cluster  # runs JAX programs
def test_a_periodic_fingerprint_due_while_its_programs_compile_is_skipped_and_a_boundary_s_is_not():
    """A world's first check can come before the programs ``warm`` compiles on a thread are ready:
    compiling them again in the step loop held one process for seconds (the others waiting, the
    watchdog naming it stuck). That step is skipped (the next due one is compared); at a planned
    stop or the run's end (``now``) the fingerprint is always taken."""
    import threading

    import jax.numpy as jnp

    from ray_elastic.slice.integrity import Fingerprints

    state = {"w": jnp.arange(12, dtype=jnp.float32)}
    f = Fingerprints(every=5)
    release = threading.Event()
    f._warming = threading.Thread(target=release.wait, daemon=True)  # a compile that has not finished
    f._warming.start()
    try:
        f.dispatched(4, state)
        f.finished(4)
        assert f.warming and 4 not in f.done
        f.dispatched(6, state, now=True)
        f.finished(6)
        assert 6 in f.done
    finally:
        release.set()
    f._warming.join()
    f.dispatched(9, state)
    f.finished(9)
    assert not f.warming and list(f.done) == [6, 9]


def test_a_new_world_trusts_what_its_replicas_loaded_from_one_source_or_what_was_compared():
    from ray_elastic.decide.integrity import trusted_at_start

    assert trusted_at_start(0, False, None) == -1  # fresh parameters, the same seed on every replica
    assert trusted_at_start(501, False, 200) == 500  # one checkpoint, loaded by every replica
    assert trusted_at_start(501, True, None) == 500  # a takeover's first world: nothing compared before
    # After a failure each holder loads its own snapshot, taken since the last check: back to that check.
    assert trusted_at_start(531, True, 500) == 500
    assert trusted_at_start(531, True, 530) == 530  # a planned stop compared its boundary
    assert trusted_at_start(401, True, 500) == 400  # a rollback to before the newest check
