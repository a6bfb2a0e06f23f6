"""horovodrun's command line on ``syncdp-run``: every flag of horovodrun 0.28, and its effect.

``syncdp-run`` takes every flag horovodrun 0.28 takes, with Horovod's spelling and argument type,
so a horovodrun command line runs unchanged. :data:`FLAGS` is the table: one row per horovodrun
option (its spellings together), of one of four kinds:

- ``same``: syncdp-run has the flag itself, with the same meaning;
- ``maps``: syncdp-run does what the flag asks through its own machinery (the row says how);
- ``inert``: the concept does not exist in syncdp: the flag is accepted and its argument checked
  as horovodrun checks it, and one line on stderr says why it changes nothing;
- ``refused``: the flag asks for what syncdp does not do: exit 2 before anything starts, saying
  what to use instead.

:func:`add_arguments` registers the rows no other part of the parser has: the ``inert`` and
``refused`` ones and the switches that only spell a syncdp-run setting another way
(``--no-hierarchical-allreduce``, ``--stall-check``, ``--mpi``). The settings table's flags take
their horovodrun spellings from :data:`ALIASES`. :func:`scan` reads the launcher's part of a
command line the way argparse will, to learn which spelling set what and to let a bare
``--hierarchical-allreduce`` mean "on" as it does in horovodrun. The README's table of horovodrun
flags is :func:`markdown_table`'s output.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from syncdp.base import settings

__all__ = [
    "Flag",
    "FLAGS",
    "ALIASES",
    "BARE_VALUES",
    "SAME",
    "MAPS",
    "INERT",
    "REFUSED",
    "add_arguments",
    "scan",
    "notes",
    "refusal",
    "resolve_stall_check",
    "markdown_table",
]

SAME, MAPS, INERT, REFUSED = "same", "maps", "inert", "refused"


def _count(text: str) -> int:
    """A whole number, at least 0 (horovodrun's check for its counts)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number, at least 0; got {text!r}")
    return value


def _milliseconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number, at least 0; got {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be a number from 0 to 1; got {text!r}")
    return value


@dataclasses.dataclass(frozen=True)
class Flag:
    """One horovodrun option and what syncdp-run does with it.

    Attributes:
        names: horovodrun's spellings of the option, the long one first.
        kind: :data:`SAME`, :data:`MAPS`, :data:`INERT` or :data:`REFUSED`.
        effect: What syncdp-run does with it; for ``inert`` rows why it changes nothing, for
            ``refused`` ones what to use instead (a clause that reads after the flag's name).
        dest: Where the parsed value goes, for the rows :func:`add_arguments` registers; None
            for the rows registered elsewhere.
        value: Parses the flag's argument (horovodrun's type and check); None for a switch,
            which stores ``const``.
        const: What a switch stores.
        nargs: How many arguments the flag takes (with ``value``).
        setting: The settings row whose flag these spellings are another name for.
        says: A ``maps`` switch that says on stderr, in one line, what runs instead of what
            it names (``--gloo``, ``--jsrun``).
    """

    names: tuple[str, ...]
    kind: str
    effect: str
    dest: str | None = None
    value: Callable[[str], Any] | None = None
    const: Any = True
    nargs: int = 1
    setting: str | None = None
    says: bool = False


_NO_CYCLES = "syncdp orders collectives when the graph is traced, so there is no negotiation cycle"
_NO_LOG_TIMESTAMPS = (
    "syncdp's own messages carry no timestamp to show or hide; "
    "--prefix-output-with-timestamp stamps every output line"
)
_THREADS = (
    "syncdp asks MPI for MPI_THREAD_MULTIPLE, which its stall watchdog needs to ask the other "
    "ranks where they are; mpi4py works alongside syncdp as it is"
)
_ALLGATHER = (
    "syncdp's allgather is one MPI allgather whose algorithm Open MPI picks; there is no "
    "hierarchical variant to switch"
)

# Every option of horovodrun 0.28 (horovod/runner/launch.py), in horovodrun's order.
FLAGS: tuple[Flag, ...] = (
    Flag(("--help", "-h"), SAME, "prints the flags, with syncdp's defaults, and exits"),
    Flag(("--version", "-v"), MAPS, "prints syncdp's version and exits 0"),
    Flag(
        ("--num-proc", "-np"),
        SAME,
        "number of ranks; defaults to a Slurm allocation's tasks, or to the hosts' slots",
    ),
    Flag(
        ("--check-build", "-cb"),
        MAPS,
        "prints what this install supports in horovodrun's layout (frameworks with versions, "
        "Keras 2 through tf-keras included, the MPI controller with Open MPI's version, tensor "
        "operations, ULFM for elastic mode, visible GPUs) and exits 0; -np is not needed",
    ),
    Flag(
        ("--disable-cache",),
        INERT,
        "syncdp-run caches none of its start-up checks; it checks every host at every start",
        dest="disable_cache",
    ),
    Flag(
        ("--start-timeout",),
        SAME,
        "every rank must reach init() within this many seconds (SYNCDP_START_TIMEOUT; syncdp's "
        "default is 120)",
        setting="start_timeout",
    ),
    Flag(
        ("--network-interfaces",),
        MAPS,
        "NIC names or CIDR subnets, comma-separated, for MPI's TCP traffic and Open MPI's "
        "out-of-band channel (btl_tcp_if_include, oob_tcp_if_include; loopback only for MPI's "
        "traffic); the launcher listens on the first one this host has",
    ),
    Flag(
        ("--network-interface",),
        SAME,
        "as --network-interfaces; may be given more than once, and may hold a comma-separated list",
    ),
    Flag(
        ("--output-filename",),
        MAPS,
        "each rank's stdout and stderr also go to DIR/rank.N/stdout and DIR/rank.N/stderr on "
        "the launcher's host (N zero-padded to the width of the last rank), as the rank wrote "
        "them, without the `[N]<stdout>:` tag",
    ),
    Flag(
        ("--verbose",),
        SAME,
        "the launcher prints its mpirun command and every rank logs syncdp's decisions "
        "(SYNCDP_VERBOSE)",
        setting="verbose",
    ),
    Flag(
        ("--config-file",),
        MAPS,
        "reads horovodrun's YAML layout (controller, params, autotune, timeline, stall_check, "
        "library_options, logging): each key acts as its flag, and flags on the command line "
        "win; a key horovodrun does not read is named on stderr and ignored",
    ),
    Flag(("--ssh-port", "-p"), SAME, "the remote shell's port, for Open MPI's daemons too"),
    Flag(
        ("--ssh-identity-file", "-i"),
        SAME,
        "the remote shell's private key, for Open MPI's daemons too",
    ),
    Flag(
        ("--fusion-threshold-mb",),
        SAME,
        "largest gradient bucket in MiB; 0: one collective per tensor (SYNCDP_FUSION_THRESHOLD)",
        setting="fusion_threshold",
    ),
    Flag(
        ("--cycle-time-ms",),
        INERT,
        _NO_CYCLES,
        dest="cycle_time_ms",
        value=_milliseconds,
    ),
    Flag(
        ("--cache-capacity",),
        INERT,
        "syncdp has no response cache: ranks never negotiate which tensors are ready, so there "
        "is nothing to cache",
        dest="cache_capacity",
        value=_count,
    ),
    Flag(
        ("--hierarchical-allreduce",),
        SAME,
        "alone, as in horovodrun: on; syncdp-run also takes auto, on or off "
        "(SYNCDP_HIERARCHICAL_ALLREDUCE)",
        setting="hierarchical_allreduce",
    ),
    Flag(
        ("--no-hierarchical-allreduce",),
        MAPS,
        "--hierarchical-allreduce off (SYNCDP_HIERARCHICAL_ALLREDUCE=off)",
        dest="hierarchical_allreduce",
        const="off",
    ),
    Flag(
        ("--torus-allreduce",),
        MAPS,
        "horovodrun's 2D torus (reduce within each host, then across hosts) is syncdp's "
        "hierarchical allreduce: --hierarchical-allreduce on",
        dest="hierarchical_allreduce",
        const="on",
    ),
    Flag(
        ("--no-torus-allreduce",),
        MAPS,
        "one flat allreduce over all ranks: --hierarchical-allreduce off",
        dest="hierarchical_allreduce",
        const="off",
    ),
    Flag(
        ("--hierarchical-allgather",),
        INERT,
        _ALLGATHER,
        dest="hierarchical_allgather",
    ),
    Flag(
        ("--no-hierarchical-allgather",),
        INERT,
        _ALLGATHER,
        dest="hierarchical_allgather",
        const=False,
    ),
    Flag(
        ("--autotune",),
        SAME,
        "tunes the fusion threshold, first bucket, chunk size and (across hosts) hierarchical "
        "allreduce from step times measured while the job trains, then keeps the fastest "
        "(SYNCDP_AUTOTUNE)",
        setting="autotune",
    ),
    Flag(
        ("--no-autotune",),
        MAPS,
        "autotuning off, the default (SYNCDP_AUTOTUNE=0)",
        dest="autotune",
        const=False,
    ),
    Flag(
        ("--autotune-log-file",),
        SAME,
        "rank 0 writes every sample and the choice as CSV (SYNCDP_AUTOTUNE_LOG_FILE)",
        setting="autotune_log_file",
    ),
    Flag(
        ("--autotune-warmup-samples",),
        SAME,
        "samples thrown away before measuring (SYNCDP_AUTOTUNE_WARMUP_SAMPLES)",
        setting="autotune_warmup_samples",
    ),
    Flag(
        ("--autotune-steps-per-sample",),
        SAME,
        "training steps per sample (SYNCDP_AUTOTUNE_STEPS_PER_SAMPLE)",
        setting="autotune_steps_per_sample",
    ),
    Flag(
        ("--autotune-bayes-opt-max-samples",),
        MAPS,
        "most samples measured; syncdp searches one setting at a time instead of by Bayesian "
        "optimization, so this bounds that search (SYNCDP_AUTOTUNE_MAX_SAMPLES)",
        setting="autotune_max_samples",
    ),
    Flag(
        ("--autotune-gaussian-process-noise",),
        INERT,
        "syncdp's search fits no Gaussian process: it scores each sample by its median step "
        "and keeps a choice's best score over repeated samples",
        dest="autotune_gaussian_process_noise",
        value=_fraction,
    ),
    Flag(
        ("--min-np", "--min-num-proc"),
        SAME,
        "fewest ranks to go on with; elastic mode on Open MPI's ULFM (SYNCDP_MIN_NP)",
        setting="min_np",
    ),
    Flag(
        ("--max-np", "--max-num-proc"),
        SAME,
        "most ranks to grow to when the discovery script adds slots (SYNCDP_MAX_NP)",
        setting="max_np",
    ),
    Flag(
        ("--slots-per-host",),
        MAPS,
        "the slots of every -H or --hostfile host given without a count (and so -np's default), "
        "and of a discovery script's line without :N",
    ),
    Flag(
        ("--elastic-timeout",),
        INERT,
        "syncdp does not wait for hosts after a failure: the survivors go on at once with the "
        "replacements the free slots allow (at least --min-np ranks, or the job ends)",
        dest="elastic_timeout",
        value=_count,
    ),
    Flag(
        ("--reset-limit",),
        SAME,
        "most membership changes before the job ends (SYNCDP_RESET_LIMIT)",
        setting="reset_limit",
    ),
    Flag(
        ("--blacklist-cooldown-range",),
        INERT,
        "syncdp keeps no host blacklist: a replacement may start on any host with a free slot; "
        "stop listing a host in the discovery script to keep it out",
        dest="blacklist_cooldown_range",
        value=_count,
        nargs=2,
    ),
    Flag(
        ("--timeline-filename",),
        SAME,
        "Chrome-trace timeline of every collective (SYNCDP_TIMELINE)",
        setting="timeline",
    ),
    Flag(
        ("--timeline-mark-cycles",),
        INERT,
        _NO_CYCLES + " to mark on the timeline",
        dest="timeline_mark_cycles",
    ),
    Flag(
        ("--no-timeline-mark-cycles",),
        INERT,
        _NO_CYCLES + " to mark on the timeline",
        dest="timeline_mark_cycles",
        const=False,
    ),
    Flag(
        ("--no-stall-check",),
        MAPS,
        "no stall warning and no stall shutdown (SYNCDP_STALL_TIMEOUT=0, SYNCDP_STALL_WARNING=0); "
        "exit 2 if a stall time is also given on the command line",
        dest="stall_check",
        const=False,
    ),
    Flag(
        ("--stall-check",),
        MAPS,
        "the stall check on, as by default; overrides a config file's stall_check: enabled: false",
        dest="stall_check",
    ),
    Flag(
        ("--stall-check-warning-time-seconds",),
        MAPS,
        "--stall-warning: seconds before a waiting collective prints a warning "
        "(SYNCDP_STALL_WARNING; syncdp's default is 10)",
        setting="stall_warning",
    ),
    Flag(
        ("--stall-check-shutdown-time-seconds",),
        MAPS,
        "--stall-timeout: seconds before a waiting collective ends the job, naming the missing "
        "ranks; 0: never (SYNCDP_STALL_TIMEOUT; syncdp's default is 60)",
        setting="stall_timeout",
    ),
    Flag(("--mpi-threads-disable",), INERT, _THREADS, dest="mpi_threads_disable"),
    Flag(
        ("--no-mpi-threads-disable",),
        INERT,
        _THREADS,
        dest="mpi_threads_disable",
        const=False,
    ),
    Flag(("--mpi-args",), SAME, "extra mpirun arguments, split like a shell would"),
    Flag(
        ("--tcp",),
        MAPS,
        "MPI messages between hosts go over TCP, never RDMA: mpirun gets --mca pml ob1 --mca btl "
        "self,sm,tcp --mca osc ^ucx (ranks on one host still share memory, as under horovodrun "
        "with Open MPI)",
    ),
    Flag(
        ("--binding-args",),
        MAPS,
        "replaces syncdp-run's --bind-to none in the mpirun command, split like a shell would",
    ),
    Flag(
        ("--num-nccl-streams",),
        INERT,
        "syncdp does not use NCCL; every collective goes through MPI",
        dest="num_nccl_streams",
        value=_count,
    ),
    Flag(
        ("--thread-affinity",),
        INERT,
        "syncdp has no background communication thread to pin; collectives run on the thread "
        "that calls them",
        dest="thread_affinity",
        value=_count,
    ),
    Flag(
        ("--gloo-timeout-seconds",),
        INERT,
        "syncdp does not use Gloo; --stall-timeout bounds how long a collective waits",
        dest="gloo_timeout_seconds",
        value=_count,
    ),
    Flag(
        ("--log-level",),
        MAPS,
        "the launcher's own verbosity: TRACE or DEBUG also print the mpirun command; ERROR or "
        "FATAL leave out the launcher's notes and its timing table; failures and the verdict are "
        "always printed",
    ),
    Flag(("--log-with-timestamp",), INERT, _NO_LOG_TIMESTAMPS, dest="log_with_timestamp"),
    Flag(
        ("--log-without-timestamp",),
        INERT,
        _NO_LOG_TIMESTAMPS,
        dest="log_with_timestamp",
        const=False,
    ),
    Flag(
        ("--prefix-output-with-timestamp", "-prefix-timestamp"),
        MAPS,
        "every output line starts with the time the launcher received it (time.asctime(), as "
        "horovodrun writes it), on the console and in --output-filename's files",
    ),
    Flag(
        ("--log-hide-timestamp",),
        INERT,
        _NO_LOG_TIMESTAMPS,
        dest="log_with_timestamp",
        const=False,
    ),
    Flag(("--no-log-hide-timestamp",), INERT, _NO_LOG_TIMESTAMPS, dest="log_with_timestamp"),
    Flag(("--hosts", "-H"), SAME, "hosts and slots, host1:2,host2:2 (mpirun --host)"),
    Flag(("--hostfile", "-hostfile"), SAME, "file of 'host slots=N' lines (mpirun --hostfile)"),
    Flag(
        ("--host-discovery-script",),
        SAME,
        "program printing host:slots lines where replacements may start; elastic mode "
        "(SYNCDP_HOST_DISCOVERY_SCRIPT)",
        setting="host_discovery_script",
    ),
    Flag(
        ("--gloo",),
        MAPS,
        "accepted, and the job runs on syncdp's engine over Open MPI, as with --mpi (syncdp "
        "has no Gloo controller; elastic mode runs on Open MPI's ULFM)",
        dest="controller",
        const="gloo",
        says=True,
    ),
    Flag(
        ("--mpi",),
        MAPS,
        "accepted: MPI is syncdp's only controller, and the default",
        dest="controller",
        const="mpi",
    ),
    Flag(
        ("--jsrun",),
        MAPS,
        "accepted, and the job runs on syncdp's engine, its ranks started by Open MPI's mpirun "
        "instead of jsrun, on the hosts of -H or --hostfile (this host without them)",
        dest="controller",
        const="jsrun",
        says=True,
    ),
)


def _aliases() -> dict[str, tuple[str, ...]]:
    flags = {s.name: s.flag for s in settings.SETTINGS}
    found: dict[str, tuple[str, ...]] = {}
    for row in FLAGS:
        if row.setting is not None:
            found[row.setting] = tuple(n for n in row.names if n != flags[row.setting])
    return {name: spellings for name, spellings in found.items() if spellings}


# Setting name -> horovodrun's other spellings of its flag (``stall_timeout`` ->
# ``--stall-check-shutdown-time-seconds``).
ALIASES: Mapping[str, tuple[str, ...]] = _aliases()
# A settings flag whose value horovodrun never takes: alone, it means this value.
BARE_VALUES: Mapping[str, str] = {"--hierarchical-allreduce": "on"}
_METAVARS = {_count: "N", _milliseconds: "MS", _fraction: "X", str: "FILE"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Registers the horovodrun rows that have a ``dest``: each stores into it, default None."""
    group = parser.add_argument_group(
        "horovodrun's other flags",
        "accepted so that horovodrun command lines run unchanged; each flag that changes "
        "nothing says why on stderr",
    )
    for row in FLAGS:
        if row.dest is None:
            continue
        if row.kind == INERT:
            text = f"changes nothing: {row.effect}"
        elif row.kind == REFUSED:
            text = f"refused: {row.effect}"
        else:
            text = row.effect
        options = dict(dest=row.dest, default=None, help=text.replace("%", "%%"))
        if row.value is None:
            group.add_argument(*row.names, action="store_const", const=row.const, **options)
        else:
            group.add_argument(
                *row.names,
                type=row.value,
                nargs=row.nargs if row.nargs > 1 else None,
                metavar=_METAVARS[row.value],
                **options,
            )


def _takes(action: argparse.Action, rest: Sequence[str]) -> int:
    """How many of ``rest`` (the arguments after the option) argparse gives the option."""
    if action.nargs == 0:
        return 0
    if action.nargs is None:
        return 1
    if isinstance(action.nargs, int):
        return action.nargs
    if action.nargs == "?":
        return 1 if rest and not rest[0].startswith("-") else 0
    return 0


def _action(parser: argparse.ArgumentParser, name: str) -> tuple[argparse.Action | None, bool]:
    """The action for an option as typed, and whether its value is attached (``-p2222``)."""
    known = parser._option_string_actions  # argparse's own map: option string -> action
    if name in known:
        return known[name], False
    if name.startswith("--"):
        matches = {a for option, a in known.items() if option.startswith(name)}
        return (matches.pop() if len(matches) == 1 else None), False
    if name[:2] in known and known[name[:2]].nargs != 0:
        return known[name[:2]], True
    return None, False


def scan(argv: Sequence[str], parser: argparse.ArgumentParser) -> tuple[list[str], dict[str, str]]:
    """Reads the launcher's part of ``argv``, up to the program to run, as argparse will.

    Args:
        argv: The arguments after ``syncdp-run``.
        parser: :func:`syncdp.launch.run.build_parser`'s parser.

    Returns:
        ``argv`` with a bare ``--hierarchical-allreduce`` (horovodrun's switch, no value) made
        ``--hierarchical-allreduce=on``, and dest -> the spelling that set it last.

    Raises:
        ValueError: Two spellings of one switch that contradict each other
            (``--stall-check`` and ``--no-stall-check``), named.
    """
    out: list[str] = []
    spelled: dict[str, str] = {}
    switched: dict[str, tuple[str, Any]] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--" or token == "-" or not token.startswith("-"):
            break  # the program starts here
        name, eq, _ = token.partition("=")
        action, attached = _action(parser, name)
        if action is None:
            break  # argparse names it
        spelled[action.dest] = action.option_strings[0] if attached else name
        rest = argv[i + 1 :]
        if name in BARE_VALUES and not eq and (not rest or rest[0] not in _choices(name)):
            _switch(switched, action.dest, name, BARE_VALUES[name])
            out.append(f"{name}={BARE_VALUES[name]}")
            i += 1
            continue
        if action.nargs == 0 and action.const is not None:
            _switch(switched, action.dest, name, action.const)
        taken = 0 if eq or attached else _takes(action, rest)
        out.extend(argv[i : i + 1 + taken])
        i += 1 + taken
    return out + list(argv[i:]), spelled


def _switch(switched: dict[str, tuple[str, Any]], dest: str, name: str, value: Any) -> None:
    """Records a switch; two that store different values in one place contradict each other."""
    before = switched.setdefault(dest, (name, value))
    if before[1] != value:
        raise ValueError(f"argument {name}: not allowed with argument {before[0]}")


def _choices(flag: str) -> tuple[str, ...]:
    return next(s.choices for s in settings.SETTINGS if s.flag == flag)


def _rows_by_dest() -> dict[str, Flag]:
    rows: dict[str, Flag] = {}
    for row in FLAGS:
        if row.dest is not None:
            rows.setdefault(row.dest, row)
    return rows


def notes(args: argparse.Namespace, spelled: Mapping[str, str]) -> list[str]:
    """One line per ``inert`` flag given: why it changes nothing (named as it was given); and
    one per switch that says what runs instead (``--gloo``: syncdp's engine)."""
    lines = []
    for dest, row in _rows_by_dest().items():
        if row.kind == INERT and getattr(args, dest, None) is not None:
            lines.append(f"{spelled.get(dest, row.names[0])} changes nothing: {row.effect}")
    for row in FLAGS:
        if row.says and getattr(args, row.dest, None) == row.const:
            lines.append(f"{spelled.get(row.dest, row.names[0])} is {row.effect}")
    return lines


def refusal(args: argparse.Namespace, spelled: Mapping[str, str]) -> str | None:
    """Why the job cannot run as asked (a ``refused`` flag, named), or None."""
    for row in FLAGS:
        if row.kind == REFUSED and getattr(args, row.dest) == row.const:
            return f"{spelled.get(row.dest, row.names[0])}: {row.effect}."
    return None


def resolve_stall_check(
    args: argparse.Namespace, spelled: dict[str, str], on_command_line: set[str]
) -> None:
    """``--no-stall-check`` (or a config file's ``stall_check: enabled: false``) as syncdp's
    settings: no stall timeout and no warning (0: never, for both).

    A stall time on the command line beside ``--no-stall-check`` contradicts it; beside the
    config file's ``enabled: false``, the command line wins and the check stays on. Within the
    config file, ``enabled: false`` wins over its times, as in horovodrun.

    Args:
        args: The parsed command line (config file applied); changed in place.
        spelled: dest -> how it was given; the stall settings are added.
        on_command_line: The dests the command line itself set.

    Raises:
        ValueError: Both ``--no-stall-check`` and a stall time on the command line (named).
    """
    if args.stall_check is not False:
        return
    times = [name for name in ("stall_timeout", "stall_warning") if name in on_command_line]
    if times and "stall_check" in on_command_line:
        raise ValueError(
            f"{spelled['stall_check']} turns the stall check off, but {spelled[times[0]]} "
            "sets a time for it; give one of them."
        )
    if times:
        return
    args.stall_timeout = args.stall_warning = "0"
    spelled["stall_timeout"] = spelled["stall_warning"] = spelled["stall_check"]


def markdown_table() -> str:
    """The README's table: every horovodrun 0.28 flag and what syncdp-run does with it."""
    words = {
        SAME: "same",
        MAPS: "maps",
        INERT: "accepted, changes nothing",
        REFUSED: "refused (exit 2)",
    }
    lines = ["| horovodrun flag | syncdp-run | what it does |", "|---|---|---|"]
    for row in FLAGS:
        names = ", ".join(f"`{n}`" for n in row.names)
        lines.append(f"| {names} | {words[row.kind]} | {row.effect} |")
    return "\n".join(lines)
