"""The timing table's bandwidth column: one unit for every row, chosen so that the figures
mean something (a small model's kilobytes per step never print as 0.00 GB/s)."""

from __future__ import annotations

import pytest

from syncdp.launch import summary


def _timing(rank: int, gbps) -> dict:
    return {
        "kind": "timing",
        "rank": rank,
        "host": "h",
        "steps": 10,
        "step_s": 0.002,
        "waiting": 0.1,
        "moving": 0.1,
        "computing": 0.8,
        "gbps": gbps,
    }


def _column(text: str) -> list[str]:
    lines = text.splitlines()
    return [line.split()[-1] for line in lines[1:-1]]


@pytest.mark.parametrize(
    "rates,column",
    [
        ((2.104, 1.97), ["GB/s", "2.10", "1.97"]),
        ((0.0031, 0.0029), ["MB/s", "3.10", "2.90"]),  # was 0.00 and 0.00 GB/s
        ((0.250, 0.0123), ["MB/s", "250", "12.3"]),
        ((4.2e-6, 3e-6), ["kB/s", "4.20", "3.00"]),
        ((1.5, None), ["GB/s", "1.50", "-"]),  # rank 1 moved nothing
        ((1.5, 2e-6), ["GB/s", "1.50", "<0.01"]),
        ((None, None), ["kB/s", "-", "-"]),
    ],
)
def test_the_bandwidth_column_takes_one_meaningful_unit(rates, column):
    text = summary.format_table([_timing(r, g) for r, g in enumerate(rates)])
    assert _column(text) == column, text
    assert "0.00" not in text
    widths = {len(line) for line in text.splitlines()[1:-1]}
    assert len(widths) == 1, text  # the rows line up under the heading


def test_a_rank_without_a_measured_step_shows_none_and_is_not_named_slowest():
    # Rank 0 called join() after its first batch: it has no step time, and its shares are
    # over its whole run (start-up included), where it hardly waits. It printed "nan" and was
    # named the slowest rank, the one the others wait for.
    joined = {**_timing(0, 1.0), "steps": 1, "step_s": None, "waiting": 0.02, "computing": 0.97}
    busy = [{**_timing(r, 1.0), "waiting": w} for r, w in ((1, 0.45), (2, 0.30))]
    text = summary.format_table([joined, *busy])
    rows = text.splitlines()[2:5]
    assert rows[0].split()[:4] == ["0", "h", "1", "-"], text  # 1 step, no step time
    assert "nan" not in text
    assert len({len(row) for row in rows}) == 1, text  # still lined up
    assert text.splitlines()[-1] == (
        "syncdp-run: slowest: rank 2 on h (waits 30% of its step; the others wait 45% on average)"
    ), text
    # With one measured rank left, none is named.
    alone = summary.format_table([joined, busy[0]])
    assert "slowest" not in alone and "straggler" not in alone, alone
