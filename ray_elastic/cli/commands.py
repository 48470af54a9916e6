"""``train``, ``demo`` and ``report``: a run on an existing cluster, on a simulated one, and its timeline."""

from __future__ import annotations

import json

from ray_elastic.cli.options import config_from_args, load_task, simulated_cluster
from ray_elastic.tpu import SliceSpec
from ray_elastic.trainer import ElasticTrainer


def print_summary(result, as_json: bool, goodput_printed: bool = False) -> None:
    if as_json:
        print(json.dumps(result.summary))
        return
    if not goodput_printed and result.events:
        from ray_elastic.observe.goodput import account

        print(account(result.events).table())
    print("\nray-elastic summary")
    width = max(len(k) for k in result.summary)
    for k, v in result.summary.items():
        if isinstance(v, float):
            v = f"{v:.4f}"
        print(f"  {k:<{width}}  {v}")


def fit_and_report(task, config, args, address=None):
    result = ElasticTrainer(
        task,
        config,
        address=address,
        progress=not args.no_progress,
        run_dir=args.run_dir,
        run_id=args.run_id,
        tensorboard_dir=args.tensorboard_dir,
    ).fit(args.steps, resume_from=args.resume_from)
    print_summary(result, args.json, goodput_printed=not args.no_progress)
    return result


def cmd_report(args) -> int:
    from ray_elastic.observe import report

    tl = report.timeline(report.load_events(args.run_dir))
    out = report.render(args.run_dir, args.out, tl)
    print(tl.goodput.table())
    if tl.skipped:
        print(tl.skipped_line())
    print(f"timeline: {out}")
    return 0


def cmd_train(args) -> int:
    spec = SliceSpec(accelerator=args.accelerator, topology=args.topology, devices_per_host=args.devices_per_host)
    task = load_task(args.task)
    config = config_from_args(args, spec)
    fit_and_report(task, config, args, address=args.address)
    return 0


def cmd_demo(args) -> int:
    import threading
    import time

    args.devices_per_host = args.devices_per_host or (4 if args.task == "llm" else 2)
    spec = SliceSpec.for_hosts(args.accelerator, args.hosts_per_slice, args.devices_per_host)
    task = load_task(args.task)
    config = config_from_args(args, spec)  # validated before the cluster starts
    if args.run_dir is None:
        import tempfile

        args.run_dir = tempfile.mkdtemp(prefix="ray-elastic-demo-")
    kill_at = args.steps // 2 if args.kill_at is None else args.kill_at
    if kill_at >= args.steps:
        raise ValueError(f"--kill-at {kill_at} must be below --steps {args.steps} (or -1 for no kill)")
    print(
        f"starting a simulated cluster: {args.num_slices} x {spec.pod_type} slice(s), "
        f"{spec.num_hosts} host(s) each, {spec.host_devices} JAX CPU device(s) per host; mode {args.mode}"
    )
    with simulated_cluster(args) as cluster:
        if not cluster.autoscaler:  # a thread stands in for the autoscaler
            cluster.provisioner(delay_s=args.arrival_delay)
        killed = {}
        trainer_box = {}

        def on_step(metrics):
            if kill_at >= 0 and not killed and metrics["step"] >= kill_at:
                victim = trainer_box["t"].world.plan.slice_names[-1]
                killed.update(name=victim, at=time.time(), step=metrics["step"])
                threading.Thread(target=cluster.kill_slice, args=(victim,), daemon=True).start()

        trainer = ElasticTrainer(
            task,
            config,
            progress=not args.no_progress,
            on_step=on_step,
            run_dir=args.run_dir,
            run_id=args.run_id,
            tensorboard_dir=args.tensorboard_dir,
        )
        trainer_box["t"] = trainer
        result = trainer.fit(args.steps, resume_from=args.resume_from)
        if killed and result.recoveries:
            rec = result.recoveries[0]
            result.summary["killed_slice"] = f"{killed['name']} after step {killed['step']}"
            result.summary["detection_s"] = round(rec.detected_at - killed["at"], 3)
            result.summary["kill_to_training_again_s"] = round(rec.ready_at - killed["at"], 3)
    # After the cluster is gone: what Ray prints about the killed slice's raylet comes before the result.
    print_summary(result, args.json, goodput_printed=not args.no_progress)
    if not args.json:
        from ray_elastic.observe import report

        print(f"timeline of this run: {report.render(args.run_dir)}  (ray-elastic report {args.run_dir})")
    return 0
