"""Where the time went: the rank's recorder and the launcher's table."""

import pytest

from syncdp.launch import summary
from syncdp.watch import stats


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_recorder_splits_the_window_between_steps():
    clock = _Clock()
    rec = stats.Recorder(clock)
    rec.add("move", 5.0, 10**9)  # before the first step: startup, not counted
    for _ in range(4):  # steps of 100 ms: 20 ms waiting, 30 ms moving 60 MB
        rec.step()
        clock.now += 0.05
        rec.add("wait", 0.02)
        rec.add("move", 0.03, 60_000_000)
        clock.now += 0.05
    rec.step()
    s = rec.summary()
    assert s["steps"] == 5
    assert s["step_s"] == pytest.approx(0.1)
    assert s["waiting"] == pytest.approx(0.2)
    assert s["moving"] == pytest.approx(0.3)
    assert s["computing"] == pytest.approx(0.5)
    assert s["gbps"] == pytest.approx(2.0)  # 60 MB in 30 ms
    assert s["nbytes"] == 240_000_000


def test_recorder_without_steps_covers_the_whole_run():
    clock = _Clock()
    rec = stats.Recorder(clock)
    clock.now = 2.0
    rec.add("wait", 0.5)
    s = rec.summary()
    assert s["step_s"] is None and s["gbps"] is None
    assert s["waiting"] == pytest.approx(0.25) and s["computing"] == pytest.approx(0.75)


def _timing(rank, waiting, host="h"):
    return {
        "kind": "timing",
        "rank": rank,
        "host": host,
        "steps": 10,
        "step_s": 0.1,
        "waiting": waiting,
        "moving": 0.1,
        "computing": 0.9 - waiting,
        "gbps": 1.5,
    }


def test_table_names_the_rank_the_others_wait_for():
    reports = [_timing(0, 0.5), {"kind": "exit", "rank": 0}, _timing(1, 0.01, "b"), _timing(2, 0.4)]
    text = summary.format_table(reports)
    lines = text.splitlines()
    assert "over 10 steps" in lines[0]
    assert len(lines) == 2 + 3 + 1
    assert lines[-1].startswith("syncdp-run: slowest: rank 1 on b (waits 1%")
    assert "45% on average" in lines[-1]


def test_table_uses_each_ranks_latest_report_and_sees_no_straggler_among_equals():
    reports = [_timing(0, 0.5), _timing(0, 0.05), _timing(1, 0.05)]
    text = summary.format_table(reports)
    assert "no straggler" in text.splitlines()[-1]
    assert summary.format_table([{"kind": "exit", "rank": 0}]) == ""
