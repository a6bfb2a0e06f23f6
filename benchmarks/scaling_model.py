"""An alpha-beta model of the fused allreduce, fitted here, projected to ResNet-50 at scale.

The model. Reducing ``n`` bytes over ``p`` ranks with a ring (what Open MPI does for large
messages) costs ``T(n, p) = 2 (p - 1) alpha + 2 (p - 1) / p * n * beta``: a latency ``alpha``
per step and ``beta`` seconds per byte of the slowest link. Topology-aware (``r`` ranks per
host, ``h = p / r`` hosts): a reduce and a broadcast in shared memory inside each host plus a
ring among the ``h`` leaders, ``T = 2 T_shm(n, r) / 2 + T_net(n, h)``, which moves ``r`` times
fewer bytes over the network than a flat ring that crosses it from every rank.

The constants are fitted (least squares on ``T = a + b * n``) from measurements on this
machine: MPI allreduce between 2 ranks in shared memory (measured now, unless ``--no-measure``)
and the flat allreduce across namespace hosts on ``tbf``-limited links that
``benchmarks/multihost.py`` wrote to ``results/multihost.json`` (its link rate gives the
bandwidth scale; the fitted latency is kept). Projection for ResNet-50 (25.6M float32
gradients, 102 MB per step) on 10, 25 and 100 Gbit/s networks, 8 ranks per host, 8 to 128
ranks, with a compute time per step of ``--step-ms`` (default 200 ms: a V100-class GPU at batch
64, an assumption), without overlap (step = compute + allreduce) and with overlap (the
allreduce hides behind the backward pass, two thirds of compute; step = compute + what is
left). Scaling efficiency = one rank's step time / the step time at p ranks.

Set against the Horovod paper (Sergeev and Del Balso 2018, Fig. 6: Inception V3 and ResNet-101
about 88-90% at 128 Pascal GPUs on 25 Gbit/s TCP, VGG-16 about 68%).

Usage::

    python benchmarks/scaling_model.py            # measures shared memory (2 ranks) first
    python benchmarks/scaling_model.py --no-measure

Results go to ``benchmarks/results/scaling_model.md`` and ``scaling_model.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, machine, plot_lines, write_markdown  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESNET50_BYTES = 25_557_032 * 4
RANKS_PER_HOST = 8
NETWORKS_GBIT = (10, 25, 100)
SIZES = (8, 16, 32, 64, 128)
HOROVOD_PAPER = (
    "Horovod paper, 128 Pascal GPUs, 25 Gbit/s: Inception V3 / ResNet-101 ~88-90%, VGG-16 ~68%"
)
# Used when no measurement of a network is available: a typical TCP latency per message.
DEFAULT_NET_ALPHA = 50e-6


def _measure_shm() -> list[tuple[int, float]]:
    """(bytes, seconds) of MPI Allreduce between 2 ranks on this host, medians of repeats."""
    code = (
        "import json, time, numpy as np; from mpi4py import MPI; c = MPI.COMM_WORLD; out = []\n"
        "for n in (1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24):\n"
        "    a = np.ones(n // 4, np.float32); t = []\n"
        "    for _ in range(12):\n"
        "        c.Barrier(); s = time.perf_counter(); c.Allreduce(MPI.IN_PLACE, a)\n"
        "        t.append(time.perf_counter() - s)\n"
        "    out.append((n, sorted(t)[6]))\n"
        "if c.rank == 0: print('SHM', json.dumps(out))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "syncdp.launch", "-np", "2", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    line = next(x for x in proc.stdout.splitlines() if "SHM" in x)
    return [tuple(p) for p in json.loads(line.split("SHM", 1)[1])]


def _rate_bytes(rate: str) -> float:
    """Bytes per second of a tc rate such as ``200mbit`` or ``1gbit``."""
    for unit, scale in (("kbit", 1e3), ("mbit", 1e6), ("gbit", 1e9)):
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale / 8
    raise ValueError(f"unknown rate {rate!r}")


def fit(points: list[tuple[int, float]], p: int) -> tuple[float, float]:
    """alpha (s) and beta (s/byte) of a ring allreduce among ``p`` ranks, from (bytes, s)."""
    n = np.array([x for x, _ in points], dtype=float)
    t = np.array([y for _, y in points], dtype=float)
    design = np.stack([np.full_like(n, 2 * (p - 1)), 2 * (p - 1) / p * n], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(design, t, rcond=None)
    return max(float(alpha), 1e-7), max(float(beta), 1e-13)


def ring(n: float, p: int, alpha: float, beta: float) -> float:
    return 0.0 if p == 1 else 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta


def step_times(step_s, n, p, shm, net, *, hierarchical, overlap) -> float:
    hosts = max(1, p // RANKS_PER_HOST)
    local = min(p, RANKS_PER_HOST)
    if hierarchical:
        comm = ring(n, local, *shm) + ring(n, hosts, *net)
    else:
        comm = ring(n, p, *(net if hosts > 1 else shm))
    if overlap:
        return step_s + max(0.0, comm - step_s * 2 / 3)
    return step_s + comm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-measure", action="store_true", help="use the default constants")
    p.add_argument("--step-ms", type=float, default=200.0, help="compute time per step")
    args = p.parse_args()
    notes = [
        machine(),
        f"assumed compute per step: {args.step_ms:g} ms; {RANKS_PER_HOST} ranks/host",
    ]
    if args.no_measure:
        shm = (5e-6, 1 / 5e9)
        notes.append("shared memory: default constants (5 us, 5 GB/s)")
    else:
        points = _measure_shm()
        shm = fit(points, 2)
        notes.append(
            f"shared memory fitted from 2 ranks here: alpha {shm[0] * 1e6:.1f} us, "
            f"{1 / shm[1] / 1e9:.2f} GB/s"
        )
    measured_net = RESULTS / "multihost.json"
    net_alpha, link_efficiency = DEFAULT_NET_ALPHA, 1.0
    if measured_net.exists():
        data = json.loads(measured_net.read_text())
        a, b = fit([tuple(x) for x in data["flat"]], data["ranks"])
        # What a flat ring got of the link's nominal rate here, applied to every network below;
        # the latency cannot be told apart from zero with 1-64 MiB messages, so the assumed TCP
        # latency stays unless the fit finds more.
        link_efficiency = min(1.0, (1 / b) / _rate_bytes(data["rate"]))
        net_alpha = max(a, DEFAULT_NET_ALPHA)
        notes.append(
            f"links fitted from benchmarks/multihost.py ({data['rate']}, {data['ranks']} ranks): "
            f"{1 / b / 1e6:.1f} MB/s = {link_efficiency:.2f} of the nominal rate (applied to "
            f"every network), alpha {a * 1e6:.1f} us (kept at >= {DEFAULT_NET_ALPHA * 1e6:.0f} us)"
        )
    else:
        notes.append(f"no results/multihost.json: network alpha {net_alpha * 1e6:.0f} us assumed")
    step_s = args.step_ms / 1e3
    rows, series = [], {}
    for gbit in NETWORKS_GBIT:
        net = (net_alpha, 8 / (gbit * 1e9 * link_efficiency))
        for hierarchical in (False, True):
            for overlap in (False, True):
                eff = [
                    step_s
                    / step_times(
                        step_s,
                        RESNET50_BYTES,
                        q,
                        shm,
                        net,
                        hierarchical=hierarchical,
                        overlap=overlap,
                    )
                    for q in SIZES
                ]
                label = (
                    f"{gbit} Gbit/s, {'topology-aware' if hierarchical else 'flat ring'}, "
                    f"{'overlap' if overlap else 'no overlap'}"
                )
                rows.append([label, *(f"{e * 100:.0f}%" for e in eff)])
                series[label] = (list(SIZES), [e * 100 for e in eff])
    rows.append([HOROVOD_PAPER, "", "", "", "", "~90% (published)"])
    path = write_markdown(
        "scaling_model",
        "Projected scaling efficiency of ResNet-50 (alpha-beta model)",
        ["network, allreduce, overlap", *(f"{q} ranks" for q in SIZES)],
        rows,
        notes="; ".join(notes),
    )
    plot_lines(
        "scaling_model",
        "ResNet-50 scaling efficiency, projected",
        {k: v for k, v in series.items() if "overlap" in k and "no overlap" not in k},
        xlabel="ranks",
        ylabel="efficiency (%)",
    )
    print(path.read_text())


if __name__ == "__main__":
    main()
