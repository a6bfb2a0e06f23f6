"""wait_politely: how a rank waits for the others. It polls without a system call first, then
yielding the core, through the spin (a wait shorter than that never sleeps), and only then
sleeps; a wait that sleeps asks for a 1 us timer slack on its own thread, and loads nothing to
do so."""

import ctypes
import threading
import time

import pytest

from syncdp.transport import waiting

_PR_SET_TIMERSLACK, _PR_GET_TIMERSLACK = 29, 30


class _DoneAfter:
    """An MPI request stand-in that completes ``seconds`` after it is made."""

    def __init__(self, seconds: float):
        self.at = time.perf_counter() + seconds
        self.tests = 0

    def Test(self) -> bool:
        self.tests += 1
        return time.perf_counter() >= self.at


class _DoneOnceSlept:
    """An MPI request stand-in that completes at the first test after ``time.sleep`` was
    called (really sleeping), so a wait surely reaches its sleeping part however slow the
    machine."""

    def __init__(self, monkeypatch):
        self.slept, self.tests = False, 0
        real = time.sleep

        def sleep(seconds):
            self.slept = True
            real(seconds)

        monkeypatch.setattr(waiting.time, "sleep", sleep)

    def Test(self) -> bool:
        self.tests += 1
        return self.slept


def _in_thread(fn):
    out = {}

    def run():
        out["value"] = fn()

    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    return out["value"]


@pytest.mark.skipif(waiting._prctl is None, reason="no prctl here")
def test_a_wait_that_sleeps_tightens_its_threads_timer_slack_without_loading_a_library(
    monkeypatch,
):
    prctl = ctypes.CDLL(None).prctl

    def loaded(*args, **kwargs):
        raise AssertionError("wait_politely loaded a library while waiting")

    monkeypatch.setattr(ctypes, "CDLL", loaded)
    for _ in range(2):  # a second thread too: each thread has its own slack

        def wait():
            prctl(_PR_SET_TIMERSLACK, 50_000, 0, 0, 0)  # Linux's default, whatever it inherited
            request = _DoneOnceSlept(monkeypatch)
            waiting.wait_politely(request, spin=0.0)
            assert request.slept and request.tests > 1
            return prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0)

        assert _in_thread(wait) == 1000  # nanoseconds


def test_a_request_already_complete_returns_at_once():
    request = _DoneAfter(0)
    waiting.wait_politely(request)
    assert request.tests == 1


class _DoneOnTest:
    """An MPI request stand-in that completes at its ``n``-th test."""

    def __init__(self, n: int):
        self.n, self.tests = n, 0

    def Test(self) -> bool:
        self.tests += 1
        return self.tests >= self.n


def test_a_wait_polls_without_a_system_call_first_then_yields_the_core(monkeypatch):
    yields = []
    monkeypatch.setattr(waiting.os, "sched_yield", lambda: yields.append(1))
    monkeypatch.setattr(waiting, "_HOT_SECONDS", 1.0)  # far longer than three polls
    waiting.wait_politely(_DoneOnTest(3))
    assert yields == []
    monkeypatch.setattr(waiting, "_HOT_SECONDS", 0.0)  # past the first polls: yields
    waiting.wait_politely(_DoneOnTest(3), spin=1.0)  # and never sleeps instead
    assert len(yields) == 2


def test_a_wait_shorter_than_the_spin_never_sleeps(monkeypatch):
    # A rank asleep holds the collective up for the other ranks too: a wait as long as ranks
    # usually arrive apart (a few hundred microseconds) polls throughout.
    sleeps = []
    monkeypatch.setattr(waiting.time, "sleep", lambda seconds: sleeps.append(seconds))
    request = _DoneAfter(0.0003)
    waiting.wait_politely(request)
    assert time.perf_counter() >= request.at
    assert sleeps == []

    class _DoneOnceAsleep:  # past the spin (here none): it does sleep
        def Test(self) -> bool:
            return bool(sleeps)

    waiting.wait_politely(_DoneOnceAsleep(), spin=0.0)
    assert sleeps


def test_a_sleeping_wait_wakes_to_poll_at_least_every_100_us(monkeypatch):
    # Past the spin a rank sleeps, and the last rank to arrive waits about a pause per round of
    # the collective for it to wake: the pauses stay short.
    sleeps = []
    monkeypatch.setattr(waiting.time, "sleep", lambda seconds: sleeps.append(seconds))

    class _DoneAfterManySleeps:
        def Test(self) -> bool:
            return len(sleeps) >= 50

    waiting.wait_politely(_DoneAfterManySleeps(), spin=0.0)
    assert len(sleeps) == 50
    assert 0 < max(sleeps) <= 100e-6
