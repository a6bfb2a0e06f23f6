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

In elastic mode a membership change splits the measure (:meth:`Recorder.restart_window`): the
recovery itself, and the first step after it (a newcomer's carries its start-up, and the others
wait for it), are left out of every rank's figures, so a recovery is charged to no rank.

The launcher prints every rank's :meth:`Recorder.summary` at the end of the job ("where the
time went"; ``syncdp.launch.summary``); ranks also send it every :data:`REPORT_EVERY` seconds, so
``kill -USR1`` of ``syncdp-run`` prints the figures so far. ``syncdp.timing()`` returns this
rank's.
"""

from __future__ import annotations

import time

from syncdp.watch import report

__all__ = ["RECORDER", "REPORT_EVERY", "Recorder"]

# Seconds between the timing reports a rank sends while it trains.
REPORT_EVERY = 20.0
# How long a report sent while training may hold up the step when the launcher does not answer
# at once (the report at exit waits longer: it is the one the table is made of).
_PROGRESS_PATIENCE_SECONDS = 2.0


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
        self._marks = 0  # step marks in the current window
        self._done = (0.0, 0.0, 0.0, 0, 0)  # closed windows: seconds, waiting, moving, bytes, steps
        self._skip = 0  # step marks to let pass before the next window starts
        self._sent = self.started

    def add(self, phase: str, seconds: float, nbytes: int = 0) -> None:
        """Files ``seconds`` under ``phase`` ("wait" or "move")."""
        if phase == "wait":
            self.waiting += seconds
        else:
            self.moving += seconds
            self.nbytes += nbytes

    def step(self, rank: int | None = None, *, measured: bool = True) -> None:
        """Marks the start of a step's gradient reduction; reports now and then.

        Args:
            rank: This process's rank, for the reports. Defaults to None (none sent).
            measured: False for a step taken while the job re-forms (elastic mode, between a
                membership change and the sync after it): counted, but its time is left out,
                as is the first step after the next restart of the measure. Defaults to True.
        """
        now = self._clock()
        snap = (now, self.waiting, self.moving, self.nbytes)
        self.steps += 1
        if not measured:
            self.restart_window()
        elif self._skip:
            self._skip -= 1
        else:
            if self._first is None:
                self._first = snap
            self._last = snap
            self._marks += 1
        if rank is not None and now - self._sent >= REPORT_EVERY:
            self._sent = now
            self.send(rank, patience=_PROGRESS_PATIENCE_SECONDS)

    def restart_window(self) -> None:
        """The job's membership changed (elastic mode; called at the sync after it): what was
        measured so far is kept, and the measure goes on from the second step from now (the
        time in between, a recovery and the first step after it, is left out)."""
        if self._marks >= 2:
            (t0, w0, m0, b0), (t1, w1, m1, b1) = self._first, self._last
            seconds, waiting, moving, nbytes, steps = self._done
            self._done = (
                seconds + t1 - t0,
                waiting + w1 - w0,
                moving + m1 - m0,
                nbytes + b1 - b0,
                steps + self._marks - 1,
            )
        self._first = self._last = None
        self._marks = 0
        self._skip = 1

    def summary(self) -> dict:
        """This rank's figures: per-step time and the share of each phase.

        Measured between the first and the last marked step when there were two or more
        (startup, the initial broadcast and the end stay out), less what
        :meth:`restart_window` left out; otherwise over the whole run.

        Returns:
            ``steps``, ``seconds`` (the window measured), ``step_s`` (None without 2 steps),
            ``waiting``, ``moving``, ``computing`` (shares of the window, summing to 1),
            ``gbps`` (bytes moved per second moving, None if nothing moved) and ``nbytes``.
        """
        seconds, waited, moved, nbytes, intervals = self._done
        if self._marks >= 2:
            (t0, w0, m0, b0), (t1, w1, m1, b1) = self._first, self._last
            seconds, waited, moved = seconds + t1 - t0, waited + w1 - w0, moved + m1 - m0
            nbytes, intervals = nbytes + b1 - b0, intervals + self._marks - 1
        if not intervals:
            seconds = self._clock() - self.started
            waited, moved, nbytes = self.waiting, self.moving, self.nbytes
        seconds = max(seconds, 1e-9)
        waiting, moving = waited / seconds, moved / seconds
        return {
            "steps": self.steps,
            "seconds": seconds,
            "step_s": seconds / intervals if intervals else None,
            "waiting": waiting,
            "moving": moving,
            "computing": max(0.0, 1.0 - waiting - moving),
            "gbps": nbytes / moved / 1e9 if moved > 0 and nbytes > 0 else None,
            "nbytes": nbytes,
        }

    def send(self, rank: int, *, patience: float | None = None) -> None:
        """Sends :meth:`summary` to the launcher as a ``timing`` report.

        Args:
            rank: This process's rank.
            patience: How long to keep trying while the launcher does not answer
                (:func:`syncdp.watch.report.send`). Defaults to the channel's.
        """
        report.send("timing", rank, patience=patience, **self.summary())


RECORDER = Recorder()
