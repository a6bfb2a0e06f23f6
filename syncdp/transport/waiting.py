"""How a rank waits for the others without taking a core from them."""

from __future__ import annotations

import os
import time

__all__ = ["wait_politely"]

# How a rank waits for the others (wait_politely): spin this long first, then sleep in growing
# pauses up to the last.
_SPIN_SECONDS = 50e-6
_PAUSES = (20e-6, 50e-6, 100e-6, 200e-6)


def wait_politely(request, spin: float = _SPIN_SECONDS) -> None:
    """Completes an MPI ``request`` without holding a core while it waits.

    Open MPI's blocking calls poll without pause: a rank waiting for the slowest one burns a
    core that other ranks (and TensorFlow's own threads) need for computing, where PyTorch's
    Gloo blocks in the kernel. Here a rank polls for a few tens of microseconds (most waits
    inside a step are that short), yielding the core to any thread that wants it between
    polls, then sleeps between polls, which costs a waiting rank at
    most a fraction of a millisecond of latency when the last rank arrives.

    Args:
        request: The MPI request.
        spin: Seconds to poll without pause first. Defaults to 50 us; waits that are short
            by construction (ranks already in step inside one collective) spin longer.
    """
    if request.Test():
        return
    spin_until = time.perf_counter() + spin
    while time.perf_counter() < spin_until:
        os.sched_yield()  # a thread waiting for this core (the rank we wait for?) runs first
        if request.Test():
            return
    pause = 0
    while not request.Test():
        time.sleep(_PAUSES[pause])
        pause = min(pause + 1, len(_PAUSES) - 1)
