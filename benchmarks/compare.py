"""One model and batch trained three ways, side by side: syncdp, MultiWorkerMirrored, a PS.

- ``syncdp``: ``syncdp-run -np N``, ``DistributedGradientTape`` (fused MPI allreduce).
- ``MultiWorkerMirroredStrategy``: N worker processes on this host, ``TF_CONFIG`` with gRPC
  ports on 127.0.0.1, the same step under ``strategy.run`` (TF's collective all-reduce).
- ``parameter server``: the replica_device_setter design, synchronous: the variables live on
  one server (rank 0, which also trains, as a PS task on a worker host would); every step the
  workers push their gradients to it, it averages and applies them, and the workers pull the
  new weights. Over MPI between the same N processes, so only the architecture differs.

The driver runs each setup as its own job, ``--rounds`` times in rotation (so load from other
programs hits each alike), and reports the median step throughput.

Usage::

    python benchmarks/compare.py                 # np=2, small CNN, batch 32 per worker
    python benchmarks/compare.py --np 2 --steps 30 --rounds 3

Needs 2 or more workers. Results go to ``benchmarks/results/compare.md`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine, median, plot_lines, setup_threads, write_markdown

__all__ = ["main"]

SETUPS = ["syncdp", "MultiWorkerMirroredStrategy", "parameter server"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=int, default=2, help="workers (>= 2)")
    p.add_argument("--model", choices=["cnn", "mobilenetv2", "resnet50"], default="cnn")
    p.add_argument("--batch-size", type=int, default=32, help="images per worker per step")
    p.add_argument("--steps", type=int, default=20, help="timed steps per job")
    p.add_argument("--rounds", type=int, default=2, help="jobs per setup, in rotation")
    p.add_argument("--timeout", type=float, default=600, help="seconds per job")
    p.add_argument("--role", choices=["syncdp", "mwms", "ps"], help=argparse.SUPPRESS)
    p.add_argument("--task", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--json-out", default="", help=argparse.SUPPRESS)
    return p


def _data(args, seed):
    import numpy as np
    import tensorflow as tf

    image = 32 if args.model == "cnn" else 64
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.random((args.batch_size, image, image, 3), dtype=np.float32))
    y = tf.constant(rng.integers(0, 10, args.batch_size))
    return image, x, y


def _time_steps(step, args) -> float:
    for _ in range(3):
        step()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    return (time.perf_counter() - start) / args.steps


def _worker(args) -> None:
    setup_threads(1)
    import keras
    import tensorflow as tf
    from synthetic import build_model

    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if args.role == "mwms":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        rank, size = args.task, args.np
        image, x, y = _data(args, rank)
        with strategy.scope():
            model = build_model(args.model, image)
            opt = keras.optimizers.SGD(0.01, momentum=0.9)

        @tf.function
        def train():
            def replica_step():
                with tf.GradientTape() as tape:
                    loss = loss_fn(y, model(x, training=True))
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))
                return loss

            return strategy.run(replica_step)

        def step():
            train().numpy()
    else:
        import numpy as np
        from mpi4py import MPI

        import syncdp

        syncdp.init()
        rank, size = syncdp.rank(), syncdp.size()
        image, x, y = _data(args, rank)
        model = build_model(args.model, image)
        opt = keras.optimizers.SGD(0.01, momentum=0.9)
        model(x[:1])
        opt.build(model.trainable_variables)
        syncdp.broadcast_variables(model.variables)
        if args.role == "syncdp":

            @tf.function
            def train():
                with tf.GradientTape() as tape:
                    loss = loss_fn(y, model(x, training=True))
                tape = syncdp.DistributedGradientTape(tape)  # syncdp:
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))
                return loss

            def step():
                train().numpy()
        else:
            world = MPI.COMM_WORLD
            variables = model.trainable_variables

            @tf.function
            def compute():
                with tf.GradientTape() as tape:
                    loss = loss_fn(y, model(x, training=True))
                grads = tape.gradient(loss, variables)
                return tf.concat([tf.reshape(g, [-1]) for g in grads], 0)

            @tf.function
            def apply(flat):
                sizes = [int(np.prod(v.shape)) for v in variables]
                pieces = tf.split(flat, sizes)
                opt.apply_gradients((tf.reshape(p, v.shape), v) for p, v in zip(pieces, variables))

            @tf.function
            def assign(flat):
                sizes = [int(np.prod(v.shape)) for v in variables]
                for p, v in zip(tf.split(flat, sizes), variables):
                    v.assign(tf.reshape(p, v.shape))

            def step():
                mine = compute().numpy()
                pushed = np.empty((size, mine.size), np.float32) if rank == 0 else None
                world.Gather(mine, pushed, root=0)  # push gradients to the server
                if rank == 0:
                    apply(tf.constant(pushed.mean(axis=0)))
                    weights = tf.concat([tf.reshape(v, [-1]) for v in variables], 0).numpy()
                else:
                    weights = np.empty_like(mine)
                world.Bcast(weights, root=0)  # pull the new weights
                if rank != 0:
                    assign(tf.constant(weights))

    seconds = _time_steps(step, args)
    if rank == 0 and args.json_out:
        params = model.count_params()
        Path(args.json_out).write_text(
            json.dumps({"step": seconds, "np": size, "params": params, "image": image})
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_setup(setup: str, args, out: str) -> None:
    me = [
        sys.executable,
        os.path.abspath(__file__),
        "--np",
        str(args.np),
        "--model",
        args.model,
        "--batch-size",
        str(args.batch_size),
        "--steps",
        str(args.steps),
        "--json-out",
        out,
    ]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    if setup != "MultiWorkerMirroredStrategy":
        role = "syncdp" if setup == "syncdp" else "ps"
        subprocess.run(
            ["syncdp-run", "-np", str(args.np)] + me + ["--role", role],
            check=True,
            stdout=subprocess.DEVNULL,
            timeout=args.timeout,
            env=env,
        )
        return
    workers = [f"127.0.0.1:{_free_port()}" for _ in range(args.np)]
    procs = []
    for i in range(args.np):
        tf_config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}
        procs.append(
            subprocess.Popen(
                me + ["--role", "mwms", "--task", str(i)],
                env=dict(env, TF_CONFIG=json.dumps(tf_config)),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    deadline = time.monotonic() + args.timeout
    for p in procs:
        try:
            p.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    if any(p.returncode for p in procs):
        raise RuntimeError(
            f"MultiWorkerMirroredStrategy workers exited with {[p.returncode for p in procs]}"
        )


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.role:
        _worker(args)
        return
    if args.np < 2:
        print("compare.py compares distributed setups; it needs --np 2 or more.")
        sys.exit(2)
    steps: dict[str, list[float]] = {s: [] for s in SETUPS}
    info = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for setup in SETUPS[r % 3 :] + SETUPS[: r % 3]:
                out = os.path.join(tmp, "r.json")
                print(f"round {r + 1}: {setup} ...", flush=True)
                try:
                    _run_setup(setup, args, out)
                    result = json.loads(Path(out).read_text())
                    steps[setup].append(result["step"])
                    info = result
                except (subprocess.SubprocessError, RuntimeError, OSError) as e:
                    print(f"  {setup} failed: {e}", flush=True)
                if os.path.exists(out):
                    os.remove(out)
    base = median(steps["syncdp"])
    rows = []
    for s in SETUPS:
        t = median(steps[s])
        rows.append(
            [
                s,
                f"{t * 1e3:.1f}",
                f"{args.batch_size * args.np / t:.1f}",
                f"{base / t:.2f}",
                len(steps[s]),
            ]
        )
    mach = machine(f"{args.np} workers, 1 intra-op thread each")
    cfg = (
        f"{args.model} ({info.get('params', 0) / 1e6:.2f}M params), batch {args.batch_size} "
        f"per worker, {args.steps} timed steps per job, median of {args.rounds} jobs"
    )
    print(f"compare: {cfg}\nmachine: {mach}")
    print(f"{'setup':<30}{'step ms':>10}{'img/s total':>13}{'vs syncdp':>11}{'jobs':>6}")
    for row in rows:
        print(f"{row[0]:<30}{row[1]:>10}{row[2]:>13}{row[3]:>11}{row[4]:>6}")
    write_markdown(
        "compare",
        "syncdp vs MultiWorkerMirroredStrategy vs parameter server",
        ["setup", "step ms", "img/s total", "throughput vs syncdp", "jobs"],
        rows,
        f"{cfg}.\n\nMachine: {mach}.",
    )
    plot_lines(
        "compare",
        f"{args.model}, {args.np} workers: images/s total",
        {r[0].replace("MultiWorkerMirroredStrategy", "MWMS"): ([0], [float(r[2])]) for r in rows},
        xlabel="",
        ylabel="images/s",
        kind="bar",
    )


if __name__ == "__main__":
    main()
