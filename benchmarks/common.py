"""What every benchmark here shares: the machine line, alternating timing, tables and plots.

Benchmarks print from rank 0 only, say which machine and configuration they ran on, and time
the variants they compare side by side in one run, alternating repetitions, so that load from
other programs on a shared machine hits every variant alike. Report ratios of medians.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = [
    "RESULTS",
    "alternate",
    "fmt_interval",
    "interval",
    "machine",
    "paired_ratio",
    "median",
    "plot_lines",
    "say",
    "setup_threads",
    "write_markdown",
]

RESULTS = Path(__file__).resolve().parent / "results"


def setup_threads(intra: int = 1, inter: int = 2) -> None:
    """Gives TensorFlow ``intra`` threads per op and ``inter`` ops at once (call before use)."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(intra)
    tf.config.threading.set_inter_op_parallelism_threads(inter)


def say(*args, rank: int = 0) -> None:
    """Prints on rank 0 only."""
    if rank == 0:
        print(*args, flush=True)


def machine(extra: str = "") -> str:
    """One line naming the machine, the software and the load it ran under."""
    import mpi4py
    import numpy as np
    import tensorflow as tf

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    parts = [
        f"{cpu}, {os.cpu_count()} cores",
        f"load {load}",
        f"Python {platform.python_version()}",
        f"TF {tf.__version__}",
        f"NumPy {np.__version__}",
        f"mpi4py {mpi4py.__version__}",
        time.strftime("%Y-%m-%d %H:%M"),
    ]
    return "; ".join(parts + ([extra] if extra else []))


def median(values: Sequence[float]) -> float:
    """The median, or NaN for no values."""
    return statistics.median(values) if values else float("nan")


def interval(values: Sequence[float], *, draws: int = 2000, seed: int = 0) -> tuple:
    """``(median, low, high)``: the median of ``values`` and a bootstrap 95% interval for it.

    The interval is the 2.5th and 97.5th percentiles of the medians of ``draws`` resamples
    (with replacement) of ``values``; a fixed seed makes the same values give the same
    interval. Fewer than 3 values give the median as both bounds.
    """
    import numpy as np

    values = np.asarray(values, dtype=np.float64)
    mid = float(np.median(values)) if values.size else float("nan")
    if values.size < 3:
        return mid, mid, mid
    rng = np.random.default_rng(seed)
    medians = np.median(rng.choice(values, size=(draws, values.size)), axis=1)
    return mid, float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))


def paired_ratio(base: Sequence[float], other: Sequence[float]) -> tuple:
    """``interval`` of ``base[i] / other[i]``: repetitions paired by round, so load that hits
    one round hits both sides of its ratio (with times, > 1 means ``other`` is faster)."""
    return interval([b / o for b, o in zip(base, other)])


def fmt_interval(iv: tuple, digits: int = 3) -> str:
    """``0.981 [0.975, 0.990]``."""
    mid, lo, hi = iv
    return f"{mid:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def alternate(
    variants: dict[str, Callable[[], object]],
    repeats: int,
    *,
    sync: Callable[[], None] | None = None,
    warmup: int = 1,
) -> dict[str, list[float]]:
    """Times each variant ``repeats`` times, rotating their order every round.

    Args:
        variants: Name -> a function running one repetition.
        repeats: Rounds; every round runs every variant once.
        sync: Called before each timed call (an MPI barrier, so all ranks start together).
            Defaults to None.
        warmup: Untimed rounds first. Defaults to 1.

    Returns:
        Name -> the seconds of each repetition.
    """
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            if sync is not None:
                sync()
            start = time.perf_counter()
            variants[n]()
            if r >= warmup:
                times[n].append(time.perf_counter() - start)
    return times


def write_markdown(
    name: str, title: str, header: Sequence[str], rows: Sequence[Sequence], notes: str = ""
) -> Path:
    """Writes ``results/NAME.md`` with a title, the machine notes and a table; returns it."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    lines = [f"# {title}", ""]
    if notes:
        lines += [notes, ""]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    lines.append("")
    lines.append(f"Command: `{' '.join([Path(sys.argv[0]).name] + sys.argv[1:])}`")
    path = RESULTS / f"{name}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def pyplot(name: str):
    """matplotlib's pyplot (drawing to files), or None with one line saying the plot
    ``results/NAME.png`` is skipped because matplotlib is not installed (the tables are still
    written)."""
    try:
        import matplotlib
    except ImportError:
        say(
            f"matplotlib is not installed, so results/{name}.png is not drawn (the table is "
            "written); pip install -e '.[bench]' adds it."
        )
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_lines(
    name: str,
    title: str,
    series: dict[str, tuple[Sequence[float], Sequence[float]]],
    *,
    xlabel: str,
    ylabel: str,
    logx: bool = False,
    logy: bool = False,
    kind: str = "line",
) -> Path | None:
    """Writes ``results/NAME.png``: one line (or bar group) per series; returns the path, or
    None where matplotlib is missing (:func:`pyplot`)."""
    plt = pyplot(name)
    if plt is None:
        return None
    RESULTS.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if kind == "bar":
        labels = list(series)
        values = [series[k][1][0] for k in labels]
        ax.bar(labels, values, color=["#4c72b0", "#dd8452", "#55a868", "#c44e52"][: len(labels)])
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.1f}", ha="center", va="bottom")
    else:
        for label, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o", label=label)
        ax.legend()
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    path = RESULTS / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
