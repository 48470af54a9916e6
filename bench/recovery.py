"""Recovery on simulated slices, on every path: each victim position, each kind of loss, both modes.

For each mode, one long run on a 3-slice simulated cluster with a provisioner (a lost
slice's replacement arrives ``--arrival-delay`` seconds after it is asked for; in
replica-resize it comes back ``--regrow-delay`` seconds later and the world grows back).
Faults fire one at a time, each once the world is at full size again:

- every slice position (0 also hosts the JAX coordinator; with the default ``snapshot_replicas=3`` every
  slice of the 3 holds a snapshot),
- both kinds: ``node`` (the host lost: node removed, its processes SIGKILLed) and
  ``process`` (the JAX process SIGKILLed, its host alive),
- ``--repeats`` times each *warm* (fired once every host has a warm standby process), and
  ``--cold`` times each *cold* (fired at the first step of a new full-size world, while the
  standbys that replace the ones it used are still starting),
- plus ``cascade``: a second slice lost while the first recovery runs,
- and ``preempt``: the slice's hosts drained with a deadline ``--notice-s`` away (a preemption
  notice, ``SimulatedTPUCluster.preempt_slice``), killed at the deadline: the slice should leave at
  a step boundary (no failure, nothing rewound) and the kill change nothing. Per notice the bench
  prints the stall (the last step before the planned stop -> the first step after it), the
  notice's seconds left when the slice was out, and the failures counted at the kill.

A 2-host-slice variant (``--multihost``) loses one host of a slice per position. Per fault the
bench prints, for node losses, when Ray's node table marks the node dead (``node_dead_s``, its
health checks), then detection (kill, i.e. the simulated host's first SIGKILL, -> the controller sees the failure; the drain after it, collecting
what the survivors streamed and their keepers hold, is its own column) and kill -> first step
afterwards, with the controller's own phase split; then per kind and position the median and
worst, and the grow-back pauses. The last line is one JSON object:

    {"replica_resize_recovery_s": median kill -> step over all kills (warm and cold), "replica_resize_worst_s": ...,
     "replica_resize_warm_median_s": ..., "replica_resize_warm_worst_s": ..., "replica_resize_cold_median_s": ...,
     "detection_worst_s": ..., "node_dead_worst_s": ..., "cascade_recovery_s": ... (replica-resize: second loss -> step), "cascade_worst_s": ...,
     "pause_resume_cascade_s": ..., "pause_resume_cascade_after_arrival_s": ..., "grow_pause_s": median over
     every grow-back, "grow_pause_worst_s": ..., "grow_pause_multihost_s": median of the 2-host slices' grows,
     "pause_resume_recovery_after_arrival_s": ..., "replica_resize_tpu_model_median_s": ... (with the
     modelled TPU start-up), "replica_resize_tpu_model_worst_s": ..., "chips_wait_worst_s": ... (a new
     process waiting for its host's previous chip owner to exit), "steps_rewound_max": ...,
     "preempt_pause_s": ... (replica-resize: the leave's stop -> ready), "preempt_pause_worst_s": ...,
     "grow_ready_s": ... (a grow-back's stop -> ready; grow_pause_s and preempt_stall_s are step -> step),
     "preempt_stall_s": ... (median over notices), "preempt_stall_worst_s": ..., "preempt_failures": ... (failures
     counted from the notice to 3 s after the kill: 0), "preempt_seconds_left_min": ...}

    .venv/bin/python bench/recovery.py [--repeats 2] [--multihost 1] [--model mlp|llm]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import threading
import time

PHASES = (
    "node_dead_s",
    "detection_s",
    "drain_s",
    "classify_s",
    "teardown_s",
    "wait_for_capacity_s",
    "world_formation_s",
    "chips_wait_s",
    "jax_init_s",
    "state_load_s",
    "compile_s",
    "trace_s",
    "load_s",
    "first_step_s",
    "kill_to_step_s",
    "after_arrival_s",
)


# Opening a TPU host's chips and loading a step's executable, per new process (docs/tpu.md says
# where these figures come from and that they are a model, not a measurement).
TPU_STARTUP_S = (5.0, 3.0)


class _Done(Exception):
    """Every fault has fired and settled: stop the run."""


def faults_for(
    positions: list[int], kinds: list[str], repeats: int, cascades: int, cold: int = 0
) -> list[tuple[str, int, bool]]:
    """(kind, position, cold) in firing order. A warm fault waits until every host has a warm standby
    process; a cold one fires at the first step of a new full-size world (standbys still starting)."""
    plan = [(kind, pos, False) for _ in range(repeats) for kind in kinds for pos in positions]
    plan += [(kind, pos, True) for _ in range(cold) for kind in kinds for pos in positions]
    return plan + [("cascade", positions[-1], False)] * cascades


MODELS = ("mlp", "llm")


def model(name: str) -> tuple:
    """The task and its layout settings: the digits MLP, or the LLM example (annotated, 2 fsdp x 2 tensor
    slices, gradient accumulation)."""
    if name == "mlp":
        from ray_elastic.examples.digits_mlp import DigitsMLPTask

        return DigitsMLPTask(), {}
    from ray_elastic.examples.llm import LOGICAL_AXIS_RULES, DecoderLMTask

    return (
        DecoderLMTask(seq_len=32, d_model=64, num_layers=2, max_chars=100_000),
        {"slice_mesh": {"fsdp": -1, "tensor": 2}, "logical_axis_rules": LOGICAL_AXIS_RULES, "microbatch_size": 2},
    )


# A world_formed event's times, printed on the timeline: where a formation's seconds went.
FORMING_PHASES = (
    "start_actors_s",
    "chips_wait_s",
    "jax_init_s",
    "state_load_s",
    "compile_s",
    "total_s",
    "processes_starting",
)


def run_mode(
    cluster,
    mode: str,
    faults: list[tuple[str, int]],
    gap: int,
    gap_s: float,
    hosts: int,
    timeline: bool = False,
    settle_timeout_s: float = 180.0,
    snapshot_every="auto",
    model_name: str = "mlp",
    notice_s: float = 10.0,
    all_standbys: bool = False,
) -> dict:
    """One run that fires ``faults`` in order; returns per-fault rows, grow pauses and rewinds."""
    from ray_elastic import AutoInterval, ElasticConfig, ElasticTrainer
    from ray_elastic.errors import ElasticRuntimeError

    arrivals: list[float] = []  # wall time of every finished step
    fired: list[dict] = []
    todo = list(faults)
    box: dict = {"quiet_from": gap, "quiet_until": time.time() + gap_s}

    def kill(t, kind: str, pos: int, row: dict) -> None:
        name = t.world.plan.slice_names[pos]
        if kind == "preempt":
            row["deadline"] = cluster.preempt_slice(name, notice_s)
            return
        if kind == "process":
            os.kill(t.world.host_infos[pos * hosts]["pid"], signal.SIGKILL)
            return
        threading.Thread(
            target=watch_node_death, args=(cluster.slice_by_name(name).node_ids[hosts - 1], row), daemon=True
        ).start()

        def lose_node() -> None:  # the loss happens at the first SIGKILL, not when the bench asked for it
            row["asked_at"] = row["at"]
            row["at"] = cluster.kill_host(name, hosts - 1) if hosts > 1 else cluster.kill_slice(name)

        threading.Thread(target=lose_node, daemon=True).start()

    def on_step(m: dict) -> None:
        arrivals.append(m.get("finished_at", time.time()))  # steps arrive in batches: when each finished
        box["last_step"] = m["step"]
        t = box["t"]
        full = t.world is not None and t.world.plan.num_slices == 3
        quiet = m["step"] >= box["quiet_from"] and time.time() >= box["quiet_until"]
        if todo and todo[0][2]:  # cold: at the first step of a new full-size world
            settled = full and m["step"] >= box.get("cold_from", 0) and box.get("cold_world") != t.world
        else:
            settled = full and quiet and t.backend.warm(t.gens.members, every=all_standbys)
        # a warned slice may train on a few seconds before it leaves: nothing fires (or ends) before
        settled = settled and box.get("notices", 0) >= sum(1 for r in fired if r["kind"] == "preempt")
        if not todo:
            if settled:
                box["done_at"] = time.time()  # what the run does from here is the bench stopping it
                raise _Done()
            return
        if not settled:
            if todo and time.time() > box["quiet_until"] + settle_timeout_s:
                print(
                    f"  {mode}: not back at full size {settle_timeout_s:.0f}s after the last fault; "
                    f"{len(todo)} fault(s) not fired: {todo} (full size: {full}, quiet: {quiet})",
                    flush=True,
                )
                box["skipped"] = list(todo)
                box["done_at"] = time.time()
                raise _Done()
            return
        kind, pos, cold = todo.pop(0)
        row = {
            "kind": kind,
            "position": pos,
            "holder": pos < t.config.snapshot_replicas,
            "at": time.time(),
            "step": m["step"],
            "cold": cold,
        }
        box["cold_world"] = t.world  # a cold fault needs a newer world than this one
        fired.append(row)
        kill(t, "node" if kind == "cascade" else kind, pos, row)
        if kind == "cascade":
            box["cascade"] = row
        box["quiet_from"], box["quiet_until"] = m["step"] + gap, time.time() + gap_s

    def on_event(e: dict) -> None:
        row = box.pop("cascade", None)
        if row is not None and e["kind"] == "failure":  # the first recovery is under way: lose another slice
            victim = next(n for n in box["t"].gens.members[0:1] if n.slice_name)
            row["second_at"] = time.time() + 0.3  # until the kill says when its first SIGKILL went out

            def second_loss() -> None:
                time.sleep(0.3)
                row["second_at"] = cluster.kill_slice(victim.slice_name)

            threading.Thread(target=second_loss, daemon=True).start()
        elif row is not None:
            box["cascade"] = row
        if e["kind"] == "preemption_notice":
            box["notices"] = box.get("notices", 0) + 1
        if e["kind"] in ("recovered", "scale_up", "slice_left"):
            box["cold_from"] = box.get("last_step", 0) + 1
            box["quiet_from"] = max(box["quiet_from"], box.get("last_step", 0) + gap)
            box["quiet_until"] = max(box["quiet_until"], time.time() + gap_s)

    task, layout = model(model_name)
    cfg = ElasticConfig(
        num_slices=3,
        global_batch_size=48,
        slice=cluster.slice_spec,
        steps_per_chunk=10,
        mode=mode,
        min_slices=1,  # a snapshot after every step by default: any rewind is a bug then
        snapshot_every=AutoInterval() if snapshot_every == "auto" else int(snapshot_every),
        **layout,
    )
    trainer = ElasticTrainer(task, cfg, progress=False, on_step=on_step, on_event=on_event)
    box["t"] = trainer
    try:
        trainer.fit(100_000)
    except ElasticRuntimeError as e:
        if not isinstance(e.__cause__, _Done):
            raise
    events = trainer.events.events
    recs = trainer.recoveries
    rows = []
    for row in fired:
        if row["kind"] == "preempt":
            continue  # a planned exit, not a recovery: preempt_rows
        t_kill = row.get("second_at", row["at"])
        after = [r for r in recs if r.ready_at > t_kill]
        if not after:
            continue
        rec = after[0]
        first = min(a for a in arrivals if a > rec.ready_at)
        detected = [
            (e.seen_at, e.get("drain_s", float("nan")))
            for e in events
            if e["kind"] == "failure" and e["ts"] > row["at"]
        ]
        rows.append(
            {
                **row,
                **{
                    k: getattr(rec, k)
                    for k in (
                        "classify_s",
                        "teardown_s",
                        "wait_for_capacity_s",
                        "world_formation_s",
                        "state_load_s",
                        "compile_s",
                        "steps_rewound",
                    )
                },
                **{
                    k: trainer.worlds[rec.generation].times[k]
                    for k in ("chips_wait_s", "jax_init_s", "trace_s", "load_s", "processes_starting")
                },
                "node_dead_s": row.get("node_dead_s", float("nan")),
                "detection_s": detected[0][0] - row["at"] if detected else float("nan"),
                "drain_s": detected[0][1] if detected else float("nan"),
                "first_step_s": first - rec.ready_at,
                "kill_to_step_s": first - t_kill,
                "after_arrival_s": first - rec.capacity_ready_at,
                "slices_after": rec.slices,
            }
        )
    pauses, ready = [], []  # step -> step, and stop -> next world ready (the event's pause_s)
    for e in events:
        if e["kind"] == "scale_up":
            ready.append(e["pause_s"])
            stopped = e["ts"] - e["resize_s"]
            before = [a for a in arrivals if a <= stopped]
            after = [a for a in arrivals if a > e["ts"]]
            if before and after:
                pauses.append(after[0] - before[-1])
    if timeline:  # the controller's events around each fault, in seconds after the kill
        for row in fired:
            t_kill = row.get("second_at", row["at"])
            late = (
                f" (first SIGKILL {row['at'] - row['asked_at']:.3f} s after it was asked for)"
                if "asked_at" in row
                else ""
            )
            print(f"--- {row['kind']} {row['position']}{late}")
            for e in events:
                if t_kill - 0.1 < e["ts"] < t_kill + 12 and e["kind"] not in ("steps",):
                    keys = ("lost_slices", "restore_source", "steps_rewound", "reason", "teardown_s", "pause_s")
                    keys += FORMING_PHASES if e["kind"] == "world_formed" else ()
                    detail = {k: round(e[k], 3) if isinstance(e[k], float) else e[k] for k in keys if k in e}
                    print(f"   {e['ts'] - t_kill:7.3f} {e['kind']} {detail}")
        formed = [e for e in events if e["kind"] == "world_formed"]
        for e in events:  # and each grow-back's formation, to compare with a leave's
            if e["kind"] == "scale_up":
                world = max((f for f in formed if f["ts"] <= e["ts"]), key=lambda f: f["ts"], default={})
                print(
                    f"--- grow-back: pause {e['pause_s']:.3f} s; "
                    + ", ".join(f"{k}={world.get(k)}" for k in FORMING_PHASES)
                )
    preempts = preempt_rows(
        [r for r in fired if r["kind"] == "preempt"], events, arrivals, box.get("done_at", float("inf"))
    )
    return {
        "rows": rows,
        "grow_pauses": pauses,
        "grow_ready": ready,
        "preempts": preempts,
        "skipped": box.get("skipped", []),
    }


def preempt_rows(fired: list[dict], events: list, arrivals: list[float], done_at: float) -> list[dict]:
    """Per preemption notice: the stall (the last step before the planned stop -> the first step of
    the next world), the notice's seconds left when the slice was out, the steps rewound, and the
    failures counted from the notice to 3 s after the kill at its deadline (0: the kill changed nothing)."""
    out = []
    for row in fired:
        left = next((e for e in events if e["kind"] == "slice_left" and e["ts"] > row["at"]), None)
        notice = next((e for e in events if e["kind"] == "preemption_notice" and e["ts"] > row["at"]), None)
        if left is None or notice is None:
            out.append(
                {
                    **row,
                    "stall_s": float("nan"),
                    "pause_s": None,
                    "seconds_left": None,
                    "rewound": None,
                    "failures": None,
                }
            )
            continue
        last_step = left["ready_at"] - left["pause_s"]
        before = [a for a in arrivals if a <= last_step + 1e-3]
        after = [a for a in arrivals if a > left["ready_at"]]
        # A kill that counted would be seen within a second of it (detection_worst_s); later ones are
        # the next fault's, or the bench ending the run.
        failures = [
            e for e in events if e["kind"] == "failure" and row["at"] < e["ts"] < min(row["deadline"] + 3, done_at)
        ]
        out.append(
            {
                **row,
                "stall_s": after[0] - before[-1] if before and after else float("nan"),
                "pause_s": left["pause_s"],  # stop -> next world ready (as a grow-back's stop -> ready)
                "seconds_left": notice["seconds_left"],
                "rewound": left["steps_rewound"],
                "failures": len(failures),
                "failure_errors": [
                    f"{e['ts'] - row['deadline']:+.1f}s {e['cause']}: {e['error'][:160]}" for e in failures
                ],
            }
        )
    return out


def watch_node_death(node_id: str, row: dict, timeout_s: float = 30.0) -> None:
    """``row["node_dead_s"]``: seconds from the kill until Ray's node table marks the node dead (the GCS's
    health checks), beside the controller's own detection: a late detection is Ray's, or ours."""
    import ray

    while time.time() < row["at"] + timeout_s:
        if not any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
            row["node_dead_s"] = time.time() - row["at"]
            return
        time.sleep(0.05)


def report(title: str, out: dict) -> None:
    rows = out["rows"]
    print(f"\n{title}: {len(rows)} faults")
    # starting: processes the new world took before they had started (Python, JAX, data)
    print(
        f"  {'kind':>8} {'pos':>3} {'holder':>6} {'cold':>5} {'starting':>8} "
        + " ".join(f"{p[:-2]:>11}" for p in PHASES)
    )
    for r in rows:
        print(
            f"  {r['kind']:>8} {r['position']:>3} {r['holder']!s:>6} {r['cold']!s:>5} "
            f"{r['processes_starting']:>8} " + " ".join(f"{r[p]:>11.3f}" for p in PHASES)
        )
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["kind"], r["position"], r["cold"]), []).append(r["kill_to_step_s"])
    for (kind, pos, cold), v in sorted(groups.items()):
        print(
            f"  kill->step {kind:>8} position {pos} {'cold' if cold else 'warm'}: median {statistics.median(v):.3f}s"
            f"  worst {max(v):.3f}s"
        )
    if out["grow_pauses"]:
        p = out["grow_pauses"]
        r = out.get("grow_ready") or [float("nan")]
        print(
            f"  grow-back pause: median {statistics.median(p):.3f}s  worst {max(p):.3f}s  ({len(p)} grows; "
            f"stop -> ready: median {statistics.median(r):.3f}s  worst {max(r):.3f}s)"
        )
    for r in out.get("preempts", []):
        print(
            f"  preempt position {r['position']} {'cold' if r['cold'] else 'warm'}: stall {r['stall_s']:.3f}s "
            f"(pause {r['pause_s'] if r['pause_s'] is None else round(r['pause_s'], 3)}s), "
            f"{r['seconds_left']}s of the notice left, {r['rewound']} rewound, {r['failures']} failures counted"
            + "".join(f"\n    failure (from the deadline) {f}" for f in r.get("failure_errors", []))
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2, help="kills per kind and position")
    ap.add_argument(
        "--model",
        choices=MODELS,
        default="mlp",
        help="mlp: the digits MLP on slices of 2 devices; llm: the LLM example on slices of 4 (2 fsdp x "
        "2 tensor), annotated, with gradient accumulation",
    )
    ap.add_argument("--positions", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--kinds", nargs="+", default=["node", "process", "preempt"])
    ap.add_argument("--notice-s", type=float, default=10.0, help="preempt: seconds from the notice to the kill")
    ap.add_argument(
        "--cold",
        type=int,
        default=1,
        help="kills per kind and position fired at the first step of a new world (standbys still starting)",
    )
    ap.add_argument("--cascades", type=int, default=2, help="faults during a recovery, per mode")
    ap.add_argument("--modes", nargs="*", default=["replica-resize", "pause-and-resume"])
    ap.add_argument(
        "--settle-timeout",
        type=float,
        default=180.0,
        help="seconds to wait for the world to be back at full size before giving up on the rest",
    )
    ap.add_argument("--timeline", action="store_true", help="print the events around each fault")
    ap.add_argument(
        "--all-standbys",
        action="store_true",
        help="a warm fault waits until every standby process has started, not only the next one per host "
        "(none still starting beside the recovery, as before a grow-back)",
    )
    ap.add_argument("--multihost", type=int, default=1, help="also run the 2-host-slice variant (replica-resize)")
    ap.add_argument("--gap", type=int, default=10, help="steps at full size between faults")
    ap.add_argument(
        "--gap-s",
        type=float,
        default=5.0,
        help="seconds of training between faults (standby processes warm up; cascades measure the cold case)",
    )
    ap.add_argument(
        "--arrival-delay", type=float, default=1.0, help="pause-and-resume: seconds until a replacement slice arrives"
    )
    ap.add_argument(
        "--regrow-delay",
        type=float,
        default=8.0,
        help="replica-resize: seconds until a lost slice comes back (after the recovery being measured)",
    )
    ap.add_argument(
        "--snapshot-every",
        default="auto",
        help='snapshot interval ("auto": the default users get, which keeps every step where a copy '
        "fits its budget; an integer to force one)",
    )
    ap.add_argument(
        "--tpu-startup",
        type=float,
        nargs=2,
        default=list(TPU_STARTUP_S),
        metavar=("OPEN_S", "LOAD_S"),
        help="the modelled TPU start-up (opening the chips, loading the executable) of the replica-resize "
        "pass run with it (once per position and kind, warm); 0 0 skips that pass",
    )
    args = ap.parse_args()

    from machine import cpu_probe_s, hour

    from ray_elastic.sim.cluster import SimulatedTPUCluster
    from ray_elastic.sim.tpu_runtime import StartupCost, set_startup_cost
    from ray_elastic.sim.tpu_runtime import breaches as tpu_breaches

    def run(cluster, mode: str, faults: list, hosts: int = 1) -> dict:
        return run_mode(
            cluster,
            mode,
            faults,
            args.gap,
            args.gap_s,
            hosts=hosts,
            timeline=args.timeline,
            settle_timeout_s=args.settle_timeout,
            snapshot_every=args.snapshot_every,
            model_name=args.model,
            notice_s=args.notice_s,
            all_standbys=args.all_standbys,
        )

    probes = [cpu_probe_s()]
    results: dict = {}
    breaches = 0  # processes that broke a rule of the TPU runtime (sim/tpu_runtime.py): must be 0
    faults = faults_for(args.positions, args.kinds, args.repeats, args.cascades, args.cold)
    devices = 4 if args.model == "llm" else 2
    with SimulatedTPUCluster(num_slices=3, devices_per_host=devices, log_to_driver=False) as cluster:
        for mode in args.modes:
            prov = cluster.provisioner(delay_s=args.regrow_delay if mode == "replica-resize" else args.arrival_delay)
            results[mode] = run(cluster, mode, faults)
            prov.stop()
            report(mode, results[mode])
            cluster.reap_dead_slices()
        cost = StartupCost(*args.tpu_startup)
        if cost.total_s > 0 and "replica-resize" in args.modes:
            set_startup_cost(cost)  # every backend opened from here on waits it (sim/tpu_runtime.py)
            prov = cluster.provisioner(delay_s=args.regrow_delay)
            results["tpu_model"] = run(cluster, "replica-resize", faults_for(args.positions, args.kinds, 1, 0, 0))
            prov.stop()
            set_startup_cost(StartupCost())
            report(
                f"replica-resize with a modelled TPU start-up of {cost.total_s:.1f}s per process", results["tpu_model"]
            )
        breaches += len(tpu_breaches())
    if args.multihost:
        with SimulatedTPUCluster(
            num_slices=3, hosts_per_slice=2, devices_per_host=devices, log_to_driver=False
        ) as cluster:
            prov = cluster.provisioner(delay_s=args.regrow_delay)
            results["multihost"] = run(cluster, "replica-resize", faults_for(args.positions, ["node"], 1, 0), hosts=2)
            prov.stop()
            report("replica-resize, 2-host slices (one host lost)", results["multihost"])
            breaches += len(tpu_breaches())

    def rows(mode, kinds=("node", "process")):
        return [r for r in results.get(mode, {"rows": []})["rows"] if r["kind"] in kinds]

    rr_rows = rows("replica-resize") + rows("multihost")
    rr = [r["kill_to_step_s"] for r in rr_rows]
    warm = [r["kill_to_step_s"] for r in rr_rows if not r["cold"]]
    cold = [r["kill_to_step_s"] for r in rr_rows if r["cold"]]
    cascade = [r["kill_to_step_s"] for r in rows("replica-resize", ("cascade",))]
    pr_cascade = rows("pause-and-resume", ("cascade",))
    pauses = [p for out in results.values() for p in out["grow_pauses"]]
    tpu = [r["kill_to_step_s"] for r in rows("tpu_model")]
    everything = [r for out in results.values() for r in out["rows"]]
    dead = [r["node_dead_s"] for r in everything if r["node_dead_s"] == r["node_dead_s"]]  # not NaN
    preempts = [r for out in results.values() for r in out.get("preempts", [])]
    stalls = [r["stall_s"] for r in preempts if r["stall_s"] == r["stall_s"]]
    leaves = [r["pause_s"] for r in results.get("replica-resize", {}).get("preempts", []) if r["pause_s"] is not None]
    ready = results.get("replica-resize", {}).get("grow_ready", [])
    summary = {
        "replica_resize_recovery_s": round(statistics.median(rr), 3) if rr else None,
        "replica_resize_worst_s": round(max(rr), 3) if rr else None,
        "replica_resize_warm_median_s": round(statistics.median(warm), 3) if warm else None,
        "replica_resize_warm_worst_s": round(max(warm), 3) if warm else None,
        "replica_resize_cold_median_s": round(statistics.median(cold), 3) if cold else None,
        "detection_worst_s": round(max(r["detection_s"] for r in everything), 3) if everything else None,
        # kill -> Ray's node table says the node is dead (node losses): Ray's share of a late detection
        "node_dead_worst_s": round(max(dead), 3) if dead else None,
        # second loss -> first step; in pause-and-resume also from the second replacement's arrival
        "cascade_recovery_s": round(statistics.median(cascade), 3) if cascade else None,
        "cascade_worst_s": round(max(cascade), 3) if cascade else None,
        "pause_resume_cascade_s": round(statistics.median(r["kill_to_step_s"] for r in pr_cascade), 3)
        if pr_cascade
        else None,
        "pause_resume_cascade_after_arrival_s": round(statistics.median(r["after_arrival_s"] for r in pr_cascade), 3)
        if pr_cascade
        else None,
        "grow_pause_s": round(statistics.median(pauses), 3) if pauses else None,
        "grow_pause_worst_s": round(max(pauses), 3) if pauses else None,
        "grow_pause_multihost_s": round(statistics.median(results["multihost"]["grow_pauses"]), 3)
        if results.get("multihost", {}).get("grow_pauses")
        else None,
        "pause_resume_recovery_after_arrival_s": round(
            statistics.median(r["after_arrival_s"] for r in rows("pause-and-resume")), 3
        )
        if rows("pause-and-resume")
        else None,
        # the same recoveries with the modelled TPU start-up (opening the chips, loading the executable)
        "tpu_startup_s": sum(args.tpu_startup),
        "replica_resize_tpu_model_median_s": round(statistics.median(tpu), 3) if tpu else None,
        "replica_resize_tpu_model_worst_s": round(max(tpu), 3) if tpu else None,
        "chips_wait_worst_s": round(max((r["chips_wait_s"] for r in everything), default=0.0), 3),
        "steps_rewound_max": max((r["steps_rewound"] for r in everything), default=0),
        # replica-resize, stop -> next world ready: the warned slice's leave against a grow-back's
        "preempt_pause_s": round(statistics.median(leaves), 3) if leaves else None,
        "preempt_pause_worst_s": round(max(leaves), 3) if leaves else None,
        "grow_ready_s": round(statistics.median(ready), 3) if ready else None,
        "preempt_stall_s": round(statistics.median(stalls), 3) if stalls else None,
        "preempt_stall_worst_s": round(max(stalls), 3) if stalls else None,
        "preempt_failures": sum(r["failures"] or 0 for r in preempts),
        "preempt_rewound_max": max((r["rewound"] or 0 for r in preempts), default=0),
        "preempt_seconds_left_min": min(
            (r["seconds_left"] for r in preempts if r["seconds_left"] is not None), default=None
        ),
        "preempts_unseen": sum(1 for r in preempts if r["seconds_left"] is None),
        "faults": len(everything) + len(preempts),
        "tpu_breaches": breaches,
        "faults_not_fired": sum(len(out["skipped"]) for out in results.values()),
        "snapshot_every": args.snapshot_every,
        "cpu_probe_s": probes + [cpu_probe_s()],  # this hour's speed (bench/machine.py)
    }
    print(f"machine: {hour(summary['cpu_probe_s'])}", flush=True)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
