"""The JAX side alone, in real multi-process JAX worlds (no Ray): the step a standby traces ahead of
a world computes what the world's own trace computes, and a snapshot block goes back only where it
came from."""

import json
import os
import subprocess
import sys

import psutil

NUM_PROCESSES, DEVICES, BATCH, STEPS = 2, 2, 48, 3


def _process(process_id: int, coordinator: str, cache_dir: str) -> None:
    """One process: trace ahead (before jax.distributed exists), join, then train the same steps
    from the same fresh state with the step traced ahead and with the world's own trace."""
    from ray_elastic.decide import plan_world
    from ray_elastic.examples.digits_mlp import DigitsMLPTask
    from ray_elastic.slice import compile_cache, jax_world
    from ray_elastic.slice import mesh as world_mesh
    from ray_elastic.slice.data import StepBatches

    task = DigitsMLPTask()
    plan = plan_world(0, [f"s{i}" for i in range(NUM_PROCESSES)], 1, DEVICES, BATCH)
    batches = StepBatches(task.dataset(), BATCH, 0)
    compile_cache.enable_compilation_cache(cache_dir)
    traced = jax_world.trace_ahead(task, plan, 0, 2**20, batches)
    world_mesh.initialize(coordinator, plan, process_id, 60)
    mesh = world_mesh.build_mesh(plan)
    out = {}
    for name, ahead in (("ahead", traced), ("own", None)):
        loop = jax_world.TrainLoop(task, plan, process_id, 0, mesh, 2**20, batches)
        times = loop.compile(0, ahead)
        out[name] = {
            "losses": [m["loss"] for m in loop.run(0, STEPS)],
            "traced_ahead": times["traced_ahead"],
            "trace_s": times["trace_s"],
        }
    port = int(coordinator.rsplit(":", 1)[1])
    out["listening_on"] = sorted(
        {
            c.laddr.ip.removeprefix("::ffff:")
            for c in psutil.net_connections("tcp")
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
        }
    )
    print("RESULT " + json.dumps(out), flush=True)


def test_the_step_traced_ahead_trains_like_the_worlds_own(tmp_path):
    # Process 0's port is held as SliceWorker.reserve_coordinator_port holds it: nobody else can take it.
    results = _run_world(["trace", str(tmp_path / "cache")])
    for r in results:
        assert r["ahead"]["traced_ahead"] and r["ahead"]["trace_s"] == 0.0
        assert not r["own"]["traced_ahead"] and r["own"]["trace_s"] > 0
        assert r["ahead"]["losses"] == r["own"]["losses"]  # bit for bit: the same program
        assert r["ahead"]["losses"][-1] < r["ahead"]["losses"][0]
    assert results[0]["ahead"]["losses"] == results[1]["ahead"]["losses"]
    # The coordination service (process 0) bound the held port, on the given address only
    # (gRPC may use an IPv6 socket for it: ::ffff:127.0.0.1; without the bind address it is ::).
    assert results[0]["listening_on"] == ["127.0.0.1"]


def _snapshot_process(process_id: int, coordinator: str) -> None:
    """A one-slice world of 2 processes: snapshot, restore into the same mesh (fine), then into a
    mesh whose fsdp axis puts the other process's devices first (refused, not placed by position)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from ray_elastic.decide import FSDP_AXIS, REPLICA_AXIS, plan_world
    from ray_elastic.examples.digits_mlp import DigitsMLPTask
    from ray_elastic.slice import jax_world, snapshot_pack
    from ray_elastic.slice import mesh as world_mesh
    from ray_elastic.slice.data import StepBatches
    from ray_elastic.state.snapshot_slots import unpack

    task = DigitsMLPTask()
    plan = plan_world(0, ["s0"], NUM_PROCESSES, DEVICES, BATCH)
    batches = StepBatches(task.dataset(), BATCH, 0)
    world_mesh.initialize(coordinator, plan, process_id, 60)
    mesh = world_mesh.build_mesh(plan)
    loop = jax_world.TrainLoop(task, plan, process_id, 0, mesh, 1024, batches)
    snap = loop.snapshot()
    same = jax_world.TrainLoop(task, plan, process_id, 0, mesh, 1024, batches, restore=snap)
    out = {
        "sharded": loop.sharded_params,
        "same_ok": all(np.array_equal(a, b) for a, b in zip(snap["leaves"], same.snapshot()["leaves"])),
    }
    swapped = Mesh(np.roll(mesh.devices, DEVICES, axis=1), (REPLICA_AXIS, FSDP_AXIS))
    try:
        jax_world.TrainLoop(task, plan, process_id, 0, swapped, 1024, batches, restore=snap)
        out["swapped"] = "placed"
    except ValueError as e:
        out["swapped"] = str(e)
    # The model's parameters renamed so that two same-shaped leaves swap places (what the snapshot
    # says its arrays were called differs from the model's): refused, as Orbax refuses a rename.
    renamed = dict(snap, paths=snap["paths"][:2][::-1] + snap["paths"][2:])
    try:
        jax_world.TrainLoop(task, plan, process_id, 0, mesh, 1024, batches, restore=renamed)
        out["renamed"] = "placed"
    except ValueError as e:
        out["renamed"] = str(e)
    # A snapshot copied on the device after step 0 is still step 0's state once step 1, dispatched
    # before the copy was read out, has donated (reused) the state's buffers.
    # It is packed (one byte buffer per device) and unpacked into the blocks a restore takes.
    fresh = lambda: jax_world.TrainLoop(task, plan, process_id, 0, mesh, 1024, batches)  # noqa: E731
    live = jax_world.TrainLoop(task, plan, process_id, 0, mesh, 1024, batches, pack=True)
    layout = snapshot_pack.layout(jax.tree.leaves(live.state), live.leaf_paths)
    live.dispatch(0)
    packed = live.packed  # the step packed its new state
    live.dispatch(1)
    live.finish(), live.finish()
    after_0 = fresh()
    after_0.run(0, 1, in_flight=0)
    rows = snapshot_pack.host_rows(packed, layout)
    want, got = after_0.snapshot(), {"leaves": unpack(layout, rows), "ranges": list(layout.ranges)}
    out["rows"] = layout.rows
    out["copy_ok"] = got["ranges"] == want["ranges"] and all(
        np.array_equal(a, b) for a, b in zip(got["leaves"], want["leaves"])
    )
    out["copy_differs_from_live"] = not all(
        np.array_equal(a, b) for a, b in zip(got["leaves"], live.snapshot()["leaves"])
    )
    # One step in flight computes what the blocking loop computes, bit for bit.
    out["pipelined"] = [m["loss"] for m in fresh().run(0, 4, in_flight=1)]
    out["blocking"] = [m["loss"] for m in fresh().run(0, 4, in_flight=0)]
    print("RESULT " + json.dumps(out), flush=True)


def _save_process(process_id: int, coordinator: str, directory: str) -> None:
    """Save two checkpoints, counting what the first one compiles (orbax's default replica-parallel
    write slices the replicated leaves with programs compiled on a process's first save); then see
    whether the syncs between hosts that orbax runs ~8 times per save (and in the background while
    the next steps train) queue behind a long computation on the devices. Its default sync, a
    device all-gather, does; the coordination service's does not."""
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    from ray_elastic.decide import plan_world
    from ray_elastic.examples.digits_mlp import DigitsMLPTask
    from ray_elastic.slice import jax_world
    from ray_elastic.slice import mesh as world_mesh
    from ray_elastic.slice.data import StepBatches
    from ray_elastic.state.checkpoints import Checkpointer

    task = DigitsMLPTask()
    plan = plan_world(0, ["s0"], NUM_PROCESSES, 1, BATCH)  # one device each: see the test
    batches = StepBatches(task.dataset(), BATCH, 0)
    world_mesh.initialize(coordinator, plan, process_id, 60)
    loop = jax_world.TrainLoop(
        task,
        plan,
        process_id,
        0,
        world_mesh.build_mesh(plan),
        1024,
        batches,
        checkpointer=Checkpointer(directory, max_to_keep=None),
    )
    loop.run(0, 1)
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _s, **_kw: (
            compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None
        )
    )
    loop.save_checkpoint(1, {"step": 1})
    compiled_by_save = len(compiles)
    loop.run(1, 1)
    loop.save_checkpoint(2, {"step": 2})
    loop.checkpointer.wait()
    slow = jax.jit(lambda x: jax.lax.fori_loop(0, 2000, lambda i, y: jnp.tanh(y @ y), x))
    xs = [jax.device_put(jnp.full((512, 512), 1 / 512, jnp.float32), d) for d in jax.local_devices()]
    jax.block_until_ready([slow(x) for x in xs])  # compiled
    busy = [slow(x) for x in xs]  # every device of the process busy
    ocp.multihost.sync_global_processes("while_busy")
    out = {
        "synced_while_busy": not any(b.is_ready() for b in busy),
        "compiled_by_save": compiled_by_save,
        "replicated_leaves": sum(x.sharding.is_fully_replicated for x in jax.tree.leaves(loop.state)),
    }
    jax.block_until_ready(busy)
    print("RESULT " + json.dumps(out), flush=True)


def test_a_checkpoint_save_compiles_nothing_and_its_syncs_do_not_queue_behind_device_work(tmp_path):
    from ray_elastic.state.checkpoints import latest_checkpoint

    # One device per process: with several CPU devices the all-gather does not reliably queue
    # behind work on them, so the old behaviour would only sometimes show.
    for r in _run_world(["save", str(tmp_path / "ckpt")], devices=1):
        assert r["synced_while_busy"]
        assert r["replicated_leaves"] > 0 and r["compiled_by_save"] == 0
    assert latest_checkpoint(str(tmp_path / "ckpt")).step == 2  # and saves commit with those syncs


def _run_world(args: list, timeout_s: float = 240, devices: int = DEVICES) -> list[dict]:
    """Run this file as NUM_PROCESSES processes of one JAX world on 127.0.0.1, each with ``devices``
    CPU devices; their RESULT lines."""
    from ray_elastic.slice.mesh import hold_port

    holder = hold_port("127.0.0.1")
    port = holder.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, args[0], str(p), f"127.0.0.1:{port}", *args[1:]],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for p in range(NUM_PROCESSES)
    ]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout_s)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]))
    finally:
        holder.close()
    return results


def test_a_snapshot_block_is_placed_by_its_index_not_its_position():
    for r in _run_world(["snapshot"]):
        assert r["sharded"] > 0 and r["same_ok"]
        assert "refusing to place it by position" in r["swapped"], r["swapped"]
        assert "named otherwise than the model" in r["renamed"], r["renamed"]
        assert r["copy_ok"] and r["copy_differs_from_live"]  # packed, unpacked: step 0's blocks
        assert r["rows"] == DEVICES  # one packed buffer per device
        assert r["pipelined"] == r["blocking"] and r["blocking"][-1] < r["blocking"][0]


if __name__ == "__main__":
    if sys.argv[1] == "snapshot":
        _snapshot_process(int(sys.argv[2]), sys.argv[3])
    elif sys.argv[1] == "save":
        _save_process(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    else:
        _process(int(sys.argv[2]), sys.argv[3], sys.argv[4])
