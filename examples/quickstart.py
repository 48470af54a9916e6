# %% [markdown]
# # ray-elastic quickstart (runs as a script or cell by cell in a notebook)
#
# Trains your own Flax NNX model data-parallel across 3 simulated TPU slices on
# this machine. On a real TPU Ray cluster, drop the `SimulatedTPUCluster` block
# and call `ray.init(address=...)` (or nothing, inside `ray job submit`), with a
# `SliceSpec` naming your real slices, e.g. `SliceSpec("v5p", "2x2x2")`.

# %%
import numpy as np
import optax
from flax import nnx

from ray_elastic import ElasticConfig, ElasticTrainer, TrainTask
from ray_elastic.sim import SimulatedTPUCluster


# %% A task: model, optimizer, loss, and random-access data (one example per index).
class SineRegression(TrainTask):
    """Fit y = sin(3x) with a small MLP; the data is made here, deterministically."""

    def create_model(self, rngs):
        return nnx.Sequential(nnx.Linear(1, 64, rngs=rngs), nnx.tanh, nnx.Linear(64, 1, rngs=rngs))

    def create_optimizer(self):
        return optax.adam(1e-2)

    def loss(self, model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()

    def dataset(self):
        x = np.linspace(-1, 1, 4096, dtype=np.float32)[:, None]
        return [{"x": x[i], "y": np.sin(3 * x[i])} for i in range(len(x))]


# %% A simulated 3-slice TPU cluster (a real local Ray cluster: one node per slice host).
if __name__ == "__main__":
    import tempfile
    import threading

    from ray_elastic.observe.report import render

    # Ray's autoscaler launches the slices, and a replacement ~1 s after one is asked for.
    with SimulatedTPUCluster(
        num_slices=3, log_to_driver=False, autoscaler=True, launch_delay_s=1.0, max_slices=3
    ) as cluster:
        config = ElasticConfig(num_slices=3, global_batch_size=96, slice=cluster.slice_spec, steps_per_chunk=25)
        result = ElasticTrainer(SineRegression(), config).fit(100)

        # %% Per-step losses and a summary come back to the notebook.
        print(f"loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f} in {len(result.steps)} steps")
        print(result.summary)

        # %% Now lose a slice half way: its host is removed and its processes SIGKILLed.
        killed = []

        def kill_a_slice_once(metrics):
            if metrics["step"] >= 50 and not killed:
                killed.append(trainer.world.plan.slice_names[-1])
                threading.Thread(target=cluster.kill_slice, args=(killed[0],)).start()

        run_dir = tempfile.mkdtemp(prefix="quickstart-run-")
        # A snapshot after every step: a lost slice costs no step at all. (The default, "auto", keeps
        # snapshots within 2% of the step time and bounds the rewind by the interval it picks.)
        config = ElasticConfig(
            num_slices=3, global_batch_size=96, slice=cluster.slice_spec, steps_per_chunk=10, snapshot_every=1
        )
        trainer = ElasticTrainer(SineRegression(), config, on_step=kill_a_slice_once, run_dir=run_dir)
        result = trainer.fit(100)  # the progress bar shows state=recovering, then slices=2/3

        # %% The run went on with the survivors (replica-resize), and grew back onto the slice the
        # autoscaler launched; nothing was recomputed.
        rec = result.recoveries[0]
        print(
            f"lost {killed[0]}: training again after {rec.recovery_s:.2f}s on {rec.slices} slices, "
            f"{rec.steps_rewound} steps rewound, {len(result.steps)} steps done"
        )
        print("timeline:", render(run_dir))  # in a notebook: IPython.display.Image(render(run_dir))
