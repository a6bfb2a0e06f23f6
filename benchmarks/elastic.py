"""What elastic mode costs: recovery time, commit() against a step, ULFM's overhead.

Three measurements, each started here through the real launcher:

1. Recovery: an elastic job of N ranks (N = 2, 3, 4) trains a small MLP, committing every
   step; at step 30 rank 1 SIGKILLs itself. Reported: the seconds from the kill to the first
   step at full size again (the survivors notice, revoke, shrink, spawn a replacement that
   imports TensorFlow and builds its model, merge, sync), and the part of it the launcher logs
   as "recovered in" (notice to rebuilt communicator, replacement started and merged).
2. commit() against a training step, 2 ranks, a ~25M-parameter MLP with momentum SGD: the
   median time of ``state.commit()`` (model and optimizer copied to host memory) and of one
   training step, alternating, and their ratio.
3. ULFM's overhead: the same 2-rank training job without and with elastic mode
   (``--with-ft ulfm``), alternating launches; steps per second and their ratio.

4. With ``--spares``, only recovery, with and without a warm spare (``syncdp-run --spares 1``):
   the same kill at N = 2 and 3, the two cases alternating launch by launch, ``--repeats``
   times each; the spare waits in ``init()`` with TensorFlow loaded, so recovery skips the
   replacement's start. Then what a waiting spare costs the ranks: steps per second of a
   2-rank job with and without one, alternating.
5. With ``--refill``: what replacing a spare in the background costs the ranks. A 2-rank job
   with ``--spares 1``; at step 30 rank 0 SIGKILLs the waiting spare; rank 0 then starts a new
   one from a thread while training goes on, and the ranks take it in at a commit. Reported,
   within one job: the median step while the new spare starts against the median step before
   the kill, how long the start took, and the commit that took the spare in against an
   ordinary commit.

Usage::

    python benchmarks/elastic.py            # all three, about 4 minutes on 2 cores
    python benchmarks/elastic.py --quick    # N = 2, 3 only, fewer repeats
    python benchmarks/elastic.py --spares --repeats 3   # spare against spawn, side by side
    python benchmarks/elastic.py --refill --repeats 3   # a spare replaced in the background

Results go to ``benchmarks/results/elastic.md`` (``elastic_spares.md`` with ``--spares``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine, median, write_markdown  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KILL_STEP = 30


def _rank_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="2", TF_CPP_MIN_LOG_LEVEL="3")
    return env


def _launch(np_: int, *args: str, elastic: bool = True, timeout: float = 400, spares: int = 0):
    flags = ["--min-np", "1"] if elastic else []
    if spares:
        flags += ["--spares", str(spares)]
    cmd = [sys.executable, "-m", "syncdp.launch", "-np", str(np_), *flags, sys.executable, __file__]
    proc = subprocess.run(
        [*cmd, *args], capture_output=True, text=True, env=_rank_env(), cwd=ROOT, timeout=timeout
    )
    if proc.returncode != 0:
        sys.exit(f"benchmark job failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


# ---- the rank programs -------------------------------------------------------------------


def _mlp(width: int, depth: int, inputs: int):
    import keras

    layers = [keras.Input((inputs,))]
    layers += [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
    layers.append(keras.layers.Dense(10))
    return keras.Sequential(layers)


def _train_step(model, optimizer, hvd):
    import tensorflow as tf

    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    return step


def _worker(mode: str, steps: int) -> None:
    import keras
    import numpy as np
    import tensorflow as tf

    import syncdp.tensorflow as hvd
    from syncdp.job import runtime
    from syncdp.membership import membership

    hvd.init()
    label = membership.me().label
    if mode == "commit":
        model, batch, inputs = _mlp(4096, 2, 2048), 32, 2048  # 2048*4096 + 4096*4096 + ...
    else:
        model, batch, inputs = _mlp(256, 2, 64), 64, 64
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
    optimizer.build(model.trainable_variables)
    step = _train_step(model, optimizer, hvd)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(batch, inputs)).astype(np.float32))
    y = tf.constant(rng.integers(0, 10, size=batch))
    state = hvd.elastic.TensorFlowKerasState(model, optimizer, step=0)
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)

    if mode == "refill":
        return _refill_worker(hvd, runtime, step, x, y, state, steps)

    @hvd.elastic.run
    def train(state):
        times = {"step": [], "commit": []}
        started = None
        while state.step < steps:
            if mode == "recovery" and label == 1 and state.step == KILL_STEP:
                print(f"KILLED {time.time():.6f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            t0 = time.perf_counter()
            step(x, y)
            t1 = time.perf_counter()
            state.step += 1
            state.commit()
            t2 = time.perf_counter()
            if hvd.rank() == 0 and mode == "recovery":
                changes = runtime.elastic_plan().resets
                print(f"STEP {time.time():.6f} {hvd.size()} {changes}", flush=True)
            if state.step > 5:  # past tracing
                started = started or time.perf_counter()
                times["step"].append(t1 - t0)
                times["commit"].append(t2 - t1)
        return times, started

    times, started = train(state)
    if hvd.rank() == 0:
        elapsed = time.perf_counter() - started
        result = {
            "params": params,
            "step": median(times["step"]),
            "commit": median(times["commit"]),
            "steps_per_s": (len(times["step"]) - 1) / elapsed if elapsed else 0.0,
        }
        print("RESULT " + json.dumps(result), flush=True)


def _refill_worker(hvd, runtime, step, x, y, state, steps: int) -> None:
    """Rank 0 kills the waiting spare at KILL_STEP and times the steps while a new one starts."""
    phases = {"before": [], "starting": [], "after": []}
    commits = {"plain": [], "adopt": []}
    marks = {}

    @hvd.elastic.run
    def train(state):
        phase = "before"
        while state.step < steps:
            if hvd.rank() == 0 and state.step == KILL_STEP:
                os.kill(runtime.elastic_plan().spares[0].pid, signal.SIGKILL)
                marks["killed"] = time.perf_counter()
                phase = "starting"
            t0 = time.perf_counter()
            step(x, y)
            t1 = time.perf_counter()
            state.step += 1
            state.commit()
            t2 = time.perf_counter()
            waiting = runtime.elastic_plan().spares  # a new spare is labelled after the first
            joined = phase == "starting" and any(m.label > hvd.size() for m in waiting)
            if state.step > 5:
                phases[phase].append(t1 - t0)
                commits["adopt" if joined else "plain"].append(t2 - t1)
            if joined:
                marks["joined"] = time.perf_counter()
                phase = "after"

    train(state)
    if hvd.rank() == 0:
        result = {k: median(v) for k, v in phases.items() if v}
        result.update(
            steps={k: len(v) for k, v in phases.items()},
            start_seconds=marks["joined"] - marks["killed"],
            commit=median(commits["plain"]),
            adopt_commit=max(commits["adopt"]),
        )
        print("RESULT " + json.dumps(result), flush=True)


# ---- the driver --------------------------------------------------------------------------


def _result(out: str) -> dict:
    return json.loads(re.findall(r"<stdout>:RESULT (\{.*\})", out)[-1])


def recovery(np_: int, spares: int = 0) -> tuple[float, float]:
    """Seconds from the kill to the first full-size step, and the launcher's "recovered in"."""
    proc = _launch(np_, "--worker", "recovery", "--steps", "80", spares=spares)
    killed = float(re.findall(r"<stdout>:KILLED ([0-9.]+)", proc.stdout)[0])
    steps = re.findall(r"<stdout>:STEP ([0-9.]+) (\d+) (\d+)", proc.stdout)
    # The first step after the membership change, at full size again.
    back = min(float(t) for t, n, changes in steps if int(changes) >= 1 and int(n) == np_)
    logged = float(re.findall(r"recovered in ([0-9.]+) s", proc.stderr)[0])
    return back - killed, logged


def spares_against_spawn(sizes: list[int], repeats: int) -> None:
    """Recovery with a warm spare against recovery by spawning, alternating launches."""
    rows = []
    for n in sizes:
        measured = {0: [], 1: []}
        for _ in range(repeats):
            for spares in (0, 1):
                measured[spares].append(recovery(n, spares)[0])
                print(f"np={n} spares={spares}: {measured[spares][-1]:.2f} s", flush=True)
        spawn, spare = median(measured[0]), median(measured[1])
        each = "; ".join(
            f"{label}: " + ", ".join(f"{t:.2f}" for t in measured[k])
            for k, label in ((0, "spawn"), (1, "spare"))
        )
        rows.append(
            [
                f"recovery, np={n}",
                f"{spare:.2f} s with --spares 1",
                f"{spawn:.2f} s without (spawn)",
                f"spare / spawn = {spare / spawn:.2f} (median of {repeats}; {each} s)",
            ]
        )
        print(rows[-1], flush=True)
    rates = {0: [], 1: []}
    for _ in range(repeats):
        for spares in (0, 1):
            out = _launch(2, "--worker", "throughput", "--steps", "300", spares=spares).stdout
            rates[spares].append(_result(out)["steps_per_s"])
    plain, waiting = median(rates[0]), median(rates[1])
    rows.append(
        [
            "throughput, np=2, small MLP, commit every step (elastic mode)",
            f"{waiting:.0f} steps/s with a spare waiting",
            f"{plain:.0f} steps/s without",
            f"with / without = {waiting / plain:.3f}; with: "
            + ", ".join(f"{r:.0f}" for r in rates[1])
            + "; without: "
            + ", ".join(f"{r:.0f}" for r in rates[0])
            + " (3 processes on 2 cores: Open MPI yields when idle, see the README)",
        ]
    )
    print(rows[-1], flush=True)
    path = write_markdown(
        "elastic_spares",
        "Elastic recovery: a warm spare against a spawned replacement",
        ["what", "measured", "against", "note"],
        rows,
        notes=machine(
            "seconds from rank 1's SIGKILL to rank 0's first step at full size again; each rank "
            "1 intra-op thread; the two cases alternate launch by launch in one run"
        ),
    )
    print(f"wrote {path}")


def refill(repeats: int) -> None:
    """What starting a spare in the background costs the ranks (one job per repeat)."""
    runs = []
    for _ in range(repeats):
        out = _launch(2, "--worker", "refill", "--steps", "2500", spares=1).stdout
        runs.append(_result(out))
        print(runs[-1], flush=True)
    slow = [r["starting"] / r["before"] for r in runs]
    rows = [
        [
            "step while a new spare starts, np=2, small MLP",
            f"{median([r['starting'] for r in runs]) * 1e3:.2f} ms (median step)",
            f"{median([r['before'] for r in runs]) * 1e3:.2f} ms before the spare was killed",
            f"starting / before = {median(slow):.2f} (per job: "
            + ", ".join(f"{v:.2f}" for v in slow)
            + "; the new process imports TensorFlow on the ranks' 2 cores)",
        ],
        [
            "spare killed -> new spare waiting",
            f"{median([r['start_seconds'] for r in runs]):.2f} s",
            "training went on throughout",
            "per job: " + ", ".join(f"{r['start_seconds']:.2f}" for r in runs) + " s",
        ],
        [
            "the commit that takes the new spare in",
            f"{median([r['adopt_commit'] for r in runs]) * 1e3:.1f} ms",
            f"{median([r['commit'] for r in runs]) * 1e3:.2f} ms an ordinary commit",
            "once per replaced spare (connect, merge, allgather)",
        ],
    ]
    path = write_markdown(
        "elastic_refill",
        "Warm spares: replacing one in the background",
        ["what", "measured", "against", "note"],
        rows,
        notes=machine(
            "one 2-rank job with --spares 1 per repeat; rank 0 kills the waiting spare at step "
            f"{KILL_STEP}; medians within each job; each rank 1 intra-op thread"
        ),
    )
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=["recovery", "commit", "throughput", "refill"])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--spares", action="store_true", help="only: recovery with a spare vs without")
    p.add_argument("--refill", action="store_true", help="only: a spare replaced in the background")
    p.add_argument("--repeats", type=int, default=3, help="launches per case with --spares")
    args = p.parse_args()
    if args.worker:
        _worker(args.worker, args.steps)
        return
    if args.spares:
        spares_against_spawn([2, 3], args.repeats)
        return
    if args.refill:
        refill(args.repeats)
        return
    sizes = [2, 3] if args.quick else [2, 3, 4]
    repeats = 1 if args.quick else 2
    rows = []
    for n in sizes:
        measured = [recovery(n) for _ in range(repeats)]
        back = median([m[0] for m in measured])
        logged = median([m[1] for m in measured])
        rows.append(
            [
                f"recovery, np={n}",
                f"{back:.2f} s kill -> full-size step",
                f"{logged:.2f} s notice -> merged",
                f"{repeats} run(s)",
            ]
        )
        print(rows[-1], flush=True)
    commit = _result(_launch(2, "--worker", "commit", "--steps", "25").stdout)
    rows.append(
        [
            f"commit(), {commit['params'] / 1e6:.1f}M params + momentum, np=2",
            f"{commit['commit'] * 1e3:.1f} ms per commit",
            f"{commit['step'] * 1e3:.1f} ms per step",
            f"commit / step = {commit['commit'] / commit['step']:.2f}",
        ]
    )
    print(rows[-1], flush=True)
    rates = {False: [], True: []}
    for _ in range(repeats + 1):
        for elastic in (False, True):
            out = _launch(2, "--worker", "throughput", "--steps", "300", elastic=elastic).stdout
            rates[elastic].append(_result(out)["steps_per_s"])
    plain, ulfm = median(rates[False]), median(rates[True])
    rows.append(
        [
            "throughput, np=2, small MLP, commit every step",
            f"{plain:.0f} steps/s without elastic mode",
            f"{ulfm:.0f} steps/s with it (--with-ft ulfm)",
            f"elastic / plain = {ulfm / plain:.3f}",
        ]
    )
    print(rows[-1], flush=True)
    path = write_markdown(
        "elastic",
        "Elastic mode: recovery time, commit cost, ULFM overhead",
        ["what", "measured", "against", "note"],
        rows,
        notes=machine(
            "each rank 1 intra-op thread; the throughput job commits every step "
            "in both columns, so the ratio is ULFM's cost alone"
        ),
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
