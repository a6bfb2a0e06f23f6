"""Where a rank's step time goes: computing, waiting for the others, moving bytes.

Every collective syncdp runs is timed by the communicator and filed under one of two phases:

- **waiting**: the argument check before each collective and explicit barriers. The check is
  one tiny collective that every rank enters when it is ready, so its duration is how long
  this rank waited for the slowest one to arrive (plus a few microseconds of latency);
- **moving**: the collective itself, with packing and unpacking (its bytes are counted, so the
  achieved bandwidth is bytes over this time).

A training step is marked once per gradient reduction (the bucket that carries the step). The
rest of the time between two marks is computing (and anything else the program does). One
recorder per process (:data:`RECORDER`) collects across every communicator, so process sets
and elastic rebuilds add to the same figures.

The launcher prints every rank's :meth:`Recorder.summary` at the end of the job ("where the
time went"; ``launch.summary``); ranks also send it every :data:`REPORT_EVERY` seconds, so
``kill -USR1`` of ``syncdp-run`` prints the figures so far. ``syncdp.timing()`` returns this
rank's.
"""

from __future__ import annotations

import time

from syncdp.core import report

__all__ = ["RECORDER", "REPORT_EVERY", "Recorder"]

# Seconds between the timing reports a rank sends while it trains.
REPORT_EVERY = 20.0


class Recorder:
    """Accumulates time per phase and marks training steps.

    Attributes:
        waiting: Seconds in argument checks and barriers.
        moving: Seconds in collectives moving data.
        nbytes: Payload bytes this rank contributed to those collectives.
        steps: Training steps marked.
    """

    def __init__(self, clock=time.perf_counter):
        self._clock = clock
        self.reset()

    def reset(self) -> None:
        """Starts counting from zero."""
        self.started = self._clock()
        self.waiting = self.moving = 0.0
        self.nbytes = 0
        self.steps = 0
        self._first = self._last = None  # (time, waiting, moving, nbytes) at a step mark
        self._sent = self.started

    def add(self, phase: str, seconds: float, nbytes: int = 0) -> None:
        """Files ``seconds`` under ``phase`` ("wait" or "move")."""
        if phase == "wait":
            self.waiting += seconds
        else:
            self.moving += seconds
            self.nbytes += nbytes

    def step(self, rank: int | None = None) -> None:
        """Marks the start of a step's gradient reduction; reports now and then."""
        now = self._clock()
        snap = (now, self.waiting, self.moving, self.nbytes)
        if self._first is None:
            self._first = snap
        self._last = snap
        self.steps += 1
        if rank is not None and now - self._sent >= REPORT_EVERY:
            self._sent = now
            self.send(rank)

    def summary(self) -> dict:
        """This rank's figures: per-step time and the share of each phase.

        Measured between the first and the last marked step when there were two or more
        (startup, the initial broadcast and the end stay out); otherwise over the whole run.

        Returns:
            ``steps``, ``seconds`` (the window measured), ``step_s`` (None without 2 steps),
            ``waiting``, ``moving``, ``computing`` (shares of the window, summing to 1),
            ``gbps`` (bytes moved per second moving, None if nothing moved) and ``nbytes``.
        """
        if self.steps >= 2:
            (t0, w0, m0, b0), (t1, w1, m1, b1) = self._first, self._last
            intervals = self.steps - 1
        else:
            t0, w0, m0, b0 = self.started, 0.0, 0.0, 0
            t1, w1, m1, b1 = self._clock(), self.waiting, self.moving, self.nbytes
            intervals = 0
        seconds = max(t1 - t0, 1e-9)
        waiting, moving = (w1 - w0) / seconds, (m1 - m0) / seconds
        return {
            "steps": self.steps,
            "seconds": seconds,
            "step_s": seconds / intervals if intervals else None,
            "waiting": waiting,
            "moving": moving,
            "computing": max(0.0, 1.0 - waiting - moving),
            "gbps": (b1 - b0) / (m1 - m0) / 1e9 if m1 > m0 and b1 > b0 else None,
            "nbytes": b1 - b0,
        }

    def send(self, rank: int) -> None:
        """Sends :meth:`summary` to the launcher as a ``timing`` report."""
        report.send("timing", rank, **self.summary())


RECORDER = Recorder()
