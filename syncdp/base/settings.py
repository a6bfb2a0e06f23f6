"""The one table of syncdp's settings, and the one place they are read.

Every setting is a row of :data:`SETTINGS`: its name (the ``init()`` keyword and the
:class:`Config` field), its ``SYNCDP_*`` environment variable, its ``syncdp-run`` flag, its type,
default and meaning. Everything else is derived from the table: :func:`from_env` parses the
environment, the launcher builds its flags and ``--help`` from it (:func:`launcher_env` turns
parsed flags back into variables), and the README's settings table is :func:`markdown_table`'s
output (a test checks they agree).

A frozen :class:`Config` is read once by ``syncdp.init()``: environment first, keyword arguments
win. A ``SYNCDP_*`` name that is not in the table raises, so a typo is never silently ignored.

Example:
    >>> from syncdp.base import settings
    >>> settings.from_env({"SYNCDP_STALL_TIMEOUT": "30"}, verbose=True).stall_timeout
    30.0
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

from syncdp.base.errors import ConfigError

__all__ = [
    "HOROVOD_VARS",
    "HOROVOD_SWITCHES",
    "HOROVOD_VARS_WITHOUT_EFFECT",
    "horovod_values",
    "Config",
    "SETTINGS",
    "Setting",
    "from_env",
    "launcher_env",
    "resolve",
    "markdown_table",
    "INTERNAL_VARS",
    "ELASTIC_IMPLIED_BY",
    "from_env_or_default",
    "validate",
    "unwritable",
]

MiB = 1024 * 1024


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


@dataclasses.dataclass(frozen=True)
class Setting:
    """One row of the settings table.

    Attributes:
        name: The ``init()`` keyword and :class:`Config` field.
        env: The environment variable the launcher sets and ``init()`` reads.
        flag: The ``syncdp-run`` flag.
        type: ``int``, ``float``, ``str`` or ``bool``.
        default: The value when neither the environment nor ``init()`` sets it.
        doc: What it does, one line (``--help`` and the README show it).
        flag_unit: Bytes per unit of the flag's value (flags take MiB where the variable
            holds bytes); 1 for flags given in the variable's own unit.
        minimum: The smallest valid value, for numbers.
        choices: The valid values, for a string setting that takes one of a few words.
    """

    name: str
    env: str
    flag: str
    type: type
    default: Any
    doc: str
    flag_unit: int = 1
    minimum: float | None = 0
    choices: tuple[str, ...] = ()

    def parse(self, text: str) -> Any:
        """Parses the environment variable's text into a checked value (see :func:`validate`)."""
        return validate(self, text, source="env")

    def env_text(self, flag_value: Any) -> str:
        """The environment variable's text for a value given on the launcher's flag."""
        if self.type is bool:
            return "1" if flag_value else "0"
        if self.type is str:
            return str(flag_value)
        value = flag_value * self.flag_unit
        if self.type is int:
            value = int(value)
        return str(int(value)) if float(value).is_integer() else str(value)

    def default_text(self) -> str:
        """The default as a reader would write it on the flag."""
        if self.type is bool:
            return "off"
        if self.type is str:
            return self.default or "none"
        value = self.default / self.flag_unit
        return f"{value:g}"


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "fusion_threshold",
        "SYNCDP_FUSION_THRESHOLD",
        "--fusion-threshold-mb",
        int,
        25 * MiB,
        "largest gradient bucket (0: one collective per tensor)",
        flag_unit=MiB,
    ),
    Setting(
        "first_bucket_bytes",
        "SYNCDP_FIRST_BUCKET_BYTES",
        "--first-bucket-mb",
        int,
        1 * MiB,
        "size of the first gradient bucket, so communication starts early in backprop",
        flag_unit=MiB,
    ),
    Setting(
        "chunk_bytes",
        "SYNCDP_CHUNK_BYTES",
        "--chunk-mb",
        int,
        8 * MiB,
        "largest single MPI message; larger buckets go in pieces",
        flag_unit=MiB,
        minimum=1024,
    ),
    Setting(
        "start_timeout",
        "SYNCDP_START_TIMEOUT",
        "--start-timeout",
        float,
        120.0,
        "seconds for every rank to reach init(), and for Open MPI to start any process; the job "
        "ends naming the ranks that did not",
    ),
    Setting(
        "stall_timeout",
        "SYNCDP_STALL_TIMEOUT",
        "--stall-timeout",
        float,
        60.0,
        "a collective waiting longer ends the job, naming the missing ranks (0: never)",
    ),
    Setting(
        "finalize_timeout",
        "SYNCDP_FINALIZE_TIMEOUT",
        "--finalize-timeout",
        float,
        60.0,
        "elastic mode: seconds a rank's MPI_Finalize may take at exit before SIGALRM ends it",
        minimum=1,
    ),
    Setting(
        "stall_warning",
        "SYNCDP_STALL_WARNING",
        "--stall-warning",
        float,
        10.0,
        "seconds before a waiting collective prints a warning",
    ),
    Setting(
        "timeline",
        "SYNCDP_TIMELINE",
        "--timeline-filename",
        str,
        "",
        "write a Chrome-trace timeline of every collective to this file",
    ),
    Setting(
        "verify_every",
        "SYNCDP_VERIFY_EVERY",
        "--verify-every",
        int,
        0,
        "check every K gradient steps that replicas are bit-identical (0: never)",
    ),
    Setting(
        "hierarchical_allreduce",
        "SYNCDP_HIERARCHICAL_ALLREDUCE",
        "--hierarchical-allreduce",
        str,
        "auto",
        "topology-aware allreduce (reduce-scatter in each host, ring among hosts, allgather): "
        "on, off, or auto (on across 3 or more hosts when some host runs several ranks)",
        choices=("auto", "on", "off"),
    ),
    Setting(
        "shared_memory",
        "SYNCDP_SHARED_MEMORY",
        "--shared-memory",
        str,
        "auto",
        "allreduce through an MPI-3 shared-memory window where every rank reduces its slice, "
        "when all ranks of a group share one host: auto (= on) or off (Open MPI's allreduce)",
        choices=("auto", "on", "off"),
    ),
    Setting(
        "autotune",
        "SYNCDP_AUTOTUNE",
        "--autotune",
        bool,
        False,
        "tune the fusion threshold, first bucket, chunk size and hierarchical allreduce from "
        "step times measured during the first steps, then keep the fastest",
    ),
    Setting(
        "autotune_log_file",
        "SYNCDP_AUTOTUNE_LOG_FILE",
        "--autotune-log-file",
        str,
        "",
        "autotune: rank 0 writes every sample and the choice to this CSV file (an earlier "
        "one is removed at init)",
    ),
    Setting(
        "autotune_warmup_samples",
        "SYNCDP_AUTOTUNE_WARMUP_SAMPLES",
        "--autotune-warmup-samples",
        int,
        3,
        "autotune: samples thrown away before measuring (tracing, first use of buffers)",
    ),
    Setting(
        "autotune_steps_per_sample",
        "SYNCDP_AUTOTUNE_STEPS_PER_SAMPLE",
        "--autotune-steps-per-sample",
        int,
        10,
        "autotune: training steps per sample; a sample scores the median step",
        minimum=1,
    ),
    Setting(
        "autotune_max_samples",
        "SYNCDP_AUTOTUNE_MAX_SAMPLES",
        "--autotune-max-samples",
        int,
        20,
        "autotune: most samples measured before the fastest choice is kept",
        minimum=1,
    ),
    Setting(
        "elastic",
        "SYNCDP_ELASTIC",
        "--elastic",
        bool,
        False,
        "elastic mode (Open MPI ULFM): a lost rank is replaced and training goes on",
    ),
    Setting(
        "min_np",
        "SYNCDP_MIN_NP",
        "--min-np",
        int,
        0,
        "elastic: fewest ranks to go on with (0: -np); implies --elastic",
    ),
    Setting(
        "max_np",
        "SYNCDP_MAX_NP",
        "--max-np",
        int,
        0,
        "elastic: most ranks to grow to when the discovery script adds slots (0: -np)",
    ),
    Setting(
        "host_discovery_script",
        "SYNCDP_HOST_DISCOVERY_SCRIPT",
        "--host-discovery-script",
        str,
        "",
        "elastic: program (or shell command line) printing 'host:slots' lines, where "
        "replacements may start",
    ),
    Setting(
        "reset_limit",
        "SYNCDP_RESET_LIMIT",
        "--reset-limit",
        int,
        0,
        "elastic: most membership changes before the job ends (0: no limit)",
    ),
    Setting(
        "log_all_ranks",
        "SYNCDP_LOG_ALL_RANKS",
        "--log-all-ranks",
        bool,
        False,
        "Keras progress output on every rank, not only rank 0",
    ),
    Setting(
        "verbose",
        "SYNCDP_VERBOSE",
        "--verbose",
        bool,
        False,
        "log syncdp's decisions on every rank (and the launcher's mpirun command)",
    ),
)

_BY_ENV = {s.env: s for s in SETTINGS}
_BY_NAME = {s.name: s for s in SETTINGS}

# How each source of a value names it in an error: the launcher's flag, the variable, or the
# init() keyword (which also names the other two, so a reader finds where it came from).
_SOURCES = ("flag", "env", "keyword")
_BOOL_WORDS = "1, true, yes, on, or 0, false, no, off"


def _allowed(s: Setting, unit: int) -> str:
    """What ``s`` accepts, in words, for a value given in ``unit`` (bytes per unit)."""
    if s.type is bool:
        return f"a boolean ({_BOOL_WORDS})"
    if s.choices:
        return "one of " + ", ".join(s.choices)
    if s.type is str:
        return "text"
    if unit == MiB:
        what = "a finite number of MiB"
    elif s.type is int:
        what = "a whole number" + (" of bytes" if s.flag_unit == MiB else "")
    else:
        what = "a finite number of seconds"
    if s.minimum is not None:
        what += f", at least {s.minimum / unit:g}"
        if unit != 1 and s.minimum:
            what += f" ({s.minimum:g} bytes)"
    return what


def _parse_text(s: Setting, text: str, unit: int) -> Any:
    """``text`` as the setting's type in ``unit``; ValueError when it is not one."""
    if s.type is bool:
        return _bool(text)
    if s.type is str:
        return text
    if s.type is int and unit == 1:
        return int(text.strip())  # "2.5" and "1e3" are not whole numbers of anything
    return float(text)


def _in_range(s: Setting, value: Any) -> bool:
    """Whether a typed value, in the variable's unit, is one ``s`` allows."""
    if s.type is bool:
        return isinstance(value, bool)
    if s.type is str:
        return isinstance(value, str) and (not s.choices or value in s.choices)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    # NaN compares false with everything, so it would pass a minimum: finite is checked first.
    if not math.isfinite(value):
        return False
    if s.type is int and value != int(value):
        return False
    return s.minimum is None or value >= s.minimum


def validate(
    setting: Setting | str, value: Any, *, source: str = "keyword", spelling: str | None = None
) -> Any:
    """Parses and checks one setting's value: the one check for every way a value arrives.

    The launcher calls it for its flags and for the ``SYNCDP_*`` variables it passes on, before
    anything starts; :class:`Config` calls it for every field, so ``init()`` checks the same
    way in a program started without the launcher. NaN and infinity are never allowed (every
    setting that can mean "never" says so with 0), nor are values below the row's minimum, text
    where a number belongs, or a fraction where a whole number does.

    Args:
        setting: The row of :data:`SETTINGS`, or its name.
        value: For ``source="flag"`` the flag's text, in the flag's unit (MiB for the ``-mb``
            flags; True or False for a boolean flag); for ``"env"`` the variable's text; for
            ``"keyword"`` the Python value (``init()``'s keyword, a :class:`Config` field).
        source: Where the value came from: ``"flag"``, ``"env"`` or ``"keyword"``. Defaults to
            ``"keyword"``.
        spelling: For ``source="flag"``, how the error names the value's origin when it is not
            the row's flag: horovodrun's spelling the user typed
            (``--stall-check-shutdown-time-seconds``), or a config file's key. Defaults to the
            row's flag.

    Returns:
        The value, typed, in the source's unit (MiB for the ``-mb`` flags, else the
        variable's unit).

    Raises:
        ConfigError: One line naming the setting as the source spells it, the value received
            and what is allowed, e.g. ``--stall-timeout must be a finite number of seconds, at
            least 0; got 'nan'.``

    Example:
        >>> validate("chunk_bytes", "4096", source="env")
        4096
    """
    s = _BY_NAME[setting] if isinstance(setting, str) else setting
    if source not in _SOURCES:
        raise ValueError(f"source must be one of {', '.join(_SOURCES)}; got {source!r}")
    unit = s.flag_unit if source == "flag" else 1
    typed = value
    ok = True
    # A boolean flag stores True (``--autotune``) or False (``--no-autotune``), not text.
    if source != "keyword" and not (s.type is bool and isinstance(value, bool)):
        try:
            typed = _parse_text(s, value, unit)
        except (TypeError, ValueError):
            ok = False
    if ok:
        ok = _in_range(s, _variable_value(s, typed, unit))
    if ok:
        return typed
    allowed = _allowed(s, unit)
    if source == "flag":
        raise ConfigError(f"{spelling or s.flag} must be {allowed}; got {value!r}.")
    if source == "env":
        raise ConfigError(f"{s.env} must be {allowed}; got {value!r}.")
    raise ConfigError(f"{s.name} must be {allowed}; got {value!r} ({s.env}, syncdp-run {s.flag}).")


def _variable_value(s: Setting, typed: Any, unit: int) -> Any:
    """The variable's value for a value in ``unit``: a ``-mb`` flag's MiB become whole bytes."""
    if unit == 1 or isinstance(typed, bool) or not isinstance(typed, int | float):
        return typed
    scaled = typed * unit
    return int(scaled) if s.type is int and math.isfinite(scaled) else scaled


# Variables the launcher sets for its own machinery; not settings of the library.
#   SYNCDP_LAUNCHER     set under syncdp-run
#   SYNCDP_REPORT_ADDR  host:port where ranks send structured reports (syncdp.watch.report)
#   SYNCDP_REPLACEMENT  set by syncdp.launch.worker on a rank spawned by elastic recovery: its label
#   SYNCDP_JOB_ID, SYNCDP_REPORT_SECRET  the job's id and the key its reports are signed with
#   SYNCDP_LIFELINE_ADDR  host:port every supervisor holds a connection to (syncdp.launch.lifeline)
#   SYNCDP_SPARES       how many of the job's last processes are warm spares
#                       (syncdp.membership.spares)
#   SYNCDP_COMMIT_DIR   elastic jobs on several hosts: where each host keeps the last commit on its
#                       local disk, so a restart after a lost host resumes
#                       (syncdp.membership.commits)
#   SYNCDP_CARRIED      the variables every process of the job carries, spawned ones included
#                       (syncdp.membership.jobenv)
#   SYNCDP_LOST_HOSTS   hosts an earlier runtime of the job lost, under all their names: never
#                       grown onto again (syncdp.membership.membership.lost_hosts)
#   SYNCDP_DISCOVERY_SLOTS  --slots-per-host: the slots of a discovery script's host printed
#                       without a count (syncdp.membership.membership.discovery_slots)
#   SYNCDP_RUN_FUNC_ADDR, SYNCDP_RUN_FUNC_SECRET  horovod.run: where each rank fetches the
#                       function and sends its value back, and the key both are signed with
#                       (syncdp.launch.run_func)
INTERNAL_VARS = frozenset(
    {
        "SYNCDP_LAUNCHER",
        "SYNCDP_REPORT_ADDR",
        "SYNCDP_REPLACEMENT",
        "SYNCDP_JOB_ID",
        "SYNCDP_REPORT_SECRET",
        "SYNCDP_LIFELINE_ADDR",
        "SYNCDP_SPARES",
        "SYNCDP_NEW_SPARE",
        "SYNCDP_COMMIT_DIR",
        "SYNCDP_CARRIED",
        "SYNCDP_LOST_HOSTS",
        "SYNCDP_RESETS_USED",
        "SYNCDP_DISCOVERY_SLOTS",
        "SYNCDP_RUN_FUNC_ADDR",
        "SYNCDP_RUN_FUNC_SECRET",
    }
)


# Settings that switch elastic mode on by being set (horovodrun: --min-np alone is elastic).
ELASTIC_IMPLIED_BY = ("min_np", "max_np", "host_discovery_script")


def _default(name: str):
    return _BY_NAME[name].default


@dataclasses.dataclass(frozen=True)
class Config:
    """syncdp's settings for one process: one field per row of :data:`SETTINGS`.

    The fields' defaults come from the table, and an import-time check keeps the two the same
    list, so the table stays the one place a setting is defined.
    """

    fusion_threshold: int = _default("fusion_threshold")
    first_bucket_bytes: int = _default("first_bucket_bytes")
    chunk_bytes: int = _default("chunk_bytes")
    start_timeout: float = _default("start_timeout")
    stall_timeout: float = _default("stall_timeout")
    finalize_timeout: float = _default("finalize_timeout")
    stall_warning: float = _default("stall_warning")
    timeline: str = _default("timeline")
    verify_every: int = _default("verify_every")
    hierarchical_allreduce: str = _default("hierarchical_allreduce")
    shared_memory: str = _default("shared_memory")
    autotune: bool = _default("autotune")
    autotune_log_file: str = _default("autotune_log_file")
    autotune_warmup_samples: int = _default("autotune_warmup_samples")
    autotune_steps_per_sample: int = _default("autotune_steps_per_sample")
    autotune_max_samples: int = _default("autotune_max_samples")
    elastic: bool = _default("elastic")
    min_np: int = _default("min_np")
    max_np: int = _default("max_np")
    host_discovery_script: str = _default("host_discovery_script")
    reset_limit: int = _default("reset_limit")
    log_all_ranks: bool = _default("log_all_ranks")
    verbose: bool = _default("verbose")

    def __post_init__(self):
        for s in SETTINGS:
            validate(s, getattr(self, s.name))


assert [f.name for f in dataclasses.fields(Config)] == [s.name for s in SETTINGS], (
    "Config's fields must be SETTINGS' names, in order"
)


def _on_off(text: str) -> str:
    """Horovod's boolean as syncdp's three-way word: on, or off."""
    return "off" if text.strip().lower() in ("", "0", "false", "no", "off") else "on"


# Horovod's own variables that set a syncdp setting, with how their text reads as syncdp's
# variable's (horovod/common/common.h; horovodrun exports them too). A SYNCDP_* variable or a
# flag wins over them.
HOROVOD_VARS: dict[str, tuple[str, Callable[[str], str]]] = {
    "HOROVOD_FUSION_THRESHOLD": ("fusion_threshold", str),  # bytes, as syncdp's
    "HOROVOD_START_TIMEOUT": ("start_timeout", str),  # seconds, as horovodrun's --start-timeout
    # DYNAMIC: no timeline now; the program starts one (start_timeline), as in Horovod.
    "HOROVOD_TIMELINE": ("timeline", lambda text: "" if text == "DYNAMIC" else text),
    "HOROVOD_STALL_CHECK_TIME_SECONDS": ("stall_warning", str),
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": ("stall_timeout", str),  # 0: never, as syncdp's
    "HOROVOD_HIERARCHICAL_ALLREDUCE": ("hierarchical_allreduce", _on_off),
    "HOROVOD_AUTOTUNE": ("autotune", str),
    "HOROVOD_AUTOTUNE_LOG": ("autotune_log_file", str),
    "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": ("autotune_warmup_samples", str),
    "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": ("autotune_steps_per_sample", str),
    "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": ("autotune_max_samples", str),
}
# Horovod's switches that set several syncdp settings when on (read as :func:`_on_off`). They
# win over the HOROVOD_VARS above, as in Horovod, and lose to a SYNCDP_* variable or a flag.
HOROVOD_SWITCHES: dict[str, dict[str, str]] = {
    # No stall check at all: no warning and no shutdown (horovodrun --no-stall-check).
    "HOROVOD_STALL_CHECK_DISABLE": {"stall_warning": "0", "stall_timeout": "0"},
}
# Horovod's variables that tune machinery syncdp does not have: the launcher says so.
HOROVOD_VARS_WITHOUT_EFFECT = (
    "HOROVOD_CYCLE_TIME",
    "HOROVOD_CACHE_CAPACITY",
    "HOROVOD_TIMELINE_MARK_CYCLES",
    "HOROVOD_MPI_THREADS_DISABLE",
    "HOROVOD_NUM_NCCL_STREAMS",
    "HOROVOD_BATCH_D2D_MEMCOPIES",
    "HOROVOD_CPU_OPERATIONS",
    "HOROVOD_CONTROLLER",
    "HOROVOD_HIERARCHICAL_ALLGATHER",
    "HOROVOD_ADASUM_MPI_CHUNK_SIZE",
    "HOROVOD_DISABLE_GROUP_FUSION",
    "HOROVOD_ENABLE_XLA_OPS",
    "HOROVOD_LOG_LEVEL",  # the C++ core's log; the launcher's own is --log-level
    "HOROVOD_LOG_HIDE_TIME",
    "HOROVOD_ELASTIC_TIMEOUT",
    "HOROVOD_GLOO_TIMEOUT_SECONDS",
)


def horovod_values(environ: Mapping[str, str]) -> dict[str, Any]:
    """Setting name -> value from Horovod's variables in ``environ`` (:data:`HOROVOD_VARS`,
    :data:`HOROVOD_SWITCHES`), for the settings whose ``SYNCDP_*`` variable is not set.

    Raises:
        ConfigError: A Horovod variable's value cannot be read (named).
    """
    values = {}
    for var, (name, convert) in HOROVOD_VARS.items():
        setting = _BY_NAME[name]
        if var not in environ or setting.env in environ:
            continue
        try:
            values[name] = validate(setting, convert(environ[var]), source="env")
        except ConfigError as e:
            raise ConfigError(
                f"{var}={environ[var]!r} (Horovod's; read as {setting.env}): {e}"
            ) from None
    for var, switched in HOROVOD_SWITCHES.items():
        if _on_off(environ.get(var, "")) == "off":
            continue
        for name, text in switched.items():
            setting = _BY_NAME[name]
            if setting.env not in environ:
                values[name] = validate(setting, text, source="env")
    return values


def from_env(environ: Mapping[str, str] | None = None, **overrides) -> Config:
    """Reads a Config from ``SYNCDP_*`` variables; keyword arguments win.

    Args:
        environ: The environment to read. Defaults to ``os.environ``.
        **overrides: Settings by name (``fusion_threshold=16 << 20``); None means "not set".

    Returns:
        The frozen Config.

    Raises:
        ConfigError: A ``SYNCDP_*`` variable is unknown or cannot be parsed, a keyword names
            no setting, or a value is out of range; or, on rank 0 (the environment's
            ``OMPI_COMM_WORLD_RANK``, else this process) of a job that tunes, the autotune log
            cannot be written there (:func:`unwritable`).
    """
    environ = os.environ if environ is None else environ
    values = horovod_values(environ)  # below the SYNCDP_* variables, which win
    for key, text in environ.items():
        if not key.startswith("SYNCDP_") or key in INTERNAL_VARS:
            continue
        setting = _BY_ENV.get(key)
        if setting is None:
            known = ", ".join(sorted(_BY_ENV))
            raise ConfigError(f"Unknown environment variable {key}; syncdp knows {known}.")
        values[setting.name] = validate(setting, text, source="env")
    for key, value in overrides.items():
        if key not in _BY_NAME:
            raise ConfigError(f"Unknown syncdp option {key!r}; options are {sorted(_BY_NAME)}.")
        if value is not None:
            values[key] = value
    if any(values.get(name) for name in ELASTIC_IMPLIED_BY):
        values["elastic"] = True
    for name in ("timeline", "autotune_log_file"):
        if values.get(name):  # where the program started: it may change directory later
            values[name] = os.path.abspath(values[name])
    config = Config(**values)
    _check_autotune_log(config, environ)
    return config


def unwritable(path: str) -> str | None:
    """Why a file could not be written at ``path`` (replaced through ``PATH.tmp``), in a few
    words that name what is wrong; None when it can. Touches nothing.

    Example:
        >>> unwritable("/nonexistent/tune.csv")
        "No such directory: '/nonexistent'"
    """
    path = os.path.abspath(path)
    directory = os.path.dirname(path)
    if os.path.isdir(path):
        return f"{path!r} is a directory"
    if not os.path.exists(directory):
        return f"No such directory: {directory!r}"
    if not os.path.isdir(directory):
        return f"Not a directory: {directory!r}"
    try:
        if os.statvfs(directory).f_flag & os.ST_RDONLY:
            return f"Read-only file system: {directory!r}"
    except OSError:
        pass
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"Permission denied: {directory!r}"
    return None


def _check_autotune_log(config: Config, environ: Mapping[str, str]) -> None:
    """On the rank that writes it (rank 0), the autotune log's file can be written: found at
    init rather than when the first sample is logged, steps into training."""
    rank = next(
        (environ[k] for k in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK") if k in environ),
        "0",
    )
    if rank != "0" or not config.autotune or config.elastic or not config.autotune_log_file:
        return  # elastic jobs do not tune (syncdp.tensorflow.autotuning)
    problem = unwritable(config.autotune_log_file)
    if problem is not None:
        s = _BY_NAME["autotune_log_file"]
        raise ConfigError(
            f"The autotune log {config.autotune_log_file!r} ({s.env}, syncdp-run {s.flag}) "
            f"cannot be written: {problem}. Name a file in a writable directory."
        )


def from_env_or_default(environ: Mapping[str, str] | None = None) -> Config:
    """:func:`from_env`, or the defaults when the environment is malformed (for the launcher's
    helpers, which must not fail where the ranks will report the error themselves)."""
    try:
        return from_env(environ)
    except ConfigError:
        return Config()


def resolve(flag_values: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """The launcher's settings, each resolved once: a flag (a ``--config-file`` key counts as
    its flag, below the command line) wins over the environment's ``SYNCDP_*`` variable,
    which wins over Horovod's (:data:`HOROVOD_VARS`).

    What is returned is what :func:`launcher_env` exports for every rank, so the ranks read
    exactly the values the launcher acts on (elastic mode, ``--spares``, its timeouts).

    Args:
        flag_values: Setting name -> the flag's parsed value (:func:`validate`,
            ``source="flag"``); settings not given are absent or None.
        environ: The launcher's environment.

    Returns:
        Setting name -> value in the flag's unit, for every setting a flag or a variable sets.

    Raises:
        ConfigError: A variable not replaced by a flag is malformed (named).
    """
    resolved = {name: value for name, value in flag_values.items() if value is not None}
    horovods = horovod_values(environ)
    for s in SETTINGS:
        if s.name in resolved or (s.env not in environ and s.name not in horovods):
            continue
        if s.env in environ:
            value = validate(s, environ[s.env], source="env")
        else:
            value = horovods[s.name]
        if s.flag_unit != 1:
            value = value / s.flag_unit  # exact: the unit is a power of two
        resolved[s.name] = value
    return resolved


def launcher_env(flag_values: Mapping[str, Any]) -> dict[str, str]:
    """The ``SYNCDP_*`` variables for the launcher's settings (:func:`resolve`).

    A false boolean is exported too (``--no-autotune``, a config file's ``enabled: false``):
    it replaces a true variable the ranks would otherwise inherit.

    Args:
        flag_values: Setting name -> the flag's parsed value, None when not given.

    Returns:
        One variable per given setting.
    """
    env = {}
    for s in SETTINGS:
        value = flag_values.get(s.name)
        if value is None:
            continue
        named_file = s.name in ("timeline", "autotune_log_file")
        if value and (named_file or s.name == "host_discovery_script" and os.path.exists(value)):
            value = os.path.abspath(value)  # ranks may start in another working directory
        env[s.env] = s.env_text(value)
    return env


# How the README shows each kind of flag's argument (every float setting is in seconds).
_FLAG_ARG = {bool: "", int: " N", float: " S", str: " FILE"}


def markdown_table() -> str:
    """The README's table of settings, one row per setting."""
    lines = [
        "| `syncdp-run` flag | variable on every rank | `init()` keyword | default | effect |",
        "|---|---|---|---|---|",
    ]
    for s in SETTINGS:
        unit = " (MiB; the variable holds bytes)" if s.flag_unit == MiB else ""
        arg = _FLAG_ARG[s.type] if s.flag_unit == 1 else " MB"
        if s.choices:
            arg = " " + "\\|".join(s.choices)
        lines.append(
            f"| `{s.flag}{arg}` | `{s.env}` | `{s.name}` | {s.default_text()} | {s.doc}{unit} |"
        )
    return "\n".join(lines)
