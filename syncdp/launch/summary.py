"""'Where the time went': the launcher's per-rank table of step time and its shares.

Every rank sends a ``timing`` report at exit (and every 20 s while it trains, so that
``kill -USR1 <syncdp-run>`` can print the figures so far): its step time and the shares spent
computing, waiting for the other ranks and moving bytes, and the bandwidth it achieved (see
``syncdp.watch.stats``). :func:`format_table` turns the latest report of each rank into a short
table and names the slowest rank: the one that waits least, since every other rank waits
for it.

Example output::

    syncdp-run: where the time went (per rank, over 480 steps):
      rank  host   step ms  computing  waiting  moving   GB/s
         0  vm       105.2        81%      12%      7%   2.10
         1  vm       104.9        90%       3%      7%   2.03
    syncdp-run: slowest: rank 1 (waits 3% of its step; the others wait 12% on average)

In an elastic job the heading counts the steps of the ranks that trained longest; a rank that
joined later (a replacement, a spare made a rank) trained fewer, and a ``steps`` column then
says how many each did. A rank with fewer than two steps (one that called ``join()`` after its
first batch) has no step time (``-``), its shares are over its whole run, and it is not
compared with the others for the slowest. Each rank leaves a recovery, and the first step
after it, out of its figures (``syncdp.watch.stats``), so a newcomer's start-up is charged to
no rank.

The bandwidth column takes one unit for every row, the largest of GB/s, MB/s and kB/s in
which the fastest rank moves at least 1 (a small model moves kilobytes per step, which in GB/s
would print 0.00); a rank that moved nothing shows ``-``, one too slow to show in that unit
``<0.01``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

__all__ = ["TimingBoard", "format_table", "latest_by_rank"]

# Below this much waiting between the slowest rank and the others, no rank is singled out.
_STRAGGLER_GAP = 0.02
# The bandwidth column's units, largest first: (heading, bytes per second per unit / 1e9).
_RATE_UNITS = (("GB/s", 1.0), ("MB/s", 1e-3), ("kB/s", 1e-6))


def latest_by_rank(reports: Iterable[Mapping]) -> dict[int, Mapping]:
    """The last ``timing`` report of each rank, by rank."""
    latest: dict[int, Mapping] = {}
    for r in reports:
        if r.get("kind") == "timing" and isinstance(r.get("rank"), int):
            latest[r["rank"]] = r
    return latest


def _share(value) -> str:
    return f"{value:.0%}" if isinstance(value, int | float) else "-"


def _rate_unit(rates: Iterable[float]) -> tuple[str, float]:
    """The bandwidth column's unit for these rates in GB/s: the largest in which the fastest
    is at least 1 (kB/s below that)."""
    fastest = max(rates, default=0.0)
    return next((u for u in _RATE_UNITS if fastest >= u[1]), _RATE_UNITS[-1])


def _rate(gbps, per_unit: float) -> str:
    """One rank's bandwidth in the column's unit, three significant digits or so."""
    if not isinstance(gbps, int | float) or not gbps > 0:
        return "-"
    value = gbps / per_unit
    if value < 0.01:
        return "<0.01"
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def format_table(reports: Iterable[Mapping], *, prefix: str = "syncdp-run: ") -> str:
    """The summary lines for the latest ``timing`` report of each rank ('' if none).

    Args:
        reports: Reports as the launcher received them (any kinds; others are skipped).
        prefix: Put before the heading and the verdict lines.
    """
    latest = latest_by_rank(reports)
    if not latest:
        return ""
    counts = {rank: int(r.get("steps") or 0) for rank, r in latest.items()}
    steps = max(counts.values())
    what = f"over {steps} steps" if steps >= 2 else "no training steps: whole run"
    uneven = min(counts.values()) != steps  # some rank joined later (elastic)
    steps_head = f"{'steps':>7}" if uneven else ""
    unit, per_unit = _rate_unit(
        r["gbps"] for r in latest.values() if isinstance(r.get("gbps"), int | float)
    )
    lines = [
        f"{prefix}where the time went (per rank, {what}):",
        f"  {'rank':>4}  {'host':<12}{steps_head}{'step ms':>8}{'computing':>11}{'waiting':>9}"
        f"{'moving':>8}{unit:>7}",
    ]
    for rank in sorted(latest):
        r = latest[rank]
        step = r.get("step_s")
        lines.append(
            f"  {rank:>4}  {str(r.get('host', '?'))[:11]:<12}"
            + (f"{counts[rank]:>7}" if uneven else "")
            + (f"{step * 1e3:>8.1f}" if step else f"{'-':>8}")
            + f"{_share(r.get('computing')):>11}{_share(r.get('waiting')):>9}"
            f"{_share(r.get('moving')):>8}"
            f"{_rate(r.get('gbps'), per_unit):>7}"
        )
    # Only ranks with a measured step are compared: one that ran fewer than two steps (it
    # joined early, or trained on one batch) has its shares over its whole run instead.
    stepped = {rank: r for rank, r in latest.items() if r.get("step_s")}
    if len(stepped) >= 2:
        waits = {rank: float(r.get("waiting") or 0.0) for rank, r in stepped.items()}
        slowest = min(waits, key=waits.get)
        others = [w for rank, w in waits.items() if rank != slowest]
        mean_other = sum(others) / len(others)
        if mean_other - waits[slowest] >= _STRAGGLER_GAP:
            host = latest[slowest].get("host", "?")
            lines.append(
                f"{prefix}slowest: rank {slowest} on {host} (waits {waits[slowest]:.0%} of its "
                f"step; the others wait {mean_other:.0%} on average)"
            )
        else:
            lines.append(f"{prefix}no straggler: the ranks wait about equally")
    return "\n".join(lines)


class TimingBoard:
    """The latest ``timing`` report of each rank, kept as reports arrive (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._latest: dict[int, Mapping] = {}

    def add(self, report: Mapping) -> None:
        """Keeps ``report`` if it is a rank's ``timing`` report; ignores every other kind."""
        if report.get("kind") == "timing" and isinstance(report.get("rank"), int):
            with self._lock:
                self._latest[report["rank"]] = report

    def trained(self) -> bool:
        """Whether some rank ran two or more training steps (a table worth printing)."""
        with self._lock:
            return any(int(r.get("steps") or 0) >= 2 for r in self._latest.values())

    def table(self) -> str:
        """:func:`format_table` of the reports so far ('' if none)."""
        with self._lock:
            reports = list(self._latest.values())
        return format_table(reports)
