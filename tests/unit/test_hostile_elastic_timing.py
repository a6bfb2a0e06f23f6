"""'Where the time went' across an elastic recovery: the recovery is charged to no rank."""

import pytest

from syncdp.launch import summary
from syncdp.watch import stats


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _steps(rec, clock, n, *, seconds=0.1, waiting=0.01, measured=True):
    for _ in range(n):
        rec.step(measured=measured)
        clock.now += seconds - waiting
        rec.add("wait", waiting)
        clock.now += waiting


def test_a_survivor_leaves_the_recovery_and_the_first_step_after_it_out():
    clock = _Clock()
    rec = stats.Recorder(clock)
    _steps(rec, clock, 5)  # 4 measured steps of 100 ms, the 5th cut short by the failure
    clock.now += 8.0  # the recovery: shrink, spawn
    _steps(rec, clock, 1, seconds=0.5, measured=False)  # a reset callback's step
    clock.now += 1.0
    rec.restart_window()  # the sync
    _steps(rec, clock, 1, seconds=3.0, waiting=2.9)  # it waits for a newcomer's first step
    _steps(rec, clock, 4)
    rec.step()
    s = rec.summary()
    assert s["steps"] == 12
    # 4 intervals before the failure, 4 after the first step after it: all 100 ms steps.
    assert s["step_s"] == pytest.approx(0.1)
    assert s["waiting"] == pytest.approx(0.1)


def test_a_newcomers_start_up_is_left_out_too():
    clock = _Clock()
    rec = stats.Recorder(clock)
    clock.now = 5.0  # it joined: init(), the reset callbacks' steps before the sync
    _steps(rec, clock, 2, seconds=1.0, waiting=0.0, measured=False)  # before the sync
    rec.restart_window()  # the sync: its figures start here
    _steps(rec, clock, 1, seconds=2.5, waiting=0.0)  # its first step traces the function
    _steps(rec, clock, 3, waiting=0.0)
    s = rec.summary()
    assert s["steps"] == 6 and s["step_s"] == pytest.approx(0.1)
    assert s["computing"] == pytest.approx(1.0)


def test_a_recovery_just_before_the_end_keeps_what_was_measured():
    clock = _Clock()
    rec = stats.Recorder(clock)
    _steps(rec, clock, 4)
    rec.restart_window()
    clock.now += 5.0
    rec.step()
    assert rec.summary()["step_s"] == pytest.approx(0.1)


def _timing(rank, steps, waiting):
    return {
        "kind": "timing",
        "rank": rank,
        "host": "h",
        "steps": steps,
        "step_s": 0.1,
        "waiting": waiting,
        "moving": 0.1,
        "computing": 0.9 - waiting,
        "gbps": 1.5,
    }


def test_the_table_counts_the_steps_of_the_ranks_that_trained_longest():
    text = summary.format_table([_timing(0, 40, 0.05), _timing(1, 14, 0.05)])
    lines = text.splitlines()
    assert "over 40 steps" in lines[0]
    assert lines[1].split()[:3] == ["rank", "host", "steps"]
    assert lines[3].split()[:3] == ["1", "h", "14"]
    assert "no straggler" in lines[-1]
    equal = summary.format_table([_timing(0, 40, 0.05), _timing(1, 40, 0.05)])
    assert "steps" not in equal.splitlines()[1]
