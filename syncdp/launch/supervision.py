"""Process supervision: mpirun as the launcher's child, and how the job is stopped.

- :func:`start_mpirun` starts mpirun in its own session (a signal meant for the launcher never
  reaches it by accident) with a parent-death signal: if the launcher dies, SIGKILL included,
  mpirun is killed, and the supervisors' lifelines (:mod:`syncdp.launch.lifeline`) end every
  rank and what it started, on every host, within seconds. (SIGTERM would have mpirun end the
  job itself: it kills each supervisor about 0.25 s later, often before the supervisor has
  ended what its rank started in a session of its own, which then outlives the job.)
- :func:`supervise` waits for mpirun, and ends the job when a rank reported a failure or the
  ranks did not all reach ``init()`` within the start timeout; and when every rank has reported
  how it ended, the job is over whatever mpirun does: mpirun gets a short grace to exit, then it
  is stopped (an Open MPI daemon that cannot run, on a stopped host, would keep it waiting). In
  elastic mode that holds for the final membership's ranks, whatever their verdict: warm spares
  are never needed for a job to end, and one that does not leave is stopped with mpirun. When
  mpirun has ended, the shared-memory segments that the job's killed processes left in
  ``/dev/shm`` on this host are removed (:class:`syncdp.launch.cleanup.ShmLeftovers`), and
  whatever is left in mpirun's session is killed (:func:`end_session`: a remote shell whose
  link was cut would wait for it for hours).
- :class:`StopOnSignals` turns SIGINT, SIGTERM and SIGHUP to the launcher into stopping the job
  (mpirun is asked first, then killed after a grace), and remembers the signal.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from syncdp.launch.cleanup import (
    ShmLeftovers,
    remove_stale_segments,
    remove_stale_session_dirs,
    session_members,
)
from syncdp.launch.elastic import SPARE_GRACE_SECONDS

if TYPE_CHECKING:
    from syncdp.launch.lifeline import Link
    from syncdp.launch.output import Flow
    from syncdp.launch.verdict import Verdict

__all__ = ["start_mpirun", "stop", "end_session", "supervise", "StopOnSignals", "in_main_thread"]

_PR_SET_PDEATHSIG = 1
# Seconds between asking mpirun to stop (SIGTERM) and killing it.
TERMINATE_GRACE_SECONDS = 10.0
# Once a rank has reported a failure, mpirun gets this long to end the job by itself, then as
# long again after SIGTERM. Short: when a host has vanished, mpirun waits for its daemon in
# vain, and the job must end within the stall timeout plus 15 s.
FAILURE_GRACE_SECONDS = 5.0
# After a failure, output still moving through the launcher extends that grace by this much at
# most (a rank that keeps printing cannot hold the failed job up for longer); writes waiting
# for the launcher's own reader extend it without a bound.
FAILURE_OUTPUT_SECONDS = 60.0
# Between SIGTERM and SIGKILL when a job that never started is stopped.
START_STOP_GRACE_SECONDS = 2.0
# Once every rank has reported how it ended, mpirun gets this long to exit, then as long again
# after SIGTERM.
FINISHED_GRACE_SECONDS = 5.0
# How often the terminal's reader looks whether the job has ended or the launcher is back in
# the foreground.
_TERMINAL_POLL_SECONDS = 0.2
# How often the job's processes on this host are looked at for their shared-memory segments
# (until one is found: syncdp.launch.cleanup.ShmLeftovers).
_LOOK_SECONDS = 2.0


def _end_with_launcher() -> None:
    """In mpirun's process before exec: SIGKILL when the launcher dies, however it dies (see
    the module docstring)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: the supervisors' lifelines still end the job
        pass


def start_mpirun(
    cmd: list[str], env: dict[str, str], *, terminal: int | None = None
) -> subprocess.Popen:
    """Starts mpirun (see the module docstring), its output on pipes, once the session
    directories that killed mpiruns left behind are gone (one would stop an mpirun that gets
    its process id: :func:`syncdp.launch.cleanup.remove_stale_session_dirs`) and so are the
    shared-memory segments that killed processes of earlier jobs left on this host
    (:func:`syncdp.launch.cleanup.remove_stale_segments`).

    Args:
        cmd: The mpirun command line.
        env: Its environment.
        terminal: The launcher's standard input when it is a terminal, whose lines mpirun
            forwards to rank 0. mpirun reads a terminal only while its process group is the
            terminal's foreground one, which in a session of its own it never is: the launcher
            reads the terminal and passes what it reads on to mpirun through a pipe. Defaults
            to None: mpirun inherits the launcher's input (which it reads only when asked to,
            ``--stdin``).
    """
    remove_stale_session_dirs(env)
    remove_stale_segments()
    process = subprocess.Popen(
        cmd,
        env=env,
        stdin=None if terminal is None else subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=_end_with_launcher,
    )
    if terminal is not None:
        threading.Thread(
            target=_pass_on,
            args=(terminal, process),
            name="syncdp-stdin",
            daemon=True,
        ).start()
    return process


def _pass_on(terminal: int, process: subprocess.Popen) -> None:
    """Copies what is typed on ``terminal`` to mpirun's input until either side ends.

    It reads only while the launcher is the terminal's foreground job, as a shell's job
    control expects (a background read would stop the launcher, and with it the job's
    output), and it stops once mpirun has ended, so that nothing typed after the job (into
    the program that called ``horovod.run``) is taken.
    """
    pipe = process.stdin
    try:
        while process.poll() is None:
            if os.tcgetpgrp(terminal) != os.getpgrp():  # in the background: wait for fg
                time.sleep(_TERMINAL_POLL_SECONDS)
                continue
            ready, _, _ = select.select([terminal], [], [], _TERMINAL_POLL_SECONDS)
            if not ready:
                continue
            data = os.read(terminal, 65536)
            if not data:  # end of input (Ctrl-D at the start of a line)
                break
            pipe.write(data)
            pipe.flush()
    except OSError:  # the terminal went away, or mpirun ended (a broken pipe)
        pass
    finally:
        try:
            pipe.close()
        except OSError:
            pass


def stop(
    process: subprocess.Popen,
    signum: int = signal.SIGTERM,
    grace: float = TERMINATE_GRACE_SECONDS,
) -> None:
    """Asks mpirun (and through it every rank) to stop, then, after ``grace`` seconds, kills
    whatever is left of its process group; and, once it has ended, of its session."""
    if process.poll() is not None:
        end_session(process.pid)
        return
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        end_session(process.pid)
        return
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
    end_session(process.pid)


def end_session(session: int) -> list[int]:
    """Kills what is left of mpirun's session once mpirun has ended.

    Open MPI starts each remote shell (ssh) in a process group of its own, which stopping
    mpirun's group misses; an ssh whose host's link was cut waits for its peer until TCP gives
    up (hours), so it outlived the launcher.

    Args:
        session: mpirun's process id, which is its session's (``start_new_session``).

    Returns:
        The process ids killed.
    """
    if os.path.exists(f"/proc/{session}"):
        # mpirun is reaped: its number, in use again, is another process's (the kernel reuses
        # none while a session of that number has a member), and that session is not the job's.
        return []
    left = session_members(session)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def supervise(
    process: subprocess.Popen,
    verdict: Verdict,
    *,
    links: Callable[[], Mapping[int, Link]] | None = None,
    flow: Flow | None = None,
) -> bool:
    """Waits for mpirun; ends the job on a failure report or a start timeout, or once every rank
    has reported how it ended and mpirun has not exited within a grace.

    Args:
        process: mpirun.
        verdict: What the ranks reported.
        links: The supervisors' lifelines (:meth:`syncdp.launch.lifeline.LifelineServer.links`): the
            grace starts only once every supervisor has exited too (it sends its report before
            the last of its rank's output, which mpirun still forwards). Defaults to None (the
            grace starts at the last report).
        flow: mpirun's output through the launcher (:class:`syncdp.launch.output.Flow`): the grace
            counts only while none moves (mpirun waits for a slow reader of the launcher's
            output to take the rest of it: stopping it then would lose it). Defaults to None.

    Returns:
        Whether mpirun had to be stopped after every rank had reported (a daemon somewhere did
        not finish: the hosts may hold leftovers).
    """
    leftovers = ShmLeftovers(process.pid)
    try:
        return _supervise(process, verdict, links, leftovers, flow)
    finally:
        if process.poll() is not None:
            end_session(process.pid)  # a remote shell stuck on a cut link, say
        leftovers.remove()  # what killed processes left in /dev/shm, once nothing holds it


def _supervise(process, verdict, links, leftovers: ShmLeftovers, flow) -> bool:
    finished: float | None = None  # time.monotonic() when every rank had reported
    grace = FINISHED_GRACE_SECONDS
    if verdict.elastic is not None:
        # Spares are no rank: the launcher kills any still there SPARE_GRACE_SECONDS after
        # the last rank, but a job whose ranks did not all finish never asks it to.
        grace += SPARE_GRACE_SECONDS
    next_look = time.monotonic() + _LOOK_SECONDS
    while process.poll() is None:
        if time.monotonic() >= next_look:
            leftovers.look()
            next_look = time.monotonic() + _LOOK_SECONDS
        if finished is None and _every_rank_reported(verdict):
            if (
                verdict.elastic is not None
                or links is None
                or all(link.closed is not None for link in links().values())
            ):
                finished = time.monotonic()
        if finished is not None and flow is not None and flow.active(within=1.0):
            finished = max(finished, time.monotonic() - 1.0)  # output still moves: not stuck
        if finished is not None and time.monotonic() > finished + grace:
            stop(process, grace=FINISHED_GRACE_SECONDS)
            return True
        if verdict.check_start(anything_started=links is None or bool(links())):
            # The ranks' own start timeout did not end the job: nothing will. Training never
            # began, so there is nothing to let the ranks finish: a short grace.
            stop(process, grace=START_STOP_GRACE_SECONDS)
        elif verdict.failed.wait(timeout=0.5):
            # mpirun normally ends the job at once; make sure nothing is left waiting. While
            # the launcher waits for its own reader (a slow one holds mpirun up), mpirun is not
            # stuck: stopping it would lose what it still holds, the failing rank's last words
            # among it. Output that merely moves (a rank still printing) earns a bounded wait.
            deadline = time.monotonic() + FAILURE_GRACE_SECONDS
            latest = deadline + FAILURE_OUTPUT_SECONDS
            while process.poll() is None and time.monotonic() < deadline:
                if flow is not None and (
                    flow.writing > 0 or (flow.active(within=1.0) and time.monotonic() < latest)
                ):
                    deadline = max(deadline, time.monotonic() + 1.0)
                time.sleep(0.2)
            stop(process, grace=FAILURE_GRACE_SECONDS)
    return False


def _every_rank_reported(verdict: Verdict) -> bool:
    """Whether every rank has reported how it ended: in elastic mode, every member of the
    final membership (a failed one's recovery may change it yet, while any other runs)."""
    if verdict.elastic is None:
        return not verdict.unreported()
    unfinished = verdict.elastic.unfinished(verdict.num_proc)
    return all(report is not None for report in unfinished.values())


class Stopped(Exception):
    """A signal stopped the launcher before the job started (:class:`StopOnSignals`)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def in_main_thread() -> bool:
    """Whether this is the main thread, the only one Python lets set signal handlers."""
    return threading.current_thread() is threading.main_thread()


class StopOnSignals:
    """``with StopOnSignals(process) as signals:`` SIGINT, SIGTERM and SIGHUP stop the job.

    Before the job starts (``process`` None: the hosts are being checked), they raise
    :class:`Stopped` in the main thread instead. A signal that was ignored when the launcher
    started (``nohup`` ignores SIGHUP) stays ignored. Outside the main thread (``horovod.run``
    called from another thread) nothing is set: the program's own handlers stay.

    Attributes:
        received: The signals received, in order.
    """

    _SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, process: subprocess.Popen | None):
        self.process = process
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def _on_signal(self, signum, frame) -> None:
        self.received.append(signum)
        if self.process is None:
            raise Stopped(signum)
        threading.Thread(target=stop, args=(self.process,), daemon=True).start()

    def __enter__(self) -> StopOnSignals:
        if not in_main_thread():
            return self  # only the main thread may set handlers (horovod.run from another)
        for s in self._SIGNALS:
            if signal.getsignal(s) is not signal.SIG_IGN:
                self._previous[s] = signal.signal(s, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
