"""Autotuning: the reduction settings that make this job's training step fastest, found while
it trains (``syncdp-run --autotune``).

What is tuned, each a *dimension* with a few values (the configured value is always one of
them, so the search can keep it):

- the fusion threshold (most bytes per gradient bucket): 2, 8, 25 or 64 MiB;
- the first bucket (small, so its collective starts while backprop still runs): 0.25, 1 or
  4 MiB, or as large as the others (0);
- the chunk size (most bytes per MPI message), only where gradients go through Open MPI's
  allreduce rather than the shared-memory plane: 1, 4, 8 or 32 MiB;
- hierarchical allreduce on or off, only across hosts with several ranks on some host.

How it measures. Horovod's three numbers mean what they mean there: the first
``warmup_samples`` samples are thrown away (tracing, first-touch of buffers), a *sample* is
``steps_per_sample`` consecutive steps with one choice, and at most ``max_samples`` samples are
measured. A step is the time between two gradient reductions on this rank; a sample's score is
the median of its steps (one slow step from outside does not decide), and then the largest over
the ranks (a synchronous step is as slow as the slowest rank). Every rank gets the same scores,
so every rank makes the same decisions without sending choices around.

How it searches: one dimension at a time (coordinate descent), instead of Horovod's Gaussian
process: for each dimension every value is tried with the others at the best found so far, and
the best is kept; then the dimensions are swept a second time while samples remain. A choice
seen twice keeps its best score (noise on a shared machine only ever adds time). Two choices
that give the same buckets at every tuned call site (a small model fits one bucket whatever the
cap) share one measurement. When the samples run out, the fastest choice measured is kept for
the rest of the job.

This module is pure bookkeeping: the TensorFlow side (:mod:`syncdp.tensorflow.autotuning`)
ticks it at every gradient reduction, agrees on each sample's score over the ranks and applies
the choice.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Hashable, Mapping, Sequence

__all__ = ["Choice", "Tuner", "DIMENSIONS", "csv_lines"]

MiB = 1 << 20

# The values each dimension tries (the configured value is added when it is not among them).
DIMENSIONS: Mapping[str, tuple] = {
    "cap_bytes": (2 * MiB, 8 * MiB, 25 * MiB, 64 * MiB),
    "first_bytes": (MiB // 4, MiB, 4 * MiB, 0),
    "chunk_bytes": (MiB, 4 * MiB, 8 * MiB, 32 * MiB),
    "hierarchical": (False, True),
}
# How many times the dimensions are swept while samples remain.
_PASSES = 2


@dataclasses.dataclass(frozen=True)
class Choice:
    """One setting of every tuned dimension."""

    cap_bytes: int
    first_bytes: int
    chunk_bytes: int
    hierarchical: bool

    def describe(self, dims: Sequence[str] = tuple(DIMENSIONS)) -> str:
        """The values of ``dims`` in words (``fusion threshold 8 MiB, first bucket 1 MiB``)."""
        first = "as large as the others" if self.first_bytes == 0 else _mib(self.first_bytes)
        words = {
            "cap_bytes": f"fusion threshold {_mib(self.cap_bytes)}",
            "first_bytes": f"first bucket {first}",
            "chunk_bytes": f"chunk {_mib(self.chunk_bytes)}",
            "hierarchical": f"hierarchical allreduce {'on' if self.hierarchical else 'off'}",
        }
        return ", ".join(words[d] for d in dims)


def _mib(n: int) -> str:
    return f"{n / MiB:g} MiB"


class Tuner:
    """The search's state on one rank; every rank holds an identical one.

    Args:
        start: The configured settings: the first choice, and the one warmup measures.
        warmup_samples: Samples thrown away before the search starts.
        steps_per_sample: Steps measured per sample.
        max_samples: Most samples the search measures (warmup not counted).
        active: Called once, when the search starts, with a dimension's name: whether to
            tune it (the TF side answers for the chunk size and the hierarchy; the bucket
            dimensions are always tuned).
    """

    def __init__(
        self,
        start: Choice,
        *,
        warmup_samples: int,
        steps_per_sample: int,
        max_samples: int,
        active: Callable[[str], bool] = lambda name: True,
    ):
        if steps_per_sample < 1 or max_samples < 1 or warmup_samples < 0:
            raise ValueError(
                "steps_per_sample and max_samples must be at least 1, warmup_samples at least 0"
            )
        self.start = self.choice = self.best = start
        self.warmup_left = warmup_samples
        self.steps_per_sample = steps_per_sample
        self.samples_left = max_samples
        self._active = active
        self.settled = False
        self.scores: dict[Choice, float] = {}  # best agreed score of each measured choice
        self.rows: list[dict] = []  # one per sample, for the log
        self._last_tick: float | None = None
        self._steps: list[float] = []
        self._plans: dict[Hashable, Mapping[tuple[int, int], Hashable]] = {}
        self._sweeps: list[str] = []  # dimensions still to sweep, in order
        self._queue: list[Choice] = []  # choices of the current sweep still to measure
        self._sweep: list[Choice] = []  # every choice of the current sweep
        self._fresh: list[Choice] = []  # the choices of the current sweep measured so far
        self.tuned: tuple[str, ...] = ()  # the dimensions searched, known once warmup ends
        self._begun = False
        values = {name: list(v) for name, v in DIMENSIONS.items()}
        for name, mine in dataclasses.asdict(start).items():
            if mine not in values[name]:
                values[name].append(mine)
        self.values = {name: tuple(v) for name, v in values.items()}
        # Every (first, cap) pair the search may pick: the plans a traced step must hold.
        self.plan_grid: tuple[tuple[int, int], ...] = tuple(
            (first, cap) for first in self.values["first_bytes"] for cap in self.values["cap_bytes"]
        )

    # --- what the traced step asks -------------------------------------------------------

    def plan_index(self) -> int:
        """The position in :attr:`plan_grid` of the current choice's buckets."""
        return self.plan_grid.index((self.choice.first_bytes, self.choice.cap_bytes))

    def note_plans(self, site: Hashable, keys: Mapping[tuple[int, int], Hashable]) -> None:
        """Records what buckets each (first, cap) pair gives at one call site.

        Args:
            site: Any key naming the call site (its name and tensor sizes).
            keys: (first_bytes, cap_bytes) -> a key equal for pairs that plan the same buckets.
        """
        self._plans[site] = dict(keys)

    def same(self, a: Choice, b: Choice) -> bool:
        """Whether two choices run identically: equal, or only bucket limits that give the
        same buckets at every call site."""
        if (a.chunk_bytes, a.hierarchical) != (b.chunk_bytes, b.hierarchical):
            return False
        pa, pb = (a.first_bytes, a.cap_bytes), (b.first_bytes, b.cap_bytes)
        if pa == pb:
            return True
        return bool(self._plans) and all(k.get(pa) == k.get(pb) for k in self._plans.values())

    # --- measuring -----------------------------------------------------------------------

    def tick(self, now: float) -> bool:
        """Marks a gradient reduction at time ``now`` (seconds); True when a sample is complete
        and its score must be agreed (:meth:`local_score`, then :meth:`record`)."""
        if self.settled:
            return False
        if self._last_tick is not None:
            self._steps.append(now - self._last_tick)
        self._last_tick = now
        return len(self._steps) >= self.steps_per_sample

    def local_score(self) -> float:
        """This rank's score of the sample just completed: its median step, in seconds."""
        return statistics.median(self._steps)

    def record(self, score: float) -> None:
        """Takes the sample's agreed score (the same on every rank) and moves to the next
        choice; settles on the best when the search is over."""
        self._steps = []
        measured = self.choice
        if self.warmup_left > 0:
            self.warmup_left -= 1
            self.rows.append(self._row(measured, score, "warmup"))
            if self.warmup_left == 0:
                self._begin()
                self._advance()
            return
        if not self._begun:  # no warmup: the first sample is the configured choice's
            self._begin()
        self.samples_left -= 1
        # A twin runs identically, so it shares every measurement.
        for choice in [measured, *(c for c in self.scores if self.same(c, measured))]:
            old = self.scores.get(choice)
            self.scores[choice] = score if old is None else min(old, score)
        self.rows.append(self._row(measured, score, "sample"))
        self._advance()

    # --- the search ----------------------------------------------------------------------

    def _begin(self) -> None:
        dims = [d for d in ("cap_bytes", "first_bytes") if len(self.values[d]) > 1]
        for name in ("chunk_bytes", "hierarchical"):
            if self._active(name):
                dims.append(name)
        self.tuned = tuple(dims)
        self._sweeps = dims * _PASSES
        self._begun = True

    def _advance(self) -> None:
        """Picks the next choice to measure, or settles."""
        while True:
            while self._queue:
                nxt = self._queue.pop(0)
                twin = self._measured_twin(nxt)
                if twin is None:
                    if self.samples_left <= 0:
                        break
                    self.choice = nxt
                    return
                self.scores.setdefault(nxt, self.scores[twin])
            if self._sweep:  # the sweep is over: keep its best
                # Ties (twins share a score) keep the value the search came in with.
                incumbent = self.best
                self.best = min(
                    self._sweep,
                    key=lambda c: (self.scores.get(c, float("inf")), c != incumbent),
                )
                self._sweep = []
            if not self._sweeps or self.samples_left <= 0:
                self._settle()
                return
            name = self._sweeps.pop(0)
            self._sweep = [dataclasses.replace(self.best, **{name: v}) for v in self.values[name]]
            # Within a sweep every choice is measured anew (the machine drifts): a choice
            # is only skipped for a twin measured in this same sweep.
            self._queue = list(self._sweep)
            self._fresh = []

    def _measured_twin(self, choice: Choice) -> Choice | None:
        """A choice of this sweep, already measured in it, that runs identically to ``choice``."""
        for other in self._fresh:
            if self.same(choice, other):
                return other
        self._fresh.append(choice)
        return None

    def _settle(self) -> None:
        if self.scores:
            incumbent = self.best
            self.best = min(self.scores, key=lambda c: (self.scores[c], c != incumbent))
        self.choice = self.best
        self.settled = True
        self.rows.append(self._row(self.best, self.scores.get(self.best), "chosen"))

    def _row(self, choice: Choice, score: float | None, kind: str) -> dict:
        return {
            "sample": len(self.rows),
            "kind": kind,
            "fusion_threshold_mb": choice.cap_bytes / MiB,
            "first_bucket_mb": choice.first_bytes / MiB,
            "chunk_mb": choice.chunk_bytes / MiB,
            "hierarchical": int(choice.hierarchical),
            "step_ms": None if score is None else round(score * 1000, 3),
        }

    def summary(self) -> str:
        """One line: what was chosen, its step time and the starting settings'."""
        best = self.scores.get(self.best)
        start = self.scores.get(self.start)
        text = f"autotune chose {self.best.describe(self.tuned or ('cap_bytes', 'first_bytes'))}"
        if best is not None:
            text += f": median step {best * 1000:.1f} ms"
            if start is not None and self.best != self.start:
                text += f" (the configured settings: {start * 1000:.1f} ms)"
        measured = sum(1 for r in self.rows if r["kind"] == "sample")
        return f"{text}, after {measured} samples of {self.steps_per_sample} steps"


def csv_lines(rows: Sequence[dict]) -> list[str]:
    """The log file's lines: a header, then one line per row."""
    if not rows:
        return []
    keys = list(rows[0])
    out = [",".join(keys)]
    for row in rows:
        out.append(",".join(_cell(row[k]) for k in keys))
    return out


def _cell(value) -> str:
    if value is None:
        return ""
    return f"{value:g}" if isinstance(value, float) else str(value)
