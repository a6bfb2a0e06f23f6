"""The launcher's last resort: it kills what is left of the job on a host whose ranks never
reported.

A supervisor (:mod:`syncdp.launch.worker`) ends its rank and Open MPI's daemon itself when the
launcher goes away, but a process that cannot run cannot do that: on a host whose processes were all
stopped (SIGSTOP, a frozen container, a debugger), the daemon, the supervisors and the ranks
stay there for good. So the launcher sweeps such a host itself, through the remote shell Open
MPI used to start the daemon there (the ``plm_rsh_agent`` in ``--mpi-args``, or ssh with the
job's port and key; a host that is this machine needs none): the moment the host falls silent
(:mod:`syncdp.launch.lifeline` tells), and at the end of the job for every host with ranks that
never reported how they ended.

A sweep sends SIGKILL (which also ends a stopped process) to the processes of this host that
are this job's, and to nothing else: those whose environment holds ``SYNCDP_JOB_ID`` with this
job's id (every supervisor and rank, and whatever a rank started), and Open MPI's processes
whose command line names this job's mpirun (``prterun-LAUNCHERHOST-PID@``, the daemon and the
shell that started it). It looks only at processes in its own network namespace (a host is a
network identity: containers or namespaces that share a kernel are told apart) and never at
itself or its parents. Each sweep ends within :data:`SWEEP_SECONDS` (a remote shell that hangs
on an unreachable host is killed), and the launcher prints one line saying what it cleaned up
where, just before its verdict::

    syncdp-run: cleaned up what was left of the job: on hb, 5 processes killed (prted x2, python
    x2, sh); hc could not be reached (no answer within 8 s)

Files too: each Open MPI process on a host keeps a shared-memory segment in ``/dev/shm``
(``sm_segment.HOST.UID.JOBID.LOCALRANK``) and removes it in ``MPI_Finalize``; one that was
killed (a lost rank, a spare that died) leaves its segment there for good. While the job runs,
:class:`ShmLeftovers` learns from the job's processes on the launcher's host which segments are
theirs (the upper half of the job id is mpirun's, shared by the processes a recovery spawns),
and when the job ends it removes the job's segments that no process maps or holds open. What
no launcher was there to remove (a killed launcher's job, a process that ran without one) goes
when the next job starts: :func:`remove_stale_segments` removes this user's segments on the
launcher's host (by the host name in theirs) that nothing holds and that are a minute old.

And Open MPI's session directories: mpirun keeps its PMIx rendezvous files in ``ompi.PID``
under the temporary directory (``$TMPDIR``, else ``/tmp``) and removes it when it exits; a
killed mpirun leaves it, and a killed Open MPI daemon its ``prted.PID``. Process ids come round
again, and a later mpirun or daemon that gets the same id finds that directory and stops at once
("The PMIx server's listener thread failed to start", exit 213). Before it starts mpirun, the
launcher removes such directories on this host whose process is gone
(:func:`remove_stale_session_dirs`).
"""

from __future__ import annotations

import collections
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from syncdp.launch.hosts import Host, is_local

if TYPE_CHECKING:
    from syncdp.launch.lifeline import Link

__all__ = [
    "STALE_SEGMENT_SECONDS",
    "remove_stale_segments",
    "SWEEP_SECONDS",
    "Sweeper",
    "ShmLeftovers",
    "sweep_command",
    "remove_directory",
    "remove_stale_session_dirs",
    "session_members",
]

# The most a sweep of one host takes, remote shell included.
SWEEP_SECONDS = 5.0

# Runs on the host: argv[1] is the job id, argv[2] + argv[3] the mark of its mpirun's daemons
# (given in two parts, so that no command line, this one's included, holds it whole). Prints
# "PID NAME" for each process it killed.
_SWEEP = r"""
import os, signal, sys
job = b"\0SYNCDP_JOB_ID=" + sys.argv[1].encode() + b"\0"
daemon = (sys.argv[2] + sys.argv[3]).encode()
def read(pid, what):
    try:
        with open(f"/proc/{pid}/{what}", "rb") as f:
            return f.read()
    except OSError:
        return b""
def net(pid):
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None
mine, pid, spare = net("self"), os.getpid(), set()
while pid > 1 and pid not in spare:
    spare.add(pid)
    try:
        pid = int(read(pid, "stat").rsplit(b")", 1)[1].split()[1])
    except (IndexError, ValueError):
        break
for name in os.listdir("/proc"):
    if not name.isdigit() or int(name) in spare or net(name) != mine:
        continue
    ours = job in b"\0" + read(name, "environ")
    if ours or (sys.argv[2] and daemon in read(name, "cmdline")):
        comm = read(name, "comm").decode(errors="replace").strip() or "?"
        try:
            os.kill(int(name), signal.SIGKILL)
        except OSError:
            continue
        print(name, comm)
"""


def sweep_command(
    job_id: str, mpirun_pid: int | None, launcher_host: str | None = None
) -> list[str]:
    """The command that kills this job's processes on the host it runs on (see the module
    docstring); its output is one ``PID NAME`` line per process killed.

    Args:
        job_id: The job's ``SYNCDP_JOB_ID``.
        mpirun_pid: mpirun's process id (its daemons' mark), or None to spare Open MPI's daemons
            that lack the job's environment.
        launcher_host: The launcher's host name, as Open MPI writes it (short). Defaults to this
            machine's.
    """
    if mpirun_pid is None:
        mark = ("", "")
    else:
        name = (launcher_host or socket.gethostname()).split(".")[0]
        mark = (f"prterun-{name}-", f"{mpirun_pid}@")
    return [sys.executable, "-c", _SWEEP, job_id, *mark]


def _run(cmd: list[str], timeout: float) -> tuple[str | None, str]:
    """Runs ``cmd`` for at most ``timeout`` seconds: (its stdout, or None, and why not)."""
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # so that a hung remote shell can be killed with its children
        )
    except OSError as e:
        return None, f"{cmd[0]!r} could not run: {e.strerror}"
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            proc.communicate(timeout=1.0)
        except subprocess.TimeoutExpired:  # a grandchild outside the group holds the pipes
            pass
        return None, f"no answer within {timeout:g} s"
    if proc.returncode != 0:
        detail = (err.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        return None, detail[:200]
    return out, ""


class Sweeper:
    """Sweeps the job's hosts (see the module docstring); each host at most once.

    Thread-safe: the lifeline's thread starts sweeps, the launcher's main thread finishes them.

    Args:
        job_id: The job's id.
        shell: The remote shell, ``[*shell, HOST, COMMAND]``
            (:func:`syncdp.launch.hosts.remote_shell`).
        hosts: The hosts of ``-H``/``--hostfile``, in order; empty for a job on this machine.
        timeout: The most one sweep takes. Defaults to :data:`SWEEP_SECONDS`.
    """

    def __init__(
        self,
        job_id: str,
        shell: Sequence[str],
        hosts: Sequence[Host] = (),
        *,
        timeout: float = SWEEP_SECONDS,
    ):
        self.job_id = job_id
        self.shell = list(shell)
        self.hosts = list(hosts)
        self.timeout = timeout
        self.mpirun_pid: int | None = None
        self._threads: dict[str, threading.Thread] = {}
        self._results: dict[str, tuple[str | None, str]] = {}
        self._lock = threading.Lock()

    def host_of(self, rank: int, reported: str | None = None, address: str | None = None) -> str:
        """The name the remote shell reaches ``rank``'s host by: the listed host its supervisor
        named (exactly, or by short name) or that is the address its lifeline came from, else
        the host Open MPI's default mapping (by slot, in list order) put it on;
        ``"localhost"`` for a job on this machine."""
        if not self.hosts:
            return "localhost"
        names = [h.name for h in self.hosts]
        if address is not None and address in names:
            return address
        if reported is not None:
            short = reported.split(".")[0]
            for name in names:
                if name in (reported, short) or name.split(".")[0] == short:
                    return name
        first = 0
        for h in self.hosts:
            if rank < first + h.slots:
                return h.name
            first += h.slots
        return reported or self.hosts[-1].name

    def start(self, host: str) -> None:
        """Starts sweeping ``host`` in the background, unless it was already."""
        with self._lock:
            if host in self._threads:
                return
            thread = threading.Thread(
                target=self._sweep, args=(host,), name="syncdp-sweep", daemon=True
            )
            self._threads[host] = thread
        thread.start()

    def start_all(self) -> None:
        """Starts sweeping every host of the job (this machine for a job without hosts)."""
        for host in self.hosts or [Host("localhost", 1)]:
            self.start(host.name)

    def on_lost(self, host: str | None, links: Iterable[Link]) -> None:
        """For :class:`syncdp.launch.lifeline.LifelineServer`: sweeps the host that fell silent."""
        for link in links:
            if isinstance(link.rank, int):
                self.start(self.host_of(link.rank, host, link.address))

    def _sweep(self, host: str) -> None:
        command = sweep_command(self.job_id, self.mpirun_pid)
        if is_local(host):
            result = _run(command, self.timeout)
        else:
            result = _run([*self.shell, host, shlex.join(command)], self.timeout)
        with self._lock:
            self._results[host] = result

    def finish(self, ranks: Iterable[int], links: Mapping[int, Link]) -> str | None:
        """Sweeps the hosts of ``ranks`` (those never reported how they ended) not swept yet,
        waits for every sweep (bounded), and says what was cleaned up where.

        Args:
            ranks: The ranks that never reported; the hosts of those whose supervisors may
                still be there (lifeline still open, or never connected) are swept.
            links: Each rank's lifeline, for the host its supervisor named.

        Returns:
            One line for the launcher to print, or None when no sweep found anything or failed.
        """
        for rank in ranks:
            link = links.get(rank)
            if link is None:
                self.start(self.host_of(rank))  # never connected: where mpirun put it
            elif link.closed is None:  # a closed lifeline is a dead supervisor: its rank died too
                self.start(self.host_of(rank, link.host, link.address))
        deadline = time.monotonic() + self.timeout + 2.0
        with self._lock:
            threads = dict(self._threads)
        for thread in threads.values():
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        with self._lock:
            results = dict(self._results)
        parts = []
        for host in sorted(threads):
            out, why = results.get(host, (None, "the sweep did not finish"))
            if out is None:
                parts.append(f"{host} could not be cleaned up ({why})")
                continue
            names = collections.Counter(line.split(" ", 1)[-1] for line in out.splitlines())
            if names:
                count = sum(names.values())
                what = ", ".join(
                    f"{name} x{n}" if n > 1 else name for name, n in sorted(names.items())
                )
                parts.append(f"on {host}, {count} process{'es' * (count > 1)} killed ({what})")
        if not parts:
            return None
        return "cleaned up what was left of the job: " + "; ".join(parts)


def remove_directory(directory: str, shell: Sequence[str], hosts: Iterable[str]) -> str | None:
    """Removes ``directory`` (an elastic job's commits, :mod:`syncdp.membership.commits`) on every
    one of ``hosts``, in parallel, each within :data:`SWEEP_SECONDS`; its parent too when that
    is left empty.

    Returns:
        One line naming the hosts where it could not be removed, or None when it was removed
        everywhere.
    """
    parent = os.path.dirname(os.path.normpath(directory))
    command = f"rm -rf {shlex.quote(directory)}; rmdir {shlex.quote(parent)} 2>/dev/null; true"
    results: dict[str, tuple[str | None, str]] = {}

    def remove(host: str) -> None:
        if is_local(host):
            results[host] = _run(["sh", "-c", command], SWEEP_SECONDS)
        else:
            results[host] = _run([*shell, host, command], SWEEP_SECONDS)

    threads = [threading.Thread(target=remove, args=(h,), daemon=True) for h in sorted(set(hosts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SWEEP_SECONDS + 2)
    failed = {h: why for h, (out, why) in sorted(results.items()) if out is None}
    if not failed:
        return None
    where = "; ".join(f"{h} ({why})" for h, why in failed.items())
    return f"the job's commits could not be removed from {directory} on {where}"


_SESSION_DIR = re.compile(r"(?:ompi|prted)\.(\d+)")  # mpirun's, and each Open MPI daemon's


def _temporary_base(env: Mapping[str, str]) -> str:
    """Where Open MPI puts its session directories, given mpirun's environment ``env``: the
    first of ``$TMPDIR``, ``$TEMP`` and ``$TMP`` that is set, else ``/tmp``."""
    for name in ("TMPDIR", "TEMP", "TMP"):
        if env.get(name):
            return env[name]
    return "/tmp"


def remove_stale_session_dirs(env: Mapping[str, str] | None = None) -> list[str]:
    """Removes this user's Open MPI session directories (``ompi.PID``, a daemon's
    ``prted.PID``) whose process is gone.

    Args:
        env: mpirun's environment, which says where they are. Defaults to this process's.

    Returns:
        The names removed.
    """
    base = _temporary_base(os.environ if env is None else env)
    try:
        names = os.listdir(base)
    except OSError:
        return []
    removed = []
    for name in names:
        found = _SESSION_DIR.fullmatch(name)
        if found is None or os.path.exists(f"/proc/{found[1]}"):
            continue
        path = os.path.join(base, name)
        try:
            if os.lstat(path).st_uid != os.getuid() or os.path.islink(path):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(name)
    return removed


# A segment younger than this is left alone by remove_stale_segments: its process may be
# between creating and mapping it (Open MPI holds it open meanwhile; this is a second guard).
STALE_SEGMENT_SECONDS = 60.0


def remove_stale_segments(
    directory: str = "/dev/shm", min_age: float = STALE_SEGMENT_SECONDS
) -> list[str]:
    """Removes this user's Open MPI shared-memory segments of this host (by the host name in
    theirs) in ``directory`` that no process here maps or holds open and that are older than
    ``min_age`` seconds: what killed
    processes of earlier jobs left when no launcher was there to remove them (the launcher was
    killed too, or the process ran without one, as a singleton).

    Returns:
        The names removed.
    """
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    uid, now = os.getuid(), time.time()
    # Only this host's own: containers that share /dev/shm but not the process table (their
    # processes out of sight here) go by other host names.
    here = {socket.gethostname(), socket.gethostname().split(".")[0], socket.getfqdn()}
    stale = set()
    for name in names:
        mark = ShmLeftovers.parse(name)
        if mark is None or mark[0] != str(uid):
            continue
        if name[len(ShmLeftovers.PREFIX) :].rsplit(".", 3)[0] not in here:
            continue
        path = os.path.join(directory, name)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode) and info.st_uid == uid and now - info.st_mtime > min_age:
            stale.add(path)
    return _remove_unheld(stale)


def _remove_unheld(paths: set[str]) -> list[str]:
    """Removes those of ``paths`` that no process here maps or holds open; their names."""
    if not paths:
        return []
    removed = []
    for path in sorted(paths - _held(paths)):
        try:
            os.unlink(path)
            removed.append(os.path.basename(path))
        except OSError:
            pass
    return removed


class ShmLeftovers:
    """The job's Open MPI shared-memory segments on this host (see the module docstring).

    Args:
        root: mpirun's process id: its descendants on this host are the job's processes.
        directory: Open MPI's backing directory. Defaults to ``/dev/shm``.
    """

    PREFIX = "sm_segment."

    def __init__(self, root: int, directory: str = "/dev/shm"):
        self.root = root
        self.directory = directory
        self._mark: tuple[str, str] | None = None  # (uid, upper job id): the job's

    def look(self) -> None:
        """Learns which segments are the job's from a process of it, until one is found."""
        if self._mark is not None:
            return
        for pid in _descendants(self.root):
            for path in _mapped(pid, self.directory):
                mark = self.parse(os.path.basename(path))
                if mark is not None:
                    self._mark = mark
                    return

    def remove(self) -> list[str]:
        """Removes the job's segments that no process maps or holds open; returns their names."""
        if self._mark is None:
            return []
        try:
            names = os.listdir(self.directory)
        except OSError:
            return []
        ours = {os.path.join(self.directory, n) for n in names if self.parse(n) == self._mark}
        return _remove_unheld(ours)

    @classmethod
    def parse(cls, name: str) -> tuple[str, str] | None:
        """``sm_segment.HOST.UID.JOBID.N`` -> (UID, the upper half of JOBID): a host's name
        does not matter, hosts that share this directory share it with this job's too."""
        if not name.startswith(cls.PREFIX):
            return None
        parts = name[len(cls.PREFIX) :].rsplit(".", 3)
        if len(parts) != 4 or not all(parts) or not (parts[1] + parts[3]).isdigit():
            return None
        _, uid, job, _ = parts
        if len(job) < 5 or job.strip("0123456789abcdef"):
            return None
        return uid, job[:-4]  # Open MPI's job ids: mpirun's 16 bits, then its job's 16


def _processes() -> dict[int, list[bytes]]:
    """Every process on this host: its ``/proc/PID/stat`` fields after the command's name
    (state, parent, process group, session, ...); empty without ``/proc``."""
    try:
        names = os.listdir("/proc")
    except OSError:  # not Linux
        return {}
    found = {}
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 3:
            found[int(name)] = fields
    return found


def _descendants(root: int) -> list[int]:
    """``root`` and every process below it, on this host."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for pid, fields in _processes().items():
        children[int(fields[1])].append(pid)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def session_members(session: int) -> list[int]:
    """The live processes of this host in session ``session``, other than this one."""
    me, key = os.getpid(), str(session).encode()
    return [
        pid
        for pid, fields in _processes().items()
        if pid != me and fields[3] == key and fields[0] != b"Z"
    ]


def _mapped(pid: int | str, directory: str) -> set[str]:
    """The files under ``directory`` that process ``pid`` maps."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return set()
    prefix = directory.rstrip("/") + "/"
    return {line.split(None, 5)[-1] for line in text.splitlines() if prefix in line}


def _held(paths: set[str]) -> set[str]:
    """Those of ``paths`` that some process on this host maps or holds open."""
    directory = os.path.dirname(next(iter(paths)))
    held: set[str] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        held |= _mapped(name, directory) & paths
        try:
            fds = os.listdir(f"/proc/{name}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{name}/fd/{fd}")
            except OSError:
                continue
            if target in paths:
                held.add(target)
    return held
