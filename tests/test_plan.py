"""World layout decisions, tested without a cluster."""

import math

import pytest

from ray_elastic.decide import ErrorKind as K
from ray_elastic.decide import (
    FailureVerdict,
    RestoreSource,
    batch_for_world,
    choose_restore,
    classify_failure,
    drop_repeat_offender,
    failures_exceeded,
    is_checkpoint_step,
    is_snapshot_step,
    lr_scale,
    plan_world,
    watchdog_timeout,
)
from ray_elastic.decide.layout import fsdp_partition as param_partition
from ray_elastic.policy.scaling import MODES, Action, scaling_policy
from ray_elastic.state.snapshots import SnapshotStore


def test_mesh_has_replica_axis_across_slices_and_fsdp_inside():
    p = plan_world(0, ["a", "b", "c"], hosts_per_slice=2, devices_per_host=4, global_batch_size=48)
    assert p.mesh_shape == {"replica": 3, "fsdp": 8}
    assert p.num_processes == 6
    assert [p.process_id(s, h) for s in range(3) for h in range(2)] == list(range(6))


def test_process_rows_tile_the_global_batch_exactly_once():
    p = plan_world(0, ["a", "b", "c"], 2, 2, 24)
    ranges = [p.process_rows(i) for i in range(p.num_processes)]
    assert ranges[0] == (0, 4) and ranges[-1] == (20, 24)
    covered = [r for lo, hi in ranges for r in range(lo, hi)]
    assert covered == list(range(24))


def test_plan_refuses_batches_that_do_not_split():
    with pytest.raises(ValueError, match="does not split over 3 slice"):
        plan_world(0, ["a", "b", "c"], 1, 2, 10)
    with pytest.raises(ValueError, match="at least one slice"):
        plan_world(0, [], 1, 2, 10)


def test_param_partition_shards_largest_divisible_dim_over_fsdp():
    assert param_partition((64, 128), 4, 1024) == (None, "fsdp")
    assert param_partition((96, 30), 4, 1024) == ("fsdp", None)
    assert param_partition((33, 35), 4, 1024) == (None, None)  # nothing divisible: replicated
    assert param_partition((10,), 2, 1024) == (None,)  # small: replicated
    assert param_partition((64, 128), 4, 10**6) == (None, None)  # below the threshold
    assert param_partition((64, 128), 1, 1024) == (None, None)


# ----------------------------------------------------------------------------- recovery decisions
def test_classify_dead_node_is_lost_slice_and_collateral_is_not():
    v = classify_failure(errors={"a": K.ACTOR_DIED, "b": K.ACTOR_DIED}, dead_slices={"a"}, world_slices=["a", "b", "c"])
    assert v == FailureVerdict(("a",), ("b",), True, "lost slice(s) a")
    # Ray's "its node has died" is a lost slice before the node table says so.
    v = classify_failure(errors={"a": K.NODE_DIED, "b": K.PROCESS_DIED}, dead_slices=set(), world_slices=["a", "b"])
    assert (v.lost_slices, v.crashed_slices) == (("a",), ("b",))
    v = classify_failure(errors={"b": K.ACTOR_DIED}, dead_slices=set(), world_slices=["a", "b"])
    assert v.lost_slices == () and v.crashed_slices == ("b",) and v.recoverable


def test_classify_user_error_is_not_recoverable():
    v = classify_failure(
        errors={"a": K.TASK_ERROR}, dead_slices=set(), world_slices=["a", "b"], error_text="ValueError: nan"
    )
    assert not v.recoverable and v.training_code and "ValueError: nan" in v.reason
    # A slice-down JaxRuntimeError is a slice failure, not user code.
    v = classify_failure(errors={"a": K.SLICE_DOWN}, dead_slices=set(), world_slices=["a", "b"])
    assert v.recoverable and not v.training_code


def test_a_task_error_next_to_a_death_is_collateral():
    # A survivor's collective error whose text pathwaysutils does not know, next to a lost slice.
    v = classify_failure(errors={"a": K.TASK_ERROR, "c": K.ACTOR_DIED}, dead_slices={"c"}, world_slices=["a", "b", "c"])
    assert v.recoverable and not v.training_code and v.lost_slices == ("c",) and v.crashed_slices == ("a",)
    v = classify_failure(errors={"a": K.TASK_ERROR, "b": K.SLICE_DOWN}, dead_slices=set(), world_slices=["a", "b"])
    assert v.recoverable
    v = classify_failure(errors={"a": K.TASK_ERROR}, dead_slices=set(), world_slices=["a", "b"])
    assert not v.recoverable and v.training_code


def test_drop_repeat_offender():
    v = classify_failure(errors={"b": K.PROCESS_DIED}, dead_slices=set(), world_slices=["a", "b", "c"])
    same = dict(origin="b", previous_origin="b")
    assert drop_repeat_offender(v, **same, progressed=True) == v  # steps in between: a new failure
    assert drop_repeat_offender(v, origin="b", previous_origin="a", progressed=False) == v
    d = drop_repeat_offender(v, **same, progressed=False)
    assert (d.lost_slices, d.crashed_slices, d.quarantined) == (("b",), (), ("b",)) and "twice in a row" in d.reason


def nw(mode, survivors, ready, num_slices, min_slices, timed_out=False, fallback_to_resize=False):
    policy = scaling_policy(mode, num_slices, min_slices, fallback_to_resize)
    return policy.next_world(survivors, ready, timed_out=timed_out)


def test_decide_next_world_replica_resize():
    assert nw("replica-resize", ["a", "b"], 0, 3, 1).action is Action.FORM
    d = nw("replica-resize", ["a"], 0, 3, 2)
    assert d.action == "wait" and "need 2" in d.reason
    d = nw("replica-resize", ["a"], 5, 3, 2)
    assert (d.action, d.survivors, d.replacements) == ("form", ("a",), 2)
    # Never below min_slices forever: once replacement_timeout_s is spent, fail and say what is left.
    d = nw("replica-resize", ["a"], 0, 3, 2, timed_out=True)
    assert d.action == "fail" and "only 1 slice(s) available, fewer than min_slices=2" in d.reason
    assert nw("replica-resize", [], 0, 3, 1, timed_out=True).action == "fail"


def test_decide_next_world_pause_and_resume():
    assert nw("pause-and-resume", ["a", "b"], 0, 3, 1).action == "wait"
    assert nw("pause-and-resume", ["a", "b"], 1, 3, 1).size == 3
    d = nw("pause-and-resume", ["a", "b"], 0, 3, 1, timed_out=True)
    assert d.action == "fail" and "fallback_to_resize is off" in d.reason
    d = nw("pause-and-resume", ["a", "b"], 0, 3, 1, timed_out=True, fallback_to_resize=True)
    assert (d.action, d.size) == ("form", 2)
    d = nw("pause-and-resume", ["a"], 0, 3, 2, timed_out=True, fallback_to_resize=True)
    assert d.action == "fail" and "fewer than min_slices=2" in d.reason


def test_a_recovery_takes_a_replacement_still_starting_only_when_no_world_forms_without_it():
    # A ready replacement whose processes have not started (no warm standby) kept a chaos run's
    # recovery waiting 20 s for Python and JAX to start on a loaded host: where the survivors may
    # form a world without it, they do, and it joins through a grow-back once warm.
    resize, pause = scaling_policy("replica-resize", 4, 2), scaling_policy("pause-and-resume", 4, 2)
    d = resize.next_world_warm_first(["a", "b"], 0, 1, timed_out=False)
    assert (d.action, d.size) == ("form", 2)
    d = resize.next_world_warm_first(["a", "b"], 1, 1, timed_out=False)
    assert (d.action, d.replacements) == ("form", 1)  # the warm one joins at once
    d = resize.next_world_warm_first(["a"], 0, 2, timed_out=False)  # below min_slices without the cold ones
    assert (d.action, d.replacements) == ("form", 2)
    d = pause.next_world_warm_first(["a", "b", "c"], 0, 1, timed_out=False)  # full size or nothing: wait for it
    assert (d.action, d.size) == ("form", 4)
    assert pause.next_world_warm_first(["a", "b"], 0, 1, timed_out=False).action == "wait"


def test_batch_policies_and_lr_rules():
    assert batch_for_world(2, 3, 48, "constant") == 48
    assert batch_for_world(2, 3, 48, "scale") == 32
    with pytest.raises(ValueError):
        batch_for_world(2, 3, 10, "scale")
    assert lr_scale(2, 4, None) == 1.0 and lr_scale(2, 4, "linear") == 0.5 and lr_scale(1, 4, "sqrt") == 0.5


def test_a_checkpoint_of_a_step_without_metrics_does_not_beat_the_snapshot_before_it():
    # The save of checkpoint 1540 (state after step 1539) committed, but the world failed before
    # step 1539's loss reached the driver: the snapshot of 1538 is the newest state with a record.
    r = choose_restore({"a": 1538, "b": 1538}, checkpoint_step=1539, last_step=1538)
    assert (r.source, r.step, r.holders) == ("snapshot", 1538, ("a", "b"))
    assert choose_restore({"a": 1538}, checkpoint_step=1539).source == "checkpoint"  # no record to keep
    # No snapshot of the last step: the newer checkpoint still beats rewinding further.
    assert choose_restore({"a": 1530}, checkpoint_step=1539, last_step=1538).step == 1539
    assert choose_restore({}, checkpoint_step=1539, last_step=1538).source == "checkpoint"
    assert choose_restore({"a": 1538}, checkpoint_step=1559, last_step=1560).step == 1559  # newer, and known
    assert choose_restore({}, checkpoint_step=999, last_step=-1).step == 999  # resuming: no record yet


def test_choose_restore_prefers_own_snapshot_and_newest_step():
    r = choose_restore({"a": 41, "b": 41, "c": 40})
    assert r.step == 41 and r.source is RestoreSource.SNAPSHOT
    assert [r.donor(n) for n in ("a", "b", "c", "new")] == ["a", "b", "a", "a"]
    assert choose_restore({}).step == -1
    assert choose_restore({}).source == "fresh" and choose_restore({}).donor("a") is None


def test_choose_restore_falls_back_to_the_newest_committed_checkpoint():
    # No snapshot survived: the checkpoint (state after step 99) is the restore point.
    r = choose_restore({}, checkpoint_step=99)
    assert (r.step, r.source, r.donor("a")) == (99, "checkpoint", None)
    # A newer snapshot wins; on a tie the in-memory snapshot wins too.
    assert choose_restore({"a": 120}, 99).source == "snapshot"
    assert choose_restore({"a": 99}, 99).source == "snapshot"
    # A snapshot older than the checkpoint (snapshot_every > checkpoint_every) loses.
    r = choose_restore({"a": 95}, 99)
    assert (r.step, r.source) == (99, "checkpoint")


def test_snapshot_store_completes_per_slice_and_prunes():
    st = SnapshotStore(hosts_per_slice=2, keep_steps=2)
    for step in range(5):
        st.add("a", 0, step, f"a0-{step}")
        if step < 4:
            st.add("a", 1, step, f"a1-{step}")
    assert st.latest_complete(["a", "b"]) == {"a": 3}  # step 4 misses host 1
    assert st.refs("a", 3) == ["a0-3", "a1-3"]
    assert sorted(st._refs["a"]) == [2, 3, 4]  # older complete steps dropped
    st.forget("a")
    assert st.latest_complete(["a"]) == {}


def test_snapshot_store_keeps_the_newest_step_the_replicas_agreed_on():
    """With two replicas that disagree the run goes back to the newest step they agreed on: its
    snapshot (or the newest complete one before it) outlives the newest few."""
    st = SnapshotStore(hosts_per_slice=1, keep_steps=2)
    st.trusted = 4
    for step in range(3, 12):
        st.add("a", 0, step, f"a-{step}")
    assert sorted(st._refs["a"]) == [4, 10, 11]
    st.trusted = 11  # a later check agreed: the old one goes at the next add
    st.add("a", 0, 12, "a-12")
    st.add("a", 0, 13, "a-13")
    assert sorted(st._refs["a"]) == [11, 12, 13]
    st.drop_after(11)  # the rollback
    assert st.latest_complete(["a"]) == {"a": 11}


def test_snapshot_store_keeps_fingerprinted_steps_not_yet_compared():
    """A probe round may find step 9 agreed and step 14 disagreeing together: the rollback goes to
    step 9, whose snapshot must still be there although the trusted step was 4 when it was added."""
    st = SnapshotStore(hosts_per_slice=1, keep_steps=2, checked_every=5)
    st.trusted = 4
    for step in range(3, 18):
        st.add("a", 0, step, f"a-{step}")
    assert sorted(st._refs["a"]) == [4, 9, 14, 16, 17]
    st.trusted = 9  # the round: 9 agreed, 14 disagreed
    st.drop_after(9)
    assert st.latest_complete(["a"]) == {"a": 9}
    for step in range(10, 21):  # the replay: 14 and 19 kept until compared, 4 and 9 go once trusted moves on
        st.add("a", 0, step, f"b-{step}")
    assert sorted(st._refs["a"]) == [9, 14, 19, 20]
    st.trusted = 19
    st.add("a", 0, 21, "b-21")
    assert sorted(st._refs["a"]) == [19, 20, 21]


def test_snapshot_store_never_completes_a_step_from_two_worlds():
    st = SnapshotStore(hosts_per_slice=2)
    st.add("a", 0, 5, "old-a0-5")
    st.add("a", 1, 5, "old-a1-5")
    st.add("a", 0, 6, "old-a0-6")  # the old world died after host 0 delivered step 6
    st.drop_after(5)  # the next world restores step 5 and runs step 6 again
    st.add("a", 1, 6, "new-a1-6")
    assert st.latest_complete(["a"]) == {"a": 5}
    st.add("a", 0, 6, "new-a0-6")
    assert st.refs("a", 6) == ["new-a0-6", "new-a1-6"]


def test_misc_policies():
    assert [s for s in range(10) if is_snapshot_step(s, 3)] == [2, 5, 8]
    assert not any(is_snapshot_step(s, 0) for s in range(10))  # snapshots off
    assert [s for s in range(25) if is_checkpoint_step(s, 10, final_step=24)] == [9, 19, 24]
    assert failures_exceeded([0, 1, 2, 100], now=101, max_failures=2, window_s=5) is False
    assert failures_exceeded([97, 98, 99, 100], now=101, max_failures=2, window_s=5) is True
    assert watchdog_timeout([], 10, 3) == 3 and watchdog_timeout([1.0] * 5, 10, 3) == 10
    grow = scaling_policy("replica-resize", 3, 1).should_grow
    assert grow(2, 1) and not grow(3, 1)


def test_resize_until_full_trains_on_the_survivors_and_grows_back_once():
    """The third scaling policy: like replica-resize after a loss; grows back only when the ready
    replacements restore full size at once (one pause for slices that return one by one)."""
    policy = scaling_policy("resize-until-full", 4, 2)
    d = policy.next_world(["a", "b"], 0)
    assert (d.action, d.size) == ("form", 2)  # at once, as replica-resize
    assert not policy.should_grow(2, 1)  # one replacement of two: keep training on 2
    assert policy.should_grow(2, 2) and policy.should_grow(3, 1)  # full size at once
    assert policy.world_sizes() == [2, 3, 4]
    assert policy.next_world(["a"], 0, timed_out=True).action == "fail"


def test_each_mode_is_one_policy_chosen_by_the_config():
    from ray_elastic import ElasticConfig

    for mode in MODES:
        cfg = ElasticConfig(num_slices=4, global_batch_size=48, mode=mode, min_slices=2)
        assert cfg.scaling_policy().mode == mode
    with pytest.raises(ValueError, match=r"unknown mode 'shrink'.*resize-until-full"):
        ElasticConfig(num_slices=4, global_batch_size=48, mode="shrink")
    assert ElasticConfig(num_slices=4, global_batch_size=48, mode="pause-and-resume").world_sizes() == [4]


def test_newest_snapshot_step_follows_the_snapshot_rule():
    from ray_elastic.decide import is_snapshot_step, newest_snapshot_step

    for every in (1, 3, 5):
        for step in range(-1, 20):
            want = max([s for s in range(step + 1) if is_snapshot_step(s, every)], default=-1)
            assert newest_snapshot_step(step, every) == want, (step, every)
    assert newest_snapshot_step(10, 0) == -1


def test_the_newest_due_snapshot_follows_each_interval_where_it_held():
    """``AutoInterval`` changes the interval as a world runs; each holds from its first step."""
    from ray_elastic.decide import is_snapshot_step, newest_due_snapshot

    # The interval changes of a 2-host demo run (10 -> 8 at step 60): its drain waited the whole 3 s
    # bound for step 55, which no process had snapshotted (the newest was 54).
    demo = [(0, 1), (20, 7), (40, 11), (60, 8)]
    assert newest_due_snapshot(60, demo) == 54 and newest_due_snapshot(63, demo) == 63
    for intervals in (demo, [(5, 1)], [(0, 4), (6, 0)], [(0, 0), (10, 3)], [(0, 3), (4, 5), (7, 2)]):
        firsts = [f for f, _ in intervals] + [10**6]
        every_at = {s: e for (f, e), nxt in zip(intervals, firsts[1:]) for s in range(f, nxt)}
        for step in range(-1, 80):
            want = max([s for s in range(step + 1) if s in every_at and is_snapshot_step(s, every_at[s])], default=-1)
            assert newest_due_snapshot(step, intervals) == want, (intervals, step)
    assert newest_due_snapshot(10, []) == -1


def test_snapshot_interval_keeps_the_cost_under_the_budget():
    from ray_elastic.decide import snapshot_interval

    # 4 ms per snapshot on 100 ms steps: every step costs 4%; every 2nd step 2%, within a 2% budget.
    assert snapshot_interval([0.004] * 5, [0.1] * 5, 0.02) == 2
    assert snapshot_interval([0.0041] * 5, [0.1] * 5, 0.02) == 3
    assert snapshot_interval([0.001], [0.1], 0.02) == 1  # cheap: every step, zero rewind
    assert snapshot_interval([], [0.1], 0.02, current=1) == 1  # nothing measured yet: as it is
    assert snapshot_interval([5.0], [0.01], 0.02, max_every=50) == 50
    # Medians: one slow snapshot (a keeper starting) does not set the interval.
    assert snapshot_interval([0.001, 0.001, 2.0], [0.1] * 3, 0.02) == 1


def test_a_snapshot_costs_what_it_adds_to_the_steps_near_it():
    """Work a snapshot causes outside its writer thread (the keeper's and the object store's
    copies on the cores the steps use) is not on the writer's clock. The step times around
    snapshot steps show all of it, and a stray slow step elsewhere is not charged to them."""
    import random

    from ray_elastic.decide import snapshot_cost_in_steps, snapshot_interval

    rng = random.Random(0)
    every, base = 17, 0.28
    slow = {0: 0.2, 1: 0.15, 2: 0.02}  # 0.37 s per snapshot, spread over the steps after it
    timed = [(s, base + slow.get((s + 1) % every, 0.0) + rng.uniform(-0.005, 0.005)) for s in range(170)]
    timed[100] = (100, 3.0)  # one stray slow step (a standby starting)
    cost = snapshot_cost_in_steps(timed, every)
    assert 0.35 < cost < 0.39, cost
    # The writer timed 0.09 s: alone it would allow every 17th step (8% here); with the steps' view,
    # the interval that keeps snapshots within 2%.
    assert snapshot_interval([0.09] * 20, [base] * 20, 0.02) == 17
    assert snapshot_interval([0.09] * 20, [base] * 20, 0.02, step_cost=cost) == math.ceil(cost / (0.02 * base))
    # Snapshots that cost the steps nothing: the writer's own measurement stands.
    flat = [(s, base + rng.uniform(-0.005, 0.005)) for s in range(170)]
    assert snapshot_cost_in_steps(flat, every) < 0.02
    assert snapshot_interval([0.09] * 20, [base] * 20, 0.02, step_cost=snapshot_cost_in_steps(flat, every)) == 17
    # Measurements that move a little leave the interval as it is (an event per change).
    assert snapshot_interval([0.09] * 20, [base] * 20, 0.02, current=36, step_cost=0.2) == 36  # 0.2 s: 36
    assert snapshot_interval([0.09] * 20, [base] * 20, 0.02, current=34, step_cost=0.2) == 34
    assert snapshot_interval([0.09] * 20, [base] * 20, 0.02, current=30, step_cost=0.2) == 36
    # Cannot tell: an interval leaving no step far from a snapshot, or too few steps.
    assert snapshot_cost_in_steps(timed, 5) is None
    assert snapshot_cost_in_steps(timed[:20], every) is None


def test_the_snapshot_store_follows_what_the_keepers_hold():
    """The hosts of a slice report their kept steps at their own pace; a keeper keeps only its
    newest few. Before a restore the store is made to say what the keepers really hold."""
    from ray_elastic.state.snapshots import SnapshotStore

    store = SnapshotStore(hosts_per_slice=2, keep_steps=5)
    store.add("a", 0, 13, "a0-13")
    store.add("a", 1, 13, "a1-13")
    store.add("a", 0, 15, "a0-15")
    assert store.latest_complete(["a"]) == {"a": 13}
    assert sorted(e[:3] for e in store.entries(["a"])) == [("a", 0, 13), ("a", 0, 15), ("a", 1, 13)]
    store.drop("a", 0, 13)  # host 0's keeper let go of 13
    assert store.latest_complete(["a"]) == {}
    store.hold_only("a", 1, {14: "a1-14", 15: "a1-15"})
    store.hold_only("a", 0, {14: "a0-14", 15: "a0-15"})
    assert store.latest_complete(["a"]) == {"a": 15} and store.refs("a", 15) == ["a0-15", "a1-15"]
    assert store.complete("a", 14) and not store.complete("a", 13)


def test_a_keeper_keeps_every_snapshot_its_driver_may_know_of():
    """A process streams every ~0.2 s; its keeper may hold more steps than the driver has heard of
    from it. The driver restores only steps it has metrics for, taken from whichever holder streams
    first: the newest step the driver acknowledged, and every step after it, must still be held."""
    from ray_elastic.state.snapshot_keeper import evictable

    held = [(7, s) for s in range(850, 860)]
    # Acknowledged up to 856: 856 is pinned, 857-859 are newer than the driver's word, the rest goes.
    assert evictable(held, 3, (7, 856)) == [(7, s) for s in range(850, 856)]
    # Acknowledged up to 852, kept up to 859: another holder may have streamed any of 853-859 before it
    # died (the case the newest three alone lost): all of them stay.
    assert evictable(held, 3, (7, 852)) == [(7, s) for s in range(850, 852)]
    assert evictable(held, 3, (7, 859)) == [(7, s) for s in range(850, 857)]  # the pinned one is among the newest
    # Nothing acknowledged is held: everything is newer than the driver's word, bounded by max_unacked.
    assert evictable(held, 3, (7, 800)) == []
    assert evictable(held, 3, (7, 800), max_unacked=4) == [(7, s) for s in range(850, 856)]
    # A new world has had nothing acknowledged yet: the last snapshot of the world before stays until it has.
    assert evictable([(6, 500), (7, 501), (7, 502), (7, 503)], 3, (7, -1)) == []
    assert evictable([(6, 500), (7, 501), (7, 502), (7, 503), (7, 504)], 3, (7, 501)) == [(6, 500)]
    # The newest step the replicas agreed on (or the newest before it) stays too, of any world.
    assert evictable(held, 3, (7, 859), trusted=853) == [(7, s) for s in range(850, 857) if s != 853]
    assert evictable([(6, 500), (7, 501), (7, 502), (7, 503), (7, 504)], 3, (7, 504), trusted=500) == [(7, 501)]


def test_chunks_grow_with_the_world_but_last_at_most_ten_seconds():
    from ray_elastic.decide import chunk_steps

    assert chunk_steps(10, 6) == 10  # small worlds: as configured
    assert chunk_steps(10, 1024) == 103  # one submission per process per chunk: flat per step
    assert chunk_steps(10, 1024, [0.1] * 5) == 100  # 10 s of 100 ms steps
    assert chunk_steps(10, 1024, [2.0] * 5) == 10  # slow steps: never below the configured chunk
    assert chunk_steps(50, 64, [1.0]) == 50
    # A straggler suspected: ~0.3 s of the newest steps, at least 2, so a confirmed one leaves soon.
    assert chunk_steps(10, 6, [0.01] * 5, suspect=True) == 10  # 30 steps of 10 ms: as configured
    assert chunk_steps(10, 6, [2.0] * 20 + [0.06] * 10, suspect=True) == 5  # the newest 10 steps
    assert chunk_steps(10, 6, [1.0] * 5, suspect=True) == 2


def test_relay_channels_group_quiet_processes_only_in_large_worlds():
    from ray_elastic.ray_backend.relay import PROCESSES_PER_RELAY, RELAY_MIN_QUIET, channels

    small = channels(range(6), [2, 3, 4, 5])
    assert small == [([0], False), ([1], False), ([2], False), ([3], False), ([4], False), ([5], False)]
    n = RELAY_MIN_QUIET + 10
    big = channels(range(n), list(range(3, n)))
    assert big[:3] == [([0], False), ([1], False), ([2], False)]
    groups = [procs for procs, relayed in big if relayed]
    assert [p for g in groups for p in g] == list(range(3, n))  # every quiet process, once, in order
    assert all(len(g) <= PROCESSES_PER_RELAY for g in groups) and len(big) == 3 + len(groups)


def test_a_silent_process_in_a_world_that_moved_on_is_starved_not_hung():
    """The watchdog fired and a probe went unanswered. A step finished that the driver has not seen
    needed every process's collectives: the silent one is starved (seen in the chaos bench, a world
    beside three starting processes on 2 cores, taken for hung). Without such a step, a silent
    process is a hang; a save in progress counts only when every process answered."""
    from ray_elastic.detect.health import busy, newest_step

    moved = [None, {"last_step": 1479, "saving": False}, {"last_step": 1478, "saving": False}]
    assert busy(moved, 1477)
    assert not busy(moved, max(1477, newest_step(moved)))  # the next watch: nothing moved since: hung
    assert not busy([None, {"last_step": 1477, "saving": True}], 1477)  # a stopped process beside a save
    assert busy([{"last_step": 1477, "saving": True}, {"last_step": 1477, "saving": False}], 1477)
    assert not busy([{"last_step": 1477, "saving": False}] * 2, 1477)
    assert newest_step([None, None]) == -1


def test_a_rewind_is_explained_only_when_every_holder_was_lost_or_its_step_failed_on_the_survivor():
    """``results.unexplained_rewinds``: the rule the chaos bench and the recovery tests hold a run to."""
    from ray_elastic.observe.results import unexplained_rewinds

    def run(lost: list[str], not_kept: list[dict] = ()) -> list[dict]:
        events = [{"kind": "world_formed", "slices": ["a", "b", "c"]}]
        if not_kept:
            events.append({"kind": "snapshot_not_kept", "first": list(not_kept)})
        events += [
            {"kind": "failure", "lost_slices": lost, "crashed_slices": []},
            {"kind": "world_formed", "slices": ["a", "c"]},
            {"kind": "recovered", "restored_from_step": 40, "steps_rewound": 3},
        ]
        return events

    assert unexplained_rewinds(run(["b"]), replicas=2) == 3  # holder "a" survived: 3 steps for nothing
    assert unexplained_rewinds(run(["a", "b"]), replicas=2) == 0  # both holders lost
    assert unexplained_rewinds(run(["b"]), replicas=3) == 3  # "a" and "c" survived
    # The survivor's snapshot of each rewound step failed in the step's own collective: no living
    # process had that state.
    failed = [{"step": s, "why": "JaxRuntimeError: gloo"} for s in (41, 42, 43)]
    assert unexplained_rewinds(run(["b"], failed), replicas=2) == 0
    # ... but not when it failed for another reason, or not for every rewound step.
    assert unexplained_rewinds(run(["b"], [{"step": s, "why": "MemoryError"} for s in (41, 42, 43)]), replicas=2) == 3
    assert unexplained_rewinds(run(["b"], failed[:2]), replicas=2) == 3
    # A planned grow-back never rewinds.
    grow = [
        {"kind": "world_formed", "slices": ["a", "b"]},
        {"kind": "world_formed", "slices": ["a", "b", "c"]},
        {"kind": "scale_up", "restored_from_step": 10, "steps_rewound": 1},
    ]
    assert unexplained_rewinds(grow, replicas=2) == 1


def test_world_shapes_lay_out_every_world_size_as_the_config_does():
    """The slice processes plan worlds from ``WorldShapes`` (in their ``SliceSettings``), the driver
    from the config: the same plan for every world size the run may train on, or a step traced
    ahead would not fit the world formed later."""
    import pickle

    from ray_elastic import ElasticConfig
    from ray_elastic.ray_backend.slice_settings import slice_settings

    cfg = ElasticConfig(num_slices=4, global_batch_size=48, min_slices=2, batch_policy="scale", lr_rule="sqrt")
    settings = pickle.loads(pickle.dumps(slice_settings(cfg)))  # as it crosses to a slice process
    assert settings.worlds.sizes() == sorted(cfg.world_sizes()) == [2, 3, 4]
    names = ["a", "b", "c", "d"]
    for n in settings.worlds.sizes():
        assert settings.worlds.plan(5, names[:n]) == cfg.world_plan(5, names[:n])
    assert settings.worlds.plan(0, names[:2]).global_batch_size == 24  # "scale": the batch follows the world
    with pytest.raises(ValueError, match="no layout for a world of 1 slices"):
        settings.worlds.plan(0, names[:1])


def test_the_snapshot_policy_decides_the_interval_and_whether_the_step_packs():
    from ray_elastic import AutoInterval, ElasticConfig, EveryNSteps
    from ray_elastic.policy.snapshots import SnapshotCosts
    from ray_elastic.ray_backend.slice_settings import slice_settings

    assert AutoInterval().interval(SnapshotCosts()) == 1  # nothing measured: every step
    assert AutoInterval(budget=0.02).interval(SnapshotCosts((0.004,) * 5, (0.1,) * 5)) == 2
    assert EveryNSteps(4).interval(SnapshotCosts((9.0,), (0.1,))) == 4  # whatever it costs
    base = dict(num_slices=2, global_batch_size=48, allow_restart_from_scratch=True)
    for every, on, first in ((AutoInterval(), True, 1), (3, True, 3), (EveryNSteps(0), False, 0), (0, False, 0)):
        settings = slice_settings(ElasticConfig(**base, snapshot_every=every))
        assert (settings.pack, settings.snapshot_every) == (on, first), every
