"""World layout decisions, tested without a cluster."""

import pytest

from ray_elastic.plan import chunks, param_partition, plan_world


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


def test_chunks_cover_range_in_order():
    assert chunks(0, 25, 10) == [(0, 10), (10, 10), (20, 5)]
    assert chunks(5, 5, 10) == []
