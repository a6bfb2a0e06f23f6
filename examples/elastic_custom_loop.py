"""Elastic training with a custom loop: a lost rank is replaced and training goes on.

    syncdp-run -np 3 --min-np 2 python examples/elastic_custom_loop.py --epochs 3

Linear regression on synthetic TFRecords (written on first use, no download), trained with
``DistributedGradientTape`` inside ``hvd.elastic.run``. The state (weights, epoch, batch) is
committed in memory after every step; data comes from ``syncdp.data.elastic_tfrecord_dataset``,
which splits each global batch among the ranks that exist when it runs, so after a membership
change every record of the epoch is still used exactly once. The loss is a sum over the global
batch divided by its size, reduced with ``op=Sum``: the update is the same whatever the number
of ranks, so the result equals one process's.

``--kill LABEL:EPOCH:BATCH[:SIGNAL]`` (repeatable) makes the process labelled LABEL (the
original ranks are 0..N-1, replacements N, N+1, ...) send itself SIGNAL (default KILL) before
that batch (SIGNAL ``exit``: it calls ``sys.exit(3)`` there, leaving the job by its own
choice); ``--kill LABEL:reset`` makes it die in its first reset callback (a failure during
recovery); ``--kill LABEL:refilled`` makes it die at the first step at which a warm spare
started in the background waits (``--spares``: a used or dead spare was replaced).
``--touch EPOCH:BATCH:PATH`` makes rank 0 create PATH before that batch: a host discovery script
that lists more slots once PATH exists then lets the job grow (``--max-np``). The tests use
these; try them by hand to watch the launcher's log.

Every rank prints ``RESULT {json}`` at the end: its label, rank, size, epoch and weights.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import numpy as np

FEATURES = 8
SHARDS = 4


def make_data(records: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The synthetic regression data: ``x`` (records x FEATURES) and ``y``."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(records, FEATURES)).astype(np.float32)
    w = np.linspace(-1.0, 1.0, FEATURES, dtype=np.float32)
    y = (x @ w + 0.5 + 0.1 * rng.normal(size=records)).astype(np.float32)
    return x, y


def file_order(records: int, shards: int) -> np.ndarray:
    """The order the records are read in: write_tfrecord_shards deals them round-robin."""
    return np.concatenate([np.arange(s, records, shards) for s in range(shards)])


def reference(x, y, global_batch: int, epochs: int, lr: float) -> tuple[np.ndarray, float]:
    """One process's result: each global batch of each epoch applied once, in order (``x``
    and ``y`` in the order they are read, see :func:`file_order`)."""
    w, b = np.zeros(FEATURES, np.float64), 0.0
    steps = len(y) // global_batch
    for _ in range(epochs):
        for k in range(steps):
            hi = (k + 1) * global_batch if k < steps - 1 else len(y)
            xb, yb = x[k * global_batch : hi].astype(np.float64), y[k * global_batch : hi]
            err = xb @ w + b - yb
            w -= lr * 2 * (err @ xb) / len(yb)
            b -= lr * 2 * err.sum() / len(yb)
    return w, b


def _write_data(directory: str, records: int, shards: int) -> None:
    """Writes the shards once (the first original rank 0); other ranks wait for them."""
    import syncdp.data

    done = os.path.join(directory, "DONE")
    if os.path.exists(done):
        return
    if os.environ.get("OMPI_COMM_WORLD_RANK", "0") == "0" and not os.environ.get(
        "SYNCDP_REPLACEMENT"
    ):
        x, y = make_data(records)
        examples = ({"id": i, "x": x[i], "y": y[i]} for i in range(records))
        syncdp.data.write_tfrecord_shards(examples, directory, shards)
        open(done, "w").close()
        return
    deadline = time.monotonic() + 120
    while not os.path.exists(done) and time.monotonic() < deadline:
        time.sleep(0.1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--records", type=int, default=600)
    p.add_argument("--global-batch", type=int, default=60)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--data", default="/tmp/syncdp-elastic-data")
    p.add_argument("--kill", action="append", default=[], help="LABEL:EPOCH:BATCH[:SIGNAL]")
    p.add_argument("--touch", default="", help="EPOCH:BATCH:PATH, created by rank 0 there")
    p.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step (demos)")
    args = p.parse_args()

    import tensorflow as tf

    import syncdp.data
    import syncdp.tensorflow as hvd
    from syncdp.job import runtime
    from syncdp.membership import membership, spares

    _write_data(args.data, args.records, SHARDS)
    hvd.init()
    label = membership.me().label
    kills = {}
    for spec in args.kill:
        parts = spec.split(":")
        if int(parts[0]) == label:
            how = parts[3] if len(parts) > 3 else "KILL"
            kills[tuple(parts[1:3])] = how if how == "exit" else getattr(signal, "SIG" + how)

    def parse(record):
        spec = {
            "id": tf.io.FixedLenFeature([], tf.int64),
            "x": tf.io.FixedLenFeature([FEATURES], tf.float32),
            "y": tf.io.FixedLenFeature([], tf.float32),
        }
        e = tf.io.parse_single_example(record, spec)
        return e["x"], e["y"]

    w = tf.Variable(tf.zeros([FEATURES], tf.float64))
    b = tf.Variable(tf.zeros([], tf.float64))
    state = hvd.elastic.TensorFlowState([w, b], epoch=0, batch=0)
    refilled = kills.pop(("refilled",), None)
    # Spares started in the background are labelled after the ranks and spares of the start.
    first_new_spare = hvd.size() + spares.count()
    if any(k[0] == "reset" for k in kills):
        state.register_reset_callbacks([lambda: os.kill(os.getpid(), signal.SIGKILL)])
    files = sorted(
        os.path.join(args.data, f) for f in os.listdir(args.data) if f.endswith(".tfrecord")
    )

    @tf.function
    def step(x, y, n):
        with tf.GradientTape() as tape:
            err = tf.linalg.matvec(tf.cast(x, tf.float64), w) + b - tf.cast(y, tf.float64)
            loss = tf.reduce_sum(err * err) / n  # this rank's part of the global mean
        tape = hvd.DistributedGradientTape(tape, op=hvd.Sum)
        gw, gb = tape.gradient(loss, [w, b])
        w.assign_sub(args.lr * gw)
        b.assign_sub(args.lr * gb)

    total = args.records
    steps = syncdp.data._elastic.elastic_steps(total, args.global_batch)

    @hvd.elastic.run
    def train(state):
        while state.epoch < args.epochs:
            ds = syncdp.data.elastic_tfrecord_dataset(
                files, parse, args.global_batch, epoch=state.epoch, start_batch=state.batch
            )
            for x, y in ds:
                if args.touch and hvd.rank() == 0:
                    epoch, batch, path = args.touch.split(":", 2)
                    if (int(epoch), int(batch)) == (state.epoch, state.batch):
                        open(path, "w").close()
                sig = kills.pop((str(state.epoch), str(state.batch)), None)
                waiting = runtime.elastic_plan().spares
                if refilled and any(m.label >= first_new_spare for m in waiting):
                    sig = refilled
                if sig == "exit":
                    print(f"label {label}: calling sys.exit(3)", flush=True)
                    sys.exit(3)
                if sig is not None:
                    print(f"label {label}: sending myself {sig.name}", flush=True)
                    os.kill(os.getpid(), sig)
                last = state.batch == steps - 1
                n = total - (steps - 1) * args.global_batch if last else args.global_batch
                step(x, y, tf.constant(float(n), tf.float64))
                if args.step_seconds:
                    time.sleep(args.step_seconds)
                state.batch += 1
                state.commit()
            state.epoch += 1
            state.batch = 0
            state.commit()

    train(state)
    result = {
        "label": label,
        "rank": hvd.rank(),
        "size": hvd.size(),
        "epoch": state.epoch,
        "w": w.numpy().tolist(),
        "b": float(b.numpy()),
    }
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
