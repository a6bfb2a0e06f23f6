"""Autotune against a sweep: does ``--autotune`` land near the best hand-set buckets?

In one job, every rank builds the benchmark model (``--model cnn`` or ``resnet50``) and one
``tf.function`` training step per hand-set configuration: every distinct bucket plan of the
tuner's grid (fusion threshold 2/8/25/64 MiB x first bucket 0.25/1/4 MiB or none; two settings
that give the same buckets for this model are one plan, measured once). One more step is traced
with autotuning on and trained until the tuner settles. Then all of them are timed side by
side: rounds of ``--steps`` steps each, the order rotating every round, every rank starting each
variant together; a variant's figure is the median over rounds of the slowest rank's mean step.

Reported: each configuration's step time, the best hand-set one, the autotuned one (with what it
chose and how many steps the search took) and the ratio autotuned / best (target: at most 1.03).
On one host the chunk size does not matter (gradients move through the shared-memory plane),
so the search there covers the two bucket dimensions, as the sweep does.

Usage::

    syncdp-run -np 2 python benchmarks/autotune.py --model cnn
    syncdp-run -np 2 python benchmarks/autotune.py --model resnet50 --steps 5 --repeats 3

Results go to ``benchmarks/results/autotune_MODEL.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import alternate, machine, median, say, setup_threads, write_markdown  # noqa: E402
from synthetic import training_setup, training_step  # noqa: E402

__all__ = ["main"]

MiB = 1 << 20


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["cnn", "resnet50"], default="cnn")
    p.add_argument("--batch-size", type=int, default=None, help="default 32 (cnn), 4 (resnet50)")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=10, help="steps per timed repetition")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds")
    p.add_argument("--steps-per-sample", type=int, default=10, help="the tuner's sample")
    p.add_argument("--warmup-samples", type=int, default=3)
    p.add_argument("--max-samples", type=int, default=20)
    p.add_argument("--intra-threads", type=int, default=1)
    p.add_argument("--no-write", action="store_true", help="print only, write no results")
    return p


def _label(first: int, cap: int) -> str:
    first_text = "none" if first == 0 else f"{first / MiB:g}"
    return f"cap {cap / MiB:g} MiB, first {first_text}"


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    setup_threads(args.intra_threads)
    from mpi4py import MPI

    import syncdp
    from syncdp import engine
    from syncdp.engine import autotune
    from syncdp.job import runtime
    from syncdp.tensorflow import autotuning

    syncdp.init()
    if syncdp.size() < 2:
        say("autotune.py compares communication settings; run it with syncdp-run -np 2.")
        sys.exit(2)
    batch = args.batch_size or (32 if args.model == "cnn" else 4)
    model, opt, loss_fn, x, y = training_setup(args.model, args.image_size, batch, syncdp.rank())
    specs = [engine.TensorSpec(v.numpy().nbytes, "float32") for v in model.trainable_variables]
    nbytes = sum(s.nbytes for s in specs)
    config = runtime.get_config()
    comm = runtime.communicator()

    # The hand-set configurations: every distinct plan of the tuner's grid.
    grid = autotune.Tuner(
        autotune.Choice(
            config.fusion_threshold, config.first_bucket_bytes, config.chunk_bytes, False
        ),
        warmup_samples=0,
        steps_per_sample=1,
        max_samples=1,
    ).plan_grid
    plans: dict[tuple, tuple[int, int]] = {}
    for first, cap in grid:
        buckets = engine.plan(specs, first_bytes=first, cap_bytes=cap, reverse=True)
        plans.setdefault(tuple(b.indices for b in buckets), (first, cap))
    steps = {}
    # Bucket sizes and autotuning are read when a step is traced: trace each under its own.
    for first, cap in plans.values():
        runtime._state.config = dataclasses.replace(
            config, first_bucket_bytes=first, fusion_threshold=cap, autotune=False
        )
        step = training_step(model, opt, loss_fn, x, y, distributed=True)
        step()
        steps[_label(first, cap)] = step
    runtime._state.config = dataclasses.replace(
        config,
        autotune=True,
        autotune_warmup_samples=args.warmup_samples,
        autotune_steps_per_sample=args.steps_per_sample,
        autotune_max_samples=args.max_samples,
    )
    tuned = training_step(model, opt, loss_fn, x, y, distributed=True)
    began, search_steps = time.perf_counter(), 0
    while True:
        tuned().numpy()
        search_steps += 1
        tuner = autotuning.tuner()
        if tuner is not None and tuner.settled:
            break
    search_seconds = time.perf_counter() - began
    runtime._state.config = config
    steps["autotuned"] = tuned

    def repetition(step):
        def run():
            comm.chunk_bytes = config.chunk_bytes  # the tuned step sets its own at each step
            for _ in range(args.steps):
                loss = step()
            loss.numpy()

        return run

    world = MPI.COMM_WORLD
    times = alternate(
        {k: repetition(s) for k, s in steps.items()}, args.repeats, sync=world.Barrier, warmup=1
    )
    every = world.gather(times, root=0)
    if syncdp.rank() != 0:
        return
    worst = {
        k: [max(t[k][i] for t in every) / args.steps for i in range(args.repeats)] for k in times
    }
    med = {k: median(v) for k, v in worst.items()}
    hand = {k: v for k, v in med.items() if k != "autotuned"}
    best = min(hand, key=hand.get)
    chosen = tuner.best
    chosen_plan = engine.plan(
        specs, first_bytes=chosen.first_bytes, cap_bytes=chosen.cap_bytes, reverse=True
    )
    chosen_label = _label(*plans[tuple(b.indices for b in chosen_plan)])
    ratio = med["autotuned"] / hand[best]
    rows = [
        [k, f"{v * 1e3:.1f}", f"{v / hand[best]:.3f}", "best hand-set" if k == best else ""]
        for k, v in sorted(med.items(), key=lambda kv: kv[1])
    ]
    cfg = (
        f"{args.model}, {nbytes / 1e6:.1f} MB of float32 gradients in {len(specs)} tensors, "
        f"batch {batch} per rank of {args.image_size}x{args.image_size} images, SGD with "
        f"momentum, np={syncdp.size()}; {len(plans)} distinct plans of the grid; "
        f"{args.repeats} rounds of {args.steps} steps"
    )
    verdict = (
        f"autotuned / best hand-set = {ratio:.3f} (target <= 1.03). The tuner chose "
        f"{chosen.describe(tuner.tuned)} after {search_steps} steps ({search_seconds:.0f} s: "
        f"{args.warmup_samples} warmup samples, then at most {args.max_samples} samples of "
        f"{args.steps_per_sample} steps)."
    )
    mach = machine(f"{args.intra_threads} intra-op thread per rank")
    say(f"autotune: {cfg}\nmachine: {mach}")
    say(f"{'variant':<36}{'median step ms':>16}{'x best':>9}")
    for row in rows:
        say(f"{row[0]:<36}{row[1]:>16}{row[2]:>9}  {row[3]}")
    say(f"{verdict} Its buckets are those of: {chosen_label}.")
    if not args.no_write:
        write_markdown(
            f"autotune_{args.model}",
            f"Autotune against a sweep of hand-set buckets: {args.model}",
            ["configuration", "median step ms (slowest rank)", "x best hand-set", ""],
            rows,
            f"{cfg}.\n\n{verdict} The autotuned row is the same traced step timed in the same "
            f"rounds as the others (its choice plans the same buckets as {chosen_label}).\n\n"
            f"Machine: {mach}.",
        )


if __name__ == "__main__":
    main()
