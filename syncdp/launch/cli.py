"""``syncdp-run``'s command line: flags, ``--config-file`` and the environment, checked and
turned into one :class:`LaunchConfig` before anything starts (:func:`parse_args`).

The command line is horovodrun's: every flag of horovodrun 0.28 is accepted with Horovod's
spelling and argument type (:mod:`syncdp.launch.horovodrun_flags` has the table).
:mod:`syncdp.launch.run` turns the LaunchConfig into mpirun's environment and command and runs
the job.

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
                               DIR/rank.N/stderr (:mod:`syncdp.launch.output`)
    --prefix-output-with-timestamp
                               every output line starts with the time it arrived
    --config-file FILE         horovodrun's YAML settings; flags on the command line win
                               (:mod:`syncdp.launch.config_file`)
    --log-level LEVEL          the launcher's own verbosity: TRACE and DEBUG print the mpirun
                               command; ERROR and FATAL leave out its notes and timing table
    --version, --check-build   print syncdp's version, or what this install supports, and exit
    --spares K                 elastic mode: K warm spares (see below)

Every other flag is a row of :data:`syncdp.base.settings.SETTINGS` and sets exactly that row's
``SYNCDP_*`` variable on every rank (flags ending in ``-mb`` take MiB; the variable holds
bytes). ``syncdp-run --help`` lists them with their defaults. Each setting is resolved once, here:
the command line, then ``--config-file``, then the launcher's ``SYNCDP_*`` variable; the launcher
acts on that value (``SYNCDP_MIN_NP`` in the environment makes the job elastic, mpirun included)
and exports it to every rank, a false boolean too (``--no-autotune`` beats an inherited
``SYNCDP_AUTOTUNE=1``). Every value, given as a flag or
as a ``SYNCDP_*`` variable in the launcher's environment or a key of ``--config-file``, is
checked before anything starts
(:func:`syncdp.base.settings.validate`, the check ``init()`` also runs): NaN, infinity, text
where a number belongs, a value below the minimum, or an unknown ``SYNCDP_*`` name exits 2
with one line naming it, the value and what is allowed. horovodrun's spellings of settings
flags (``--stall-check-shutdown-time-seconds`` for ``--stall-timeout``,
``--stall-check-warning-time-seconds`` for ``--stall-warning``, ``--min-num-proc``,
``--max-num-proc``, ``--no-hierarchical-allreduce``) set the same variables; ``--no-stall-check``
sets SYNCDP_STALL_TIMEOUT=0 and SYNCDP_STALL_WARNING=0.

Warm spares: ``--spares K`` (elastic mode only; exit 2 otherwise) starts K more processes than
``-np``. They run the program up to ``syncdp.init()`` and wait there, so a lost rank is replaced
by a process that has TensorFlow and the program's imports loaded already, instead of a spawned
one that must load them (:mod:`syncdp.membership.spares`). Their output is labelled after the ranks'
(``[N]`` to ``[N+K-1]``); a spare that becomes a rank keeps its label. Spares hold slots: with
``-H`` or ``--hostfile``, ``-np`` plus ``--spares`` must fit in the hosts' slots. A spare that dies
while waiting is logged and is not a failure; when training ends, rank 0 releases the spares,
which exit 0 without running the rest of the program. The ranks learn K from SYNCDP_SPARES.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import shutil
import sys
import types
from collections.abc import Mapping
from typing import Any

from syncdp.base import settings
from syncdp.base.errors import ConfigError
from syncdp.launch import check_build, config_file, horovodrun_flags
from syncdp.launch import hosts as _hosts

__all__ = ["LaunchConfig", "LOG_LEVELS", "TCP_ONLY", "build_parser", "parse_args"]

# The settings that switch elastic mode on.
_ELASTIC_SETTINGS = ("elastic", *settings.ELASTIC_IMPLIED_BY)


def _is_elastic(given: Mapping[str, Any]) -> bool:
    """Whether settings ``given`` by name make the job elastic (ULFM; lost ranks replaced)."""
    return any(given.get(name) for name in _ELASTIC_SETTINGS)


# horovodrun's --log-level words (the launcher says more at TRACE and DEBUG, less at ERROR and
# FATAL).
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")
# --tcp: Open MPI's point-to-point over its TCP and shared-memory transports only, and no UCX
# one-sided component, so nothing between hosts goes over RDMA.
TCP_ONLY = ("--mca", "pml", "ob1", "--mca", "btl", "self,sm,tcp", "--mca", "osc", "^ucx")


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Everything the launcher was asked to do.

    Attributes:
        num_proc: Number of ranks.
        command: The program and its arguments, run on every rank.
        hosts: mpirun's ``--host`` value, or None.
        hostfile: mpirun's ``--hostfile`` value, or None.
        settings: Every setting a flag, a ``--config-file`` key or a ``SYNCDP_*`` variable of
            the launcher's environment sets, in that precedence, by setting name
            (``stall_timeout``), each in the flag's unit (MiB for the ``-mb`` flags); settings
            set nowhere are absent. The launcher acts on these and exports each of them
            (:func:`syncdp.base.settings.launcher_env`), so the ranks read the same values.
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
        slots_per_host: The slots of a host listed without a count, on ``-H``, in the
            hostfile or by the discovery script (``--slots-per-host``), or None for one.
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
    slots_per_host: int | None = None
    slurm_nodes: bool = False

    @property
    def multihost(self) -> bool:
        """Whether hosts were named (the job may span machines)."""
        return bool(self.hosts or self.hostfile)

    @property
    def elastic(self) -> bool:
        """Whether the job runs in elastic mode (ULFM; lost ranks are replaced)."""
        return _is_elastic(self.settings)


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


def _version(prog: str) -> str:
    """What ``--version`` prints: syncdp's version, and under Horovod's name, which one runs."""
    from syncdp import __version__

    if prog != "horovodrun":
        return __version__
    return f"horovodrun from syncdp {__version__} (syncdp-run; Horovod is not installed)"


def _add_launcher_flags(p: argparse.ArgumentParser) -> None:
    """The launcher's own flags: where and how mpirun starts the ranks, and their output."""
    p.add_argument(
        "-v",
        "--version",
        action="version",
        version=_version(p.prog),
        help="print syncdp's version and exit",
    )
    p.add_argument(
        "-np",
        "--num-proc",
        dest="num_proc",
        type=int,
        metavar="N",
        help="number of ranks (default: the listed hosts' slots, or the Slurm allocation's tasks)",
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
        help="slots of a host listed without a count by -H, --hostfile or the discovery "
        "script (default 1)",
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
        help="no RDMA between hosts: mpirun gets " + " ".join(TCP_ONLY),
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


def build_parser(prog: str = "syncdp-run") -> argparse.ArgumentParser:
    """The argument parser: the launcher's own flags, one flag per setting (with horovodrun's
    spellings of it), and horovodrun's other flags (:mod:`syncdp.launch.horovodrun_flags`).

    Args:
        prog: The command's name in usage, errors and ``--version``: ``syncdp-run`` or
            ``horovodrun`` (:mod:`syncdp.launch.horovodrun`). Defaults to ``"syncdp-run"``.

    Returns:
        A parser whose settings flags store into ``dest`` = the setting's name, None when the
        flag is not given.
    """
    p = argparse.ArgumentParser(
        prog=prog,
        description="Run a program on N synchronous data-parallel ranks through mpirun.",
        usage=f"{prog} -np N [options] COMMAND [ARGS...]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "examples:\n"
            f"  {prog} -np 2 python examples/train.py\n"
            f"  {prog} -np 4 -H host1:2,host2:2 python train.py\n"
            f"  {prog} -np 4 --min-np 2 --spares 1 python train.py   # elastic\n"
            "\nEvery flag of horovodrun 0.28 is accepted: docs/horovodrun-flags.md. The settings "
            "and\ntheir SYNCDP_* variables: docs/settings.md. The guide: README.md."
        ),
    )
    _add_launcher_flags(p)
    group = p.add_argument_group(
        "settings", "each sets one SYNCDP_* variable on every rank (syncdp.base.settings)"
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
            metavar = "FILE"  # every free-text setting names a file or a program
        elif s.flag_unit == settings.MiB:
            metavar = "MiB"  # fractions of a MiB are fine: the variable is bytes
        else:
            metavar = s.type.__name__.upper()
        group.add_argument(*spellings, dest=s.name, metavar=metavar, help=_setting_help(s))
    horovodrun_flags.add_arguments(p)
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    return p


def _setting_error(message: str, prog: str = "syncdp-run") -> None:
    """Exits 2 with one line: a setting's value is not allowed."""
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def _check_settings(
    args: argparse.Namespace,
    environ: Mapping[str, str],
    spelled: Mapping[str, str],
    prog: str = "syncdp-run",
) -> dict[str, Any]:
    """Every setting's value, from its flag, its ``--config-file`` key, the caller's
    ``SYNCDP_*`` variable or Horovod's (``HOROVOD_TIMELINE``, ...: :data:`syncdp.base.settings.
    HOROVOD_VARS` and ``HOROVOD_SWITCHES``), in that precedence, checked before anything
    starts; exits 2 naming the first one not allowed, as it was given (the flag's spelling, the
    config file's key, or the variable).

    Returns:
        The settings, resolved once (:func:`syncdp.base.settings.resolve`), by name, in the
        flag's unit: what the launcher acts on and exports to every rank.
    """
    given = {}
    try:
        for s in settings.SETTINGS:
            value = getattr(args, s.name)
            if value is not None:
                spelling = spelled.get(s.name)
                given[s.name] = settings.validate(s, value, source="flag", spelling=spelling)
        # The variables the ranks would inherit, except those a flag replaces: unknown names
        # and bad values are found here, not by every rank after it has loaded TensorFlow.
        flagged = {s.env for s in settings.SETTINGS if s.name in given}
        flagged |= {k for k, (name, _) in settings.HOROVOD_VARS.items() if name in given}
        flagged |= {k for k, sets in settings.HOROVOD_SWITCHES.items() if set(sets) <= set(given)}
        horovods = set(settings.HOROVOD_VARS) | set(settings.HOROVOD_SWITCHES)
        inherited = {k: v for k, v in environ.items() if k.startswith("SYNCDP_")}
        inherited |= {k: v for k, v in environ.items() if k in horovods}
        unflagged = {k: v for k, v in inherited.items() if k not in flagged}
        settings.from_env(unflagged)
        resolved = settings.resolve(given, unflagged)
        # What the ranks will read, exactly: a file rank 0 could not write (the autotune log)
        # is found here too.
        settings.from_env(settings.launcher_env(resolved))
    except ConfigError as e:
        _setting_error(str(e), prog)
    return resolved


def _split_words(parser: argparse.ArgumentParser, flag: str, text: str) -> tuple[str, ...]:
    """``text`` split as a shell splits it; a usage error (not a traceback) for a quote left
    open."""
    try:
        return tuple(shlex.split(text))
    except ValueError as e:
        parser.error(f'{flag} {text!r}: {e}: close the quote, or escape it (\\")')


def parse_args(
    argv: list[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    prog: str = "syncdp-run",
) -> LaunchConfig:
    """Parses the command line into a LaunchConfig; exits 2 with a message on a bad one.

    Every setting is checked here, flags, ``--config-file`` keys and ``SYNCDP_*`` variables
    alike (NaN, infinity, text where a number belongs, values below the minimum, unknown
    variable names), before anything starts; so are horovodrun's flags that ask for what syncdp
    does not do (``--gloo``, ``--jsrun``). ``--version`` and ``--check-build`` print and exit 0.

    Args:
        argv: The arguments after the program name. Defaults to ``sys.argv[1:]``.
        environ: The environment the ranks will inherit. Defaults to ``os.environ``.
        prog: The command's name (:func:`build_parser`). Defaults to ``"syncdp-run"``.

    Returns:
        The LaunchConfig.
    """
    environ = os.environ if environ is None else environ
    parser = build_parser(prog)
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
        _setting_error(str(e), prog)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        parser.error("missing the command to run, e.g. syncdp-run -np 2 python train.py")
    if args.slots_per_host is not None and args.slots_per_host < 1:
        parser.error(f"--slots-per-host must be at least 1; got {args.slots_per_host}")
    if args.hostfile and os.path.isdir(args.hostfile):
        parser.error(f"--hostfile {args.hostfile!r} is a directory, not a hostfile")
    if args.hostfile and not os.path.isfile(args.hostfile):
        parser.error(f"--hostfile {args.hostfile!r} does not exist")
    try:
        listed = _hosts.listed(args.hosts, args.hostfile, slots_per_host=args.slots_per_host)
    except _hosts.HostError as e:
        parser.error(str(e))
    if listed and (args.slots_per_host is not None or args.hostfile):
        # Every host with the slots counted here, on mpirun's --host: mpirun counts one slot
        # for a -H host without a count, but every core for a hostfile line without slots=
        # (ranks piled onto the first host), and max_slots= as slots.
        args.hosts, args.hostfile = _hosts.format_hosts(listed), None
    slots = sum(h.slots for h in listed) if listed else None
    if args.num_proc is None:
        if slots is not None:
            args.num_proc = slots
        elif environ.get("SLURM_NTASKS", "").isdigit():
            args.num_proc = int(environ["SLURM_NTASKS"])  # the allocation decides
        else:
            parser.error("-np is required outside a Slurm allocation and without hosts")
    if args.num_proc < 1:
        parser.error(f"-np must be at least 1; got {args.num_proc}")
    if slots is not None and args.num_proc > slots:
        # As horovodrun and mpirun refuse it: the slots a user lists are what the job may use
        # (oversubscription is for a job on this host given no hosts).
        parser.error(
            f"-np {args.num_proc} needs {args.num_proc} slots, and the hosts listed have "
            f"{slots} ({_hosts.format_hosts(listed)}); add slots (HOST:N) or use a smaller -np"
        )
    allocated = _slurm_tasks(environ) if slots is None else None
    if allocated is not None and args.num_proc > allocated:
        # mpirun takes the hosts from the allocation, and would put the extra ranks on its
        # nodes beyond their tasks (syncdp-run lets ranks outnumber cores on this host only).
        parser.error(
            f"-np {args.num_proc} needs {args.num_proc} slots, and the Slurm allocation's nodes "
            f"have {allocated} tasks (SLURM_TASKS_PER_NODE="
            f"{environ['SLURM_TASKS_PER_NODE']}); ask Slurm for more tasks or use a smaller -np"
        )
    if args.ssh_port is not None and not 0 < args.ssh_port < 65536:
        parser.error(f"--ssh-port must be a TCP port (1-65535); got {args.ssh_port}")
    if args.ssh_identity_file and not os.path.isfile(args.ssh_identity_file):
        parser.error(f"--ssh-identity-file {args.ssh_identity_file!r} does not exist")
    if args.ssh_identity_file and any(c.isspace() for c in args.ssh_identity_file):
        # Open MPI splits its ssh arguments (plm_ssh_args) at spaces, quotes or not.
        parser.error(
            f"--ssh-identity-file {args.ssh_identity_file!r} holds a space, which Open MPI "
            "cannot pass to ssh; link the key from a path without one"
        )
    resolved = _check_settings(args, environ, spelled, prog)
    for var in settings.HOROVOD_VARS_WITHOUT_EFFECT:
        if var in environ:
            notes.append(
                f"{var} is Horovod's and changes nothing here; docs/settings.md lists the "
                "settings syncdp has"
            )
    if args.slots_per_host is not None and not listed:
        if not resolved.get("host_discovery_script"):
            notes.append(
                "--slots-per-host changes nothing without -H, --hostfile or "
                "--host-discovery-script: it gives the slots of hosts they list without a count"
            )
    # Each flag sets only its own variable; the ranks read -np's defaults from the job's size.
    least = spelled.get("min_np") or _origin("min_np", args)
    most = spelled.get("max_np") or _origin("max_np", args)
    if (resolved.get("min_np") or 0) > args.num_proc:
        parser.error(f"{least} ({resolved['min_np']}) must not exceed -np ({args.num_proc})")
    if resolved.get("max_np") and resolved["max_np"] < args.num_proc:
        parser.error(f"{most} ({resolved['max_np']}) must be at least -np ({args.num_proc})")
    slurm_nodes = False  # the hosts are the Slurm allocation's nodes, by Slurm's names
    if not listed and _is_elastic(resolved):
        # An elastic job restarts without a host it loses only on hosts it knows: in a Slurm
        # allocation of several nodes, its nodes and their tasks, as mpirun would read them.
        listed = _hosts.slurm_allocation(environ)
        if listed:
            slurm_nodes = True
            args.hosts = _hosts.format_hosts(listed)
            notes.append(
                f"elastic: the hosts are the Slurm allocation's nodes ({args.hosts}), so the "
                "job can start again without a node it loses"
            )
    _check_elastic_limits(spelled, resolved, args.num_proc, prog)
    _check_spares(args.spares, args.num_proc, resolved, listed, prog)
    mpi_args = _split_words(parser, "--mpi-args", args.mpi_args)
    binding_args = _split_words(parser, "--binding-args", args.binding_args)
    return LaunchConfig(
        num_proc=args.num_proc,
        command=tuple(command),
        hosts=args.hosts,
        hostfile=args.hostfile,
        settings=types.MappingProxyType(resolved),
        mpi_args=mpi_args,
        ssh_port=args.ssh_port,
        ssh_identity_file=args.ssh_identity_file,
        network_interfaces=tuple(args.network_interfaces or ()),
        tcp=args.tcp,
        binding_args=binding_args,
        output_filename=args.output_filename,
        timestamps=args.timestamps,
        log_level=args.log_level or "WARNING",
        notes=tuple(notes + horovodrun_flags.notes(args, spelled)),
        spares=args.spares,
        slots_per_host=args.slots_per_host,
        slurm_nodes=slurm_nodes,
    )


def _slurm_tasks(environ: Mapping[str, str]) -> int | None:
    """The tasks of the Slurm allocation of two or more nodes this runs in; None elsewhere (on
    one node, as on any one host, ranks may outnumber its tasks)."""
    nodes = environ.get("SLURM_JOB_NUM_NODES", "")
    if not nodes.isdigit() or int(nodes) < 2:
        return None
    tasks = _hosts.parse_tasks_per_node(environ.get("SLURM_TASKS_PER_NODE", ""))
    return sum(tasks) if tasks else None


def _origin(name: str, args: argparse.Namespace) -> str:
    """How an error names a setting that no flag spelled: its flag, or its variable when the
    value came from the environment."""
    s = next(s for s in settings.SETTINGS if s.name == name)
    return s.flag if getattr(args, name) is not None else s.env


def _check_elastic_limits(
    spelled: Mapping[str, str], given: Mapping[str, Any], num_proc: int, prog: str
) -> None:
    """Exits 2 with one line when an elastic limit was spelled out but means nothing: 0 for
    --min-np or --max-np (the variables' "unset"; as a flag it turned elastic mode off
    silently), or --reset-limit without elastic mode."""
    for name, meaning in (
        ("min_np", "fewest ranks the job goes on with"),
        ("max_np", "most ranks the job grows to"),
    ):
        if name in spelled and given.get(name) == 0:
            _setting_error(
                f"{spelled[name]} 0: the {meaning} must be at least 1; give a number from 1 "
                f"(e.g. {spelled[name]} {num_proc}), or leave it out to use -np",
                prog,
            )
    if "reset_limit" in spelled and not _is_elastic(given):
        _setting_error(
            f"{spelled['reset_limit']} counts the membership changes of an elastic job, and "
            "this job is not elastic: add --min-np M (or --max-np, --elastic, "
            f"--host-discovery-script), or leave {spelled['reset_limit']} out",
            prog,
        )


def _check_spares(
    spares: int, num_proc: int, given: Mapping[str, Any], listed, prog: str = "syncdp-run"
) -> None:
    """Exits 2 with one line when ``--spares`` cannot be honoured: not elastic, negative, more
    than ``-np``, or more processes than the listed hosts have slots (spares hold slots too)."""
    problem = None
    if spares < 0:
        problem = f"--spares must be 0 or more; got {spares}"
    elif spares and not _is_elastic(given):
        problem = (
            f"--spares {spares} needs elastic mode: add --min-np M (or --max-np, --elastic, "
            "--host-discovery-script)"
        )
    elif spares > num_proc:
        # Each spare is a whole copy of the program, loaded and waiting; a job never loses
        # more ranks at once than it has.
        problem = (
            f"--spares {spares} is more than -np {num_proc}: a job never needs more spares than "
            f"ranks, and each one is a whole copy of the program, loaded and waiting. Use at "
            f"most --spares {num_proc}."
        )
    elif spares and listed and num_proc + spares > sum(h.slots for h in listed):
        problem = (
            f"-np {num_proc} and --spares {spares} need {num_proc + spares} slots, and the hosts "
            f"have {sum(h.slots for h in listed)}; spares hold slots too. Add slots or use fewer "
            "spares."
        )
    if problem is not None:
        _setting_error(problem, prog)
