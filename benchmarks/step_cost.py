"""What syncdp adds to a training step, beside what a hand-written Allreduce adds.

One job times the same traced training step three ways, in many short repetitions that
alternate (so load from other programs hits each alike):

- ``plain``: the step, each rank alone (no communication at all);
- ``naive``: the plain step, then one raw mpi4py ``Allreduce`` of the same number of gradient
  bytes from Python (what a hand-written data-parallel loop pays, without overlap);
- ``syncdp``: the step with ``DistributedGradientTape`` (argument check, step agreement,
  buckets, everything a user gets).

A repetition is ``--steps`` steps; its time is the slowest rank's (a synchronous step is as
slow as its slowest rank). The figures are paired by repetition: the microseconds each variant
adds per step over ``plain`` and the ratio of syncdp's step to the naive one, each as the
median with a bootstrap 95% interval.

Two models: ``tiny`` (8 dense layers of 16x16: 8.7 KB of gradients, where only the fixed cost
of a step shows) and ``8mb`` (8 dense layers of 512x512: 8.4 MB, where the bytes matter).

Usage::

    syncdp-run -np 2 python benchmarks/step_cost.py                 # both models
    syncdp-run -np 2 python benchmarks/step_cost.py --model tiny --repeats 200

Results: ``benchmarks/results/step_cost.md``. Needs 2 or more ranks.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import alternate, fmt_interval, interval, machine, say, setup_threads, write_markdown

__all__ = ["main"]

MODELS = {"tiny": (16, 8), "8mb": (512, 8)}  # name -> (width, dense layers)
VARIANTS = ("plain", "naive", "syncdp")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=[*MODELS, "both"], default="both")
    p.add_argument("--batch-size", type=int, default=32, help="rows per rank per step")
    p.add_argument("--steps", type=int, default=0, help="steps per repetition (0: by model)")
    p.add_argument("--repeats", type=int, default=0, help="repetitions (0: by model)")
    p.add_argument("--intra-threads", type=int, default=1)
    p.add_argument("--no-write", action="store_true", help="print only, write no results")
    return p


def _setup(width: int, layers: int, batch: int, rank: int):
    """The model, optimizer and this rank's batch, initial state broadcast from rank 0."""
    import keras
    import numpy as np
    import tensorflow as tf

    import syncdp

    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((width,))] + [keras.layers.Dense(width) for _ in range(layers)]
    )
    opt = keras.optimizers.SGD(1e-3)
    opt.build(model.trainable_variables)
    rng = np.random.default_rng(rank)
    x = tf.constant(rng.random((batch, width), dtype=np.float32))
    y = tf.constant(rng.random((batch, width), dtype=np.float32))
    syncdp.broadcast_variables(model.variables, root_rank=0)  # syncdp:
    return model, opt, x, y


def _step(model, opt, x, y, distributed: bool):
    import tensorflow as tf

    import syncdp

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        if distributed:
            tape = syncdp.DistributedGradientTape(tape)  # syncdp:
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


def measure(name: str, args) -> dict | None:
    """Times the three variants of ``name`` on every rank; rank 0 gets the figures."""
    import numpy as np
    from mpi4py import MPI

    import syncdp

    width, layers = MODELS[name]
    steps = args.steps or (20 if name == "tiny" else 3)
    repeats = args.repeats or (120 if name == "tiny" else 40)
    world = MPI.COMM_WORLD
    model, opt, x, y = _setup(width, layers, args.batch_size, world.rank)
    nbytes = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    grads = np.ones(nbytes // 4, np.float32)
    plain = _step(model, opt, x, y, distributed=False)
    synced = _step(model, opt, x, y, distributed=True)

    def repeat(step, after=None):
        def run():
            for _ in range(steps):
                step().numpy()
                if after is not None:
                    after()

        return run

    variants = {
        "plain": repeat(plain),
        "naive": repeat(plain, lambda: world.Allreduce(MPI.IN_PLACE, grads, MPI.SUM)),
        "syncdp": repeat(synced),
    }
    times = alternate(variants, repeats, sync=world.Barrier, warmup=3)
    every = world.allgather(times)
    if world.rank != 0:
        return None
    # Per repetition, the slowest rank; per step.
    worst = {k: [max(t[k][i] for t in every) / steps for i in range(repeats)] for k in VARIANTS}
    added = {
        k: interval([(a - b) * 1e6 for a, b in zip(worst[k], worst["plain"])])
        for k in ("naive", "syncdp")
    }
    return {
        "model": name,
        "kbytes": nbytes / 1e3,
        "np": syncdp.size(),
        "steps": steps,
        "repeats": repeats,
        "step_us": {k: interval([t * 1e6 for t in worst[k]]) for k in VARIANTS},
        "added_us": added,
        "syncdp_over_naive": interval([s / n for s, n in zip(worst["syncdp"], worst["naive"])]),
    }


def _print(r: dict) -> None:
    say(
        f"{r['model']} ({r['kbytes']:.1f} KB of gradients), np={r['np']}, {r['repeats']} "
        f"alternating repetitions of {r['steps']} steps, slowest rank; median [95% interval]"
    )
    for k in VARIANTS:
        say(f"  {k:<8} step {fmt_interval(r['step_us'][k], 0)} us")
    for k in ("naive", "syncdp"):
        say(f"  {k:<8} adds {fmt_interval(r['added_us'][k], 0)} us per step over plain")
    say(f"  syncdp step / naive step: {fmt_interval(r['syncdp_over_naive'])}")


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    setup_threads(args.intra_threads)
    import syncdp

    syncdp.init()  # syncdp:
    if syncdp.size() < 2:
        say("step_cost.py compares synchronous ranks; run it with syncdp-run -np 2 or more.")
        sys.exit(2)
    names = list(MODELS) if args.model == "both" else [args.model]
    results = []
    for name in names:
        r = measure(name, args)
        if r is not None:
            _print(r)
            results.append(r)
    if results and not args.no_write:
        rows = [
            [
                r["model"],
                f"{r['kbytes']:.1f}",
                r["np"],
                *(fmt_interval(r["step_us"][k], 0) for k in VARIANTS),
                fmt_interval(r["added_us"]["naive"], 0),
                fmt_interval(r["added_us"]["syncdp"], 0),
                fmt_interval(r["syncdp_over_naive"]),
            ]
            for r in results
        ]
        notes = (
            "Per-step times (us) of the slowest rank, medians with bootstrap 95% intervals "
            "over alternating repetitions; 'adds' is paired by repetition against plain.\n\n"
            f"Machine: {machine(f'{args.intra_threads} intra-op thread(s) per rank')}."
        )
        header = ["model", "KB", "np", *(f"{k} us" for k in VARIANTS)]
        header += ["naive adds us", "syncdp adds us", "syncdp / naive"]
        write_markdown("step_cost", "The fixed cost of a step", header, rows, notes)


if __name__ == "__main__":
    main()
