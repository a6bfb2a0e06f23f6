"""What syncdp adds to a training step, beside what a hand-written Allreduce adds.

One job times the same traced training step three ways, in many short repetitions that
alternate (so load from other programs hits each alike):

- ``plain``: the step, each rank alone (no communication at all);
- ``naive``: the plain step, then one raw mpi4py ``Allreduce`` of the same number of gradient
  bytes from Python (what a hand-written data-parallel loop pays, without overlap);
- ``loop``: what a hand-written data-parallel loop really does: the gradients come out of the
  traced step, each is averaged with one mpi4py ``Allreduce`` from Python, and a second traced
  function applies them (``naive`` leaves out moving the gradients out of TensorFlow and back);
- ``syncdp``: the step with ``DistributedGradientTape`` (argument check, step agreement,
  buckets, everything a user gets).

A repetition is ``--steps`` steps; its time is the slowest rank's (a synchronous step is as
slow as its slowest rank). The figures are paired by repetition: the microseconds each variant
adds per step over ``plain`` and the ratio of syncdp's step to the naive one, each as the
median with a bootstrap 95% interval.

``--floors`` times instead what any collective inside a traced step costs here, whoever writes
it: the plain step with its gradients passed through one host call (``tf.numpy_function``) as
they are, each its own tensor, and returned untouched (``call_apart``: what a host call between
the gradients and the update costs, before any byte moves); or packed into one tensor for a host
call that copies it (``call_noop``), that runs one blocking ``MPI.Allreduce``, or one
non-blocking ``Iallreduce`` waited on the way syncdp waits (polling, then sleeping); beside
``syncdp``.

Two models: ``tiny`` (8 dense layers of 16x16: 8.7 KB of gradients, where only the fixed cost
of a step shows) and ``8mb`` (8 dense layers of 512x512: 8.4 MB, where the bytes matter).

Usage::

    syncdp-run -np 2 python benchmarks/step_cost.py                 # both models
    syncdp-run -np 2 python benchmarks/step_cost.py --model tiny --repeats 200
    syncdp-run -np 2 python benchmarks/step_cost.py --model tiny --floors --no-write

Results: ``benchmarks/results/step_cost.md``. Needs 2 or more ranks.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    alternate,
    fmt_interval,
    interval,
    machine,
    paired_ratio,
    say,
    setup_threads,
    write_markdown,
)

__all__ = ["main"]

MODELS = {"tiny": (16, 8), "8mb": (512, 8)}  # name -> (width, dense layers)
VARIANTS = ("plain", "naive", "loop", "syncdp")
FLOORS = (
    "plain",
    "call_apart",
    "call_noop",
    "call_allreduce",
    "call_iallreduce_polite",
    "syncdp",
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=[*MODELS, "both"], default="both")
    p.add_argument("--batch-size", type=int, default=32, help="rows per rank per step")
    p.add_argument("--steps", type=int, default=0, help="steps per repetition (0: by model)")
    p.add_argument("--repeats", type=int, default=0, help="repetitions (0: by model)")
    p.add_argument("--intra-threads", type=int, default=1)
    p.add_argument("--no-write", action="store_true", help="print only, write no results")
    p.add_argument(
        "--floors",
        action="store_true",
        help="time a host call that does nothing, one blocking and one polite allreduce in it",
    )
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


def _loop_step(model, opt, x, y):
    """A hand-written loop's step: gradients out, averaged from Python, applied in a second
    traced function."""
    import numpy as np
    import tensorflow as tf
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    variables = model.trainable_variables

    @tf.function
    def gradients():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        return loss, tape.gradient(loss, variables)

    @tf.function
    def apply(grads):
        opt.apply_gradients(zip(grads, variables))

    def step():
        loss, grads = gradients()
        averaged = []
        for g in grads:
            out = np.empty(g.shape, g.dtype.as_numpy_dtype)
            world.Allreduce(g.numpy(), out, MPI.SUM)
            out /= world.size
            averaged.append(out)
        apply(averaged)
        return loss

    return step


def _floor_step(model, opt, x, y, kind: str):
    """The plain step with its gradients through one host call doing ``kind``."""
    import numpy as np
    import tensorflow as tf
    from mpi4py import MPI

    from syncdp.transport.waiting import wait_politely

    world = MPI.COMM_WORLD
    variables = model.trainable_variables
    sizes = [int(np.prod(v.shape)) for v in variables]

    def host(flat):
        out = np.empty_like(flat)
        if kind == "call_allreduce":
            world.Allreduce(flat, out, MPI.SUM)
        elif kind == "call_iallreduce_polite":
            wait_politely(world.Iallreduce(flat, out, MPI.SUM))
        else:
            np.copyto(out, flat)
        return out

    def apart(*arrays):
        return arrays

    # Passed to tf.numpy_function as they are: it keeps AutoGraph out of them itself.
    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        grads = tape.gradient(loss, variables)
        if kind == "call_apart":
            outs = tf.numpy_function(apart, grads, [g.dtype for g in grads], stateful=True)
            opt.apply_gradients(
                zip([tf.ensure_shape(o, v.shape) for o, v in zip(outs, variables)], variables)
            )
            return loss
        flat = tf.concat([tf.reshape(g, [-1]) for g in grads], 0)
        out = tf.numpy_function(host, [flat], tf.float32, stateful=True)
        pieces = tf.split(out, sizes)
        opt.apply_gradients(
            zip([tf.reshape(p, v.shape) for p, v in zip(pieces, variables)], variables)
        )
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

    if args.floors:
        kinds = FLOORS
        variants = {
            k: repeat(_floor_step(model, opt, x, y, k)) for k in FLOORS if k.startswith("call")
        }
        variants = {"plain": repeat(plain), **variants, "syncdp": repeat(synced)}
    else:
        kinds = VARIANTS
        variants = {
            "plain": repeat(plain),
            "naive": repeat(plain, lambda: world.Allreduce(MPI.IN_PLACE, grads, MPI.SUM)),
            "loop": repeat(_loop_step(model, opt, x, y)),
            "syncdp": repeat(synced),
        }
    times = alternate(variants, repeats, sync=world.Barrier, warmup=3)
    every = world.allgather(times)
    if world.rank != 0:
        return None
    # Per repetition, the slowest rank; per step.
    worst = {k: [max(t[k][i] for t in every) / steps for i in range(repeats)] for k in kinds}
    added = {
        k: interval([(a - b) * 1e6 for a, b in zip(worst[k], worst["plain"])]) for k in kinds[1:]
    }
    result = {
        "model": name,
        "kbytes": nbytes / 1e3,
        "np": syncdp.size(),
        "steps": steps,
        "repeats": repeats,
        "kinds": kinds,
        "step_us": {k: interval([t * 1e6 for t in worst[k]]) for k in kinds},
        "added_us": added,
    }
    if not args.floors:
        for k in ("naive", "loop"):
            result[f"syncdp_over_{k}"] = paired_ratio(worst["syncdp"], worst[k])
    return result


def _print(r: dict) -> None:
    say(
        f"{r['model']} ({r['kbytes']:.1f} KB of gradients), np={r['np']}, {r['repeats']} "
        f"alternating repetitions of {r['steps']} steps, slowest rank; median [95% interval]"
    )
    width = max(len(k) for k in r["kinds"])
    for k in r["kinds"]:
        say(f"  {k:<{width}} step {fmt_interval(r['step_us'][k], 0)} us")
    for k in r["kinds"][1:]:
        say(f"  {k:<{width}} adds {fmt_interval(r['added_us'][k], 0)} us per step over plain")
    for k in ("naive", "loop"):
        if f"syncdp_over_{k}" in r:
            say(f"  syncdp step / {k} step: {fmt_interval(r[f'syncdp_over_{k}'])}")


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
    if results and not args.no_write and not args.floors:
        rows = [
            [
                r["model"],
                f"{r['kbytes']:.1f}",
                r["np"],
                *(fmt_interval(r["step_us"][k], 0) for k in VARIANTS),
                fmt_interval(r["added_us"]["naive"], 0),
                fmt_interval(r["added_us"]["loop"], 0),
                fmt_interval(r["added_us"]["syncdp"], 0),
                fmt_interval(r["syncdp_over_naive"]),
                fmt_interval(r["syncdp_over_loop"]),
            ]
            for r in results
        ]
        notes = (
            "Per-step times (us) of the slowest rank, medians with bootstrap 95% intervals "
            "over alternating repetitions; 'adds' is paired by repetition against plain.\n\n"
            f"Machine: {machine(f'{args.intra_threads} intra-op thread(s) per rank')}."
        )
        header = ["model", "KB", "np", *(f"{k} us" for k in VARIANTS)]
        header += ["naive adds us", "loop adds us", "syncdp adds us", "syncdp / naive"]
        header += ["syncdp / loop"]
        write_markdown("step_cost", "The fixed cost of a step", header, rows, notes)


if __name__ == "__main__":
    main()
