"""Allreduce latency and bandwidth against message size, OSU style, and the ResNet-50 ratio.

Compares, at each size, in one run with alternating repetitions:

- ``raw mpi4py``: one ``comm.Allreduce(send, recv, MPI.SUM)`` of a contiguous float32 buffer;
- ``tf.function, no MPI``: a ``tf.function`` that only computes ``t + 0`` (TensorFlow's own
  per-call cost, a floor for the syncdp variants);
- ``syncdp eager``: ``syncdp.allreduce`` (Average) called eagerly;
- ``syncdp tf.function``: the same inside ``tf.function``;
- ``syncdp fp16``: inside ``tf.function`` with ``Compression.fp16``.

Bandwidth is the message size over the median time (OSU's "algorithm bandwidth"), rank 0's.
Each TensorFlow variant is timed until its call returns with the result computed, without
converting the result to NumPy (a copy raw MPI does not make). The last column,
``syncdp tf.function / raw bandwidth``, is per round of alternating repetitions raw time /
syncdp time: the median of these paired ratios with a bootstrap 95% interval.

``--resnet50`` instead times averaging ResNet-50's trainable-variable gradients (shapes from
``keras.applications.ResNet50(weights=None)``) through ``reduce_gradients``, the function
``DistributedGradientTape`` calls, inside ``tf.function``, against one raw mpi4py
``Allreduce`` of a single buffer of the same bytes and a shared-memory bound, the slowest
rank's time per repetition. It prints each one's time and two ratios, each the median of the
per-repetition ratios (paired by round) with a bootstrap 95% interval: raw time / syncdp time
(above 1 means syncdp is faster) and syncdp time / shared-memory bound, each printed as
``median [low, high]``.

Usage::

    syncdp-run -np 2 python benchmarks/allreduce.py            # the size sweep
    syncdp-run -np 2 python benchmarks/allreduce.py --resnet50 # the ResNet-50 ratio

Needs 2 or more ranks. Results go to ``benchmarks/results/allreduce*.md`` and ``.png``.
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
    median,
    paired_ratio,
    plot_lines,
    say,
    setup_threads,
    write_markdown,
)

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--resnet50", action="store_true", help="the ResNet-50 gradient ratio")
    p.add_argument("--min-kib", type=int, default=4, help="smallest message (KiB)")
    p.add_argument("--max-mib", type=int, default=64, help="largest message (MiB)")
    p.add_argument(
        "--repeats", type=int, default=0, help="repetitions (default: by size; 30 for --resnet50)"
    )
    p.add_argument("--intra-threads", type=int, default=1)
    p.add_argument("--no-write", action="store_true", help="print only, write no results")
    return p


def _setup(args):
    setup_threads(args.intra_threads)
    from mpi4py import MPI

    import syncdp

    syncdp.init()
    if syncdp.size() < 2:
        say(
            "allreduce.py compares collectives between ranks; run it with syncdp-run -np 2 "
            "(or more)."
        )
        sys.exit(2)
    return syncdp, MPI


def _resnet50(args) -> None:
    syncdp, MPI = _setup(args)
    import keras
    import numpy as np
    import tensorflow as tf

    from syncdp.tensorflow.tape import reduce_gradients

    shapes = [tuple(v.shape) for v in keras.applications.ResNet50(weights=None).trainable_variables]
    rng = np.random.default_rng(syncdp.rank())
    grads = [tf.constant(rng.standard_normal(s, dtype=np.float32)) for s in shapes]
    nbytes = sum(int(np.prod(s)) * 4 for s in shapes)
    send = np.ones(nbytes // 4, np.float32)
    recv = np.empty_like(send)
    world = MPI.COMM_WORLD

    @tf.function
    def average(gs):
        return reduce_gradients(gs)

    def run_syncdp():
        out = average(grads)
        out[0].numpy()  # wait for the step

    variants = {
        "raw mpi4py Allreduce (1 buffer)": lambda: world.Allreduce(send, recv, MPI.SUM),
        "shared-memory bound (1 buffer)": _shared_memory_bound(world, MPI, send, recv),
        "syncdp reduce_gradients (tf.function)": run_syncdp,
    }
    times = alternate(variants, args.repeats or 30, sync=world.Barrier, warmup=2)
    every = world.gather(times, root=0)
    if syncdp.rank() != 0:
        return
    worst = {k: [max(t[k][i] for t in every) for i in range(len(times[k]))] for k in times}
    med = {k: median(v) for k, v in worst.items()}
    raw, bound, ours = worst.values()
    rows = [
        [k, fmt_interval(interval([t * 1e3 for t in v]), 1), f"{nbytes / med[k] / 1e9:.2f}"]
        for k, v in worst.items()
    ]
    # Paired by round: load that hits a round hits both sides of its ratio.
    rows.append(["ratio raw time / syncdp time", fmt_interval(paired_ratio(raw, ours)), ""])
    rows.append(
        ["ratio syncdp time / shared-memory bound", fmt_interval(paired_ratio(ours, bound)), ""]
    )
    cfg = (
        f"ResNet-50 trainable-variable gradients: {len(shapes)} tensors, {nbytes / 1e6:.1f} "
        f"MB float32, Average, np={syncdp.size()}, fusion threshold "
        f"{syncdp.job.runtime.get_config().fusion_threshold >> 20} MiB, chunk "
        f"{syncdp.job.runtime.get_config().chunk_bytes >> 10} KiB; {len(raw)} alternating "
        "repetitions, slowest rank, median [95% interval]"
    )
    mach = machine(f"{args.intra_threads} intra-op thread per rank")
    say(f"allreduce --resnet50: {cfg}\nmachine: {mach}")
    say(f"{'variant':<42}{'ms':>24}{'GB/s':>8}")
    for row in rows:
        say(f"{row[0]:<42}{row[1]:>24}{row[2]:>8}")
    if not args.no_write:
        write_markdown(
            "allreduce_resnet50",
            "ResNet-50 gradients: syncdp against raw MPI",
            ["variant", "ms (slowest rank)", "GB/s (at the median)"],
            rows,
            f"{cfg}. A ratio is the median of the per-repetition ratios (paired by round) with "
            f"a bootstrap 95% interval in brackets.\n\nMachine: {mach}.",
        )
        plot_lines(
            "allreduce_resnet50",
            "ResNet-50 gradient average (ms, lower is better)",
            {k.split(" (")[0]: ([0], [v * 1e3]) for k, v in med.items()},
            xlabel="",
            ylabel="ms",
            kind="bar",
        )


def _shared_memory_bound(world, MPI, send, recv):
    """The least an allreduce on one host can do, written as plainly as possible.

    Every rank's whole buffer lives in one MPI-3 shared window: each rank copies its input
    in, rank ``i`` sums slice ``i`` of all ``n`` buffers with NumPy (into its own slice),
    and every rank copies the ``n`` reduced slices out; two barriers. No segmenting, no
    framework: the memory traffic an intra-host allreduce cannot avoid.
    """
    import numpy as np

    n, me = world.Get_size(), world.Get_rank()
    win = MPI.Win.Allocate_shared(send.nbytes, send.itemsize, comm=world)
    bufs = [np.frombuffer(win.Shared_query(r)[0], send.dtype, count=send.size) for r in range(n)]
    edges = [send.size * i // n for i in range(n + 1)]
    lo, hi = edges[me], edges[me + 1]

    def run():
        np.copyto(bufs[me], send)
        world.Barrier()
        np.add(bufs[0][lo:hi], bufs[1][lo:hi], out=recv[lo:hi])
        for r in range(2, n):
            np.add(recv[lo:hi], bufs[r][lo:hi], out=recv[lo:hi])
        np.copyto(bufs[me][lo:hi], recv[lo:hi])
        world.Barrier()
        for r in range(n):
            if r != me:
                np.copyto(recv[edges[r] : edges[r + 1]], bufs[r][edges[r] : edges[r + 1]])

    return run


def _sweep(args) -> None:
    syncdp, MPI = _setup(args)
    import numpy as np
    import tensorflow as tf

    world = MPI.COMM_WORLD
    sizes = []
    nbytes = args.min_kib * 1024
    while nbytes <= args.max_mib * 1024 * 1024:
        sizes.append(nbytes)
        nbytes *= 4
    table, ratio = {}, {}
    for nbytes in sizes:
        n = nbytes // 4
        send = np.ones(n, np.float32)
        recv = np.empty_like(send)
        x = tf.ones([n])
        graph = tf.function(lambda t: syncdp.allreduce(t, name="bench"))
        fp16 = tf.function(
            lambda t: syncdp.allreduce(t, name="bench16", compression=syncdp.Compression.fp16)
        )
        floor = tf.function(lambda t: t + 0.0)
        variants = {
            "raw mpi4py": lambda s=send, r=recv: world.Allreduce(s, r, MPI.SUM),
            # A call returns once its result is computed (TensorFlow runs eagerly and
            # synchronously on the CPU); .numpy() would add a copy raw MPI does not make.
            "tf.function, no MPI": lambda f=floor, x=x: f(x),
            "syncdp eager": lambda x=x: syncdp.allreduce(x, name="bench_eager"),
            "syncdp tf.function": lambda g=graph, x=x: g(x),
            "syncdp fp16": lambda g=fp16, x=x: g(x),
        }
        repeats = args.repeats or max(15, min(200, (64 << 20) // nbytes))
        times = alternate(variants, repeats, sync=world.Barrier, warmup=2)
        table[nbytes] = {k: median(v) for k, v in times.items()}
        # Raw time / syncdp time, paired by round (load hits both sides of a ratio alike).
        ratio[nbytes] = paired_ratio(times["raw mpi4py"], times["syncdp tf.function"])
        say(
            f"  {nbytes >> 10:>8} KiB: "
            + "  ".join(f"{k} {v * 1e6:.0f} us" for k, v in table[nbytes].items()),
            rank=world.rank,
        )
    if syncdp.rank() != 0:
        return
    names = list(next(iter(table.values())))
    header = (
        ["size"]
        + [f"{k} us" for k in names]
        + [f"{k} GB/s" for k in names]
        + ["syncdp tf.function / raw bandwidth"]
    )
    rows = []
    for nbytes, t in table.items():
        size = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
        rows.append(
            [size]
            + [f"{t[k] * 1e6:.0f}" for k in names]
            + [f"{nbytes / t[k] / 1e9:.2f}" for k in names]
            + [fmt_interval(ratio[nbytes], 2)]
        )
    mach = machine(f"np={syncdp.size()}, {args.intra_threads} intra-op thread per rank")
    say(f"allreduce sweep (float32, Average for syncdp, SUM for raw)\nmachine: {mach}")
    say("  ".join(f"{h:>18}" for h in header[: 1 + len(names)]) + f"{'raw / syncdp tf.fn':>24}")
    for row in rows:
        say("  ".join(f"{c:>18}" for c in row[: 1 + len(names)]) + f"{row[-1]:>24}")
    if args.no_write:
        return
    write_markdown(
        "allreduce",
        "Allreduce latency and bandwidth",
        header,
        rows,
        f"float32 messages, median of alternating repetitions, rank 0's time. The last "
        f"column is the median of the per-repetition ratios raw time / syncdp tf.function "
        f"time (paired by round) with a bootstrap 95% interval in brackets. "
        f"fp16 sends half the bytes; its bandwidth counts the float32 size. "
        f"'tf.function, no MPI' is a tf.function computing t + 0 and nothing else: the cost "
        f"of calling TensorFlow at all, a floor under both syncdp columns.\n\n"
        f"Machine: {mach}.",
    )
    xs = [b / 1024 for b in table]
    plot_lines(
        "allreduce",
        "Allreduce bandwidth (higher is better)",
        {k: (xs, [b / table[b][k] / 1e9 for b in table]) for k in names},
        xlabel="message size (KiB)",
        ylabel="GB/s",
        logx=True,
    )


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.resnet50:
        _resnet50(args)
    else:
        _sweep(args)


if __name__ == "__main__":
    main()
