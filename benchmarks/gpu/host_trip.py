"""Where a GPU step's reduction time goes: the trip of the gradients through host memory.

    syncdp-run -np 2 python benchmarks/gpu/host_trip.py      # on the lent GPU machine

syncdp has no CUDA code: a bucket's tensors leave the GPU for a host call, are reduced there and
come back (docs/performance.md, "On a GPU": 12.6 MB added about 10 ms to a 1.35 ms step). This
times the pieces of that trip for the same bytes, each as a traced call, alternating, the
slowest rank's time, and prints what each adds over a call that only touches the tensors on
the device (median and bootstrap 95% interval, milliseconds):

- ``copies``: to the host and back (``tf.identity`` on the CPU, then on the GPU);
- ``host call``: a ``tf.numpy_function`` that returns its inputs (syncdp's path with no work);
- ``MPI``: ``MPI.Allreduce`` of the same bytes already in host memory (what the host part of the
  reduction costs at least);
- ``syncdp``: ``syncdp.grouped_allreduce`` of the tensors (the whole trip).

Where TensorFlow sees no GPU it runs on the CPU (a dry run: the copies cost nothing there).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import alternate, interval, setup_threads  # noqa: E402

__all__ = ["main"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--megabytes", type=float, default=12.6, help="bytes of float32 in all")
    p.add_argument("--tensors", type=int, default=3, help="tensors the bytes are split into")
    p.add_argument("--calls", type=int, default=5, help="calls per timed repetition")
    p.add_argument("--repeats", type=int, default=20, help="timed repetitions per variant")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    setup_threads(1)
    import numpy as np
    import tensorflow as tf
    from mpi4py import MPI

    import syncdp

    syncdp.init()
    world = MPI.COMM_WORLD
    gpus = tf.config.get_visible_devices("GPU")
    device = "/GPU:0" if gpus else "/CPU:0"
    each = int(args.megabytes * 1e6 / 4 / args.tensors)
    with tf.device(device):
        tensors = [tf.random.normal([each], seed=i) for i in range(args.tensors)]
    host = [
        np.random.default_rng(i).standard_normal(each).astype(np.float32)
        for i in range(args.tensors)
    ]
    sums = [np.empty_like(a) for a in host]

    def traced(body):
        fn = tf.function(body)

        def run():
            for _ in range(args.calls):
                out = fn()
            out.numpy()  # waits for the device

        return run

    def touch():  # the baseline: the tensors used on the device, nothing moved
        with tf.device(device):
            return tf.add_n([tf.reduce_sum(t) for t in tensors])

    def copies():
        with tf.device("/CPU:0"):
            out = [tf.identity(t) for t in tensors]
        with tf.device(device):
            return tf.add_n([tf.reduce_sum(tf.identity(o)) for o in out])

    def host_call():
        out = tf.numpy_function(lambda *a: a, tensors, [tf.float32] * len(tensors))
        with tf.device(device):
            return tf.add_n([tf.reduce_sum(o) for o in out])

    def reduced():
        out = syncdp.grouped_allreduce(tensors, name="host_trip")
        with tf.device(device):
            return tf.add_n([tf.reduce_sum(o) for o in out])

    def mpi():
        for _ in range(args.calls):
            for a, out in zip(host, sums, strict=True):
                world.Allreduce(a, out, op=MPI.SUM)

    variants = {
        "touch": traced(touch),
        "copies": traced(copies),
        "host call": traced(host_call),
        "syncdp": traced(reduced),
        "MPI": mpi,
    }
    times = alternate(variants, args.repeats, sync=world.Barrier, warmup=2)
    every = world.allgather(times)
    if world.rank != 0:
        return
    slowest = {k: [max(t[k][i] for t in every) for i in range(args.repeats)] for k in times}
    where = "GPU" if gpus else "CPU (no GPU visible: a dry run)"
    print(
        f"host_trip: {args.tensors} x {each * 4 / 1e6:.1f} MB on the {where}, np={world.size}, "
        f"{args.repeats} alternating repetitions of {args.calls} calls, slowest rank; "
        "ms per call, median [95% interval]",
        flush=True,
    )
    base = slowest["touch"]
    print(f"  touch on the device      {1e3 * np.median(base) / args.calls:.3f} ms", flush=True)
    for name in ("copies", "host call", "syncdp"):
        added = [(v - b) * 1e3 / args.calls for v, b in zip(slowest[name], base)]
        mid, lo, hi = interval(added)
        print(f"  {name:<24} adds {mid:.3f} [{lo:.3f}, {hi:.3f}] ms", flush=True)
    mid, lo, hi = interval([v * 1e3 / args.calls for v in slowest["MPI"]])
    print(f"  {'MPI (host arrays)':<24} takes {mid:.3f} [{lo:.3f}, {hi:.3f}] ms", flush=True)


if __name__ == "__main__":
    main()
