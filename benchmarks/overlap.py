"""Overlap of gradient averaging with backprop: a ResNet-50 training step, three ways.

In one run, with alternating repetitions, every rank times the same ``tf.function`` step
(forward, backward, SGD update) of ResNet-50 (``keras.applications.ResNet50(weights=None)``,
25.6 M parameters, 102 MB of float32 gradients):

- ``no communication``: a plain ``tf.GradientTape``; the floor;
- ``syncdp, overlap (default)``: ``DistributedGradientTape`` with the default buckets: a 1 MiB
  first bucket of the last layers' gradients, then buckets of up to 25 MiB, each launched as
  soon as its gradients exist;
- ``syncdp, one bucket``: the same with one bucket for all gradients (first bucket and cap
  set past 102 MB), which can only start after the last gradient.

A repetition is one step, its time the slowest rank's. It prints each variant's step time and
its ratio to the floor: per round of alternating repetitions, the variant's time over the
``no communication`` time of the same round, printed as the median of these paired ratios
with a bootstrap 95% interval, ``median [low, high]`` (the step times likewise). On a 2-core
machine two ranks already fill both cores, so there is little idle time for communication to
hide in; the timeline (``--timeline-filename``) shows the first bucket starting during the
backward pass either way.

Usage::

    syncdp-run -np 2 python benchmarks/overlap.py [--batch-size 4] [--image-size 64]

Needs 2 or more ranks. Results go to ``benchmarks/results/overlap.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=4, help="images per rank per step")
    p.add_argument("--image-size", type=int, default=64, help="height and width of the images")
    p.add_argument("--repeats", type=int, default=30, help="alternating rounds of one step")
    p.add_argument("--intra-threads", type=int, default=1)
    p.add_argument("--no-write", action="store_true", help="print only, write no results")
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    setup_threads(args.intra_threads)
    import keras
    import tensorflow as tf
    from mpi4py import MPI

    import syncdp
    from syncdp.job import runtime

    syncdp.init()
    if syncdp.size() < 2:
        say("overlap.py measures communication between ranks; run it with syncdp-run -np 2.")
        sys.exit(2)
    keras.utils.set_random_seed(0)
    shape = (args.image_size, args.image_size, 3)
    model = keras.applications.ResNet50(
        weights=None, input_shape=shape, classes=10, classifier_activation=None
    )
    opt = keras.optimizers.SGD(0.01)
    opt.build(model.trainable_variables)
    syncdp.broadcast_variables(model.variables, root_rank=0)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x = tf.random.normal((args.batch_size, *shape))
    y = tf.zeros([args.batch_size], tf.int32)
    nbytes = sum(v.numpy().nbytes for v in model.trainable_variables)

    def make_step(wrap):
        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = wrap(tape).gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        return step

    config = runtime.get_config()
    steps = {"no communication": make_step(lambda tape: tape)}
    # The bucket sizes are read when a step is traced: trace each variant under its own.
    for label, first, cap in [
        ("syncdp, overlap (default)", config.first_bucket_bytes, config.fusion_threshold),
        ("syncdp, one bucket", 1 << 30, 1 << 30),
    ]:
        runtime._state.config = dataclasses.replace(
            config, first_bucket_bytes=first, fusion_threshold=cap
        )
        step = make_step(syncdp.DistributedGradientTape)
        step()  # trace now, under these settings
        steps[label] = step
    runtime._state.config = config

    world = MPI.COMM_WORLD
    variants = {k: (lambda s=s: s().numpy()) for k, s in steps.items()}
    times = alternate(variants, args.repeats, sync=world.Barrier, warmup=1)
    every = world.gather(times, root=0)
    if syncdp.rank() != 0:
        return
    worst = {k: [max(t[k][i] for t in every) for i in range(len(times[k]))] for k in times}
    floor = worst["no communication"]
    rows = [
        [
            k,
            fmt_interval(interval([t * 1e3 for t in v]), 0),
            fmt_interval(paired_ratio(v, floor)) if k != "no communication" else "1 (the floor)",
        ]
        for k, v in worst.items()
    ]
    cfg = (
        f"ResNet-50, {nbytes / 1e6:.1f} MB of float32 gradients, batch {args.batch_size} per "
        f"rank of {args.image_size}x{args.image_size} images, SGD, np={syncdp.size()}; "
        f"default buckets: first {config.first_bucket_bytes >> 20} MiB, cap "
        f"{config.fusion_threshold >> 20} MiB; {args.repeats} alternating repetitions, "
        "slowest rank, median [95% interval]"
    )
    mach = machine(f"{args.intra_threads} intra-op thread per rank")
    say(f"overlap: {cfg}\nmachine: {mach}")
    say(f"{'variant':<28}{'step ms':>18}{'time / no comm':>24}")
    for row in rows:
        say(f"{row[0]:<28}{row[1]:>18}{row[2]:>24}")
    if not args.no_write:
        write_markdown(
            "overlap",
            "ResNet-50 step: averaging with overlap, in one bucket, and no communication",
            ["variant", "step ms (slowest rank)", "time / no-communication time"],
            rows,
            f"{cfg}. A ratio is the median of the per-repetition ratios (paired by round) with "
            f"a bootstrap 95% interval in brackets.\n\nMachine: {mach}.",
        )


if __name__ == "__main__":
    main()
