"""The shared-memory ring a keeper owns and its process writes snapshots into in place
(``ray_elastic.state.snapshot_slots``): what is readable after a writer died mid-copy, which
slots a writer never overwrites, what sealing freezes, and who cleans up after a killed keeper.
Real files in /dev/shm, real processes; no cluster."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from ray_elastic.state.snapshot_slots import PREFIX, SlotLayout, SlotSegment, remove_orphans, shm_dir

LAYOUT = SlotLayout.of([(64, 32), ()], ["float32", "int32"], [((0, 64), (0, 32)), ()], ("['w']", "['count']"))


def fill(step: int):
    """What a device program's packing of this state after ``step`` writes into a slot's row."""

    def write(rows):
        blocks = [np.full((64, 32), step, np.float32), np.array(step, np.int32)]
        for p in LAYOUT.pieces:
            raw = np.frombuffer(blocks[p.leaf].tobytes(), np.uint8)
            rows[p.row][p.offset : p.offset + raw.size] = raw

    return write


@pytest.fixture
def ring():
    keeper = SlotSegment.create(0, LAYOUT, 4)
    writer = SlotSegment.open(keeper.path, LAYOUT)
    yield keeper, writer
    writer.close()
    keeper.close(unlink=True)


def test_a_written_step_is_read_back_whole_and_the_newest_steps_stay(ring):
    keeper, writer = ring
    for step in range(10):
        assert writer.write(0, step, fill(step))
    assert keeper.steps() == [6, 7, 8, 9]
    snap = keeper.read(9)
    assert snap["step"] == 9 and snap["paths"] == LAYOUT.paths and snap["ranges"] == list(LAYOUT.ranges)
    assert np.all(snap["leaves"][0] == 9) and snap["leaves"][0].shape == (64, 32) and int(snap["leaves"][1]) == 9
    with pytest.raises(KeyError):
        keeper.read(5)


def test_the_acknowledged_and_the_streamed_steps_are_never_overwritten(ring):
    keeper, writer = ring
    for step in range(4):
        writer.write(0, step, fill(step))
    keeper.acknowledge(0, 1)  # the driver has step 1 of this host
    for step in range(4, 20):
        writer.write(0, step, fill(step), keep=(12,))  # and the process streamed up to 12
    assert keeper.steps() == [1, 12, 18, 19]
    assert np.all(keeper.read(1)["leaves"][0] == 1) and np.all(keeper.read(12)["leaves"][0] == 12)
    keeper.acknowledge(1, 19)  # another world's acknowledgement pins nothing here
    for step in range(20, 23):
        writer.write(0, step, fill(step), keep=(12,))
    assert keeper.steps() == [12, 20, 21, 22]


def test_the_trusted_and_the_checked_steps_are_kept_while_the_ring_has_room(ring):
    """The newest step the replicas agreed on (the keeper's word) and the newest one fingerprinted
    (the process's) stay while the steps a zero-rewind restore needs leave room; when they do not,
    the fingerprinted one goes first."""
    keeper, writer = ring
    for step in range(6):
        writer.write(0, step, fill(step))
    keeper.trust(5)
    for step in range(6, 18):
        writer.write(0, step, fill(step), keep=(-1, 10 if step > 10 else -1))
    assert keeper.steps() == [5, 10, 16, 17]
    keeper.acknowledge(0, 16)  # with the acknowledged and the streamed steps, five to keep in four slots
    writer.write(0, 18, fill(18), keep=(17, 10))
    assert keeper.steps() == [5, 16, 17, 18]
    writer.write(0, 19, fill(19), keep=(18, 10))  # nothing at or before 10 but the trusted 5 now
    assert keeper.steps() == [5, 16, 18, 19]
    assert np.all(keeper.read(5)["leaves"][0] == 5)


def test_a_ring_sized_for_compared_replicas_keeps_the_agreed_step_and_the_next_one_whatever_the_lag():
    """With the replicas compared, the fewest slots a ring gets leave room for the step they agreed
    on and the next one fingerprinted beside the newest, acknowledged and streamed ones, all five
    apart: the agreed step's snapshot is never given up, and the one compared next is there when
    the driver trusts it (then the older agreed step goes)."""
    big = SlotLayout.of([(1 << 28,)], ["float32"], [((0, 1 << 28),)], ("['w']",))
    assert (big.slots(), big.slots(compared=True)) == (4, 6)
    keeper = SlotSegment.create(0, LAYOUT, big.slots(compared=True))
    writer = SlotSegment.open(keeper.path, LAYOUT)
    try:
        for step in range(6):
            writer.write(0, step, fill(step))
        keeper.trust(5)
        for step in range(6, 40):  # the driver hears of a step 4 steps late and acknowledges it 8 late
            keeper.acknowledge(0, max(step - 9, -1))
            writer.write(0, step, fill(step), keep=(step - 5, *([10] if step > 10 else [])))
            assert 5 in keeper.steps() and (step < 10 or 10 in keeper.steps()), (step, keeper.steps())
        held = keeper.steps()
        assert held[:2] == [5, 10] and held[-1] == 39 and len(held) == 6, held  # and the acked, the streamed
        keeper.trust(10)  # the driver compared step 10's fingerprints: the replicas agree
        for step in range(40, 44):
            keeper.acknowledge(0, step - 9)
            writer.write(0, step, fill(step), keep=(step - 5,))
        assert 5 not in keeper.steps() and 10 in keeper.steps(), keeper.steps()
        assert np.all(keeper.read(10)["leaves"][0] == 10)
    finally:
        writer.close()
        keeper.close(unlink=True)


def _die_mid_write(path: str) -> None:
    writer = SlotSegment.open(path, LAYOUT)

    def hang(rows):
        rows[0][:4096] = 99  # half the block, then the process is killed
        os.kill(os.getpid(), signal.SIGKILL)

    writer.write(0, 5, hang)


def test_a_slot_its_process_died_writing_is_never_read(ring):
    keeper, writer = ring
    for step in range(4):
        writer.write(0, step, fill(step))
    proc = multiprocessing.get_context("spawn").Process(target=_die_mid_write, args=(keeper.path,))
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    assert keeper.steps() == [1, 2, 3]  # step 0's slot was being overwritten: gone; 5 never complete
    with pytest.raises(KeyError):
        keeper.read(5)
    assert np.all(keeper.read(3)["leaves"][0] == 3)


def test_a_sealed_ring_takes_no_more_writes_and_keeps_what_it_held(ring):
    keeper, writer = ring
    for step in range(4):
        writer.write(0, step, fill(step))
    keeper.seal(before_step=3)  # a new world runs step 3 again
    assert keeper.steps() == [0, 1, 2]
    assert writer.write(0, 4, fill(4)) is False and keeper.steps() == [0, 1, 2]
    keeper.drop(0)
    assert keeper.steps() == [1, 2]


def test_a_late_write_racing_the_seal_does_not_count(ring):
    """The writer passed its check before the seal: the slot it overwrote is no longer taken."""
    keeper, writer = ring
    for step in range(4):
        writer.write(0, step, fill(step))
    keeper.seal()
    writer.header[3] = 0  # as if the seal had landed after the writer looked
    writer.write(0, 4, fill(4))
    assert 4 not in keeper.steps() and len(keeper.steps()) == 3


def test_a_ring_of_another_layout_is_refused(ring):
    keeper, _ = ring
    other = SlotLayout.of([(8, 8)], ["float32"], [((0, 8), (0, 8))], ("['w']",))
    with pytest.raises(ValueError, match="not a snapshot segment of this layout"):
        SlotSegment.open(keeper.path, other)


def test_slots_fit_a_memory_budget():
    assert LAYOUT.slots() == 16  # a small state: as many as the ring takes
    big = SlotLayout.of([(1 << 28,)], ["float32"], [((0, 1 << 28),)], ("['w']",))  # 1 GiB per slot
    assert big.slots() == 4  # never fewer than four


def test_the_rings_of_a_keeper_that_was_killed_are_removed_by_the_next_one():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = os.path.join(shm_dir(), f"{PREFIX}{dead.pid}-test")
    live = os.path.join(shm_dir(), f"{PREFIX}{os.getpid()}-test")
    for path in (orphan, live):
        with open(path, "wb") as f:
            f.write(b"x")
    try:
        assert remove_orphans() >= 1
        assert not os.path.exists(orphan) and os.path.exists(live)
    finally:
        for path in (orphan, live):
            if os.path.exists(path):
                os.unlink(path)


PACK_ROUND_TRIP = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from ray_elastic.slice import snapshot_pack
from ray_elastic.state.snapshot_slots import unpack

mesh = Mesh(np.array(jax.devices()), ("fsdp",))
rng = np.random.default_rng(0)
values = [
    (rng.normal(size=(6, 3)).astype(np.float32), P("fsdp")),
    (rng.normal(size=(7,)).astype(jnp.bfloat16), P()),  # 14 bytes: padded inside a word
    (rng.normal(size=(3,)) > 0, P()),
    (rng.integers(-100, 100, size=(5,)).astype(np.int8), P()),
    (rng.integers(0, 60000, size=(4, 3)).astype(np.uint16), P("fsdp")),
    (np.array(7, np.int32), P()),
]
leaves = [jax.device_put(v, NamedSharding(mesh, s)) for v, s in values]
layout = snapshot_pack.layout(leaves, tuple(str(i) for i in range(len(leaves))))
rows = snapshot_pack.host_rows(snapshot_pack.packer(leaves)(leaves), layout)
for (want, _), got in zip(values, unpack(layout, rows)):
    assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want), (want, got)

# Replicated on both local devices (data parallel): only the first device's row is copied.
replicated = [jax.device_put(v, NamedSharding(mesh, P())) for v, _ in values]
layout = snapshot_pack.layout(replicated, tuple(str(i) for i in range(len(values))))
views = [np.zeros(layout.row_bytes, np.uint8) for _ in range(layout.rows)]
snapshot_pack.fill(snapshot_pack.packer(replicated)(replicated), layout, views)
assert layout.rows == 2 and layout.rows_read == {0} and not views[1].any()
for (want, _), got in zip(values, unpack(layout, views)):
    assert np.array_equal(got, want), (want, got)
print("round trip ok")
"""


def test_every_dtype_packs_and_unpacks_to_the_same_bytes():
    """The step packs each shard as 32-bit words: 1- and 2-byte dtypes (bool, int8, bfloat16,
    uint16) of odd sizes are padded inside a word, and unpacking gives back exactly the leaves;
    of a state replicated over the process's devices one row is copied, and it is enough."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    out = subprocess.run([sys.executable, "-c", PACK_ROUND_TRIP], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "round trip ok" in out.stdout, out.stderr[-3000:]
