"""What every process of a launched job carries: the job's settings and its identity.

``syncdp-run`` gives the ranks it starts its environment, as horovodrun does (:func:`exported`:
all but what belongs to its own host or process), with their settings and identity among it
(``SYNCDP_*``, the job's id and secret, the launcher's addresses), exported to other hosts by
name with mpirun's ``-x``. A process the job starts later is not covered by that list: a
replacement or a new warm spare is spawned by a rank, and Open MPI starts it from the daemon on
its host, whose environment is whatever the remote shell gave it (ssh gives a bare one). Without
the job's variables such a process would not know it is elastic, would not look for the job that
spawned it, and would train alone as a second rank 0.

So the launcher names what it exports in ``SYNCDP_CARRIED`` (:func:`carried_names`), and a rank
that spawns passes those variables on with its own values (:func:`spawn_parts`):

- the job's id and secrets (every ``*_SECRET``) through the spawn's MPI info (``PMIX_ENVAR``:
  Open MPI sets them in the new process's environment), never on a command line, where any user
  of the host could read them; Open MPI bounds an info value to 255 characters, which they fit;
- everything else (settings, addresses, ``SYNCDP_CARRIED`` itself, ``PATH``, ``PYTHONPATH``,
  ``LD_LIBRARY_PATH``, the user's ``TF_*`` and ``-x`` variables) as one JSON argument of
  :mod:`syncdp.launch.worker` (``--job-env``), which the supervisor puts into its environment
  before it reads any setting.

The rest of the launcher's environment, which the first ranks get (:func:`exported`), would
not fit there (a proxy URL with its password, Lmod's tables: readable by any user of the host, and
Linux bounds one argument to 128 KiB). The spawned supervisor asks the launcher for it instead,
over the job's authenticated report channel (:data:`REQUEST`, :func:`syncdp.watch.report.ask`;
:func:`launcher_env` is the answer), and puts it under the carried values (:func:`widen`).

A process that was spawned (``SYNCDP_REPLACEMENT`` set) and still lacks them refuses to train
(:func:`missing`, checked by ``syncdp.init()``).

This module imports neither TensorFlow nor MPI: the supervisor uses it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping

from syncdp.watch import report

__all__ = [
    "CARRIED_VAR",
    "JOB_ENV_FLAG",
    "REQUEST",
    "exported",
    "carried_names",
    "carried",
    "spawn_parts",
    "apply",
    "launcher_env",
    "widen",
    "missing",
]

CARRIED_VAR = "SYNCDP_CARRIED"
# The request (syncdp.watch.report.ask) a spawned supervisor makes for the launcher's environment.
REQUEST = "job_env"
# The worker's argument that carries the job's environment, as JSON (see the docstring).
JOB_ENV_FLAG = "--job-env"
# Where the launcher's lifeline and report server listen (syncdp.launch.lifeline,
# syncdp.watch.report).
_LIFELINE_VAR = "SYNCDP_LIFELINE_ADDR"
# Set by the supervisor for its own process only: never carried to another.
_PER_PROCESS = frozenset({"SYNCDP_REPLACEMENT", "SYNCDP_NEW_SPARE"})
# Through the spawn's MPI info, never on a command line: these and every *_SECRET.
_SECRET = (report.JOB_VAR, report.SECRET_VAR)
# Open MPI's bound on an MPI info value (MPI_MAX_INFO_VAL, 256 with its terminating NUL).
_INFO_VALUE_CHARS = 255
# What a process of a launched job cannot do without.
_IDENTITY = ("SYNCDP_LAUNCHER", report.JOB_VAR, report.SECRET_VAR, _LIFELINE_VAR)


# The launcher's variables it does not give the ranks: those of its own host and login (as
# horovodrun leaves out OLDPWD, BASH_FUNC_* and CUDA_VISIBLE_DEVICES; the remote shell sets
# HOME, USER and the like for the host), and those that MPI, PMIx and the batch systems set per
# process or read themselves (OMPI_MCA_* reach the ranks through mpirun; -x would give every
# rank the launcher's own OMPI_COMM_WORLD_RANK or SLURM_PROCID).
_NOT_EXPORTED = re.compile(
    r"BASH_FUNC_.*|OLDPWD|PWD|HOSTNAME|HOST|HOME|USER|LOGNAME|SHELL|MAIL|SHLVL|_|SSH_.*|DISPLAY"
    r"|KRB5CCNAME|DBUS_SESSION_BUS_ADDRESS"
    r"|.*CUDA_VISIBLE_DEVICES|ROCR_VISIBLE_DEVICES|HIP_VISIBLE_DEVICES|GPU_DEVICE_ORDINAL"
    r"|ZE_AFFINITY_MASK|PMI_.*|MPI_LOCALRANKID|PBS_.*|LSB_.*"
    r"|XDG_RUNTIME_DIR|XDG_SESSION_.*|OMPI_(?!ALLOW_RUN_AS_ROOT).*|PMIX_.*|PRTE_.*|PRRTE_.*"
    r"|SLURM_.*|SLURMD_.*"
)


def _spawns_carry(name: str) -> bool:
    """Whether a spawned process carries the launcher's ``name`` (besides the user's ``-x``
    names): its job environment travels on its supervisor's command line, where any user of the
    host can read it and Linux bounds one argument to 128 KiB, so not the whole environment (a
    proxy URL with a password, Lmod's tables) but the job's and what the ranks need to start;
    its supervisor asks the launcher for the rest (:func:`widen`)."""
    return name.startswith(("SYNCDP_", "TF_", "OMPI_ALLOW")) or name in (
        "PYTHONUNBUFFERED",
        "PYTHONPATH",
        "PATH",
        "LD_LIBRARY_PATH",
    )


def exported(name: str) -> bool:
    """Whether the launcher gives its variable ``name`` to every rank, on every host (by name,
    with mpirun's ``-x``), as horovodrun does: all but those of its own host and session and
    Open MPI's, PMIx's and Slurm's per-process ones."""
    return _NOT_EXPORTED.fullmatch(name) is None


def carried_names(env: Mapping[str, str], extra: Iterable[str] = ()) -> list[str]:
    """The variables of ``env`` every process of the job must carry, for ``SYNCDP_CARRIED``.

    Args:
        env: The ranks' environment, as the launcher built it.
        extra: More names to carry (the user's ``-x NAME`` in ``--mpi-args``, and the Open MPI
            settings the launcher or the user put in the environment). Defaults to none.

    Returns:
        The names, sorted: those of ``env`` that are the job's (``SYNCDP_*``), ``TF_*``,
        ``PATH``, ``PYTHONPATH``, ``LD_LIBRARY_PATH``, ``PYTHONUNBUFFERED`` and
        ``OMPI_ALLOW_*``, and ``extra``. Not the rest of the launcher's environment, which the
        first ranks get (:func:`exported`): it would ride on a command line (a spawned
        supervisor asks the launcher for it instead).
    """
    names = {n for n in env if _spawns_carry(n)} | set(extra)
    return sorted(names - _PER_PROCESS - {CARRIED_VAR})


def carried(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's values of the variables its job carries (empty outside a launched job)."""
    environ = os.environ if environ is None else environ
    names = [n for n in environ.get(CARRIED_VAR, "").split(",") if n]
    found = {n: environ[n] for n in names if n in environ and n not in _PER_PROCESS}
    if found:
        found[CARRIED_VAR] = environ[CARRIED_VAR]
    return found


def spawn_parts(environ: Mapping[str, str] | None = None) -> tuple[list[str], str]:
    """What a spawn passes on: the worker's arguments and the MPI info's ``PMIX_ENVAR`` value.

    Returns:
        ``([JOB_ENV_FLAG, json], envar)``: the arguments (empty outside a launched job) and
        the ``NAME=VALUE`` lines of the job's id and secret ("" when it has none).

    Raises:
        ValueError: The id and secret do not fit an MPI info value (never with the launcher's).
    """
    env = carried(environ)
    secret = {n: env.pop(n) for n in sorted(env) if n in _SECRET or n.endswith("_SECRET")}
    envar = "\n".join(f"{n}={v}" for n, v in secret.items())
    if len(envar) > _INFO_VALUE_CHARS or any("\n" in v for v in secret.values()):
        raise ValueError(
            f"the job's id and secret take {len(envar)} characters; an MPI info value holds "
            f"{_INFO_VALUE_CHARS}"
        )
    args = [JOB_ENV_FLAG, json.dumps(env, sort_keys=True)] if env else []
    return args, envar


def apply(argv: list[str], environ: dict[str, str]) -> list[str]:
    """The supervisor's side: takes ``--job-env JSON`` off the front of ``argv`` into
    ``environ`` (the job's values win over the host's) and returns the rest of ``argv``."""
    if len(argv) >= 2 and argv[0] == JOB_ENV_FLAG:
        environ.update({str(k): str(v) for k, v in json.loads(argv[1]).items()})
        return argv[2:]
    return argv


def launcher_env(env: Mapping[str, str]) -> str:
    """The launcher's answer to a spawned supervisor's :data:`REQUEST`: the variables of
    the ranks' environment ``env`` that it exports to the first ranks (:func:`exported`), as
    JSON; not those a spawned process carries already (the job's settings and identity,
    :func:`carried_names`), so the job's secret never travels this way."""
    carried = set(env.get(CARRIED_VAR, "").split(",")) | {CARRIED_VAR}
    wider = {
        n: v
        for n, v in env.items()
        if exported(n) and n not in carried and not _spawns_carry(n) and not n.endswith("_SECRET")
    }
    return json.dumps(wider, sort_keys=True)


def widen(environ: dict[str, str], launchers: Mapping[str, str]) -> list[str]:
    """The spawned supervisor's side: puts the launcher's environment ``launchers`` into
    ``environ`` as mpirun's ``-x`` would have, under the values the spawning rank carried (the
    job's, which win) and never a per-process variable; returns the names it set."""
    keep = set(environ.get(CARRIED_VAR, "").split(",")) | _PER_PROCESS | {CARRIED_VAR}
    names = [str(n) for n in launchers if n not in keep and exported(str(n))]
    environ.update({n: str(launchers[n]) for n in names})
    return names


def missing(environ: Mapping[str, str] | None = None, *, elastic: bool) -> list[str]:
    """What a spawned process lacks of its job's settings and identity (empty: nothing).

    Args:
        environ: The process's environment. Defaults to ``os.environ``.
        elastic: Whether its settings say elastic mode (every spawned process is elastic).
    """
    environ = os.environ if environ is None else environ
    lacking = [] if elastic else ["SYNCDP_ELASTIC (or --min-np, --max-np)"]
    return lacking + [n for n in _IDENTITY if not environ.get(n)]
