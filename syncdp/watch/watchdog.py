"""The stall watchdog: a collective that waits too long, or for a rank that is gone, ends the job
and names the ranks it waits for and where they are.

A background thread on every rank watches the collective its rank is in. After
``stall_warning`` seconds (or half the stall timeout, if that is sooner) it prints a warning;
after ``stall_timeout`` seconds it asks every other rank, over a separate communicator, where it
is, prints which ranks have not arrived and where each one is, and aborts the whole MPI job. The
same thread answers the other ranks' questions, so a rank that is busy elsewhere (computing,
another code path, another collective) says so, and a rank that does not answer within a few
seconds is stopped or hung. The report's first line names the stalled ranks::

    syncdp: rank 1 stalled: collective #23 allreduce.bucket0 waited 10.0 s for it on rank 0 ...
    syncdp: ranks that have not arrived: 1 (in no collective: computing, or stuck outside syncdp)
      rank 1: in no collective: computing, or stuck outside syncdp (last finished #22).

A rank is named with its host (``rank 1 on h2``) when the job spans hosts.

It also watches the processes of the other ranks on its host (Linux pidfds; the ranks swap
host, pid and parent pid when the watchdog starts). A rank whose process ends without syncdp's
exit handshake (``os._exit(0)``, which skips ``atexit``) while this rank waits for it in a
collective is named at once, with the ranks that wait for it::

    syncdp: rank 1 (pid 4242 on node3) exited while ranks 0, 2 wait for it in collective #7
    gradients.bucket0: ...

The lowest waiting rank on the host speaks for all, after the gone rank's supervisor has exited
(the supervisor reports how its rank ended first, so the launcher's first failure stays a crash
or a kill when it was one), and sends an ``exit_early`` report naming the gone rank, the ranks
that wait and the collective. A rank that ends the job on purpose (an exception, a stall, an
early exit) tells the others first (:meth:`Watchdog.farewell`), so they do not name it twice.

Defaults (``syncdp.config``): warning at 10 s, abort at 60 s (``SYNCDP_STALL_TIMEOUT`` or
``syncdp-run --stall-timeout``; 0 waits forever). A stalled job therefore ends within the stall
timeout plus about 3 s (the time given to the other ranks to answer).

In elastic mode (``SYNCDP_ELASTIC``) a stall does not end the job: the report names the
stalled ranks' processes and the launcher kills them, which turns the stall into a rank
failure the job recovers from (:mod:`syncdp.membership.membership`); a dead rank is left to ULFM.

The main thread only sets two attributes per collective; all the waiting happens here.
"""

from __future__ import annotations

import os
import select
import socket
import sys
import threading
import time
from typing import NamedTuple

from syncdp.base import mpi
from syncdp.base.settings import Config
from syncdp.watch import report

__all__ = ["Watchdog", "Process"]

_QUERY, _REPLY, _ENDING, _LEFT = 1, 2, 3, 4
_POLL_SECONDS = 0.1
# For a while after a rank's process ends, the others ask where this rank is (to name who
# waits for it): answer at once rather than at the next poll.
_BUSY_POLL_SECONDS, _BUSY_SECONDS = 0.01, 2.0
_ANSWER_GRACE_SECONDS = 3.0
# When a rank's process is gone: how long the living get to say where they are, how long its
# supervisor gets to report how it ended (before this rank's report), and how long MPI gets to
# end the job after this rank's report before this rank does. Open MPI itself ends the job
# about 0.3 s after the gone rank's supervisor exits, so the first two are short.
_GONE_ASK_SECONDS = 0.2
_SUPERVISOR_SECONDS = 1.0
_END_SECONDS = 2.0
_NO_COLLECTIVE = "in no collective: computing, or stuck outside syncdp"

# Every running watchdog of this process: one per communicator (the job's, each process set's).
# A rank asked where it is, and in no collective of the asker's communicator, can then name
# the collective it is in on another one (ranks that passed different process sets).
_RUNNING: list[Watchdog] = []
# Side channels of watchdogs stopped at shutdown(), never freed (see Watchdog.stop).
_RETIRED: list = []
_RUNNING_LOCK = threading.Lock()


class Process(NamedTuple):
    """Where one rank runs.

    Attributes:
        host: Its host name.
        pid: Its process id.
        parent: Its parent's process id (``syncdp-run``'s supervisor of the rank).
        space: Its kernel's boot id and pid namespace: pids compare only within one space.
    """

    host: str
    pid: int
    parent: int
    space: str

    @classmethod
    def this(cls) -> Process:
        """This process."""
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                space = f.read().strip() + os.readlink("/proc/self/ns/pid")
        except OSError:  # not Linux: pids are never compared
            space = ""
        return cls(socket.gethostname(), os.getpid(), os.getppid(), space)


def _ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _alive(pid: int):
    """A pidfd of ``pid`` while that process runs; None when it has ended (or is unknown)."""
    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None
    if select.select([fd], [], [], 0)[0]:
        os.close(fd)
        return None
    return fd


class Watchdog:
    """Watches one rank's collectives on ``comm``; a collective of ``comm``'s ranks to make.

    Args:
        comm: The communicator the collectives run on. The watchdog talks over its own duplicate.
        config: ``stall_timeout`` (0 disables the abort), ``stall_warning`` and ``elastic``.
        job_comm: The job's communicator, whose rank numbers messages use. Defaults to
            ``MPI.COMM_WORLD``.
        scope: What messages call ``comm``'s group when it is not the whole job's (``the
            process set of ranks 0, 1``). Defaults to None: the whole job.
    """

    def __init__(self, comm, config: Config, job_comm=None, scope: str | None = None):
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
        self.scope = scope
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
        # Every rank's process, in rank order (empty without a side channel to swap them on).
        self.processes: list[Process] = self._side.allgather(Process.this()) if self._side else []
        # The ranks whose processes ended (found by their pidfds), in the order seen.
        self.gone: list[int] = []
        # rank -> the last collective it finished before it shut syncdp down (see leaving).
        self.left: dict[int, int] = {}
        self._told_leaving = False
        self._pidfds = self._open_pidfds()
        self._queries: list = []  # this rank's messages still in flight (see ask_others)
        self._stop = threading.Event()
        self._wake_read, self._wake_write = os.pipe()  # stop() wakes the thread's poll
        self._thread = threading.Thread(target=self._loop, name="syncdp-watchdog", daemon=True)
        self._thread.start()
        with _RUNNING_LOCK:
            _RUNNING.append(self)

    def enter(self, seq: int, name: str, timeout: float | None = None) -> None:
        """Called by the main thread as collective number ``seq`` starts; ``timeout`` < 0
        means no warning and no stall timeout (a rank gone is still named)."""
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
        with _RUNNING_LOCK:
            if self in _RUNNING:
                _RUNNING.remove(self)
        self._stop.set()
        os.write(self._wake_write, b"x")
        # The loop may be in the middle of asking the others (a few seconds at most); wait for
        # it rather than free a communicator it is using.
        self._thread.join()
        for fd in [self._wake_read, self._wake_write, *self._pidfds]:
            os.close(fd)
        self._pidfds = {}
        if self._side is not None:
            if self._told_leaving:
                # The others' notes that they left may still be on their way here: freed,
                # this channel's context id could go to a later communicator of another size,
                # where such a note is a fatal error (a source that does not exist). Kept.
                _RETIRED.append(self._side)
            elif free:
                self._side.Free()
            self._side = None

    @property
    def can_ask(self) -> bool:
        """Whether this rank can ask the others where they are (needs MPI_THREAD_MULTIPLE)."""
        return self._can_ask

    def farewell(self) -> None:
        """Tells the other ranks that this one ends the job on purpose and has said why.

        Called just before ``MPI_Abort`` (an exception, a stall, an early exit), so that the
        ranks that see this process end do not name it as gone. Not a collective.
        """
        self._tell_others(_ENDING, None)

    def leaving(self) -> None:
        """Tells the other ranks that this one shuts syncdp down after the collectives it has
        finished (``shutdown()``, which a program may call before its end): a rank that waits,
        or comes to wait, in a later collective of this communicator ends the job rather than
        wait for this one forever (``join()`` waits with no stall timeout). Not a collective.
        """
        self._told_leaving = True
        self._tell_others(_LEFT, self.last_done)

    def _tell_others(self, tag: int, message) -> None:
        """Sends ``message`` to every other rank not known to be gone, waiting up to 0.2 s for
        the sends to leave (the process may end right after)."""
        if self._side is None:
            return
        others = [r for r in range(self.size) if r != self.rank and r not in self.gone]
        try:
            sent = [self._side.isend(message, dest=r, tag=tag) for r in others]
        except self._MPI.Exception:  # a rank is gone: nothing to tell it
            return
        deadline = time.monotonic() + 0.2
        while not self._MPI.Request.Testall(sent) and time.monotonic() < deadline:
            time.sleep(0.005)
        self._queries += sent

    def _note_leavers(self) -> None:
        for source, done in self._messages(_LEFT):
            self.left[source] = done

    def _end_for_leavers(self, seq: int, name: str, late: list[int]) -> None:
        """Ends the job: ``late`` ranks shut syncdp down before collective ``seq``, which
        this rank waits in."""
        me = self._job_rank[self.rank]
        who = _ranks_text([self._job_rank[r] for r in late])
        done = ", ".join(f"#{self.left[r]}" for r in late)
        message = (
            f"{who} shut syncdp down (shutdown()) after collective {done}{self.of_scope}, "
            f"but rank {me} waits for {'it' if len(late) == 1 else 'them'} in "
            f"{self._collective(seq, name)}"
        )
        print(
            f"syncdp: {message}; ending the job. Every rank must run the same collectives "
            "before shutdown(); if the ranks' data differ in length, call syncdp.join() on "
            "every rank first.",
            file=sys.stderr,
            flush=True,
        )
        report.send(
            "exit_early",
            self._job_rank[late[0]],
            message,
            ranks=[me],
            collective=f"{name}{self.of_scope}",
            seq=seq,
            shut_down=True,
            reporter=me,
            **(
                {"pid": self.processes[late[0]].pid, "host": self.processes[late[0]].host}
                if self.processes
                else {}
            ),
        )
        self.farewell()
        self._MPI.COMM_WORLD.Abort(1)

    def _open_pidfds(self) -> dict[int, int]:
        """pidfd -> rank, for the other ranks whose pids this one can watch (same host)."""
        if self.elastic or not self.processes or not self.processes[self.rank].space:
            return {}  # elastic mode: ULFM reports dead ranks to the collectives themselves
        space = self.processes[self.rank].space
        found = {}
        for r, process in enumerate(self.processes):
            if r != self.rank and process.space == space:
                try:
                    found[os.pidfd_open(process.pid)] = r
                except (OSError, AttributeError):  # already gone, or no pidfds (Linux < 5.3)
                    pass
        return found

    def _where(self):
        """This rank's answer to "where are you?": ``(seq, name, last done)`` of this
        communicator's collective; seq None outside one, with name "exit" at the program's
        end, or naming a collective of another communicator the rank is in."""
        current = self.current
        if current is not None:
            return (current[0], current[1], self.last_done)
        return (None, "exit" if self.exiting else self._elsewhere(), self.last_done)

    def _elsewhere(self) -> str | None:
        """The collective this rank is in on another communicator, in words, or None."""
        with _RUNNING_LOCK:
            others = [w for w in _RUNNING if w is not self]
        for other in others:
            current = other.current
            if current is not None:
                return f"collective #{current[0]} {current[1]} of {other.scope or 'the whole job'}"
        return None

    def _answer_questions(self) -> None:
        for source, _ in self._messages(_QUERY):
            self._side.send(self._where(), dest=source, tag=_REPLY)

    def _messages(self, tag: int):
        """Yields ``(source, message)`` for each message with ``tag`` waiting here. Matched
        probes: the main thread may receive too (ask_others), and a plain Iprobe + recv from
        two threads could race for the same message."""
        MPI = self._MPI
        status = MPI.Status()
        while (
            message := self._side.improbe(source=MPI.ANY_SOURCE, tag=tag, status=status)
        ) is not None:
            yield status.Get_source(), message.recv()

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
        named_gone = False
        poller = select.poll()
        poller.register(self._wake_read, select.POLLIN)
        for fd in self._pidfds:
            poller.register(fd, select.POLLIN)
        busy_until = 0.0
        while not self._stop.is_set():
            busy = time.monotonic() < busy_until
            for fd, _ in poller.poll(1000 * (_BUSY_POLL_SECONDS if busy else _POLL_SECONDS)):
                if fd in self._pidfds:  # that rank's process has ended
                    poller.unregister(fd)
                    os.close(fd)
                    self.gone.append(self._pidfds.pop(fd))
                    busy_until = time.monotonic() + _BUSY_SECONDS
            if self._stop.is_set():
                break
            if self._can_ask:
                self._answer_questions()
                self._note_leavers()
            current = self.current
            if current is None:
                continue
            seq, name, start, timeout = current
            late = sorted(r for r, done in self.left.items() if done < seq)
            if late and self.current is current:
                self._end_for_leavers(seq, name, late)
            if self.gone and not named_gone:
                named_gone = True
                self._name_gone(seq, name)
            if timeout is not None and timeout < 0:  # a wait with no bound (a joined rank)
                continue
            waited = time.monotonic() - start
            warn_at = min(self.warning, timeout / 2) if timeout else self.warning
            if warn_at and waited > warn_at and warned_for != seq:
                warned_for = seq
                print(
                    f"syncdp: warning: rank {self._job_rank[self.rank]} has waited "
                    f"{waited:.0f} s in "
                    f"{self._collective(seq, name)} for other ranks.",
                    file=sys.stderr,
                    flush=True,
                )
            if timeout and waited > timeout and self.current is current and reported != seq:
                reported = seq
                self._abort(seq, name, waited)

    def ask_others(
        self, grace: float = _ANSWER_GRACE_SECONDS, ranks: list[int] | None = None
    ) -> dict[int, tuple]:
        """Asks every other rank where it is; waits ``grace`` seconds for the answers.

        Args:
            grace: Seconds to wait for the answers. Defaults to 3.
            ranks: The ranks (of this communicator) to ask. Defaults to every other rank.

        Returns:
            rank -> (collective number or None, collective name, or "exit" when that rank has
            finished its program, or None; number of its last finished collective), for the
            ranks that answered.
        """
        others = [r for r in range(self.size) if r != self.rank] if ranks is None else ranks
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

    def _on(self, r: int) -> str:
        """`` on h2``, the host of rank ``r`` when the job spans hosts; "" otherwise."""
        if len({p.host for p in self.processes}) < 2:
            return ""
        return f" on {self.processes[r].host}"

    def _name(self, r: int) -> str:
        """``rank 3``, or ``rank 3 on h2`` when the job spans hosts."""
        return f"rank {self._job_rank[r]}{self._on(r)}"

    def _collective(self, seq: int, name: str) -> str:
        """``collective #7 allreduce``, with the process set when it is not the whole job's."""
        return f"collective #{seq} {name}{self.of_scope}"

    @property
    def of_scope(self) -> str:
        """`` of the process set of ranks 0, 2`` for a process set's watchdog; "" otherwise."""
        return f" of {self.scope}" if self.scope else ""

    def ahead(self, grace: float) -> tuple[int, int, str] | None:
        """Asks the others where they are: ``(job rank, seq, name)`` of one that is in a
        collective of this communicator that this rank has not reached, or None."""
        for other, (seq, name, _) in self.ask_others(grace=grace).items():
            if seq is not None and seq > self.last_done:
                return self._job_rank[other], seq, name
        return None

    @staticmethod
    def _whereabouts(reply: tuple | None) -> tuple[str, str]:
        """Where a rank is, from its answer: a few words, and a sentence for its own line."""
        if reply is None:
            return "did not answer", "did not answer (stopped, hung or dead)."
        seq, name, done = reply
        if name == "exit":
            return "finished its program", f"has finished its program (last collective #{done})."
        if seq is None and name:  # a collective of another communicator
            return f"in {name}", f"in {name} instead."
        if seq is None:
            return _NO_COLLECTIVE, f"{_NO_COLLECTIVE} (last finished #{done})."
        return (
            f"in collective #{seq} {name}",
            f"in collective #{seq} {name} instead (the ranks took different code paths).",
        )

    def _abort(self, seq: int, name: str, waited: float) -> None:
        details, missing, where, summary = [], [], {}, []
        elsewhere = []  # ranks at the same collective number in another collective
        if self._can_ask:
            replies = self.ask_others()
            for r in range(self.size):
                if r == self.rank:
                    continue
                if r in replies and replies[r][0] == seq:
                    if replies[r][1] != name:
                        elsewhere.append(f"{self._name(r)} in {replies[r][1]}")
                    continue
                job = self._job_rank[r]
                missing.append(job)
                short, sentence = self._whereabouts(replies.get(r))
                where[job] = short
                summary.append(f"{job}{self._on(r)} ({short})")
                details.append(f"  {self._name(r)}: {sentence}")
        me = self._job_rank[self.rank]
        limit = f"(stall timeout {self.timeout:g} s)"
        collective = self._collective(seq, name)
        if missing:
            who = _ranks_text(missing)
            lines = [
                f"syncdp: {who} stalled: {collective} waited {waited:.1f} s for "
                f"{'it' if len(missing) == 1 else 'them'} on rank {me} {limit}.",
                "syncdp: ranks that have not arrived: " + ", ".join(summary),
            ]
        elif elsewhere:
            lines = [
                f"syncdp: rank {me} stalled: {collective} waited {waited:.1f} s {limit}, and "
                f"the others are in another collective of that number ({', '.join(elsewhere)})"
                ": the ranks took different code paths."
            ]
        elif self._can_ask:
            lines = [
                f"syncdp: rank {me} stalled: {collective} ran {waited:.1f} s although "
                f"every rank has arrived {limit}; an MPI transfer is stuck or very slow."
            ]
        else:
            lines = [
                f"syncdp: rank {me} stalled: {collective} waited {waited:.1f} s for "
                f"other ranks {limit}; MPI without thread support cannot say which."
            ]
        if missing and elsewhere:
            details.append(
                f"  in another collective of number {seq}: {', '.join(elsewhere)} (the ranks "
                "took different code paths)."
            )
        lines += details
        if self.elastic and missing:
            self._remove(missing, lines, name, seq)
            return
        lines.append(
            "syncdp: ending the job. Set SYNCDP_STALL_TIMEOUT (or --stall-timeout) "
            "to wait longer, or 0 to wait forever."
        )
        print("\n".join(lines), file=sys.stderr, flush=True)
        report.send(
            "stall",
            me,
            "\n".join(lines),
            ranks=missing,
            collective=f"{name}{self.of_scope}",
            seq=seq,
            where={str(job): text for job, text in where.items()},
            hosts=self._hosts(missing),
        )
        self.farewell()
        self._MPI.COMM_WORLD.Abort(1)

    def _hosts(self, jobs: list[int]) -> dict[str, str]:
        """job rank -> host, for ``jobs`` (empty when the hosts are unknown)."""
        if not self.processes:
            return {}
        index = {job: r for r, job in enumerate(self._job_rank)}
        return {str(job): self.processes[index[job]].host for job in jobs if job in index}

    def _said_farewell(self, r: int) -> bool:
        return self._side.iprobe(source=r, tag=_ENDING)

    def ended_on_purpose(self) -> int | None:
        """The lowest other rank that said :meth:`farewell` (it raised, or ended a stalled
        job, and ends the whole job), or None. Not a collective; safe on a broken group (a
        rank that cannot be asked is taken to have said nothing)."""
        if self._side is None:
            return None
        for r in range(self.size):
            if r == self.rank:
                continue
            try:
                if self._said_farewell(r):
                    return r
            except self._MPI.Exception:  # a failed rank with nothing left to match
                continue
        return None

    def _name_gone(self, seq: int, name: str) -> None:
        """Names the ranks whose processes ended while this rank waits in collective ``seq``."""
        gone = sorted(self.gone)
        if self._side is None or any(self._said_farewell(r) for r in gone):
            return  # it ended the job itself, and said why
        parents = [_alive(self.processes[r].parent) for r in gone]
        try:
            if None in parents:
                # Its supervisor ended first (killed): the rank went with it, and the launcher
                # names that supervisor; this rank has nothing to add.
                return
            living = [r for r in range(self.size) if r != self.rank and r not in gone]
            replies = self.ask_others(_GONE_ASK_SECONDS, ranks=living)
            waiting = [self.rank] + [r for r in living if r in replies and replies[r][0] == seq]
            space = self.processes[self.rank].space
            if min(r for r in waiting if self.processes[r].space == space) != self.rank:
                return  # the lowest waiting rank of this host speaks for all
            if report.ADDRESS_VAR in os.environ:
                # The supervisor reports how its rank ended, then exits: wait for that, so that a
                # crash or a kill stays the launcher's first failure.
                select.select(parents, [], [], _SUPERVISOR_SECONDS)
            if any(self._said_farewell(r) for r in gone):
                return
        finally:
            for fd in parents:
                if fd is not None:
                    os.close(fd)
        self._report_gone(gone, waiting, replies, seq, name)

    def _report_gone(self, gone, waiting, replies, seq: int, name: str) -> None:
        first = self.processes[gone[0]]
        waits = "waits" if len(waiting) == 1 else "wait"
        who = _ranks_text([self._job_rank[r] for r in gone])
        pids = ", ".join(f"{self.processes[r].pid}" for r in gone)
        pid_word = "pid" if len(gone) == 1 else "pids"
        lines = [
            f"syncdp: {who} ({pid_word} {pids} on {first.host}) exited while "
            f"{_ranks_text([self._job_rank[r] for r in waiting])} {waits} for "
            f"{'it' if len(gone) == 1 else 'them'} in {self._collective(seq, name)}: "
            f"{'its process' if len(gone) == 1 else 'their processes'} ended without syncdp's "
            "exit handshake (os._exit(), or killed); ending the job."
        ]
        for r in range(self.size):
            if r not in gone and r not in waiting:
                lines.append(f"  {self._name(r)}: {self._whereabouts(replies.get(r))[1]}")
        print("\n".join(lines), file=sys.stderr, flush=True)
        report.send(
            "exit_early",
            self._job_rank[gone[0]],
            "\n".join(lines),
            ranks=[self._job_rank[r] for r in waiting],
            gone=[self._job_rank[r] for r in gone],
            collective=f"{name}{self.of_scope}",
            seq=seq,
            pid=first.pid,
            host=first.host,
            reporter=self._job_rank[self.rank],
        )
        # Open MPI ends the job on its own once the gone rank's supervisor has exited; if it
        # does not, this rank does.
        if not self._stop.wait(_END_SECONDS):
            self.farewell()
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
