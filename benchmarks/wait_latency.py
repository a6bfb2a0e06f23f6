"""How soon a collective ends once the last rank arrives, when ranks arrive apart.

A rank that reaches a collective early waits for the others. syncdp waits politely
(:func:`syncdp.transport.waiting.wait_politely`): it polls, then polls yielding the core, then
sleeps between polls, so that a waiting rank leaves its core to the ranks still computing.
Beyond two ranks an MPI collective moves in rounds, and a round moves on only when its ranks
poll: a rank asleep holds up the others after the last one has arrived. This benchmark
measures that delay beside a blocking MPI call (which polls without pause, or yields the core
between polls under ``syncdp-run``, which sets Open MPI's ``mpi_yield_when_idle``).

Each rank repeats: sleep for a base time plus a random part up to ``--jitter-us`` (computing
that leaves the core free, as a GPU step or an input pipeline does), then one allgather of
``--bytes`` per rank (the argument check syncdp makes at every step, which carries a small
bucket of gradients; 9 KB is the tiny model's). It is timed three ways: ``blocking``
(``MPI.Allgather``), ``syncdp <N>us`` (``Iallgather`` waited on as syncdp waits, with its
default spin of N us) and ``spin <N>us`` (the same wait with another spin, ``--spins``). Every
collective's rows are checked. Every rank notes when it entered
and left each collective on the host's monotonic clock, so the figures are:

- ``last``: how long the collective took on the rank that arrived last (the time the job
  loses to it);
- ``all``: from the last arrival until every rank has left it (a rank that notices late
  starts its next step late).

Each repetition is ``--steps`` collectives; its figure is their median. Repetitions alternate
the variants; figures are medians over repetitions with bootstrap 95% intervals, and
``syncdp / blocking`` is paired by repetition. One host only (the clocks are compared).

Usage::

    syncdp-run -np 4 python benchmarks/wait_latency.py
    syncdp-run -np 8 python benchmarks/wait_latency.py --jitter-us 1000 --spins 50,200

Results: ``benchmarks/results/wait_latency_npN.md`` (N: the number of ranks).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import alternate, fmt_interval, interval, machine, paired_ratio, say, write_markdown

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bytes", type=int, default=9000, help="bytes each rank contributes")
    p.add_argument("--base-us", type=float, default=300.0, help="fixed part of the computing")
    p.add_argument(
        "--jitter-us", default="200,1000,5000", help="most random extra computing, comma-separated"
    )
    p.add_argument("--spins", default="50", help="other spins to time, in us, comma-separated")
    p.add_argument("--steps", type=int, default=40, help="collectives per repetition")
    p.add_argument("--repeats", type=int, default=12, help="repetitions of each variant")
    p.add_argument("--no-write", action="store_true", help="print only, write no results")
    return p


def _us_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(
            f"wait_latency.py: expected comma-separated microseconds, got {text!r}"
        ) from None
    if any(v < 0 for v in values):
        raise SystemExit(f"wait_latency.py: microseconds cannot be negative: {text!r}")
    return values


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    jitters, spins = _us_list(args.jitter_us), _us_list(args.spins)
    if args.bytes < 1 or args.steps < 1 or args.repeats < 1:
        raise SystemExit("wait_latency.py: --bytes, --steps and --repeats must be at least 1")
    if args.base_us < 0:
        raise SystemExit(f"wait_latency.py: --base-us cannot be negative: {args.base_us:g}")

    import numpy as np
    from mpi4py import MPI

    from syncdp.transport import waiting

    world = MPI.COMM_WORLD
    n, me = world.size, world.rank
    if n < 2:
        say("wait_latency.py needs 2 or more ranks (syncdp-run -np 4 ...)")
        return 2
    if len(set(world.allgather(MPI.Get_processor_name()))) > 1:
        say("wait_latency.py compares the ranks' clocks: run it on one host", rank=me)
        return 2

    send = np.full(args.bytes, me % 251, np.uint8)  # never 255, the mark of a missing row
    recv = np.empty(n * args.bytes, np.uint8)
    expected = np.repeat(np.arange(n) % 251, args.bytes).astype(np.uint8)
    default = f"syncdp {waiting._SPIN_SECONDS * 1e6:g}us"  # the spin it ran with, named
    variants = {
        "blocking": lambda: world.Allgather(send, recv),
        default: lambda: waiting.wait_politely(world.Iallgather(send, recv)),
    }
    for s in spins:
        variants[f"spin {s:g}us"] = lambda s=s: waiting.wait_politely(
            world.Iallgather(send, recv), spin=s * 1e-6
        )
    names = list(variants)
    rng = np.random.default_rng(1000 + me)

    def one_repetition(run, jitter: float) -> tuple[float, float]:
        entered, left = np.empty(args.steps), np.empty(args.steps)
        wrong = 0
        for i in range(args.steps):
            recv.fill(255)  # no rank's row: a wait that returned early is caught below
            time.sleep((args.base_us + rng.random() * jitter) * 1e-6)
            entered[i] = time.perf_counter()
            run()
            left[i] = time.perf_counter()
            wrong += not np.array_equal(recv, expected)
        if world.allreduce(wrong, op=MPI.SUM):  # every rank raises, none waits for the others
            raise AssertionError("an allgather returned before its rows had all arrived")
        e = np.array(world.allgather(entered))  # ranks x steps
        x = np.array(world.allgather(left))
        last = e.argmax(axis=0)
        steps = np.arange(args.steps)
        on_last = (x[last, steps] - e[last, steps]) * 1e6
        everyone = (x.max(axis=0) - e.max(axis=0)) * 1e6
        return float(np.median(on_last)), float(np.median(everyone))

    def repetitions(jitter: float) -> dict[str, list[tuple[float, float]]]:
        """Each variant's (last rank, every rank) per repetition, the variants alternating."""
        figures = {v: [] for v in names}
        timed = {
            v: lambda v=v: figures[v].append(one_repetition(variants[v], jitter)) for v in names
        }
        alternate(timed, args.repeats, sync=world.Barrier, warmup=1)
        return {v: runs[1:] for v, runs in figures.items()}  # runs[0]: the warm-up round's

    say(
        f"np={n}: allgather of {args.bytes} bytes per rank after {args.base_us:g} us plus up to "
        f"the jitter of computing; {args.repeats} alternating repetitions of {args.steps}",
        rank=me,
    )
    rows = []
    for jitter in jitters:
        figures = repetitions(jitter)
        last = {v: [f[0] for f in figures[v]] for v in names}
        every = {v: [f[1] for f in figures[v]] for v in names}
        say(f"jitter up to {jitter:g} us:", rank=me)
        for v in names:
            ratio = "" if v == "blocking" else fmt_interval(paired_ratio(last[v], last["blocking"]))
            say(
                f"  {v:14s} last rank {fmt_interval(interval(last[v]), 1)} us, every rank "
                f"{fmt_interval(interval(every[v]), 1)} us"
                + (f"; / blocking {ratio}" if ratio else ""),
                rank=me,
            )
            rows.append(
                [
                    n,
                    f"{jitter:g}",
                    v,
                    fmt_interval(interval(last[v]), 1),
                    fmt_interval(interval(every[v]), 1),
                    ratio or "1",
                ]
            )
    if me == 0 and not args.no_write:
        path = write_markdown(
            f"wait_latency_np{n}",
            "How soon a collective ends after the last rank arrives",
            ["np", "jitter us", "wait", "last rank us", "every rank us", "last / blocking"],
            rows,
            "Medians over alternating repetitions with bootstrap 95% intervals; a repetition's "
            "figure is the median of its collectives. 'last rank': the collective's time on "
            "the rank that arrived last; 'every rank': from that arrival until every rank has "
            f"left it.\n\nMachine: {machine()}",
        )
        print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
