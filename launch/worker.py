"""The per-rank supervisor that ``syncdp-run`` asks mpirun to start on every slot.

It runs the user's command as a child process, prefixes each line the child writes with the
rank (``[1]<stdout>:``), forwards termination signals to it, and when the child fails says
which rank it was and how it ended (exit code or signal) before exiting non-zero itself, which
makes mpirun end every other rank. The child is started with a parent-death signal, so it can
never outlive this supervisor.

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
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m launch.worker COMMAND [ARGS...]", file=sys.stderr)
        return 2
    rank = _rank()
    try:
        child = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_die_with_parent
        )
    except OSError as e:
        print(
            f"syncdp-run: rank {rank} could not start {argv[0]!r}: {e}", file=sys.stderr, flush=True
        )
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
        print(
            f"syncdp-run: stopped rank {rank} {where} with {name} as the job ends; it "
            f"{describe_exit(returncode)}.",
            file=sys.stderr,
            flush=True,
        )
    elif returncode != 0:
        print(
            f"syncdp-run: rank {rank} {where} {describe_exit(returncode)}.",
            file=sys.stderr,
            flush=True,
        )
    return returncode if returncode >= 0 else 128 - returncode


if __name__ == "__main__":
    sys.exit(main())
