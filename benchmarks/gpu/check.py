"""Does a syncdp rank train on a GPU? The first check to run where TensorFlow sees one.

    syncdp-run -np 2 python benchmarks/gpu/check.py      # two ranks may share one GPU

Every rank builds a small Keras model after ``syncdp.init()`` (which pins GPU ``local_rank``
modulo the GPUs there, with memory growth, so ranks can share one) and checks, on whatever device
TensorFlow puts it (``--expect gpu`` makes a CPU placement a failure):

1. **placement**: where the variables and a traced step's gradients live;
2. **the average**: one ``DistributedGradientTape`` step's gradients equal the mean of every
   rank's own gradients, gathered with ``syncdp.allgather`` and averaged in float64 here;
3. **identical replicas**: after ``--steps`` traced steps on different data, every rank holds the
   same weights, bit for bit;
4. **Keras**: ``model.fit`` with ``DistributedOptimizer`` and the broadcast callback, then the
   same comparison;
5. **step time**: the traced step with and without syncdp, alternating, the median ratio of the
   slowest rank's times (what the host-side gradient path costs beside the GPU's step).

Rank 0 prints one line per check (``PASS``/``FAIL``) and the job exits 1 if any failed. Needs
no dataset (random data, fixed seeds). On a machine without a GPU it runs on the CPU (a dry
run of the script).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import alternate, fmt_interval, paired_ratio, setup_threads  # noqa: E402

__all__ = ["main"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="traced steps before comparing weights")
    p.add_argument("--width", type=int, default=1024, help="units of each dense layer")
    p.add_argument("--batch-size", type=int, default=256, help="rows per rank per step")
    p.add_argument("--repeats", type=int, default=20, help="timed repetitions per variant")
    p.add_argument("--expect", choices=["gpu", "any"], default="any")
    return p.parse_args(argv)


def _digest(variables) -> str:
    h = hashlib.sha256()
    for v in variables:
        h.update(v.numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv=None) -> None:
    args = parse_args(argv)
    setup_threads(1)
    import keras
    import numpy as np
    import tensorflow as tf

    import syncdp
    import syncdp.keras

    syncdp.init()
    rank, size = syncdp.rank(), syncdp.size()
    results: dict[str, tuple[bool, str]] = {}  # check -> (passed, what this rank saw)

    def report(name: str, ok: bool, detail: str) -> None:
        results[name] = (bool(ok), detail)

    gpus = tf.config.get_visible_devices("GPU")
    keras.utils.set_random_seed(rank)  # different initial weights, made equal by the broadcast
    model = keras.Sequential(
        [keras.Input((args.width,))]
        + [keras.layers.Dense(args.width, activation="relu") for _ in range(3)]
        + [keras.layers.Dense(10)]
    )
    opt = keras.optimizers.SGD(0.01)
    opt.build(model.trainable_variables)
    syncdp.broadcast_variables(model.variables, root_rank=0)
    rng = np.random.default_rng(100 + rank)  # each rank its own data
    x = tf.constant(rng.standard_normal((args.batch_size, args.width), dtype=np.float32))
    y = tf.constant(rng.integers(0, 10, args.batch_size))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def step_fn(distributed: bool):
        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            if distributed:
                tape = syncdp.DistributedGradientTape(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return grads

        return step

    # 1. Placement.
    devices = sorted({v.value.device.split("/")[-1] for v in model.trainable_variables})
    grads = step_fn(True)()
    grad_devices = sorted({g.device.split("/")[-1] for g in grads})
    on_gpu = all("GPU" in d for d in devices + grad_devices)
    report(
        "placement",
        on_gpu or args.expect == "any",
        f"{len(gpus)} GPU(s) visible to rank {rank}; variables on {devices}, "
        f"reduced gradients on {grad_devices}",
    )

    # 2. The average: this rank's own gradients, gathered, against the tape's reduction.
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    own = tape.gradient(loss, model.trainable_variables)
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    reduced = syncdp.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
    worst = 0.0
    for g, r in zip(own, reduced):
        every = syncdp.allgather(tf.expand_dims(g, 0)).numpy().astype(np.float64)
        expected = every.mean(axis=0)
        scale = max(1e-30, float(np.abs(expected).max()))
        worst = max(worst, float(np.abs(r.numpy() - expected).max()) / scale)
    report("average", worst < 1e-5, f"largest error {worst:.2e} of the largest gradient")

    # 3. Identical replicas after training on different data.
    step = step_fn(True)
    for _ in range(args.steps):
        step()
    digests = syncdp.allgather_object(_digest(model.trainable_variables))
    report("replicas", len(set(digests)) == 1, f"{args.steps} steps, digests {digests}")

    # 4. Keras fit with DistributedOptimizer.
    fit_model = keras.models.clone_model(model)
    fit_model.compile(
        optimizer=syncdp.keras.DistributedOptimizer(keras.optimizers.SGD(0.01)),
        loss=loss_fn,
    )
    fit_model.fit(
        x,
        y,
        batch_size=32,
        epochs=1,
        verbose=0,
        callbacks=[syncdp.keras.callbacks.BroadcastGlobalVariablesCallback(0)],
    )
    digests = syncdp.allgather_object(_digest(fit_model.trainable_variables))
    report("keras fit", len(set(digests)) == 1, f"digests {digests}")

    # 5. Step time, syncdp against the same step alone.
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    plain, synced = step_fn(False), step_fn(True)

    def repeat(fn):
        def run():
            for _ in range(5):
                fn()
            model.trainable_variables[-1].numpy()  # waits for the device's last update

        return run

    began = time.perf_counter()
    times = alternate(
        {"plain": repeat(plain), "syncdp": repeat(synced)},
        args.repeats,
        sync=world.Barrier,
        warmup=2,
    )
    every = world.allgather(times)
    if rank == 0:
        worst_times = {k: [max(t[k][i] for t in every) for i in range(args.repeats)] for k in times}
        nbytes = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
        report(
            "step time",
            True,
            f"np={size}, {nbytes / 1e6:.1f} MB of gradients: plain step "
            f"{np.median(worst_times['plain']) / 5 * 1e3:.2f} ms, syncdp / plain "
            f"{fmt_interval(paired_ratio(worst_times['syncdp'], worst_times['plain']))} "
            f"({time.perf_counter() - began:.0f} s)",
        )

    every_result = syncdp.allgather_object(results)
    failed = 0
    if rank == 0:
        for name, (_, detail) in results.items():
            bad = [r for r, theirs in enumerate(every_result) if not theirs.get(name, (True,))[0]]
            if bad:
                failed += 1
                detail = f"{every_result[bad[0]][name][1]} (ranks {bad})"
            print(f"{'FAIL' if bad else 'PASS'} {name}: {detail}", flush=True)
    failed = syncdp.broadcast_object(failed, root_rank=0)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
