"""Allreduce and training across hosts with rate-limited links: flat against topology-aware.

Builds ``--hosts`` network-namespace hosts on this machine (tests/netns.py: a bridge, one veth
per host, each link limited to ``--rate`` each way with ``tbf``), starts ``--ranks-per-host``
ranks on each through ``syncdp-run -H`` and Open MPI's remote-shell agent, and times in one
job, alternating repetitions:

- MPI allreduce of float32 buffers (1 to 64 MiB) through syncdp's communicator, flat (every
  rank in one ring across the links) against topology-aware (reduce inside each host in shared
  memory, allreduce among one leader per host, broadcast back);
- a training step of an MLP with ~4M parameters through ``DistributedGradientTape``, both ways.

Writes a table and plot (``results/multihost.md``, ``.png``) and the flat allreduce times
(``results/multihost.json``) that ``benchmarks/scaling_model.py`` fits its link constants to.
Needs root (network namespaces); everything it makes is removed at the end.

Usage::

    python benchmarks/multihost.py                  # 2 hosts x 2 ranks, 1 Gbit/s links
    python benchmarks/multihost.py --hosts 3 --rate 500mbit
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, alternate, machine, median, plot_lines, write_markdown  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SIZES_MB = (1, 4, 16, 64)


def _both_ways(comm, run, repeats: int) -> dict[str, float]:
    """Median seconds of ``run()`` flat and topology-aware, alternating in one job."""

    def way(hierarchical: bool):
        def go():
            comm.prefer_hierarchy = hierarchical
            run()

        return go

    times = alternate({"flat": way(False), "topology": way(True)}, repeats, sync=comm.mpi.Barrier)
    return {name: median(t) for name, t in times.items()}


def _worker(repeats: int) -> None:
    import numpy as np
    import tensorflow as tf

    import syncdp.tensorflow as hvd
    from syncdp.job import runtime

    hvd.init()
    comm = runtime.communicator()
    out = {"allreduce": {}}
    for mb in SIZES_MB:
        buf = np.ones(mb * (1 << 20) // 4, np.float32)
        out["allreduce"][mb] = _both_ways(
            comm, lambda b=buf, m=mb: comm.allreduce_inplace(b, name=f"bench{m}"), repeats
        )
    model = tf.keras.Sequential(
        [
            tf.keras.Input((1024,)),
            tf.keras.layers.Dense(2048, activation="relu"),
            tf.keras.layers.Dense(1024),
        ]
    )
    x = tf.random.stateless_normal((32, 1024), seed=(1, hvd.rank()))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(x) ** 2)
        grads = hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
        for v, g in zip(model.trainable_variables, grads):
            v.assign_sub(1e-4 * g)

    step()  # traced outside the timing
    out["train"] = _both_ways(comm, step, repeats)
    out["params"] = int(sum(np.prod(v.shape) for v in model.trainable_variables))
    if hvd.rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--ranks-per-host", type=int, default=2)
    p.add_argument("--rate", default="1gbit", help="tbf rate of every link, each way")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--mpi-args", default="", help="more mpirun arguments")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args.repeats)
        return
    sys.path.insert(0, str(ROOT))
    from tests.netns import NamespaceHosts, Unavailable

    names = [f"h{i + 1}" for i in range(args.hosts)]
    with tempfile.TemporaryDirectory() as tmp:
        try:
            cluster = NamespaceHosts(Path(tmp), names)
            cluster.__enter__()
        except Unavailable as e:
            sys.exit(f"multihost benchmark: {e}")
        try:
            cluster.limit(args.rate)
            hosts = ",".join(f"{n}:{args.ranks_per_host}" for n in names)
            env = {
                **os.environ,
                "PYTHONPATH": str(ROOT),
                "TF_NUM_INTRAOP_THREADS": "1",
                "TF_CPP_MIN_LOG_LEVEL": "3",
            }
            cmd = [
                sys.executable,
                "-m",
                "syncdp.launch",
                "-np",
                str(args.hosts * args.ranks_per_host),
                "-H",
                hosts,
                "--network-interface",
                cluster.subnet,
                "--mpi-args",
                f"--mca plm_rsh_agent {cluster.agent} --mca mpi_yield_when_idle 1 {args.mpi_args}",
                sys.executable,
                __file__,
                "--worker",
                "--repeats",
                str(args.repeats),
            ]
            proc = subprocess.run(
                cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1200
            )
        finally:
            cluster.__exit__(None, None, None)
    found = re.findall(r"<stdout>:RESULT (\{.*\})", proc.stdout)
    if proc.returncode != 0 or not found:
        sys.exit(f"multihost job failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result = json.loads(found[-1])
    rows = []
    for mb, t in result["allreduce"].items():
        rows.append(
            [
                f"allreduce {mb} MiB",
                f"{t['flat'] * 1e3:.1f} ms",
                f"{t['topology'] * 1e3:.1f} ms",
                f"{t['flat'] / t['topology']:.2f}x",
            ]
        )
    t = result["train"]
    rows.append(
        [
            f"training step, MLP {result['params'] / 1e6:.1f}M params",
            f"{t['flat'] * 1e3:.1f} ms",
            f"{t['topology'] * 1e3:.1f} ms",
            f"{t['flat'] / t['topology']:.2f}x",
        ]
    )
    layout = f"{args.hosts} namespace hosts x {args.ranks_per_host} ranks, links {args.rate} (tbf)"
    path = write_markdown(
        "multihost",
        f"Flat against topology-aware allreduce: {layout}",
        ["what", "flat", "topology-aware", "gain (flat / topology)"],
        rows,
        notes=machine(f"{layout}; mpi_yield_when_idle 1; medians of {args.repeats}, alternating"),
    )
    mbs = [int(m) for m in result["allreduce"]]
    plot_lines(
        "multihost",
        layout,
        {
            "flat": (mbs, [result["allreduce"][str(m)]["flat"] * 1e3 for m in mbs]),
            "topology-aware": (mbs, [result["allreduce"][str(m)]["topology"] * 1e3 for m in mbs]),
        },
        xlabel="allreduce size (MiB)",
        ylabel="time (ms)",
        logx=True,
        logy=True,
    )
    ranks = args.hosts * args.ranks_per_host
    flat = [[int(m) << 20, result["allreduce"][str(m)]["flat"]] for m in mbs]
    (RESULTS / "multihost.json").write_text(
        json.dumps({"rate": args.rate, "ranks": ranks, "flat": flat}, indent=1) + "\n"
    )
    print(path.read_text())


if __name__ == "__main__":
    main()
