"""Chaos soak: one long run with faults of every kind at random moments, losses against the failure-free run.

Phase 1: 4 simulated slices (``min_slices`` 2), replica-resize, a provisioner that replaces every lost
slice, checkpoints every ``--checkpoint-every`` steps. ``--faults N`` faults fire at random steps
(or, with ``--every-s S``, one every S seconds of wall time), each of a random kind:

- ``process_kill``: a slice's JAX process SIGKILLed, its host alive;
- ``node_loss``: a slice's host lost (node removed, its processes SIGKILLed);
- ``host_hang``: a slice's host stopped (SIGSTOP of every process of the node);
- ``two_at_once``: two slices lost at the same moment;
- ``during_recovery``: a slice lost, and another 0.3 s after the controller saw the first;
- ``while_forming``: a process killed, and a slice lost while the next world forms;
- ``dies_on_arrival``: a slice lost, and its replacement lost as soon as it arrives;
- ``during_save``: a process killed right after a checkpoint save started;
- ``during_grow``: a slice lost, and at the next grow-back a process of the world killed as the
  controller enters ``resizing``, before the in-flight save commits (resizing -> recovering);
- faults that kill nothing: ``preempt`` (a slice's hosts drained with a 5 s notice, killed at the
  deadline: it should leave with no failure), ``slow_data`` (a slice's rows read 30 ms each),
  ``slow_host`` (a slice's processes running a fifth of the time, SIGSTOP/SIGCONT: a slow chip or
  a noisy neighbour) and ``stuck_data`` (a slice's data source blocked until the failure that names
  it). Each straggler and stuck process must be attributed to the right slice (``misattributed``:
  0); ``steps_to_named`` is how many steps the run made between the fault and the naming (a slowed
  slice lost to another fault first is ``moot``, not counted);
- wrong numbers: ``poisoned_record`` (a record that a step some 30 steps on reads, and no step
  before it, becomes inf until that step is reported, replays included: the step must be skipped,
  ``poison_kept``: 0, ``bad_kept``: 0) and ``bit_flip`` (one bit of one slice's replica of
  the state flipped: found by the replicas' fingerprints, every 10 steps here, for that slice;
  ``flips_not_found``, ``flips_misnamed``: 0; ``flips_found_after``: steps from the step the bit
  flipped before to the step whose fingerprints disagreed; ``flips_missed``: flips whose world
  stopped before they landed, so nothing flipped).

Phase 2 (``--multihost-faults M``): 3 slices of 2 hosts (``min_slices`` 2), each fault one host of a
slice lost.

Each phase is compared, step by step, with the failure-free run of the same length at full size
(differences relative to the loss, or to ``LOSS_FLOOR`` once the loss falls below it).
Float32 rounding makes any change of world size drift the losses a little (the drift grows with
the steps after it), so the failure-free run is also made at ``min_slices``: its distance from the
full-size run is the noise floor, ``world_size_noise``. Steps trained before the world first
changed shape (or skipped a batch, or had a bit flipped) must match exactly
(``same_shape_max_diff``). ``--no-noise`` skips the run at ``min_slices`` (both noise figures
null): a quick check of recovery alone. Last line, one JSON object:

    {"faults": N, "planned": ..., "unrecovered": ..., "steps_rewound": ..., "unexplained_rewound": ...,
     "max_rel_loss_diff": ...,
     "world_size_noise": ..., "loss_diff_over_noise": ..., "same_shape_max_diff": ..., "uncommitted_restored": ...,
     "final_checkpoint_committed": ..., "goodput": ..., "goodput_breakdown": {seconds per category},
     "by_kind": {...}, "attributed": ..., "misattributed": ..., "not_named": ..., "moot": ...,
     "steps_to_named": {kind: {"median", "worst", "n"}}, "steps_to_out": {kind: {...}} (to the first step
     of a world without the named slice), "steps_to_pace": {"slow_host": {...}}, "steps_to_pace_after_out":
     {"slow_host": {...}} (from that first step), "steps_to_throughput": {"slow_host": {...}},
     "recovery_worst_s": ..., "slowest_formation": {its phases' seconds, "faults_before": [...]}}

    .venv/bin/python bench/chaos.py [--faults 100] [--every-s 30 --steps 3000] [--multihost-faults 10] [--run-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time

KINDS = (
    "process_kill",
    "node_loss",
    "host_hang",
    "two_at_once",
    "during_recovery",
    "while_forming",
    "dies_on_arrival",
    "during_save",
    "during_grow",
    "preempt",
    "slow_data",
    "slow_host",
    "stuck_data",
    "poisoned_record",
    "bit_flip",
)
POISON_AHEAD = 30  # a poisoned record's step: this many steps on or more (more than two chunks ahead)
GBS, SEED = 48, 0  # 48 splits evenly over 2, 3 and 4 slices of 2 devices (and 2 or 3 slices of 4)


def chaos_task(marker_dir: str):
    """The digits MLP whose rows a fault can slow or block on one slice: a file ``slow_data-<slice>``
    in ``marker_dir`` makes each of that slice's rows take its seconds; ``stuck_data-<slice>``
    blocks them while it exists (the slice is the host's ``TPU_NAME``); ``poison-<i>`` makes
    record ``i`` infinite while it exists."""
    import dataclasses

    from ray_elastic.examples.digits_mlp import DigitsMLPTask

    @dataclasses.dataclass
    class ChaosTask(DigitsMLPTask):
        marker_dir: str = ""

        def dataset(self):
            where = self.marker_dir

            class Rows(list):
                def __getitem__(self, i):
                    me = os.environ.get("TPU_NAME", "")
                    slow = os.path.join(where, f"slow_data-{me}")
                    if os.path.exists(slow):
                        time.sleep(0.03)
                    while os.path.exists(os.path.join(where, f"stuck_data-{me}")):
                        time.sleep(0.05)
                    row = list.__getitem__(self, i)
                    if os.path.exists(os.path.join(where, f"poison-{i}")):
                        return dict(row, x=row["x"] * float("inf"))
                    return row

            return Rows(super().dataset())

    return ChaosTask(marker_dir=marker_dir)


class Chaos:
    """Fires faults into a running trainer on the simulated cluster; every fault is real (signals, node removal)."""

    def __init__(self, cluster, rng: random.Random, hosts: int):
        self.cluster, self.rng, self.hosts = cluster, rng, hosts
        self.trainer = None
        self.fired: list[dict] = []
        self._after_failure = None  # a second fault waiting for the controller to see the first
        self._kills_on_resize = 0  # during_grow faults waiting for the next grow-back
        self.marker_dir = tempfile.mkdtemp(prefix="chaos-data-")  # ChaosTask's slow and stuck rows
        self.culprits: dict[str, dict] = {}  # slice -> the fault that should be named for it
        self.attributed = self.misattributed = self.moot = 0
        self.last_step = -1  # the newest step the run reported
        self.poisoned: dict[int, str] = {}  # step -> the marker of the record made inf that it reads
        self.poison_reported: set[int] = set()  # ... those steps reported (a step past the run's end never is)
        self.poison_skipped: set[int] = set()  # ... and reported skipped (each must be)
        self._batches = None  # the run's data order, to find a record only a coming step reads
        self.flips: dict[str, dict] = {}  # slice -> its bit_flip fault, until a replica_mismatch names it
        self.flips_found: list[int] = []  # steps from a flip to the replica_mismatch that named it
        self.flips_misnamed = self.flips_missed = self.mismatches = 0
        self.steps_to_named: dict[str, list[int]] = {}  # fault kind -> steps between the fault and its naming
        self.steps_to_out: dict[str, list[int]] = {}  # ... and the first step of a world without its slice
        self._leaving: list[dict] = []  # faults named whose slice is still in the world
        self.finished_at: dict[int, float] = {}  # step -> when it finished (the newest run of it)

    # ----------------------------------------------------------------- victims
    def _names(self) -> list[str]:
        return list(self.trainer.world.plan.slice_names)

    def _pick(self, k: int = 1, exclude=()) -> list[str]:
        names = [n for n in self._names() if n not in exclude]
        return self.rng.sample(names, min(k, len(names)))

    def _pid(self, name: str) -> int:
        world = self.trainer.world
        return world.host_infos[world.plan.slice_names.index(name) * world.plan.hosts_per_slice]["pid"]

    def _lose(self, name: str, delay: float = 0.0) -> None:
        def go():
            time.sleep(delay)
            try:
                if self.hosts > 1:
                    self.cluster.kill_host(name, self.rng.randrange(self.hosts))
                else:
                    self.cluster.kill_slice(name)
            except KeyError:  # already gone
                pass

        threading.Thread(target=go, daemon=True).start()

    def _kill_process(self, name: str) -> None:
        try:
            os.kill(self._pid(name), signal.SIGKILL)
        except ProcessLookupError:
            pass

    # ------------------------------------------------------------------ faults
    def fire(self, kind: str, step: int) -> None:
        self.fired.append({"kind": kind, "step": step, "at": time.time()})
        print(f"  fault {len(self.fired)}: {kind} after step {step}", flush=True)
        t = self.trainer
        if kind == "process_kill" or kind == "during_save":
            self._kill_process(self._pick()[0])
        elif kind in ("node_loss", "one_host"):
            self._lose(self._pick()[0])
        elif kind == "host_hang":
            self.cluster.hang_slice(self._pick()[0])
        elif kind == "two_at_once":
            for name in self._pick(2):
                self._lose(name)
        elif kind == "during_recovery":
            first = self._pick()[0]
            self._after_failure = lambda: self._lose(self._pick(1, exclude=[first])[0], delay=0.3)
            self._lose(first)
        elif kind == "while_forming":
            first = self._pick()[0]
            threading.Thread(target=self._lose_while_forming, args=(t, first), daemon=True).start()
            self._kill_process(first)
        elif kind == "during_grow":  # a slice lost; at the next grow-back, a process of the world killed
            # as the controller enters ``resizing``, before the in-flight save commits (resizing -> recovering)
            self._kills_on_resize += 1
            self._lose(self._pick()[0])
        elif kind == "preempt":
            self.cluster.preempt_slice(self._pick()[0], notice_s=5.0)
        elif kind in ("slow_data", "stuck_data", "slow_host"):  # on a slice no earlier fault slows
            free = self._pick(exclude=self.culprits)
            if free:
                self._slow(kind, free[0])
            else:
                print("    skipped: every slice is slowed already", flush=True)
        elif kind == "poisoned_record":  # a record that becomes inf: its step must be skipped, not kept
            target, record = self._poison_target(step)
            self.poisoned[target] = os.path.join(self.marker_dir, f"poison-{record}")
            self.fired[-1]["target"] = target
            open(self.poisoned[target], "w").close()
        elif kind == "bit_flip":  # one bit of one slice's replica: found within integrity_every steps
            victim = self._pick()[0]
            self.fired[-1]["victim"] = victim
            self.flips[victim] = self.fired[-1]
            threading.Thread(target=self._flip, args=(t.world, victim), daemon=True).start()
        elif kind == "dies_on_arrival":
            known = {s.name for s in self.cluster.slices}
            threading.Thread(target=self._lose_on_arrival, args=(known,), daemon=True).start()
            self._lose(self._pick()[0])
        else:
            raise ValueError(f"unknown fault kind {kind!r}")

    def _flip(self, world, victim: str) -> None:
        """The flip lands before the victim's next step, unless its world stops first (then nothing
        flipped, and nothing is to be found)."""
        try:
            step = self.cluster.flip_bit(world, victim)
        except Exception as e:  # noqa: BLE001 - the world changed under it
            step = None
            print(f"    flip failed: {e!r}"[:200], flush=True)
        if victim in self.flips and step is not None:
            self.flips[victim]["landed"] = step  # the step it flipped before
        if step is None:
            print(f"    flip of {victim} missed: its world stopped first", flush=True)
            self.flips.pop(victim, None)
            self.flips_missed += 1

    def _slow(self, kind: str, name: str) -> None:
        """A slice that should be named (a straggler, a stuck process) until it is."""
        fault = self.fired[-1]
        fault["victim"] = name
        self.culprits[name] = fault
        if kind == "slow_host":
            fault["stop"] = self.cluster.slow_slice(name, 5.0)
            return
        marker = os.path.join(self.marker_dir, f"{kind}-{name}")
        with open(marker, "w") as f:
            f.write("0.03" if kind == "slow_data" else "")
        fault["marker"] = marker

    def _named(self, name: str, how: str, evidence=None, leaves: bool = False) -> None:
        """The controller named ``name`` (a straggler, a stuck process): right if a fault made it so.
        A wrong naming is printed with its evidence and how old the world was (in steps)."""
        fault = self.culprits.pop(name, None)
        if fault is None:
            self.misattributed += 1
            world = self.trainer.worlds[-1] if self.trainer.worlds else None
            age = self.last_step - world.start_step + 1 if world is not None else None
            print(f"    MISATTRIBUTED: {name} named {how}, no fault made it so", flush=True)
            print(f"      {age} steps into its world ({world and world.slices}): {evidence}", flush=True)
            return
        self.attributed += 1
        self.steps_to_named.setdefault(fault["kind"], []).append(self.last_step - fault["step"])
        if leaves:
            fault["named"] = name
            self._leaving.append(fault)
        self._undo(fault)

    @staticmethod
    def _undo(fault: dict) -> None:
        if "marker" in fault and os.path.exists(fault["marker"]):
            os.unlink(fault["marker"])
        if "stop" in fault:
            fault["stop"].set()

    def end(self) -> None:
        """The run is over: every slowed slice runs at full speed again."""
        for fault in self.culprits.values():
            self._undo(fault)

    def _lose_while_forming(self, t, spare: str, timeout_s: float = 60.0) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline and t.state.value != "forming_world":
            time.sleep(0.005)
        members = [r.slice_name for r in t.gens.members if r.slice_name and r.slice_name != spare]
        if members and t.state.value == "forming_world":
            self._lose(self.rng.choice(members))

    def on_state(self, old, new) -> None:
        """The controller's transitions (called synchronously by it): a ``during_grow`` kill lands
        while the world it is about to stop is still committing its save."""
        if new.value == "resizing" and self._kills_on_resize and self.trainer.world is not None:
            self._kills_on_resize -= 1
            victim = self.rng.choice(self._names())
            print(f"    killed a process of {victim} as the world grows back", flush=True)
            self._kill_process(victim)

    def _lose_on_arrival(self, known: set, timeout_s: float = 120.0) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            new = [s.name for s in self.cluster.alive_slices() if s.name not in known]
            if new:
                self._lose(new[0], delay=0.5)  # registered, reserved, its process starting
                return
            time.sleep(0.05)

    def _poison_target(self, step: int, ahead: int = POISON_AHEAD) -> tuple[int, int]:
        """A step ``ahead`` steps or more on (not read yet, two chunks queued) and one record of
        its batch that no step between reads (a record recurs every epoch)."""
        from ray_elastic.examples.digits_mlp import DigitsMLPTask
        from ray_elastic.slice.data import StepBatches

        if self._batches is None:
            data = DigitsMLPTask().dataset()
            self._batches = (StepBatches(data, GBS, SEED), len(data))
        batches, n = self._batches
        target = step + ahead
        while True:
            between = {batches._index(target * GBS - j) % n for j in range(1, (target - step) * GBS + 1)}
            free = [k for r in range(GBS) if (k := batches._index(target * GBS + r) % n) not in between]
            if free:
                return target, free[0]
            target += 1

    def step_reported(self, m: dict) -> None:
        """A poisoned step reported (skipped or, wrongly, kept): its record is clean again (it
        recurs an epoch later)."""
        marker = self.poisoned.get(m["step"])
        if marker is None:
            return
        if os.path.exists(marker):
            os.remove(marker)
        self.poison_reported.add(m["step"])
        if m.get("skipped"):
            self.poison_skipped.add(m["step"])

    def on_event(self, e: dict) -> None:
        if e["kind"] in ("recovered", "slice_left", "scale_up", "resize"):  # a world formed: a named slice is
            world = self.trainer.worlds[-1]  # out at the first world without it (left, or lost first)
            out = [f for f in self._leaving if f["named"] not in world.slices]
            for fault in out:
                fault["out_step"] = world.start_step
                self.steps_to_out.setdefault(fault["kind"], []).append(fault["out_step"] - fault["step"])
            self._leaving = [f for f in self._leaving if f not in out]
        if e["kind"] == "replica_mismatch":
            self.mismatches += 1
            print(f"    replica_mismatch: step {e['step']}, {e['slices']}, {e['action']}", flush=True)
            named = e["slices"] or [n for n in self.flips if n in self._names()]  # no majority: any flipped one
            for name in named:
                fault = self.flips.pop(name, None)
                if fault is None:
                    self.flips_misnamed += 1
                else:
                    self.flips_found.append(e["step"] - fault.get("landed", fault["step"]))
        if e["kind"] == "straggler":
            print(f"    straggler: {e['slice']} {e['slowdown']}x, {e['action']}", flush=True)
            self._named(e["slice"], "a straggler", e.get("evidence"), leaves=e["action"] != "report")
        elif e["kind"] == "failure" and e["cause"] == "hang" and "never reached step" in (e.get("error") or ""):
            for name in e["kinds"]:
                self._named(name, "stuck", e.get("error"))
        elif e["kind"] in ("failure", "preemption_notice"):  # a slowed slice lost or warned first: moot
            gone = {e["slice"]} if e["kind"] == "preemption_notice" else set(e.get("lost_slices") or ())
            for name in gone | set(e.get("crashed_slices") or ()):
                if name in self.culprits and self.culprits[name]["kind"] != "stuck_data":
                    self._undo(self.culprits.pop(name))
                    self.moot += 1
        if e["kind"] in ("recovered", "scale_up", "failure", "waiting_for_capacity"):
            keys = {
                "failure": ("cause", "lost_slices", "crashed_slices", "world_slices", "detection_latency_s"),
                "recovered": (
                    "slices",
                    "recovery_s",
                    "wait_for_capacity_s",
                    "world_formation_s",
                    "compile_s",
                    "steps_rewound",
                ),
                "scale_up": ("from_slices", "to_slices", "pause_s"),
                "waiting_for_capacity": ("reason",),
            }[e["kind"]]
            print(f"    {e['kind']}: " + ", ".join(f"{k}={_short(e.get(k))}" for k in keys), flush=True)
        if e["kind"] == "failure" and self._after_failure is not None:
            second, self._after_failure = self._after_failure, None
            second()


def _short(v):
    return f"{v:.2f}" if isinstance(v, float) else v


def fault_steps(rng: random.Random, n: int, first: int, gap: int) -> list[int]:
    """``n`` steps, about ``gap`` apart, each at a random point of its own window."""
    return [first + i * gap + rng.randrange(max(1, gap // 2)) for i in range(n)]


def draw_kinds(rng: random.Random, kinds, n: int) -> list[str]:
    """``n`` kinds in random order, every kind as often as another (give or take one)."""
    out: list[str] = []
    while len(out) < n:
        out += rng.sample(list(kinds), len(kinds))
    return out[:n]


def run_phase(
    cluster,
    *,
    steps: int,
    faults: int,
    every_s: float,
    kinds,
    hosts: int,
    num_slices: int,
    min_slices: int,
    checkpoint_every: int,
    gap: int,
    rng: random.Random,
    ckpt_dir: str,
    run_dir: str | None = None,
    replace_delay_s: float = 1.0,
    noise: bool = True,
) -> dict:
    from ray_elastic import ElasticConfig, ElasticTrainer, FailureConfig
    from ray_elastic.examples.digits_mlp import DigitsMLPTask
    from ray_elastic.observe import goodput
    from ray_elastic.observe.results import unexplained_rewinds
    from ray_elastic.state.checkpoints import latest_checkpoint

    def cfg(n: int, **kw) -> ElasticConfig:
        # max_failures: the bench injects faults far faster than a cluster meets them (a fault can
        # be two or three failures); max_failures_in_a_row still stops a run that makes no progress.
        return ElasticConfig(
            num_slices=n,
            global_batch_size=GBS,
            slice=cluster.slice_spec,
            steps_per_chunk=10,
            seed=SEED,
            replacement_timeout_s=120.0,
            # integrity_every 10: a flipped bit is found within a fault's window
            failure=FailureConfig(
                hang_timeout_min_s=3.0, max_failures=max(30, 4 * faults, int(steps)), integrity_every=10
            ),
            **kw,
        )  # snapshots as the default chooses them: 0 rewinds is a goal

    from ray_elastic.sim import tpu_runtime

    breaches_before = len(tpu_runtime.breaches())
    t0 = time.time()
    # The failure-free references start no standby processes: nothing fails there, and the losses
    # do not depend on them.
    full = ElasticTrainer(DigitsMLPTask(), cfg(num_slices, standby_workers=0), progress=False).fit(steps).losses
    small = (
        ElasticTrainer(DigitsMLPTask(), cfg(min_slices, standby_workers=0), progress=False).fit(steps).losses
        if noise
        else None
    )
    print(
        f"  failure-free run(s) at {num_slices}"
        + (f" and {min_slices}" if noise else "")
        + f" slices: {time.time() - t0:.0f}s",
        flush=True,
    )

    chaos = Chaos(cluster, rng, hosts)
    schedule = {}
    if not every_s:
        for s, kind in zip(fault_steps(rng, faults, first=10, gap=gap), draw_kinds(rng, kinds, faults)):
            if kind == "during_save":  # just after a save of this step started
                s = (s // checkpoint_every + 1) * checkpoint_every
            schedule.setdefault(s, kind)

    def on_step(m: dict) -> None:
        chaos.step_reported(m)
        chaos.last_step = max(chaos.last_step, m["step"])
        chaos.finished_at[m["step"]] = m.get("finished_at") or time.time()
        kind = schedule.pop(m["step"], None)
        if kind is not None:
            chaos.fire(kind, m["step"])

    stop = threading.Event()

    def every():  # --every-s: a fault of a random kind every every_s seconds of wall time
        while not stop.wait(every_s):
            if chaos.trainer.world is not None and chaos.trainer.state.value == "running":
                chaos.fire(rng.choice(kinds), -1)

    trainer = ElasticTrainer(
        chaos_task(chaos.marker_dir),
        cfg(
            num_slices,
            mode="replica-resize",
            min_slices=min_slices,
            checkpoint_dir=ckpt_dir,
            checkpoint_every=checkpoint_every,
        ),
        progress=False,
        on_step=on_step,
        on_event=chaos.on_event,
        run_dir=run_dir,
    )
    chaos.trainer = trainer
    trainer.callbacks.on_state = chaos.on_state  # the controller calls its listeners at every transition
    prov = cluster.provisioner(delay_s=replace_delay_s)
    timer = threading.Thread(target=every, daemon=True) if every_s else None
    error, result = None, None
    t0 = time.time()
    try:
        if timer:
            timer.start()
        result = trainer.fit(steps)
    except Exception as e:  # noqa: BLE001 - an unrecovered fault is what this bench counts
        error = repr(e)[:500]
        print(f"  UNRECOVERED: {error}", flush=True)
    finally:
        stop.set()
        prov.stop()
        chaos.end()
    wall = time.time() - t0
    events = trainer.events.events
    committed, uncommitted_restored = set(), 0
    for e in events:
        if e["kind"] == "checkpoint_committed":
            committed.add(e["step"])
        elif e["kind"] == "checkpoint_restore" and e["step"] not in committed:
            uncommitted_restored += 1
    latest = latest_checkpoint(ckpt_dir)
    out = {
        "faults": len(chaos.fired),
        "planned": faults if not every_s else len(chaos.fired),
        "unrecovered": int(error is not None),
        "error": error,
        "wall_s": round(wall, 1),
        "uncommitted_restored": uncommitted_restored,
        "final_checkpoint_committed": latest is not None and latest.step == steps,
        "by_kind": {k: sum(1 for f in chaos.fired if f["kind"] == k) for k in sorted({f["kind"] for f in chaos.fired})},
        "world_size_noise": _max_rel(small, full) if noise else None,
        # stragglers and stuck processes named for the slice a fault slowed or stuck, and otherwise
        "attributed": chaos.attributed,
        "misattributed": chaos.misattributed,
        "not_named": len(chaos.culprits),
        "moot": chaos.moot,
        "steps_to_named": _spread(chaos.steps_to_named),
        # ... and to the first step of a world without the named slice (what the controller decides)
        "steps_to_out": _spread(chaos.steps_to_out),
        # slow_host: steps from the fault until the world steps at >= 0.8x its pace before it again
        # (10 steps in a row by their median), and until 10 steps' whole time is (pauses counted)
        "steps_to_pace": _spread(steps_to_pace(chaos.fired, chaos.finished_at, ("slow_host",))),
        # slow_host: from that first step without it to the same pace (what the machine adds after)
        "steps_to_pace_after_out": _spread(
            steps_to_pace(chaos.fired, chaos.finished_at, ("slow_host",), after_out=True)
        ),
        "steps_to_throughput": _spread(steps_to_pace(chaos.fired, chaos.finished_at, ("slow_host",), strict=True)),
        # processes that broke a rule of the TPU runtime (sim/tpu_runtime.py): must be 0
        "tpu_breaches": len(tpu_runtime.breaches()) - breaches_before,
        # poisoned records (each step reading one skipped) and flipped bits (each found, for its slice)
        "poisoned": len(chaos.poisoned),
        "poison_kept": sorted(chaos.poison_reported - chaos.poison_skipped),  # reported, not skipped: must be []
        "poison_unread": len(set(chaos.poisoned) - chaos.poison_reported),  # its step past the run's end
        "flips": sum(1 for f in chaos.fired if f["kind"] == "bit_flip"),
        "flips_found_after": _spread({"bit_flip": chaos.flips_found}),
        "flips_not_found": len(chaos.flips),
        "flips_misnamed": chaos.flips_misnamed,
        "flips_missed": chaos.flips_missed,  # the world stopped before the flip landed: nothing flipped
        "replica_mismatches": chaos.mismatches,  # every one a flip's (with no flips: false alarms)
    }
    if result is not None:
        skipped = {e["step"] for e in events if e["kind"] == "step_skipped"}
        # a kept step whose loss is not finite: a bad step kept (must be 0)
        out["skipped"], out["bad_kept"] = (
            len(skipped),
            sum(1 for s, loss in enumerate(result.losses) if s not in skipped and not math.isfinite(loss)),
        )
        # a skipped step's loss is the bad batch's: compared as the failure-free run's
        result.losses = [full[s] if s in skipped else loss for s, loss in enumerate(result.losses)]
        # Steps before the world first changed shape, skipped a batch (the data differs after it)
        # or had a bit flipped (a corrupt replica's gradients count until it leaves) trained
        # exactly as the failure-free run did.
        changed = [r.restored_from_step for r in result.recoveries if r.slices != num_slices]
        changed += [e["restored_from_step"] for e in events if e["kind"] == "slice_left"]
        changed += [s - 1 for s in skipped] + [f["step"] for f in chaos.fired if f["kind"] == "bit_flip"]
        prefix = min(changed) + 1 if changed else steps
        out.update(
            steps_rewound=result.summary["steps_rewound"],
            unexplained_rewound=unexplained_rewinds(events, trainer.config.snapshot_replicas),
            goodput=result.summary["goodput"],
            goodput_breakdown=goodput.account(events).as_dict(),  # where the badput went, in seconds
            max_rel_loss_diff=_max_rel(result.losses, full),
            same_shape_steps=prefix,
            same_shape_max_diff=_max_rel(result.losses[:prefix], full[:prefix]),
            failures=result.summary["failures"],
            recoveries=result.summary["recoveries"],
            # detection -> ready per recovery (with --tpu-startup: the modelled start-up included)
            recovery_median_s=round(statistics.median(r.recovery_s for r in result.recoveries), 3)
            if result.recoveries
            else None,
            recovery_worst_s=round(max((r.recovery_s for r in result.recoveries), default=0.0), 3),
            slowest_formation=slowest_formation(events, chaos.fired),
        )
    return out


def slowest_formation(events: list[dict], fired: list[dict]) -> dict | None:
    """The world formation that took longest, with its phases and the faults fired in the 10 s
    before it began: where a long recovery's seconds went, read from the run itself."""
    from ray_elastic.observe.event_types import WorldFormed

    formed = [e for e in events if e["kind"] == "world_formed"][1:]  # the first world is the run's start
    if not formed:
        return None
    e = max(formed, key=lambda f: f.get("total_s", 0.0))
    began = e["ts"] - e.get("total_s", 0.0)
    out = {k: round(e[k], 3) if isinstance(e[k], float) else e[k] for k in WorldFormed.TIMES if k in e}
    out.update(
        generation=e["generation"],
        restored_from_step=e["restored_from_step"],
        faults_before=[f"{f['kind']}@{f['step']}" for f in fired if began - 10.0 <= f["at"] <= e["ts"]],
    )
    return out


def _spread(by_kind: dict[str, list[int]]) -> dict[str, dict]:
    return {k: {"median": statistics.median(v), "worst": max(v), "n": len(v)} for k, v in by_kind.items() if v}


def steps_to_pace(
    fired: list[dict],
    finished_at: dict[int, float],
    kinds,
    window: int = 10,
    strict: bool = False,
    after_out: bool = False,
) -> dict[str, list[int]]:
    """Per slowing fault of ``kinds``: steps after it until the world steps at >= 0.8x its pace
    before it again (at most 1/0.8 x the median step of the 30 steps before the fault): the first
    step after which ``window`` steps in a row keep that pace, by their median (a one-off pause
    among them, a checkpoint save or a grow-back, is not a slower pace). ``strict``: by the
    ``window`` steps' whole time instead (every pause counts), counted to the window's end: the
    throughput of those steps, not their pace. ``after_out``: counted from the first step of the
    world without the named slice (the pace before the fault still the reference)."""
    out: dict[str, list[int]] = {}
    took = {s: finished_at[s] - finished_at[s - 1] for s in finished_at if s - 1 in finished_at}
    for f in fired:
        if f["kind"] not in kinds or (after_out and "out_step" not in f):
            continue
        s0 = f["step"]
        before = [took[s] for s in range(s0 - 29, s0 + 1) if s in took]
        if len(before) < 10:
            continue
        pace = statistics.median(before) / 0.8
        if after_out:
            s0 = f["out_step"] - 1
        for s in range(s0 + 1, max(finished_at) - window + 1):
            span = [took.get(t) for t in range(s, s + window)]
            if None in span:
                continue
            if strict and sum(span) / window <= pace:
                out.setdefault(f["kind"], []).append(s + window - 1 - s0)
                break
            if not strict and span[0] <= pace and statistics.median(span) <= pace:
                out.setdefault(f["kind"], []).append(s - 1 - s0)
                break
    return out


LOSS_FLOOR = 0.01  # the MLP fits the digits to a loss of ~1e-5, where any ratio is float noise


def _max_rel(a, b) -> float:
    """Largest |a - b| relative to b's loss, or to LOSS_FLOOR once the loss is below it."""
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.size == 0:
        return float("nan")
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), LOSS_FLOOR)))


def _phase_dir(run_dir: str | None, phase: str) -> str | None:
    return os.path.join(run_dir, phase) if run_dir else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--faults", type=int, default=8, help="faults of phase 1 (4 one-host slices)")
    ap.add_argument(
        "--multihost-faults",
        type=int,
        default=None,
        help="faults of phase 2 (2-host slices, one host lost each; default faults/10, at least 1)",
    )
    ap.add_argument("--every-s", type=float, default=0.0, help="a fault every this many seconds instead of --faults")
    ap.add_argument("--steps", type=int, default=None, help="steps per phase (default: 40 per fault + 60)")
    ap.add_argument("--gap", type=int, default=40, help="steps between fault windows")
    ap.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        help="default: 20 with --faults (a checkpoint in every --gap window, so faults meet saves "
        "and a rewind to one is short); with --every-s, ElasticConfig's default (100): the "
        "goodput a user gets",
    )
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated subset of " + ",".join(KINDS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--no-noise",
        action="store_true",
        help="skip the failure-free run at min_slices (no noise floor: a quick check of recovery only)",
    )
    ap.add_argument(
        "--run-dir",
        default=None,
        help="keep each phase's event log here (<dir>/<phase>/events.jsonl; see `ray-elastic report`)",
    )
    ap.add_argument(
        "--replace-delay-s",
        type=float,
        default=1.0,
        help="a lost or evicted slice's replacement is started this long after its reservation is "
        "pending (the provisioner standing in for the autoscaler); longer than a slow host's pace "
        "window shows that window without the replacement's start-up on this machine's cores",
    )
    ap.add_argument(
        "--tpu-startup",
        type=float,
        nargs=2,
        default=[0.0, 0.0],
        metavar=("OPEN_S", "LOAD_S"),
        help="every new process waits this modelled TPU start-up (opening the chips, loading the "
        "executable) when its backend starts (sim/tpu_runtime.py; docs/tpu.md)",
    )
    args = ap.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    if bad := [k for k in kinds if k not in KINDS]:
        ap.error(f"unknown --kinds {bad}; choose from {','.join(KINDS)}")
    mh = max(1, args.faults // 10) if args.multihost_faults is None else args.multihost_faults
    if args.checkpoint_every is None:
        from ray_elastic import ElasticConfig

        args.checkpoint_every = ElasticConfig.checkpoint_every if args.every_s else 20

    from ray_elastic.sim.cluster import SimulatedTPUCluster
    from ray_elastic.sim.tpu_runtime import StartupCost, set_startup_cost

    rng = random.Random(args.seed)
    phases = {}
    with tempfile.TemporaryDirectory(prefix="ray-elastic-chaos-") as tmp:
        steps = args.steps or args.gap * args.faults + 60
        print(
            f"phase 1: 4 slices x 1 host, min 2, {args.faults or f'every {args.every_s}s'} fault(s), {steps} steps",
            flush=True,
        )
        with SimulatedTPUCluster(num_slices=4, log_to_driver=False) as cluster:
            set_startup_cost(StartupCost(*args.tpu_startup))
            phases["one_host_slices"] = run_phase(
                cluster,
                steps=steps,
                faults=args.faults,
                every_s=args.every_s,
                kinds=kinds,
                hosts=1,
                num_slices=4,
                min_slices=2,
                checkpoint_every=args.checkpoint_every,
                gap=args.gap,
                rng=rng,
                ckpt_dir=os.path.join(tmp, "one-host"),
                run_dir=_phase_dir(args.run_dir, "one_host_slices"),
                replace_delay_s=args.replace_delay_s,
                noise=not args.no_noise,
            )
        print(json.dumps(phases["one_host_slices"]), flush=True)
        if mh > 0:
            steps = args.steps or args.gap * mh + 60
            print(f"phase 2: 3 slices x 2 hosts, min 2, {mh} fault(s) (one host each), {steps} steps", flush=True)
            with SimulatedTPUCluster(num_slices=3, hosts_per_slice=2, log_to_driver=False) as cluster:
                set_startup_cost(StartupCost(*args.tpu_startup))
                phases["two_host_slices"] = run_phase(
                    cluster,
                    steps=steps,
                    faults=mh,
                    every_s=0.0,
                    kinds=["one_host"],
                    hosts=2,
                    num_slices=3,
                    min_slices=2,
                    checkpoint_every=args.checkpoint_every,
                    gap=args.gap,
                    rng=rng,
                    ckpt_dir=os.path.join(tmp, "two-host"),
                    run_dir=_phase_dir(args.run_dir, "two_host_slices"),
                    replace_delay_s=args.replace_delay_s,
                    noise=not args.no_noise,
                )
            print(json.dumps(phases["two_host_slices"]), flush=True)
    ps = list(phases.values())
    total = {
        "faults": sum(p["faults"] for p in ps),
        "planned": sum(p["planned"] for p in ps),
        "unrecovered": sum(p["unrecovered"] for p in ps),
        "steps_rewound": sum(p.get("steps_rewound", 0) for p in ps),
        # rewound although a snapshot holder of the newest step survived: must be 0
        "unexplained_rewound": sum(p.get("unexplained_rewound", 0) for p in ps),
        "max_rel_loss_diff": max(p.get("max_rel_loss_diff", float("nan")) for p in ps),
        "world_size_noise": max(p["world_size_noise"] for p in ps) if not args.no_noise else None,
        # The goal: each phase within twice its own noise floor.
        "loss_diff_over_noise": max(p.get("max_rel_loss_diff", float("nan")) / p["world_size_noise"] for p in ps)
        if not args.no_noise
        else None,
        "same_shape_max_diff": max(p.get("same_shape_max_diff", float("nan")) for p in ps),
        "uncommitted_restored": sum(p["uncommitted_restored"] for p in ps),
        "tpu_breaches": sum(p["tpu_breaches"] for p in ps),
        "tpu_startup_s": sum(args.tpu_startup),
        "final_checkpoint_committed": all(p["final_checkpoint_committed"] for p in ps),
        "goodput": phases["one_host_slices"].get("goodput"),
        "goodput_breakdown": phases["one_host_slices"].get("goodput_breakdown"),
        "every_s": args.every_s or None,
        "by_kind": {k: v for p in ps for k, v in p["by_kind"].items()},
        # stragglers and stuck processes named for the slice a fault slowed or stuck (misattributed: 0)
        "attributed": sum(p["attributed"] for p in ps),
        "misattributed": sum(p["misattributed"] for p in ps),
        "not_named": sum(p["not_named"] for p in ps),
        "moot": sum(p["moot"] for p in ps),
        "steps_to_named": phases["one_host_slices"].get("steps_to_named"),
        "steps_to_out": phases["one_host_slices"].get("steps_to_out"),
        "steps_to_pace": phases["one_host_slices"].get("steps_to_pace"),
        "steps_to_pace_after_out": phases["one_host_slices"].get("steps_to_pace_after_out"),
        "steps_to_throughput": phases["one_host_slices"].get("steps_to_throughput"),
        "poison_kept": [s for p in ps for s in p.get("poison_kept", [])],
        **{
            k: sum(p.get(k, 0) for p in ps)
            for k in (
                "poisoned",
                "skipped",
                "poison_unread",
                "bad_kept",
                "flips",
                "flips_not_found",
                "flips_misnamed",
                "flips_missed",
                "replica_mismatches",
            )
        },
        "flips_found_after": phases["one_host_slices"].get("flips_found_after"),
        "recovery_worst_s": max(p.get("recovery_worst_s", 0.0) for p in ps),
        "slowest_formation": max(
            (p["slowest_formation"] for p in ps if p.get("slowest_formation")),
            key=lambda f: f.get("total_s", 0.0),
            default=None,
        ),
    }
    print(json.dumps(total))
    return 0 if total["unrecovered"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
