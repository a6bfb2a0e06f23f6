"""Where a synchronous step loses time: four ways to run the same step, and each rank's split.

For each number of ranks, one job times the same training step (the benchmark CNN of
``synthetic.py``, or ResNet-50) four ways, alternating repetitions so that load from other
programs hits each alike:

- ``no communication``: each rank trains alone (the ceiling);
- ``barrier``: the step, then one MPI barrier: the cost of staying in step, no bytes moved;
- ``naive allreduce``: the step, then one raw mpi4py ``Allreduce`` of all the gradient bytes
  from Python (what a hand-written data-parallel loop would do, without overlap);
- ``syncdp``: the step with ``DistributedGradientTape`` (buckets reduced during backprop).

A repetition is ``--steps`` steps; its time is the slowest rank's (a synchronous step is as
slow as its slowest rank). It prints the ``no communication`` step time, and each other
variant's throughput relative to it (1.0 = synchronization is free): per repetition, the
``no communication`` time over the variant's time in the same round, reported as the median of
these paired ratios with a bootstrap 95% interval, ``median [low, high]``. Then a run of
syncdp steps alone records where each rank's step time went (``syncdp.timing()``): computing,
waiting for the slowest rank, moving bytes, and the bandwidth achieved.

Usage::

    python benchmarks/breakdown.py --np 2          # launches syncdp-run for each np
    python benchmarks/breakdown.py --np 4,8,16 --model resnet50
    syncdp-run -np 2 python benchmarks/breakdown.py --worker   # one size, printed only

Results: ``benchmarks/results/breakdown.md`` and ``breakdown.png``. Needs 2 or more ranks.
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
    RESULTS,
    alternate,
    fmt_interval,
    interval,
    machine,
    paired_ratio,
    pyplot,
    say,
    setup_threads,
    write_markdown,
)

__all__ = ["main"]

VARIANTS = ("no communication", "barrier", "naive allreduce", "syncdp")
BASE, SYNCED = VARIANTS[0], VARIANTS[1:]  # the reference, and the variants set against it


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", default="2", help="comma-separated rank counts (each >= 2)")
    p.add_argument("--model", choices=["cnn", "resnet50"], default="cnn")
    p.add_argument("--batch-size", type=int, default=32, help="images per rank per step")
    p.add_argument("--steps", type=int, default=5, help="steps per timed repetition")
    p.add_argument("--repeats", type=int, default=30, help="timed repetitions per variant")
    p.add_argument("--intra-threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=1200, help="seconds per job")
    p.add_argument("--worker", action="store_true", help="run one size under syncdp-run")
    p.add_argument("--json-out", default="", help=argparse.SUPPRESS)
    p.add_argument("--no-write", action="store_true", help="print only, write no results")
    return p


def _worker(args) -> dict | None:
    setup_threads(args.intra_threads)
    import numpy as np
    from mpi4py import MPI
    from synthetic import training_setup, training_step

    import syncdp

    syncdp.init()  # syncdp:
    size, rank = syncdp.size(), syncdp.rank()
    if size < 2:
        say("breakdown.py compares synchronous ranks; run it with syncdp-run -np 2 or more.")
        sys.exit(2)
    image = 32 if args.model == "cnn" else 64
    model, opt, loss_fn, x, y = training_setup(args.model, image, args.batch_size, rank)
    world = MPI.COMM_WORLD
    nbytes = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    grads_buffer = np.ones(nbytes // 4, np.float32)

    plain = training_step(model, opt, loss_fn, x, y, distributed=False)
    synced = training_step(model, opt, loss_fn, x, y, distributed=True)

    def repeat(step, after=None):
        def run():
            for _ in range(args.steps):
                step().numpy()
                if after is not None:
                    after()

        return run

    variants = {
        "no communication": repeat(plain),
        "barrier": repeat(plain, world.Barrier),
        "naive allreduce": repeat(
            plain, lambda: world.Allreduce(MPI.IN_PLACE, grads_buffer, MPI.SUM)
        ),
        "syncdp": repeat(synced),
    }
    times = alternate(variants, args.repeats, sync=world.Barrier)
    # A synchronous step is as slow as the slowest rank: each repetition's maximum over ranks.
    every = world.allgather(times)
    worst = {k: [max(t[k][i] for t in every) for i in range(args.repeats)] for k in times}

    # Where syncdp's step time goes, per rank, over steps that run alone.
    world.Barrier()
    syncdp.watch.stats.RECORDER.reset()
    repeat(synced)()
    repeat(synced)()
    split = world.gather(dict(syncdp.timing(), host=MPI.Get_processor_name()), root=0)
    if rank != 0:
        return None
    return {
        "np": size,
        "model": args.model,
        "mbytes": nbytes / 1e6,
        "batch": args.batch_size,
        "steps": args.steps,
        "repeats": args.repeats,
        # (median, low, high): a step's milliseconds, and throughput over no communication
        # paired by round (load that hits a round hits both sides of its ratio).
        "step_ms": {k: interval([t * 1e3 / args.steps for t in v]) for k, v in worst.items()},
        "ratio": {k: paired_ratio(worst[BASE], worst[k]) for k in SYNCED},
        "split": split,
        "machine": machine(f"np={size}, {args.intra_threads} intra-op thread(s) per rank"),
    }


def _print_one(r: dict) -> None:
    say(
        f"np={r['np']} {r['model']} ({r['mbytes']:.1f} MB of gradients), batch {r['batch']}, "
        f"{r['repeats']} alternating repetitions of {r['steps']} steps, slowest rank; "
        "median [95% interval]"
    )
    say(f"  {BASE:<18} step {fmt_interval(r['step_ms'][BASE], 1)} ms")
    for k in SYNCED:
        say(
            f"  {k:<18} throughput / no communication {fmt_interval(r['ratio'][k])}"
            f"   (step {fmt_interval(r['step_ms'][k], 1)} ms)"
        )
    say(f"  {'rank':>4}{'step ms':>9}{'computing':>11}{'waiting':>9}{'moving':>8}{'GB/s':>7}")
    for i, s in enumerate(r["split"]):
        say(
            f"  {i:>4}{(s['step_s'] or 0) * 1e3:>9.1f}{s['computing']:>11.0%}"
            f"{s['waiting']:>9.0%}{s['moving']:>8.0%}{s['gbps'] or 0:>7.2f}"
        )


def _drive(args) -> None:
    results = []
    for n in [int(s) for s in args.np.split(",")]:
        if n < 2:
            sys.exit("breakdown.py needs 2 or more ranks per job (--np 2,4,...).")
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "r.json")
            cmd = ["syncdp-run", "-np", str(n), sys.executable, os.path.abspath(__file__)]
            cmd += ["--worker", "--json-out", out, "--model", args.model]
            cmd += ["--batch-size", str(args.batch_size), "--steps", str(args.steps)]
            cmd += ["--repeats", str(args.repeats), "--intra-threads", str(args.intra_threads)]
            print(f"running np={n}: {' '.join(cmd)}", flush=True)
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=args.timeout)
            results.append(json.loads(Path(out).read_text()))
        _print_one(results[-1])
    if not args.no_write:
        _write(results)


def _write(results: list[dict]) -> None:
    """Writes ``results/breakdown.md`` and ``breakdown.png`` from the figures of each np."""
    rows = []
    for r in results:
        rows.append(
            [
                r["np"],
                fmt_interval(r["step_ms"][BASE], 1),
                *(fmt_interval(r["ratio"][k]) for k in SYNCED),
            ]
        )
    split_rows = []
    for r in results:
        for i, s in enumerate(r["split"]):
            split_rows.append(
                f"| {r['np']} | {i} | {(s['step_s'] or 0) * 1e3:.1f} | {s['computing']:.0%} | "
                f"{s['waiting']:.0%} | {s['moving']:.0%} | {s['gbps'] or 0:.2f} |"
            )
    r0 = results[-1]
    notes = (
        f"{r0['model']}, {r0['mbytes']:.1f} MB of float32 gradients, batch {r0['batch']} per "
        f"rank, {r0['steps']} steps per repetition, {r0['repeats']} alternating repetitions, "
        f"the slowest rank's time in each. Each variant's column is its throughput relative "
        f"to the same step with no communication (1.0 = synchronization costs nothing): the "
        f"median of the per-repetition ratios no-communication time / variant time (paired "
        f"by round), with a bootstrap 95% interval in brackets.\n\n"
        f"Machine: {r0['machine']}.\n\n"
        "Where syncdp's step time went, per rank (`syncdp.timing()`):\n\n"
        "| np | rank | step ms | computing | waiting | moving | GB/s |\n"
        "|---|---|---|---|---|---|---|\n"
        + "\n".join(split_rows)
        + "\n\nThroughput relative to no communication, median [95% interval]:"
    )
    header = ["np", f"{BASE} ms per step", *SYNCED]
    write_markdown("breakdown", "Where a synchronous step loses time", header, rows, notes)
    _plot(results)


def _plot(results: list[dict]) -> Path | None:
    """Draws ``results/breakdown.png``: each variant's throughput ratio with its 95% interval
    as an error bar, and each rank's split; returns the path, or None without matplotlib."""
    plt = pyplot("breakdown")
    if plt is None:
        return None
    r0 = results[-1]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / len(SYNCED)
    top = 1.1
    for j, k in enumerate(SYNCED):
        xs = [i + j * width for i in range(len(results))]
        mid, lo, hi = zip(*(r["ratio"][k] for r in results))
        errors = [[m - low for m, low in zip(mid, lo)], [h - m for m, h in zip(mid, hi)]]
        left.bar(xs, mid, width, yerr=errors, capsize=3, label=k)
        top = max(top, *(h + 0.05 for h in hi))
    left.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    left.set_xticks([i + 0.4 - width / 2 for i in range(len(results))])
    left.set_xticklabels([f"np={r['np']}" for r in results])
    left.set_ylabel("throughput / no communication (95% interval)")
    left.set_ylim(0, top)
    left.legend(fontsize=8)
    left.set_title(f"{r0['model']}: synchronization cost")
    labels = []
    phases = ("computing", "waiting", "moving")
    for r in results:
        labels += [f"{r['np']}:{i}" for i in range(len(r["split"]))]
    bottoms = [0.0] * len(labels)
    for phase in phases:
        values = [s[phase] for r in results for s in r["split"]]
        right.bar(range(len(labels)), values, bottom=bottoms, label=phase)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    right.set_xticks(range(len(labels)))
    right.set_xticklabels(labels, fontsize=7)
    right.set_xlabel("np:rank")
    right.set_ylabel("share of syncdp's step")
    right.legend(fontsize=8)
    right.set_title("where each rank's step went")
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "breakdown.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if not args.worker:
        _drive(args)
        return
    r = _worker(args)
    if r is None:
        return
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(r))
    else:
        _print_one(r)


if __name__ == "__main__":
    main()
