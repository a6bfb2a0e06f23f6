"""Synthetic training benchmark: images per second per rank and in total, and scaling.

Random images, a real model, a real optimizer: every step computes gradients with
``syncdp.DistributedGradientTape`` and applies them, as a training script would. Only the data
is fake, so the figures are the model's compute plus syncdp's communication.

Usage::

    # throughput at one size (rank 0 prints the table)
    syncdp-run -np 2 python benchmarks/synthetic.py --model cnn --batch-size 32
    # synchronous training against the same program without allreduce (needs 2+ ranks)
    syncdp-run -np 2 python benchmarks/synthetic.py --compare-no-comm
    # scaling efficiency at np=1..N: run without syncdp-run, it launches each size itself
    python benchmarks/synthetic.py --scaling 1,2

Models: ``cnn`` (2.2M parameters, 32x32 images), ``mobilenetv2`` and ``resnet50`` (Keras
applications, random weights; ``--image-size`` sets their input, default 64 to stay quick on a
CPU). ``--fp16`` sends gradients as float16 (``syncdp.Compression.fp16``). Each rank uses
``--intra-threads`` threads per op (default 1, as with 2 ranks on 2 cores).

A repetition is ``--steps`` steps, its time the slowest rank's (a synchronous step is as slow
as its slowest rank); images per second are the medians over ``--repeats`` repetitions. With
``--compare-no-comm`` (or ``--overhead``) the variants alternate repetitions, and the row
``ratio syncdp / no allreduce`` (``/ plain TF``) is syncdp's throughput over the other's: per
round, the other variant's time over syncdp's, printed as the median of these paired ratios
with a bootstrap 95% interval, ``median [low, high]``. The scaling efficiency compares
separate jobs, so it has no paired interval.

Results go to ``benchmarks/results/synthetic*.md`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    alternate,
    fmt_interval,
    machine,
    median,
    paired_ratio,
    plot_lines,
    say,
    setup_threads,
    write_markdown,
)

__all__ = ["build_model", "main", "training_setup", "training_step"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["cnn", "mobilenetv2", "resnet50"], default="cnn")
    p.add_argument("--batch-size", type=int, default=32, help="images per rank per step")
    p.add_argument("--image-size", type=int, default=None, help="default 32 (cnn) or 64")
    p.add_argument("--fp16", action="store_true", help="float16 gradient compression")
    p.add_argument("--steps", type=int, default=5, help="steps per timed repetition")
    p.add_argument("--repeats", type=int, default=30, help="timed repetitions per variant")
    p.add_argument("--intra-threads", type=int, default=1)
    p.add_argument(
        "--compare-no-comm",
        action="store_true",
        help="also time the same training with no allreduce; needs 2+ ranks",
    )
    p.add_argument(
        "--overhead",
        action="store_true",
        help="also time plain TensorFlow (no syncdp tape); the np=1 overhead",
    )
    p.add_argument(
        "--scaling", default="", help="comma-separated rank counts; launches syncdp-run for each"
    )
    p.add_argument("--json-out", default="", help=argparse.SUPPRESS)
    p.add_argument("--no-write", action="store_true", help="print only, write no results")
    return p


def build_model(name: str, image_size: int, classes: int = 10):
    """The Keras model benchmarked under ``name``."""
    import keras

    shape = (image_size, image_size, 3)
    if name == "resnet50":
        return keras.applications.ResNet50(weights=None, input_shape=shape, classes=classes)
    if name == "mobilenetv2":
        return keras.applications.MobileNetV2(weights=None, input_shape=shape, classes=classes)
    layers = keras.layers
    return keras.Sequential(
        [
            keras.Input(shape),
            layers.Conv2D(32, 3, padding="same", activation="relu"),
            layers.Conv2D(64, 3, padding="same", activation="relu"),
            layers.MaxPooling2D(),
            layers.Conv2D(128, 3, padding="same", activation="relu"),
            layers.MaxPooling2D(),
            layers.Flatten(),
            layers.Dense(256, activation="relu"),
            layers.Dense(classes),
        ]
    )


def training_setup(name: str, image: int, batch_size: int, rank: int):
    """The benchmarked model, optimizer, loss and this rank's random batch, with the model's
    initial state broadcast from rank 0: ``(model, opt, loss_fn, x, y)``."""
    import keras
    import numpy as np
    import tensorflow as tf

    import syncdp

    model = build_model(name, image)
    opt = keras.optimizers.SGD(0.01, momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(rank)
    x = tf.constant(rng.random((batch_size, image, image, 3), dtype=np.float32))
    y = tf.constant(rng.integers(0, 10, batch_size))
    model(x[:1])
    opt.build(model.trainable_variables)
    syncdp.broadcast_variables(model.variables, root_rank=0)  # syncdp:
    return model, opt, loss_fn, x, y


def training_step(model, opt, loss_fn, x, y, distributed: bool, compression=None):
    """One SGD step on ``x, y`` as a ``tf.function``, its gradients averaged over the ranks
    by ``DistributedGradientTape`` when ``distributed`` (else each rank trains alone)."""
    import tensorflow as tf

    import syncdp

    compression = compression or syncdp.Compression.none

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        if distributed:
            tape = syncdp.DistributedGradientTape(tape, compression=compression)  # syncdp:
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


def _measure(args) -> dict:
    """Runs on every rank under syncdp-run; returns rank 0's figures."""
    setup_threads(args.intra_threads)
    import numpy as np
    from mpi4py import MPI

    import syncdp

    syncdp.init()  # syncdp:
    size, rank = syncdp.size(), syncdp.rank()
    if args.compare_no_comm and size < 2:
        say(
            "--compare-no-comm compares 2+ synchronous ranks with 2+ independent ones; "
            "run it with syncdp-run -np 2 or more."
        )
        sys.exit(2)
    image = args.image_size or (32 if args.model == "cnn" else 64)
    model, opt, loss_fn, x, y = training_setup(args.model, image, args.batch_size, rank)
    compression = syncdp.Compression.fp16 if args.fp16 else syncdp.Compression.none

    def make_step(distributed: bool):
        step = training_step(model, opt, loss_fn, x, y, distributed, compression)

        def run():
            for _ in range(args.steps):
                loss = step()
            loss.numpy()

        return run

    variants = {"syncdp": make_step(True)}
    if args.compare_no_comm:
        variants["no allreduce"] = make_step(False)
    elif args.overhead:
        variants["plain TF"] = make_step(False)
    barrier = MPI.COMM_WORLD.Barrier
    times = alternate(variants, args.repeats, sync=barrier)
    # A step is as slow as the slowest rank: take every repetition's maximum over ranks.
    every = MPI.COMM_WORLD.allgather(times)
    worst = {k: [max(t[k][i] for t in every) for i in range(args.repeats)] for k in times}
    per_rank = {k: args.batch_size * args.steps / median(v) for k, v in worst.items()}
    # Throughput syncdp / other is time other / syncdp, paired by round: load that hits a
    # round hits both sides of its ratio. (median, low, high).
    ratio = {k: paired_ratio(v, worst["syncdp"]) for k, v in worst.items() if k != "syncdp"}
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    return {
        "np": size,
        "model": args.model,
        "params": params,
        "image": image,
        "batch": args.batch_size,
        "fp16": args.fp16,
        "steps": args.steps,
        "repeats": args.repeats,
        "per_rank": per_rank,
        "ratio": ratio,
        "total": {k: v * size for k, v in per_rank.items()},
        "rank": rank,
        "machine": machine(f"np={size}, {args.intra_threads} intra-op thread(s) per rank"),
    }


def _report_one(r: dict, write: bool) -> None:
    cfg = (
        f"{r['model']} ({r['params'] / 1e6:.2f}M params), {r['image']}x{r['image']} images, "
        f"batch {r['batch']} per rank, fp16 {'on' if r['fp16'] else 'off'}, np={r['np']}, "
        f"{r['repeats']} repetitions of {r['steps']} steps, slowest rank"
    )
    rows = [[k, f"{r['per_rank'][k]:.1f}", f"{r['total'][k]:.1f}"] for k in r["per_rank"]]
    for other, iv in r["ratio"].items():
        rows.append([f"ratio syncdp / {other}", fmt_interval(iv), ""])
    say(f"synthetic: {cfg}\nmachine: {r['machine']}")
    say(f"{'variant':<30}{'img/s per rank':>24}{'img/s total':>14}")
    for row in rows:
        say(f"{row[0]:<30}{row[1]:>24}{row[2]:>14}")
    if not write:
        return
    name = f"synthetic_np{r['np']}"
    if "no allreduce" in r["per_rank"]:
        name = "synthetic_no_comm"
    elif "plain TF" in r["per_rank"]:
        name = f"synthetic_overhead_np{r['np']}"
    write_markdown(
        name,
        "Synthetic training throughput",
        ["variant", "img/s per rank", "img/s total"],
        rows,
        f"{cfg}. Images per second: medians over the repetitions. A ratio row: the median of "
        f"the per-repetition ratios (paired by round of alternating repetitions) with a "
        f"bootstrap 95% interval in brackets.\n\nMachine: {r['machine']}.",
    )
    series = {k: ([0], [v]) for k, v in r["total"].items()}
    plot_lines(
        name,
        f"{r['model']}, np={r['np']}: img/s total",
        series,
        xlabel="",
        ylabel="images/s",
        kind="bar",
    )


def _scaling(args) -> None:
    sizes = [int(s) for s in args.scaling.split(",")]
    results = []
    for n in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "r.json")
            cmd = [
                "syncdp-run",
                "-np",
                str(n),
                sys.executable,
                os.path.abspath(__file__),
                "--model",
                args.model,
                "--batch-size",
                str(args.batch_size),
                "--steps",
                str(args.steps),
                "--repeats",
                str(args.repeats),
                "--intra-threads",
                str(args.intra_threads),
                "--json-out",
                out,
                "--no-write",
            ]
            if args.image_size:
                cmd += ["--image-size", str(args.image_size)]
            if args.fp16:
                cmd.append("--fp16")
            print(f"running np={n}: {' '.join(cmd)}", flush=True)
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            results.append(json.loads(Path(out).read_text()))
    base = results[0]["total"]["syncdp"] / results[0]["np"]
    rows = []
    for r in results:
        total = r["total"]["syncdp"]
        rows.append(
            [
                r["np"],
                f"{r['per_rank']['syncdp']:.1f}",
                f"{total:.1f}",
                f"{total / (r['np'] * base):.3f}",
            ]
        )
    r0 = results[-1]
    cfg = (
        f"{r0['model']} ({r0['params'] / 1e6:.2f}M params), {r0['image']}x{r0['image']} "
        f"images, batch {r0['batch']} per rank, fp16 {'on' if r0['fp16'] else 'off'}"
    )
    print(f"scaling: {cfg}\nmachine: {r0['machine']}")
    print(f"{'np':>4}{'img/s per rank':>16}{'img/s total':>14}{'efficiency':>12}")
    for row in rows:
        print(f"{row[0]:>4}{row[1]:>16}{row[2]:>14}{row[3]:>12}")
    if args.no_write:
        return
    note = (
        f"{cfg}.\n\nEfficiency = total img/s at np=N / (N x img/s at np={results[0]['np']}"
        f" per rank). On a machine with fewer cores than ranks x threads, ranks share cores"
        f" and efficiency measures that sharing, not only communication.\n\n"
        f"Machine: {r0['machine']}."
    )
    write_markdown(
        "synthetic_scaling",
        "Synthetic training: scaling",
        ["np", "img/s per rank", "img/s total", "scaling efficiency"],
        rows,
        note,
    )
    plot_lines(
        "synthetic_scaling",
        f"{r0['model']}: images/s total vs ranks",
        {
            "syncdp": ([r["np"] for r in results], [r["total"]["syncdp"] for r in results]),
            "ideal": ([r["np"] for r in results], [base * r["np"] for r in results]),
        },
        xlabel="ranks",
        ylabel="images/s",
    )


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.scaling:
        _scaling(args)
        return
    r = _measure(args)
    if r["rank"] != 0:
        return
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(r))
    _report_one(r, not args.no_write)


if __name__ == "__main__":
    main()
