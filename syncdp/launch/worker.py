"""The per-rank supervisor that ``syncdp-run`` asks mpirun to start on every slot.

It runs the user's command as a child process, prefixes each line the child writes with the
rank (``[1]<stdout>:``), forwards termination signals to it, and when the child fails says
which rank it was and how it ended (exit code or signal) before exiting non-zero itself, which
makes mpirun end every other rank. The child is started with a parent-death signal, so it can
never outlive this supervisor.

Asked to end (SIGTERM, SIGINT or SIGHUP: Open MPI ending the job), the supervisor passes the
signal on with SIGCONT (a rank stopped by SIGSTOP, a stalled rank, would otherwise never act
on it) and kills the rank's process group if the rank has not ended within
:data:`_ASKED_GRACE_SECONDS`, and what the rank started outside its group with it (SIGTERM
first): Open MPI kills the supervisor about 0.25 s after its SIGTERM, and
a rank whose supervisor dies before reaping it waits as a zombie under init, for seconds where
init reaps slowly. However it ends, the supervisor reaps its rank before it exits.

However the child ends, the supervisor sends the launcher an ``exit`` report
(:mod:`syncdp.watch.report`, which like :mod:`syncdp.base.settings` loads neither TensorFlow nor
MPI): ``code`` or ``signal``, and ``requested`` when the child was stopped because the job was
ending.

In elastic mode (``SYNCDP_ELASTIC=1``, or ``SYNCDP_MIN_NP`` and the like set) a child that fails
takes the supervisor with it by SIGKILL: Open MPI's ULFM treats a process killed by a signal as
a failed rank the others can recover from, while one that merely exits non-zero leaves them
waiting. Replacements spawned by a recovery run as ``python -m syncdp.launch.worker --replacement
LABEL COMMAND...``: their output lines carry ``LABEL`` plus their index among the ranks spawned
together (the original ranks are labelled 0..N-1), and the child finds that label in
``SYNCDP_REPLACEMENT``. The spawning rank puts the job's settings first (``--job-env JSON``,
:mod:`syncdp.membership.jobenv`): the supervisor takes them into its environment before it
reads anything, since Open MPI starts a spawned process with its host's environment only.
A warm spare rank 0 starts in the background (:mod:`syncdp.membership.refill`) runs as
``--replacement LABEL --spare COMMAND...``: the supervisor tells the launcher it is a spare (a
``spare_started`` report) before the program runs.

In elastic mode a process that stays stopped (SIGSTOP, a debugger) holds up every recovery,
which must shrink the job to the processes alive, and the end of the job, whose MPI_Finalize
waits for it under ULFM; it cannot end itself. So the supervisor watches its state: a warm spare
stopped for the stall timeout, or a rank stopped for :data:`_STOPPED_RANK_MARGIN_SECONDS` longer
(the ranks' own stall watchdog names a rank stalled in a collective first), is killed, which
ULFM sees as a lost process the job goes on without.

Before it starts its rank, the supervisor connects to the launcher's lifeline
(``SYNCDP_LIFELINE_ADDR``, :mod:`syncdp.launch.lifeline`); when the launcher cannot be reached it
starts nothing. The rank runs in its own process group. When the launcher is gone (its
lifeline closed: it ended, however it was killed; or silent past the stall timeout, at least
10 s, with its address refusing connections: a cut link), the supervisor ends the rank's process
group and what the rank started outside it (SIGTERM, then SIGKILL 2 s later), then Open MPI's
daemon above it (prterun or prted), then itself: nothing of a job outlives its launcher by
more than a few seconds, on any host.

What a rank starts dies with it too: once the rank has ended, the supervisor ends its process
group and every process the rank left behind outside it (a child in a session of its own: the
supervisor is the subreaper of its rank's descendants), SIGTERM then SIGKILL a second later.

Usage (by the launcher, not by hand): ``python -m syncdp.launch.worker COMMAND [ARGS...]``.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping

from syncdp.base import settings
from syncdp.launch.cleanup import _descendants
from syncdp.launch.lifeline import LIFELINE_VAR, Lifeline, lost_after
from syncdp.launch.output import CONTINUED, PIECE_BYTES, UNTERMINATED, Flow
from syncdp.membership import jobenv, spares
from syncdp.watch import report  # none imports TensorFlow or MPI

__all__ = ["main", "describe_exit"]

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _rank() -> str:
    for key in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"):
        if key in os.environ:
            return os.environ[key]
    return "?"


def _start_rank() -> None:
    """In the rank's process before exec: its own process group (so that it and whatever it
    starts can be ended together), and death with this supervisor."""
    os.setpgid(0, 0)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: the lifeline and the launcher's own cleanup still end the job
        pass


def _send_exit_report(
    rank: str, pid: int | None, returncode: int, requested: bool, message: str
) -> None:
    """Tells the launcher how the child ended, if there is a launcher; never raises."""
    report.send(
        "exit",
        int(rank) if rank.isdigit() else None,
        message,
        pid=pid,
        code=returncode if returncode >= 0 else None,
        signal=-returncode if returncode < 0 else None,
        requested=requested,
    )


# Open MPI's processes that may sit above a supervisor: the launcher's prterun on its own host,
# a daemon elsewhere.
_DAEMONS = frozenset({"prted", "prterun", "mpirun", "orted"})
# After SIGTERM, the rank's process group gets this long before SIGKILL.
_END_GRACE_SECONDS = 2.0
# Signals that ask the rank to end, and how long it gets before SIGKILL: shorter than the
# ~0.25 s between Open MPI's SIGTERM and SIGKILL to this supervisor, so that the supervisor
# reaps its rank before it is killed itself.
_ENDING_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_ASKED_GRACE_SECONDS = 0.1
# How long a supervisor leaving on its own waits for its rank, killed, to be reaped.
_REAP_SECONDS = 1.0
# Elastic mode: a rank stopped this much longer than the stall timeout is killed by its
# supervisor (a spare at the stall timeout itself); see the module docstring.
_STOPPED_RANK_MARGIN_SECONDS = 10.0
_STOPPED_POLL_SECONDS = 1.0
# What a rank started and left running when it ended gets this long after SIGTERM, then SIGKILL;
# the supervisor gives up on a process that outlives SIGKILL by _REAP_SECONDS (one stuck in
# the kernel).
_LEFTOVER_GRACE_SECONDS = 1.0
# Once the rank has ended, the supervisor forwards the rest of its output however long that
# takes (mpirun, behind a slow reader of the launcher's output, may take it slowly), and leaves
# only a pipe nothing has come through for this long (held open by a process that escaped).
_QUIET_OUTPUT_SECONDS = 5.0


def _become_subreaper() -> None:
    """Makes this supervisor, not init, the parent of what the rank starts and leaves behind
    when it ends (a process in a session of its own included), so that it can end it."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError, TypeError):  # not Linux: the process group still is ended
        pass


def _reap_children() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _end_leftovers(child: subprocess.Popen) -> None:
    """Ends what the rank started and left running, once the rank itself has ended: its process
    group, and every process below this supervisor (those that left the group stay here: see
    :func:`_become_subreaper`). SIGTERM, then SIGKILL after :data:`_LEFTOVER_GRACE_SECONDS`.
    A child still holding the rank's output pipes would otherwise keep this supervisor, and the
    job, from ever ending; and nothing of a job may outlive it."""
    me = os.getpid()
    kill_at = time.monotonic() + _LEFTOVER_GRACE_SECONDS
    give_up_at = kill_at + _REAP_SECONDS
    termed: set[int] = set()
    while True:
        _reap_children()
        # os.kill(-pgid) signals the rank's process group; then each process left below this
        # supervisor.
        targets = [-child.pid] if _signal_group(child.pid, 0) else []
        targets += [pid for pid in _descendants(me) if pid != me]
        now = time.monotonic()
        if not targets or now > give_up_at:
            return
        if now > kill_at:
            for pid in targets:
                _kill(pid, signal.SIGKILL)
        else:
            for pid in targets:
                if pid not in termed:
                    termed.add(pid)
                    _kill(pid, signal.SIGTERM)
                    _kill(pid, signal.SIGCONT)
        time.sleep(0.02)


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except OSError:
        pass


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _daemon_chain(supervisor: int) -> list[int]:
    """Open MPI's processes above ``supervisor`` (prted or prterun, and the remote shell's
    ``sh`` that ran a daemon)."""
    chain, pid = [], _parent(supervisor)
    while pid > 1 and _comm(pid) in _DAEMONS:
        chain.append(pid)
        pid = _parent(pid)
    if chain and _comm(chain[-1]) == "prted" and _comm(pid) == "sh":
        chain.append(pid)
    return chain


def _state(pid: int) -> str:
    """Process ``pid``'s state letter in /proc (R, S, T, t, Z, ...); "" when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (by a signal, or by a tracer)."""
    return _state(pid) in ("T", "t")


def _kill_when_stopped(child: subprocess.Popen, bound: float, who: str) -> None:
    """Kills ``child``'s process group once it has stayed stopped for ``bound`` seconds
    (elastic mode, see the module docstring); returns when the child has ended."""
    since = None
    while child.returncode is None:
        now = time.monotonic()
        if not _stopped(child.pid):
            since = None
        elif since is None:
            since = now
        elif now - since >= bound:
            try:
                print(
                    f"syncdp-run: {who} (pid {child.pid} on {socket.gethostname()}) has been "
                    f"stopped for {now - since:.0f} s; a stopped process holds up the job's "
                    "recoveries and its end, so it is killed and the job goes on without it.",
                    file=sys.stderr,
                    flush=True,
                )
            except OSError:
                pass
            _signal_group(child.pid, signal.SIGKILL)
            return
        time.sleep(_STOPPED_POLL_SECONDS)


def _started_as_spare(rank: str, env: Mapping[str, str]) -> bool:
    """Whether the process mpirun starts as world rank ``rank`` is a warm spare: one of the
    last ``--spares`` it starts."""
    try:
        return int(rank) >= int(env.get("OMPI_COMM_WORLD_SIZE", "0")) - spares.count(env)
    except ValueError:
        return False


def _signal_group(pgid: int, signum: int) -> bool:
    """Sends ``signum`` to a process group; False when the group is empty."""
    try:
        os.killpg(pgid, signum)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _share_cores(env: dict[str, str]) -> dict[str, str]:
    """``env`` with TensorFlow's intra-op threads set to this host's cores over its ranks.

    TensorFlow gives every process as many threads per op as the host has cores: N ranks on
    one host would run N times as many threads as cores, contending for them. Each rank gets
    its share instead (at least 1), unless the user set ``TF_NUM_INTRAOP_THREADS`` already.
    Warm spares on a single host are not counted: they wait without computing.
    """
    if "TF_NUM_INTRAOP_THREADS" in env:
        return env
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        local = max(1, int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1")))
        world = int(env.get("OMPI_COMM_WORLD_SIZE", "1"))
    except ValueError:
        local = world = 1
    if local == world:  # one host: its warm spares wait without computing (membership.spares)
        local = max(1, local - spares.count(env))
    env["TF_NUM_INTRAOP_THREADS"] = str(max(1, cores // local))
    return env


def _end_here(rank: str, child: subprocess.Popen, why: str) -> None:
    """The launcher is gone: ends this rank's process group, Open MPI above it, and this
    supervisor (never returns)."""
    try:
        print(
            f"syncdp-run: rank {rank} on {socket.gethostname()}: {why}; ending the rank.",
            file=sys.stderr,
            flush=True,
        )
    except OSError:  # Open MPI's daemon, which read our stderr, may be what is gone
        pass
    chain = _daemon_chain(os.getpid())
    _end_rank(child, _END_GRACE_SECONDS)
    _await_reaped(child, _REAP_SECONDS)
    # What the rank started outside its process group (not reaped here: the main thread
    # reaps the rank, and a wait for any child could take its status from it).
    _end_outside(child, _END_GRACE_SECONDS)
    for pid in chain:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    os._exit(1)


def _end_asked(child: subprocess.Popen) -> None:
    """Asked to end (the rank has the signal already): the rank's process group gets SIGCONT,
    then SIGKILL after :data:`_ASKED_GRACE_SECONDS`, and so does what the rank started
    outside it (SIGTERM first), before Open MPI kills this supervisor
    (:func:`_end_leftovers`, after the rank has ended, would come too late)."""
    threading.Thread(target=_end_outside, args=(child, _ASKED_GRACE_SECONDS), daemon=True).start()
    _end_rank(child, _ASKED_GRACE_SECONDS, None)


def _end_outside(child: subprocess.Popen, grace: float) -> None:
    """SIGTERM and SIGCONT to every process below this supervisor but the rank (a child the
    rank started in a session of its own), then SIGKILL after ``grace`` seconds. Reaps
    nothing."""
    outside = _outside_rank(child)
    if not outside:
        return
    for pid in outside:
        _kill(pid, signal.SIGTERM)
        _kill(pid, signal.SIGCONT)
    time.sleep(grace)  # one look at /proc after it: a scan costs about as much as the grace
    for pid in _outside_rank(child):
        _kill(pid, signal.SIGKILL)


def _outside_rank(child: subprocess.Popen) -> list[int]:
    """The live processes below this supervisor but the rank itself."""
    me = os.getpid()
    return [p for p in _descendants(me) if p not in (me, child.pid) and _state(p) not in ("", "Z")]


def _end_rank(child: subprocess.Popen, grace: float, signum: int | None = signal.SIGTERM) -> None:
    """Ends the rank's process group: ``signum`` (if any) and SIGCONT, then SIGKILL once the
    rank is reaped or ``grace`` seconds have passed.

    The main thread reaps the rank (it waits in ``child.wait()``, which holds the lock that
    ``poll()`` needs): from any other thread, ``returncode`` says it was reaped. A process
    group that is gone (no rank, nothing it started) needs nothing.
    """
    if signum is not None and not _signal_group(child.pid, signum):
        return
    if not _signal_group(child.pid, signal.SIGCONT):  # a stopped rank acts on nothing else
        return
    deadline = time.monotonic() + grace
    while child.returncode is None and time.monotonic() < deadline:
        time.sleep(0.01)
    _signal_group(child.pid, signal.SIGKILL)  # what is left of the group: the job is ending


def _await_reaped(child: subprocess.Popen, seconds: float) -> None:
    """Waits up to ``seconds`` for the main thread to reap the rank (see :func:`_end_rank`)."""
    deadline = time.monotonic() + seconds
    while child.returncode is None and time.monotonic() < deadline:
        time.sleep(0.01)


def _pump(source, sink, prefix: bytes, flow: Flow | None = None) -> None:
    flow = Flow() if flow is None else flow
    for line in iter(source.readline, b""):
        flow.moved = time.monotonic()
        ending = b""
        if not line.endswith(b"\n"):
            # The rank's last words, unterminated: mpirun would run them into the next line
            # it forwards, which may be another rank's. Marked, so its file keeps them as they
            # are.
            ending = UNTERMINATED + b"\n"
        # Open MPI forwards a line in time quadratic in its length (a 10 MiB line took 20 s):
        # a long line crosses in pieces, each but the last marked, and the launcher joins them.
        pieces = [line[i : i + PIECE_BYTES] for i in range(0, len(line), PIECE_BYTES)]
        pieces[-1] += ending
        flow.writes(+1)  # mpirun may be slow to take it (behind a slow reader): still moving
        try:
            for piece in pieces[:-1]:
                sink.write(prefix + piece + CONTINUED + b"\n")
            sink.write(prefix + pieces[-1])
            sink.flush()
        finally:
            flow.writes(-1)
    source.close()


def describe_exit(returncode: int) -> str:
    """Words for how a process ended, from a ``subprocess`` return code."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown signal"
        if -returncode == signal.SIGALRM:
            name += ": in elastic mode, syncdp's bound on an MPI_Finalize that hangs at exit"
        return f"was killed by signal {-returncode} ({name})"
    return f"exited with code {returncode}"


def _widen_environment(env: dict[str, str], label: str) -> None:
    """A spawned process (replacement or new spare) labelled ``label``: asks the launcher for
    the environment it gave the first ranks and puts it into ``env`` under the job's carried
    values (see :mod:`syncdp.membership.jobenv`); says so in one line when no answer comes."""
    launchers = report.ask(jobenv.REQUEST, int(label))
    if isinstance(launchers, dict):
        jobenv.widen(env, launchers)
        return
    print(
        f"syncdp-run: [{label}]: the launcher did not answer with its environment; this "
        "process starts with the job's settings, PATH, PYTHONPATH, LD_LIBRARY_PATH, TF_* "
        "and -x variables only.",
        file=sys.stderr,
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    """Runs ``argv`` as this rank's program; returns the exit status for mpirun.

    Args:
        argv: The command and its arguments. Defaults to ``sys.argv[1:]``.

    Returns:
        The child's exit code, 128 + the signal number if a signal ended it, 127 if it was not
        found and 126 if it could not be run (as a shell), 2 without a command.
    """
    argv = sys.argv[1:] if argv is None else argv
    # A spawned process: the job's settings first, before anything reads one (Open MPI started
    # it with its host's environment, which a remote shell leaves bare).
    argv = jobenv.apply(argv, os.environ)
    if not argv:
        print("usage: python -m syncdp.launch.worker COMMAND [ARGS...]", file=sys.stderr)
        return 2
    rank = _rank()
    config = settings.from_env_or_default()
    lifeline = None
    address, job = os.environ.get(LIFELINE_VAR), report.Job.from_env()
    if address and job is not None:
        try:
            lifeline = Lifeline.connect(address, job)
        except (OSError, ValueError) as e:
            print(
                f"syncdp-run: rank {rank}: the launcher's lifeline at {address} cannot be "
                f"reached ({e}); the launcher is gone, so the program is not started.",
                file=sys.stderr,
                flush=True,
            )
            return 1
    env = _share_cores(dict(os.environ))
    new_spare = False
    spare = _started_as_spare(rank, env)
    if argv[0] == "--replacement" and len(argv) > 2:
        spare = False
        rank = str(int(argv[1]) + (int(rank) if rank.isdigit() else 0))
        argv = argv[2:]
        if lifeline is not None:
            _widen_environment(env, rank)
        env["SYNCDP_REPLACEMENT"] = rank
        if argv[0] == "--spare" and len(argv) > 1:  # a spare rank 0 starts in the background
            argv = argv[1:]
            env[spares.NEW_SPARE_VAR] = "1"
            new_spare = spare = True
    elastic = config.elastic
    _become_subreaper()
    try:
        child = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=_start_rank,
            env=env,
        )
    except OSError as e:
        message = f"rank {rank} could not start {argv[0]!r}: {e}"
        print(f"syncdp-run: {message}", file=sys.stderr, flush=True)
        # As a shell: 127 for a command not found, 126 for one found but not runnable.
        code = 127 if isinstance(e, FileNotFoundError) else 126
        _send_exit_report(rank, None, code, False, message)
        return code
    if new_spare:  # before anything can end it: its exit is a spare's, never the job's
        report.send("spare_started", int(rank), pid=child.pid)
    if elastic and config.stall_timeout > 0:
        bound = config.stall_timeout
        who = f"spare [{rank}]" if spare else f"rank [{rank}]"
        if not spare:
            bound += _STOPPED_RANK_MARGIN_SECONDS
        threading.Thread(target=_kill_when_stopped, args=(child, bound, who), daemon=True).start()
    if lifeline is not None:
        lifeline.start(
            int(rank) if rank.isdigit() else None,
            child.pid,
            lost_after=lost_after(config.stall_timeout),
            on_lost=lambda why: _end_here(rank, child, why),
        )

    forwarded: list[int] = []
    ending: list[int] = []  # the first signal that asked the rank to end, once sent on

    def forward(signum, frame):
        if child.poll() is None:
            forwarded.append(signum)
            child.send_signal(signum)
            if signum in _ENDING_SIGNALS and not ending:
                ending.append(signum)
                threading.Thread(target=_end_asked, args=(child,), daemon=True).start()

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(signum, forward)
    # Daemons: a process the rank started may hold its output pipes open after it ended, and
    # the interpreter must not wait for them at exit (_end_leftovers ends such a process).
    flow = Flow()
    pumps = [
        threading.Thread(
            target=_pump,
            args=(child.stdout, sys.stdout.buffer, f"[{rank}]<stdout>:".encode(), flow),
            daemon=True,
        ),
        threading.Thread(
            target=_pump,
            args=(child.stderr, sys.stderr.buffer, f"[{rank}]<stderr>:".encode(), flow),
            daemon=True,
        ),
    ]
    for p in pumps:
        p.start()
    returncode = child.wait()
    where = f"(pid {child.pid} on {socket.gethostname()})"
    if returncode != 0 and forwarded:
        # Stopped on request (mpirun ending the job because another rank failed, or Ctrl-C):
        # not a failure of this rank, so not worded as one (the launcher reports the first).
        name = signal.Signals(forwarded[0]).name
        message = (
            f"stopped rank {rank} {where} with {name} as the job ends; it "
            f"{describe_exit(returncode)}."
        )
    else:
        message = f"rank {rank} {where} {describe_exit(returncode)}."
    # When the job is ending, mpirun may kill this supervisor at any moment (at once, when
    # the launcher was killed), and its output pipes may already be gone: what the rank left
    # outside its process group is asked to end first (only this supervisor can reach it),
    # then the launcher is told, then the leftovers are killed.
    for pid in _outside_rank(child):
        _kill(pid, signal.SIGTERM)
        _kill(pid, signal.SIGCONT)
    _send_exit_report(rank, child.pid, returncode, bool(forwarded), message)
    _end_leftovers(child)
    # The rest of the rank's output, however long mpirun takes to take it. The quiet limit
    # counts from here: a rank silent for hours may have written its last lines as it ended.
    flow.moved = time.monotonic()
    for p in pumps:
        while p.is_alive() and flow.active(within=_QUIET_OUTPUT_SECONDS):
            p.join(timeout=0.2)
    if returncode != 0:
        try:
            print(f"syncdp-run: {message}", file=sys.stderr, flush=True)
        except OSError:  # mpirun is gone: nobody reads this any more
            pass
    if elastic and returncode != 0 and not forwarded:
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)  # a failed rank, for ULFM (see the docstring)
    return returncode if returncode >= 0 else 128 - returncode


if __name__ == "__main__":
    sys.exit(main())
