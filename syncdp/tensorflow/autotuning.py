"""Autotuning in a TensorFlow step: every plan the search may pick, chosen at run time.

Buckets are planned when a step is traced (:mod:`syncdp.engine.buckets`), but the tuner
(:mod:`syncdp.engine.autotune`) changes the fusion threshold and the first bucket while the
traced step runs. So a tuned gradient reduction is traced once with every distinct plan of the
tuner's grid as a branch of a ``tf.switch_case``, and a host call picks the branch at each step.
TensorFlow lowers the switch to per-tensor switches inside a ``tf.function``, so a branch's
first bucket still starts while backprop computes the earlier layers (measured: the last
layer's bucket ran 67 ms before the first layer's gradient existed, as without the switch).

The host call that picks is also where the tuner measures: it runs once per gradient reduction,
at the start of the step, ticks the tuner, and when a sample is complete agrees its score with
the other ranks (the largest median step) before the tuner moves on. The chunk size and the
hierarchy are run-time settings of the job's communicator and are set there too. Every rank
makes the same calls in the same order, so every rank picks the same branch.

Eagerly, the plan is simply made for the current choice at each call. TF1 graphs, process sets
other than the whole job, and elastic jobs (a replacement could not join a search mid-way) keep
the configured plan.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from syncdp.engine import autotune
from syncdp.job import runtime
from syncdp.tensorflow import graph

__all__ = ["tuner", "reduce_tuned", "say_untuned"]

_TUNER: autotune.Tuner | None = None
_ELASTIC_SAID = False
_LOG_FAILED = False
# Call site -> (every grid pair's buckets, a key per pair equal for identical buckets).
_PLANS: dict[tuple, tuple[list, list]] = {}


def tuner() -> autotune.Tuner | None:
    """This process's tuner when ``--autotune`` is on (made at first use), else None."""
    global _TUNER, _ELASTIC_SAID
    config = runtime.get_config()
    if not config.autotune:
        return None
    if config.elastic:
        # A replacement would join with a fresh search while the others are mid-way, and
        # pick other buckets than they do.
        if not _ELASTIC_SAID and runtime.communicator().rank == 0:
            print(
                "syncdp: --autotune is off in elastic mode (a rank that joins later could not "
                "share the search); the configured buckets are used.",
                file=sys.stderr,
                flush=True,
            )
        _ELASTIC_SAID = True
        return None
    if _TUNER is None:

        def active(name: str) -> bool:
            comm = runtime.communicator()
            if name == "chunk_bytes":
                return comm.moves_through_mpi()
            if name == "hierarchical":
                hosts = runtime.topology().hosts
                return comm.hierarchy is not None and 1 < hosts < comm.size
            return True

        atexit.register(_say_if_unfinished)
        _TUNER = autotune.Tuner(
            autotune.Choice(
                cap_bytes=config.fusion_threshold,
                first_bytes=config.first_bucket_bytes,
                chunk_bytes=config.chunk_bytes,
                hierarchical=runtime.communicator().prefer_hierarchy,
            ),
            warmup_samples=config.autotune_warmup_samples,
            steps_per_sample=config.autotune_steps_per_sample,
            max_samples=config.autotune_max_samples,
            active=active,
        )
    return _TUNER


_UNTUNED_SAID: set[str] = set()


def say_untuned(where: str, speaker: int) -> None:
    """With ``--autotune`` on, rank ``speaker`` (the lowest of the reducing ranks) says once
    that gradient reductions ``where`` (a TF1 graph, a process set) keep the configured
    buckets: no search runs there, and no log."""
    config = runtime.get_config()
    if not config.autotune or config.elastic or where in _UNTUNED_SAID:
        return
    _UNTUNED_SAID.add(where)
    if runtime.rank() == speaker:
        print(
            f"syncdp: --autotune does not tune gradient reductions {where}; they keep the "
            "configured fusion threshold and buckets.",
            file=sys.stderr,
            flush=True,
        )


def _say_if_unfinished() -> None:
    """At exit, rank 0 says when the job ended before the search did (it ran as searched)."""
    t = _TUNER
    if t is None or t.settled or not runtime.is_initialized() or runtime.rank() != 0:
        return
    measured = sum(1 for r in t.rows if r["kind"] == "sample")
    print(
        f"syncdp: autotune did not finish: the job ended after {measured} of up to "
        f"{t.samples_left + measured} samples (plus {len(t.rows) - measured} warmup); give it "
        "more steps, or fewer or shorter samples (--autotune-steps-per-sample).",
        file=sys.stderr,
        flush=True,
    )


def _select(t: autotune.Tuner) -> int:
    """At each tuned reduction: tick, agree on a finished sample, apply the choice."""
    comm = runtime.communicator()
    if t.tick(time.perf_counter()):
        mine = np.array([t.local_score()], dtype=np.float64)
        agreed = comm.allreduce(mine, "max", name="autotune.sample")
        was_settled = t.settled
        t.record(float(agreed[0]))
        if comm.rank == 0:
            _log(t, finished=t.settled and not was_settled)
    comm.chunk_bytes = t.choice.chunk_bytes
    if "hierarchical" in t.tuned:
        comm.prefer_hierarchy = t.choice.hierarchical
    return t.plan_index()


def _log(t: autotune.Tuner, finished: bool) -> None:
    """Rank 0: rewrites the CSV log (it is short) and says the choice once.

    The file was found writable at ``init()``; one that stops being so (its directory removed
    while training) is said once and not written again: a log is no reason to end training,
    and an error here would surface as TensorFlow's "Graph execution error", naming no file.
    """
    global _LOG_FAILED
    path = runtime.get_config().autotune_log_file
    if path and not _LOG_FAILED:
        tmp = f"{path}.tmp"
        try:
            with open(tmp, "w") as f:
                f.write("\n".join(autotune.csv_lines(t.rows)) + "\n")
            os.replace(tmp, path)
        except OSError as e:
            _LOG_FAILED = True
            print(
                f"syncdp: cannot write the autotune log {path!r} ({e.strerror}: {e.filename}); "
                "autotune goes on without it.",
                file=sys.stderr,
                flush=True,
            )
    if finished:
        print(f"syncdp: {t.summary()}", file=sys.stderr, flush=True)


def reduce_tuned(
    t: autotune.Tuner,
    plan_for: Callable[[int, int], list],
    run_plan: Callable[[list], tuple[list, object]],
    site: tuple,
    with_step: bool,
):
    """Runs the tuner's current plan; in a trace, every distinct plan as a switch branch.

    Args:
        t: The tuner.
        plan_for: ``(first_bytes, cap_bytes)`` -> the buckets.
        run_plan: Buckets -> ``(reduced tensors, agreed step or None)``, building the
            collectives (or running them eagerly).
        site: Names this call site (its name and tensor sizes) for the tuner's bookkeeping.
        with_step: Whether ``run_plan`` returns an agreed step tensor.

    Returns:
        What ``run_plan`` returns.
    """
    if site not in _PLANS:  # planned once per call site (an eager step comes here each time)
        plans = [plan_for(first, cap) for first, cap in t.plan_grid]
        keys = [tuple(b.indices for b in p) for p in plans]
        t.note_plans(site, dict(zip(t.plan_grid, keys)))
        _PLANS[site] = plans, keys
    plans, keys = _PLANS[site]
    if tf.executing_eagerly():
        return run_plan(plans[_select(t)])
    distinct: list[tuple] = []
    for k in keys:
        if k not in distinct:
            distinct.append(k)
    branch_of = tf.constant([distinct.index(k) for k in keys], tf.int32)
    picked = graph.ordered_call(
        lambda _: (np.int32(_select(t)),),
        [tf.constant(0, tf.int32)],
        [tf.int32],
        [tf.TensorShape([])],
        "autotune.select",
    )[0]

    def branch(plan: list) -> Callable[[], list]:
        def build() -> list:
            reduced, agreed = run_plan(plan)
            return list(reduced) + ([agreed] if with_step else [])

        return build

    first_of = {k: plans[keys.index(k)] for k in distinct}
    outs = tf.switch_case(tf.gather(branch_of, picked), [branch(first_of[k]) for k in distinct])
    outs = list(outs) if isinstance(outs, Sequence) else [outs]
    graph.follow_collective(outs[0].op)
    if with_step:
        return outs[:-1], outs[-1]
    return outs, None
