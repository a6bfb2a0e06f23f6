"""Keeping ``--spares K`` warm spares: new ones are started in the background, never in a step.

A spare is used up when it takes a lost rank's place, and lost when it dies while it waits.
Either way rank 0 starts a new one, one at a time, from a thread of its own (:class:`Keeper`),
while the ranks go on training:

1. the thread spawns one process on ``MPI_COMM_SELF`` (the same program, under the launcher's
   supervisor, with :data:`~syncdp.membership.spares.NEW_SPARE_VAR` set). The spawn returns once the
   new process has loaded TensorFlow and reached ``init()`` (seconds), and only this thread
   waits for it;
2. the new process (:func:`join`) opens an MPI port, sends its name to rank 0 over the pair
   they share, and waits there, as spares do, for rank 0's word;
3. at the next commit (:func:`syncdp.job.runtime.tend_spares`, a collective of the ranks that
   costs one small broadcast when there is nothing to do) the ranks and the waiting spares
   *refresh* the reserve (:func:`refresh`): they shrink it first if a spare died, then connect
   to the new spare's port and merge it in, after every rank and spare. The training
   communicator is not touched; a refresh costs milliseconds.

Rank 0 notices a dead spare through a receive it keeps posted to each one, which no spare ever
answers: Open MPI's ULFM completes it with an error once that process is gone.

The pair is a communicator of its own, and the connect happens only when rank 0 says so, because
Open MPI 5.0's ``MPI_Intercomm_create`` across the pair crashed (in its ``han`` collectives) on
the new process; ``MPI_Comm_connect``/``accept`` did not (checked in a bare mpi4py job).

A recovery that must spawn while a spare is being started spawns nothing itself: rank 0 waits
for that start (:meth:`Keeper.hand_over`), the new spare is merged into the recovery and takes a
lost place. A spawn next to the background one (both in one job) left MPI_Finalize hanging at
the end. Should a recovery still spawn (no start under way, or it failed), it waits for any
start still running (:data:`syncdp.membership.membership.SPAWN_LOCK`), and a spare started meanwhile
is released rather than taken in (:meth:`Keeper.abandon`).

If rank 0 is lost before a new spare joins, the spare sees its pair fail and leaves (exit 0,
saying so); the next rank 0 starts another. A spawn that never completes (the new process died
before ``MPI_Init``) keeps only rank 0's thread waiting: training goes on, no other spare is
started, and at the end rank 0 waits at most :data:`_END_WAIT_SECONDS` for it.
"""

from __future__ import annotations

import dataclasses
import sys
import threading

from syncdp.base import mpi
from syncdp.membership import membership, spares

__all__ = ["Keeper", "join", "refresh"]

_PORT_TAG = 7302
_WATCH_TAG = 7303
# How long rank 0 waits at the end of training for a spare still being started.
_END_WAIT_SECONDS = 30.0
# Starts that fail (the spawn itself reports an error) before rank 0 stops trying.
_MAX_FAILED_STARTS = 3


class Keeper:
    """Rank 0's care of the spares: watches the waiting ones, starts new ones in the background.

    Only rank 0 has one. :meth:`order` is asked at each commit; the ranks then carry out what it
    says (:func:`refresh`), and :meth:`refreshed` is told the result.
    """

    def __init__(self):
        self._reserve = None
        self._watches: list = []
        self._dead: set[int] = set()  # watches that failed: spares that died
        self._thread: threading.Thread | None = None
        self._started: tuple | None = None  # (pair, port, label) once a new spare waits
        self._error: str | None = None
        self._failed_starts = 0  # after _MAX_FAILED_STARTS, no spare is started again
        # A recovery spawned while a spare was being started: that spare is released, never
        # taken in, and no other is started (see abandon()).
        self._abandoned = False

    def watch(self, reserve, first_spare: int) -> None:
        """Posts the receives that tell when a spare of ``reserve`` dies (again, after every
        change of the reserve; the old ones are cancelled)."""
        if reserve is self._reserve:
            return
        self._cancel()
        MPI = mpi.load()
        self._reserve, self._dead = reserve, set()
        for spare in range(first_spare, reserve.Get_size()):
            buffer = bytearray(1)
            self._watches.append(
                (reserve.Irecv([buffer, MPI.BYTE], source=spare, tag=_WATCH_TAG), buffer)
            )

    def _cancel(self) -> None:
        MPI = mpi.load()
        for request, _ in self._watches:
            try:
                request.Cancel()
                request.Wait()
            except MPI.Exception:
                pass
        self._watches = []

    def _spares_died(self) -> int:
        MPI = mpi.load()
        for i, (request, _) in enumerate(self._watches):
            if i in self._dead:
                continue
            try:
                request.Test()
            except MPI.Exception:
                self._dead.add(i)
        return len(self._dead)

    def order(self, plan: membership.Plan, alive: list) -> tuple[bool, bool] | None:
        """What the ranks do at this commit: ``(prune, adopt)``, or None for nothing.

        Starts a new spare in the background when fewer than ``plan.spare_target`` wait and
        none is being started (``alive``: every rank and spare, for the free slots).
        """
        dead = self._spares_died()
        prune = dead > 0
        if self._abandoned and self._started is not None:
            self._release()
        if self._error is not None:
            print(f"syncdp: elastic: {self._error}", file=sys.stderr, flush=True)
            self._error = None
        adopt = self._started is not None
        waiting = len(plan.spares) - dead
        busy = self._thread is not None or self._abandoned
        busy = busy or self._failed_starts >= _MAX_FAILED_STARTS
        if not busy and not adopt and waiting < plan.spare_target:
            self._start(plan, alive)
        return (prune, adopt) if prune or adopt else None

    def _start(self, plan: membership.Plan, alive: list) -> None:
        free, hosts = membership.free_slots(plan, alive)
        if free == 0:
            return  # the discovery script lists no free slot: try again at a later commit
        label = plan.next_label
        plan.next_label += 1
        args = membership.worker_args(label, plan.command, spare=True)
        self._thread = threading.Thread(
            target=self._spawn, args=(args, hosts[:1], label), daemon=True, name="spare-start"
        )
        self._thread.start()

    def _spawn(self, args: list[str], hosts: list[str], label: int) -> None:
        MPI = mpi.load()
        info = membership.spawn_where(hosts)
        try:
            with membership.SPAWN_LOCK:  # a recovery's spawn waits for this one
                inter = MPI.COMM_SELF.Spawn(sys.executable, args, maxprocs=1, info=info)
                pair = inter.Merge(high=False)
                inter.Disconnect()
            port = pair.recv(source=1, tag=_PORT_TAG)
            self._started = (pair, port, label)
        except MPI.Exception as e:
            self._failed_starts += 1
            later = "trying again later"
            if self._failed_starts >= _MAX_FAILED_STARTS:
                later = f"{self._failed_starts} starts failed, so no spare is started again"
            self._error = f"a new spare [{label}] could not be started ({e}); {later}"
            self._thread = None
        finally:
            info.Free()

    def adopting(self):
        """The new spare's pair and port, once it waits: tells it to connect (rank 0 only)."""
        pair, port, _ = self._started
        spares.wake(pair, 1, spares.REFRESH, adopt=True)
        return port

    def hand_over(self):
        """A recovery must spawn: the port of the spare being started, told to join the
        recovery (rank 0 only; waits for the start, at most SPAWN_WAIT_SECONDS), or None."""
        if self._abandoned:
            return None
        thread = self._thread
        if thread is not None and self._started is None:
            thread.join(membership.SPAWN_WAIT_SECONDS)
        if self._started is None:
            return None
        pair, port, _ = self._started
        spares.wake(pair, 1, spares.JOIN)
        self.refreshed(adopted=True)
        return port

    def refreshed(self, adopted: bool) -> None:
        """After a refresh: the adopted spare's pair is let go, and the next may start."""
        if adopted and self._started is not None:
            pair = self._started[0]
            self._started, self._thread = None, None
            try:
                pair.Free()  # MPI_Comm_disconnect here hung on both sides (Open MPI 5.0.11)
            except mpi.load().Exception:
                pass

    def abandon(self) -> None:
        """A recovery spawned replacements while a spare was being started: that spare will
        be released, not taken in, and no spare is started again in this job. (Taking it in
        after such a spawn left MPI_Finalize hanging at the end, Open MPI 5.0.11.)"""
        if self._thread is not None:
            self._abandoned = True

    def _release(self) -> None:
        pair, _, label = self._started
        self._started = None
        # The launcher knows where the new spare runs (its spare_started report).
        spares.release(pair, 1, [membership.Member("", 0, label)])
        try:
            pair.Free()
        except mpi.load().Exception:
            pass

    def close(self) -> None:
        """At the end of training: a spare being started or waiting to join is released."""
        self._cancel()
        if self._thread is not None and self._started is None:
            self._thread.join(_END_WAIT_SECONDS)
        if self._started is not None:
            self._release()


def join(finalize_timeout: float):
    """A spare started in the background: waits to be merged into the reserve.

    Args:
        finalize_timeout: For :func:`spares.leave`, if the process is told to leave.

    Returns:
        ``(reserve, recovering)``: the reserve communicator, with this process last, and
        whether it was merged by a recovery in progress (:meth:`Keeper.hand_over`: it then joins
        :func:`syncdp.membership.membership.reseat`) rather than at a commit. A process told to
        leave (the job ended) or whose rank 0 was lost before it joined exits 0 here
        (:func:`spares.leave`).
    """
    MPI = mpi.load()
    parent = MPI.Comm.Get_parent()
    pair = parent.Merge(high=True)
    parent.Disconnect()
    port = MPI.Open_port()
    pair.send(port, dest=0, tag=_PORT_TAG)
    order = spares.wait(pair)
    if order.what not in (spares.REFRESH, spares.JOIN):
        if order.what == spares.FAILURE:
            label = membership.me().label
            print(
                f"syncdp: spare [{label}]: rank 0 was lost before this spare joined; leaving.",
                file=sys.stderr,
                flush=True,
            )
        spares.leave(finalize_timeout)
    inter = MPI.COMM_SELF.Accept(port)
    reserve = inter.Merge(high=True)
    inter.Disconnect()
    MPI.Close_port(port)
    pair.Free()  # as rank 0 does (Keeper.refreshed); MPI_Comm_disconnect on it hung
    if order.what == spares.JOIN:
        return reserve, True
    reserve.allgather((dataclasses.astuple(membership.me()), False))  # as refresh() ends
    return reserve, False


def refresh(reserve, *, trains: bool, prune: bool, port=None, adopt: bool = False):
    """Drops dead spares from ``reserve`` and merges a new one in (every rank and spare calls it).

    Args:
        reserve: The reserve communicator.
        trains: Whether this process is a rank.
        prune: Shrink to the processes alive first (a spare died).
        port: The new spare's port (rank 0 only).
        adopt: Connect to the new spare and merge it in, last.

    Returns:
        ``(reserve, waiting)``: the new reserve, and the spares in it (Members, in order).

    Raises:
        mpi4py.MPI.Exception: A rank or spare was lost meanwhile (the caller recovers).
    """
    if prune:
        reserve = reserve.Shrink()
    if adopt:
        inter = reserve.Connect(port, root=0)
        reserve = inter.Merge(high=False)
        inter.Disconnect()
    rows = reserve.allgather((dataclasses.astuple(membership.me()), trains))
    waiting = [membership.Member(*m) for m, t in rows if not t]
    return reserve, waiting
