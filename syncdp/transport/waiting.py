"""How a rank waits for the others without taking a core from them."""

from __future__ import annotations

import ctypes
import os
import time

__all__ = ["wait_politely"]

_PR_SET_TIMERSLACK = 29


def _load_prctl():
    """libc's ``prctl``, loaded once; None where there is none."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError, TypeError):  # no libc to open, or no prctl in it
        return None


_prctl = _load_prctl()


def _tighten_timer_slack() -> None:
    """Lets this thread's short sleeps end on time. Linux lets a sleep overrun by the thread's
    timer slack, 50 us by default, which would more than double the pauses below and make the
    last rank's arrival noticed late; 1 us is asked instead (a no-op where prctl is missing).

    Asked before every wait that sleeps (one system call, under a microsecond): the waiting
    thread is often one of TensorFlow's, whose Python thread state (and any ``threading.local``)
    is made anew for each host call, so "once per thread" cannot be remembered cheaply; loading
    libc for each call cost 8 us or more."""
    if _prctl is not None:
        _prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)


# How a rank waits for the others (wait_politely, which says why these values): poll without
# yielding this long, poll yielding the core between polls up to the spin, then sleep in
# growing pauses up to the last.
_HOT_SECONDS = 10e-6
_SPIN_SECONDS = 1e-3
_PAUSES = (20e-6, 50e-6, 100e-6)


def wait_politely(request, spin: float = _SPIN_SECONDS) -> None:
    """Completes an MPI ``request`` without holding a core while it waits.

    Open MPI's blocking calls poll without pause: a rank waiting for the slowest one burns a
    core that other ranks (and TensorFlow's own threads) need for computing, where PyTorch's
    Gloo blocks in the kernel. Here a rank polls for 10 us without a system call (most waits
    in an even step end there), then up to a millisecond yielding the core to any thread that
    wants it between polls, then sleeps between polls. The spin is that long because a
    sleeping rank delays more than itself: an MPI collective moves on only when its ranks poll
    (among more than two ranks, in rounds), so the last rank to arrive waits for the sleepers
    to wake. With a 50 us spin, ranks that arrived up to 1 ms apart finished a 4-rank allgather
    7-9 times later than blocking ranks did; with 1 ms, within 1.1-1.2 times. A rank that waits
    longer still sleeps, so the pauses stay short (at most 100 us): the last rank waits about a
    pause per round for each sleeper (benchmarks/wait_latency.py).

    Args:
        request: The MPI request.
        spin: Seconds to poll, yielding between polls, after the first 10 us of polling
            and before sleeping. Defaults to 1 ms.
    """
    if request.Test():
        return
    hot_until = time.perf_counter() + _HOT_SECONDS
    while time.perf_counter() < hot_until:
        if request.Test():
            return
    spin_until = time.perf_counter() + spin
    while time.perf_counter() < spin_until:
        os.sched_yield()  # a thread waiting for this core (the rank we wait for?) runs first
        if request.Test():
            return
    _tighten_timer_slack()
    pause = 0
    while not request.Test():
        time.sleep(_PAUSES[pause])
        pause = min(pause + 1, len(_PAUSES) - 1)
