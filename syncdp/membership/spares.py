"""Warm spares: processes that wait inside ``init()``, ready to take a lost rank's place.

``syncdp-run --min-np M --spares K -np N`` starts N + K processes. Every one of them runs the
program up to ``syncdp.init()`` (so TensorFlow and the program's imports are loaded); there the
last K become spares and wait, without taking a core, instead of returning. All of them, ranks
and spares, share the *reserve* communicator; the ranks train on a communicator split from it.
The reserve is kept in this order, always: the ranks by rank, then the spares.

A spare waits for a message from rank 0 on the reserve (:func:`wait`):

- the reserve is revoked (the ranks lost one of theirs and are recovering) or rank 0 itself
  failed: the spare joins the recovery (:func:`syncdp.membership.membership.reseat`), which either
  makes it a rank (it returns from ``init()`` as a replacement would) or leaves it a spare;
- :data:`GROW`: the ranks grow into new slots; the spare joins, and stays a spare;
- :data:`REFRESH`: the ranks drop spares that died and take in one started in the background
  (:mod:`syncdp.membership.refill`); the spare joins, and stays a spare;
- :data:`RELEASE`: the job is over; the spare answers rank 0 and exits 0 without running the
  rest of the program (:func:`leave`).

A spare that dies while it waits disturbs no rank: rank 0 notices (:mod:`syncdp.membership.refill`
keeps the count), and the next recovery or refresh leaves it out. A spare is never needed for
the job to end: under ULFM every process's MPI_Finalize waits for a spare that is alive but does
not run (stopped), so rank 0 waits a few seconds for each spare to answer its release
(:func:`release`) and names those that did not to the launcher, which kills them.

Which process trains after a change is :func:`seat`'s pure arithmetic on four counts rank 0
decides (ranks and spares alive, spares taken, processes spawned), the same on every process:
survivors, spares and the processes just spawned (which receive the counts) each find their own
place.

A spare that took a lost rank's place, or died, is replaced in the background by rank 0
(:mod:`syncdp.membership.refill`), so the job keeps ``--spares`` of them.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import NamedTuple

from syncdp.base import mpi
from syncdp.watch import report

__all__ = [
    "SPARES_VAR",
    "NEW_SPARE_VAR",
    "RELEASE",
    "GROW",
    "FAILURE",
    "REFRESH",
    "JOIN",
    "Order",
    "count",
    "seat",
    "wait",
    "wake",
    "release",
    "leave",
]

# The number of spares the launcher started (read once by init(); spawned processes inherit it).
# One of the launcher's own variables (settings.INTERNAL_VARS), not a setting.
SPARES_VAR = "SYNCDP_SPARES"
# Set (to "1") in a spare started in the background (syncdp.membership.refill); also internal.
NEW_SPARE_VAR = "SYNCDP_NEW_SPARE"
# What wakes a spare: rank 0's message (RELEASE, GROW, REFRESH) or a failure (the reserve
# revoked, or rank 0 lost).
RELEASE, GROW, FAILURE, REFRESH, JOIN = 0, 1, 2, 3, 4
_TAG = 7301
# A released spare's answer to rank 0.
_ANSWER_TAG = 7304
# How long rank 0 waits for the released spares' answers before it names the silent ones.
RELEASE_ANSWER_SECONDS = 5.0


class Order(NamedTuple):
    """What woke a spare, and for REFRESH what the refresh does (:mod:`syncdp.membership.refill`).

    Attributes:
        what: RELEASE, GROW, FAILURE, REFRESH, or JOIN (a spare started in the background
            joins a recovery in progress, :mod:`syncdp.membership.refill`).
        prune: REFRESH: spares died, and the reserve shrinks to the processes alive.
        adopt: REFRESH: a spare started in the background joins the reserve.
    """

    what: int
    prune: bool = False
    adopt: bool = False


# A waiting spare looks this often: its wake-up costs at most this much of a recovery, and it
# costs the training ranks almost no CPU.
_POLL_SECONDS = 0.005


def count(environ=None) -> int:
    """The number of spares this job started with (0 when none, or outside the launcher)."""
    text = (os.environ if environ is None else environ).get(SPARES_VAR, "")
    return int(text) if text.isdigit() else 0


def seat(index: int, trainers: int, spares: int, take: int, spawned: int) -> tuple[bool, int]:
    """Where process ``index`` of a reserve being rebuilt goes: whether it trains, and its place.

    The reserve being rebuilt holds ``trainers`` ranks (by rank), then ``spares`` spares, then
    ``spawned`` processes just started for it. The surviving ranks keep their order (rank 0
    stays the lowest survivor, whose state the others receive); the first ``take`` spares, then
    the spawned processes, become the next ranks; the other spares stay spares, after every
    rank.

    Args:
        index: The process's rank in the reserve being rebuilt.
        trainers: Ranks that survived.
        spares: Spares that survived.
        take: Spares that become ranks.
        spawned: Processes spawned (they always train).

    Returns:
        ``(trains, key)``: whether it trains, and its rank in the new reserve (which is its
        rank in training too, for a process that trains).

    Raises:
        ValueError: ``take`` is not between 0 and ``spares``, or ``index`` is out of range.

    Example:
        >>> [seat(i, 2, 2, 1, 0) for i in range(4)]
        [(True, 0), (True, 1), (True, 2), (False, 3)]
    """
    if not 0 <= take <= spares:
        raise ValueError(f"take must be between 0 and spares ({spares}); got {take}")
    if not 0 <= index < trainers + spares + spawned:
        raise ValueError(f"index {index} is not in a reserve of {trainers + spares + spawned}")
    if index < trainers:
        return True, index
    if index >= trainers + spares:
        return True, trainers + take + (index - trainers - spares)
    j = index - trainers
    if j < take:
        return True, trainers + j
    return False, trainers + take + spawned + (j - take)


def wait(reserve) -> Order:
    """A spare's wait for rank 0 on ``reserve``: what woke it (RELEASE, GROW, REFRESH or FAILURE).

    Polls a receive every few milliseconds: a spare must not take a core from the ranks that
    train (Open MPI's own waits spin). A revoked reserve, or rank 0 lost, is a FAILURE: the
    ranks are recovering, and the spare joins them.
    """
    MPI = mpi.load()
    message = bytearray(8)
    request = reserve.Irecv([message, MPI.BYTE], source=0, tag=_TAG)
    while True:
        try:
            if request.Test():
                what = message[0] if message[0] in (GROW, REFRESH, JOIN) else RELEASE
                if what == RELEASE:
                    _answer(reserve)
                return Order(what, prune=bool(message[1]), adopt=bool(message[2]))
        except MPI.Exception:
            return Order(FAILURE)
        time.sleep(_POLL_SECONDS)


def wake(reserve, first_spare: int, what: int, *, prune: bool = False, adopt: bool = False) -> None:
    """Rank 0 sends ``what`` (RELEASE, GROW or REFRESH) to every spare of the reserve; never
    raises.

    Args:
        reserve: The reserve communicator (rank 0's side), or a spare's pair communicator with
            rank 0 (:mod:`syncdp.membership.refill`).
        first_spare: The reserve rank of the first spare (the number of training ranks).
        what: RELEASE, GROW or REFRESH.
        prune: REFRESH: the reserve shrinks first. Defaults to False.
        adopt: REFRESH: a new spare joins. Defaults to False.
    """
    MPI = mpi.load()
    message = bytes([what, prune, adopt]) + bytes(5)
    requests = []
    for spare in range(first_spare, reserve.Get_size()):
        try:
            requests.append(reserve.Isend([message, MPI.BYTE], dest=spare, tag=_TAG))
        except MPI.Exception:  # a spare that died while waiting
            pass
    deadline = time.monotonic() + 5.0
    for request in requests:
        try:
            while not request.Test() and time.monotonic() < deadline:
                time.sleep(_POLL_SECONDS)
        except MPI.Exception:
            pass


def _answer(reserve) -> None:
    """A released spare tells rank 0 it is leaving (:func:`release`); never raises."""
    MPI = mpi.load()
    try:
        request = reserve.Isend([bytes(1), MPI.BYTE], dest=0, tag=_ANSWER_TAG)
        deadline = time.monotonic() + RELEASE_ANSWER_SECONDS
        while not request.Test() and time.monotonic() < deadline:
            time.sleep(_POLL_SECONDS)
    except MPI.Exception:
        pass


def release(
    reserve, first_spare: int, waiting: Sequence = (), *, seconds: float = RELEASE_ANSWER_SECONDS
) -> list:
    """Rank 0 ends the spares of ``reserve`` (RELEASE) and names those that do not answer.

    Each released spare answers before it leaves. One that is alive but does not run (stopped)
    cannot, and under ULFM every process's MPI_Finalize would wait for it: such spares are
    reported to the launcher (an ``unanswered_spares`` report), which kills them. A spare that
    died is gone already and is not named. Never raises.

    Args:
        reserve: The reserve communicator (rank 0's side), or a new spare's pair communicator
            with rank 0 (:mod:`syncdp.membership.refill`).
        first_spare: The reserve rank of the first spare.
        waiting: The spares, in reserve order (objects with ``label``, ``host`` and ``pid``,
            :class:`syncdp.membership.membership.Member`), for the report. Defaults to none known.
        seconds: How long to wait for the answers. Defaults to
            :data:`RELEASE_ANSWER_SECONDS`.

    Returns:
        The entries of ``waiting`` (or the reserve ranks, where ``waiting`` is shorter) that
        did not answer.
    """
    MPI = mpi.load()
    wake(reserve, first_spare, RELEASE)
    pending, buffers = {}, []
    for spare in range(first_spare, reserve.Get_size()):
        buffers.append(bytearray(1))
        try:
            pending[spare] = reserve.Irecv([buffers[-1], MPI.BYTE], source=spare, tag=_ANSWER_TAG)
        except MPI.Exception:
            pass
    deadline = time.monotonic() + seconds
    while pending and time.monotonic() < deadline:
        for spare, request in list(pending.items()):
            try:
                done = request.Test()
            except MPI.Exception:  # it died: gone already
                done = True
            if done:
                del pending[spare]
        time.sleep(_POLL_SECONDS)
    silent = []
    for spare, request in pending.items():
        try:
            request.Cancel()
            request.Wait()
        except MPI.Exception:
            pass
        index = spare - first_spare
        silent.append(waiting[index] if index < len(waiting) else spare)
    if silent:
        named = [
            {"label": m.label, "host": m.host, "pid": m.pid} for m in silent if hasattr(m, "label")
        ]
        report.send(
            "unanswered_spares",
            0,
            f"{len(silent)} spare(s) did not answer rank 0's release within {seconds:g} s",
            spares=named,
        )
    return silent


def leave(finalize_timeout: float) -> None:
    """A released spare ends: MPI finalized, exit 0, the rest of the program not run.

    Args:
        finalize_timeout: Seconds MPI_Finalize may take before SIGALRM ends the process, as
            a rank's exit does (``--finalize-timeout``).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    MPI = mpi.load()
    mpi.bound_finalize(finalize_timeout)  # as a rank's exit does
    try:
        MPI.Finalize()
    except MPI.Exception:
        pass
    os._exit(0)
