"""The stall watchdog: a collective that waits too long ends the job and names the missing ranks.

A background thread on every rank watches the collective its rank is in. After
``stall_warning`` seconds (or half the stall timeout, if that is sooner) it prints a warning;
after ``stall_timeout`` seconds it asks every other rank, over a separate communicator, where it
is, prints which ranks have not arrived and why, and aborts the whole MPI job. The same thread
answers the other ranks' questions, so a rank that is busy elsewhere (another code path,
another collective) says so, and a rank that does not answer within a few seconds is stopped or
hung. The report's first line names the stalled ranks::

    syncdp: rank 1 stalled: collective #23 allreduce.bucket0 waited 10.0 s for it on rank 0 ...
    syncdp: ranks that have not arrived: 1
      rank 1: did not answer (stopped, hung or dead).

Defaults (``syncdp.config``): warning at 10 s, abort at 60 s (``SYNCDP_STALL_TIMEOUT`` or
``syncdp-run --stall-timeout``; 0 waits forever). A stalled job therefore ends within the stall
timeout plus about 3 s (the time given to the other ranks to answer).

In elastic mode (``SYNCDP_ELASTIC``) a stall does not end the job: the report names the
stalled ranks' processes and the launcher kills them, which turns the stall into a rank
failure the job recovers from (:mod:`syncdp.core.membership`).

The main thread only sets two attributes per collective; all the waiting happens here.
"""

from __future__ import annotations

import sys
import threading
import time

from syncdp.core import mpi, report
from syncdp.core.settings import Config

__all__ = ["Watchdog"]

_QUERY, _REPLY = 1, 2
_POLL_SECONDS = 0.1
_ANSWER_GRACE_SECONDS = 3.0


class Watchdog:
    """Watches one rank's collectives on ``comm``.

    Args:
        comm: The communicator the collectives run on. The watchdog talks over its own duplicate.
        config: ``stall_timeout`` (0 disables the abort), ``stall_warning`` and ``elastic``.
        job_comm: The job's communicator, whose rank numbers messages use. Defaults to
            ``MPI.COMM_WORLD``.
    """

    def __init__(self, comm, config: Config, job_comm=None):
        self._MPI = mpi.load()
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.elastic = config.elastic
        # (host, pid) of each rank of ``comm``, when the runtime knows them (elastic mode).
        self.members: list | None = None
        # The job's number of each rank of ``comm``: a process set's communicator numbers its
        # ranks from 0, but messages and reports name job ranks.
        job = self._MPI.COMM_WORLD if job_comm is None else job_comm
        world = job.Get_group()
        self._job_rank = self._MPI.Group.Translate_ranks(
            comm.Get_group(), list(range(self.size)), world
        )
        world.Free()
        self.timeout = config.stall_timeout
        self.warning = config.stall_warning
        # (seq, name, start time, timeout) of the collective in progress, or None.
        self.current = None
        self.last_done = 0
        # Set when this rank's program has finished and it waits at exit for the others.
        self.exiting = False
        # Questions need MPI from two threads at once; without it the watchdog can still warn and
        # abort, but cannot say where the other ranks are.
        self._can_ask = self._MPI.Query_thread() == self._MPI.THREAD_MULTIPLE
        self._side = comm.Dup() if self._can_ask else None
        self._queries: list = []  # this rank's questions still in flight (see ask_others)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="syncdp-watchdog", daemon=True)
        self._thread.start()

    def enter(self, seq: int, name: str, timeout: float | None = None) -> None:
        """Called by the main thread as collective number ``seq`` starts."""
        self.current = (seq, name, time.monotonic(), self.timeout if timeout is None else timeout)

    def leave(self, seq: int) -> None:
        """Called by the main thread as collective ``seq`` ends."""
        self.current = None
        self.last_done = seq

    def stop(self, free: bool = True) -> None:
        """Ends the thread, then frees its communicator (never while the thread may use it).

        Args:
            free: Free the communicator; False drops it (a rank of it died). Defaults to True.
        """
        self._stop.set()
        # The loop checks the flag every poll, but may be in the middle of asking the others
        # (a few seconds at most); wait for it rather than free a communicator it is using.
        self._thread.join()
        if self._side is not None:
            if free:
                self._side.Free()
            self._side = None

    @property
    def can_ask(self) -> bool:
        """Whether this rank can ask the others where they are (needs MPI_THREAD_MULTIPLE)."""
        return self._can_ask

    def _where(self):
        current = self.current
        if current is None:
            return (None, "exit" if self.exiting else None, self.last_done)
        return (current[0], current[1], self.last_done)

    def _answer_questions(self) -> None:
        # Matched probes: the main thread may answer questions too (ask_others), and a plain
        # Iprobe + recv from two threads could race for the same message.
        MPI = self._MPI
        status = MPI.Status()
        while (
            message := self._side.improbe(source=MPI.ANY_SOURCE, tag=_QUERY, status=status)
        ) is not None:
            message.recv()
            self._side.send(self._where(), dest=status.Get_source(), tag=_REPLY)

    def _loop(self) -> None:
        try:
            self._watch()
        except self._MPI.Exception:
            # A rank of the group died (elastic mode): the main thread's collective fails
            # and recovery builds a new watchdog; this one has nothing left to watch.
            pass

    def _watch(self) -> None:
        warned_for = None
        reported = None
        while not self._stop.wait(_POLL_SECONDS):
            if self._can_ask:
                self._answer_questions()
            current = self.current
            if current is None:
                continue
            seq, name, start, timeout = current
            waited = time.monotonic() - start
            warn_at = min(self.warning, timeout / 2) if timeout else self.warning
            if warn_at and waited > warn_at and warned_for != seq:
                warned_for = seq
                print(
                    f"syncdp: warning: rank {self._job_rank[self.rank]} has waited "
                    f"{waited:.0f} s in "
                    f"collective #{seq} {name} for other ranks.",
                    file=sys.stderr,
                    flush=True,
                )
            if timeout and waited > timeout and self.current is current and reported != seq:
                reported = seq
                self._abort(seq, name, waited)

    def ask_others(self, grace: float = _ANSWER_GRACE_SECONDS) -> dict[int, tuple]:
        """Asks every other rank where it is; waits ``grace`` seconds for the answers.

        Returns:
            rank -> (collective number or None, collective name, or "exit" when that rank has
            finished its program, or None; number of its last finished collective), for the
            ranks that answered.
        """
        others = [r for r in range(self.size) if r != self.rank]
        for r in others:
            # The request holds the pickled message: dropped, its buffer could be freed while
            # MPI still sends it (the other rank then reads a truncated pickle). Kept until done.
            self._queries.append(self._side.isend(None, dest=r, tag=_QUERY))
        replies = {}
        deadline = time.monotonic() + grace
        self._queries = [q for q in self._queries if not q.Test()]
        MPI = self._MPI
        status = MPI.Status()
        while len(replies) < len(others) and time.monotonic() < deadline:
            self._answer_questions()
            message = self._side.improbe(source=MPI.ANY_SOURCE, tag=_REPLY, status=status)
            if message is not None:
                replies[status.Get_source()] = message.recv()
            else:
                time.sleep(0.01)
        return replies

    def _abort(self, seq: int, name: str, waited: float) -> None:
        details, missing = [], []
        if self._can_ask:
            replies = self.ask_others()
            for r in range(self.size):
                if r == self.rank:
                    continue
                job = self._job_rank[r]
                if r not in replies:
                    missing.append(job)
                    details.append(f"  rank {job}: did not answer (stopped, hung or dead).")
                    continue
                their_seq, their_name, their_done = replies[r]
                if their_seq == seq:
                    continue
                missing.append(job)
                if their_name == "exit":
                    details.append(
                        f"  rank {job}: has finished its program (last collective #{their_done})."
                    )
                elif their_seq is None:
                    details.append(
                        f"  rank {job}: not in a collective (last finished "
                        f"#{their_done}); it is busy elsewhere or on another path."
                    )
                else:
                    details.append(
                        f"  rank {job}: in collective #{their_seq} {their_name} "
                        "instead (the ranks took different code paths)."
                    )
        me = self._job_rank[self.rank]
        limit = f"(stall timeout {self.timeout:g} s)"
        where = f"collective #{seq} {name}"
        if missing:
            who = ("rank " if len(missing) == 1 else "ranks ") + ", ".join(map(str, missing))
            lines = [
                f"syncdp: {who} stalled: {where} waited {waited:.1f} s for "
                f"{'it' if len(missing) == 1 else 'them'} on rank {me} {limit}.",
                "syncdp: ranks that have not arrived: " + ", ".join(map(str, missing)),
            ]
        elif self._can_ask:
            lines = [
                f"syncdp: rank {me} stalled: {where} ran {waited:.1f} s although "
                f"every rank has arrived {limit}; an MPI transfer is stuck or very slow."
            ]
        else:
            lines = [
                f"syncdp: rank {me} stalled: {where} waited {waited:.1f} s for "
                f"other ranks {limit}; MPI without thread support cannot say which."
            ]
        lines += details
        if self.elastic and missing:
            self._remove(missing, lines, name, seq)
            return
        lines.append(
            "syncdp: ending the job. Set SYNCDP_STALL_TIMEOUT (or --stall-timeout) "
            "to wait longer, or 0 to wait forever."
        )
        print("\n".join(lines), file=sys.stderr, flush=True)
        report.send("stall", me, "\n".join(lines), ranks=missing, collective=name, seq=seq)
        self._MPI.COMM_WORLD.Abort(1)

    def _remove(self, missing: list[int], lines: list[str], name: str, seq: int) -> None:
        """Elastic mode: asks the launcher to kill the stalled ranks; the job recovers."""
        members = self.members or []
        pids = [list(members[r]) for r in missing if r < len(members)]
        lines.append(
            "syncdp: elastic mode: asking the launcher to remove the stalled "
            + ("rank" if len(missing) == 1 else "ranks")
            + "; the job goes on without them."
        )
        print("\n".join(lines), file=sys.stderr, flush=True)
        report.send(
            "stall",
            self._job_rank[self.rank],
            "\n".join(lines),
            ranks=missing,
            collective=name,
            seq=seq,
            elastic=True,
            pids=pids,
        )
