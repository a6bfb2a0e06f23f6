"""The per-rank supervisor that ``syncdp-run`` asks mpirun to start on every slot.

It runs the user's command as a child process, prefixes each line the child writes with the
rank (``[1]<stdout>:``), forwards termination signals to it, and when the child fails says
which rank it was and how it ended (exit code or signal) before exiting non-zero itself, which
makes mpirun end every other rank. The child is started with a parent-death signal, so it can
never outlive this supervisor.

However the child ends, the supervisor sends the launcher an ``exit`` report
(:mod:`syncdp.core.report`, which like :mod:`syncdp.core.settings` loads neither TensorFlow nor
MPI): ``code`` or ``signal``, and ``requested`` when the child was stopped because the job was
ending.

In elastic mode (``SYNCDP_ELASTIC=1``, or ``SYNCDP_MIN_NP`` and the like set) a child that fails
takes the supervisor with it by SIGKILL: Open MPI's ULFM treats a process killed by a signal as
a failed rank the others can recover from, while one that merely exits non-zero leaves them
waiting. Replacements spawned by a recovery run as ``python -m launch.worker --replacement LABEL
COMMAND...``: their output lines carry ``LABEL`` plus their index among the ranks spawned
together (the original ranks are labelled 0..N-1), and the child finds that label in
``SYNCDP_REPLACEMENT``.

On a host other than the launcher's, each supervisor also leaves a lifeline watcher (a small
detached process): when the launcher's report address stops answering for the stall timeout
(at least 10 s) while Open MPI's daemon still runs, the watcher kills the daemon, this
supervisor and so its rank. A host whose link was cut thus ends its part of the job by itself:
Open MPI's daemons do not notice a launcher that vanished.

Usage (by the launcher, not by hand): ``python -m launch.worker COMMAND [ARGS...]``.
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

from syncdp.core import report, settings  # neither imports TensorFlow or MPI

__all__ = ["main", "describe_exit"]

_PR_SET_PDEATHSIG = 1


def _rank() -> str:
    for key in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"):
        if key in os.environ:
            return os.environ[key]
    return "?"


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: the launcher's own cleanup still ends the job
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


# The lifeline watcher checks the launcher this often, and gives up on it after the stall
# timeout, but never sooner than this.
_LIFELINE_POLL_SECONDS = 1.0
_LIFELINE_MIN_LOST_SECONDS = 10.0


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=_LIFELINE_POLL_SECONDS):
            return True
    except OSError:
        return False


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
    """Open MPI's daemon processes above ``supervisor`` (prted, and the shell that ran it)."""
    chain, pid = [], _parent(supervisor)
    while pid > 1 and _comm(pid) == "prted":
        chain.append(pid)
        pid = _parent(pid)
    if chain and _comm(pid) == "sh":
        chain.append(pid)
    return chain


def _start_lifeline(address: str, lost_after: float) -> None:
    """Leaves a detached watcher that ends this host's part of the job if the launcher at
    ``address`` stays unreachable for ``lost_after`` seconds (see the module docstring)."""
    host, _, port = address.rpartition(":")
    if host in ("127.0.0.1", "localhost") or not port.isdigit():
        return  # the launcher is on this host: it ends everything itself
    supervisor = os.getpid()
    chain = _daemon_chain(supervisor)
    if not chain:
        return
    first = os.fork()
    if first:
        os.waitpid(first, 0)
        return
    os.setsid()
    if os.fork():
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    lost_since = None
    while True:
        time.sleep(_LIFELINE_POLL_SECONDS)
        if not os.path.exists(f"/proc/{chain[0]}"):
            os._exit(0)  # the daemon is gone: the job ended
        if _reachable(host, int(port)):
            lost_since = None
            continue
        lost_since = lost_since or time.monotonic()
        if time.monotonic() - lost_since >= lost_after:
            for pid in (supervisor, *chain):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            os._exit(0)


def _pump(source, sink, prefix: bytes) -> None:
    for line in iter(source.readline, b""):
        sink.write(prefix + line)
        sink.flush()
    source.close()


def describe_exit(returncode: int) -> str:
    """Words for how a process ended, from a ``subprocess`` return code."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown signal"
        return f"was killed by signal {-returncode} ({name})"
    return f"exited with code {returncode}"


def main(argv: list[str] | None = None) -> int:
    """Runs ``argv`` as this rank's program; returns the exit status for mpirun.

    Args:
        argv: The command and its arguments. Defaults to ``sys.argv[1:]``.

    Returns:
        The child's exit code, 128 + the signal number if a signal ended it, 127 if it could
        not be started, 2 without a command.
    """
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m launch.worker COMMAND [ARGS...]", file=sys.stderr)
        return 2
    rank = _rank()
    config = settings.from_env_or_default()
    address = os.environ.get(report.ADDRESS_VAR)
    if address:
        _start_lifeline(address, max(_LIFELINE_MIN_LOST_SECONDS, config.stall_timeout))
    env = None
    if argv[0] == "--replacement" and len(argv) > 2:
        rank = str(int(argv[1]) + (int(rank) if rank.isdigit() else 0))
        argv = argv[2:]
        env = {**os.environ, "SYNCDP_REPLACEMENT": rank}
    elastic = config.elastic
    try:
        child = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=_die_with_parent,
            env=env,
        )
    except OSError as e:
        message = f"rank {rank} could not start {argv[0]!r}: {e}"
        print(f"syncdp-run: {message}", file=sys.stderr, flush=True)
        _send_exit_report(rank, None, 127, False, message)
        return 127

    forwarded: list[int] = []

    def forward(signum, frame):
        if child.poll() is None:
            forwarded.append(signum)
            child.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(signum, forward)
    pumps = [
        threading.Thread(
            target=_pump, args=(child.stdout, sys.stdout.buffer, f"[{rank}]<stdout>:".encode())
        ),
        threading.Thread(
            target=_pump, args=(child.stderr, sys.stderr.buffer, f"[{rank}]<stderr>:".encode())
        ),
    ]
    for p in pumps:
        p.start()
    returncode = child.wait()
    for p in pumps:
        p.join(timeout=5)
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
    if returncode != 0:
        print(f"syncdp-run: {message}", file=sys.stderr, flush=True)
    _send_exit_report(rank, child.pid, returncode, bool(forwarded), message)
    if elastic and returncode != 0 and not forwarded:
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)  # a failed rank, for ULFM (see the docstring)
    return returncode if returncode >= 0 else 128 - returncode


if __name__ == "__main__":
    sys.exit(main())
