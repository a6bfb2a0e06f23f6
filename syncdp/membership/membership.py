"""Elastic membership: who is in the job, and how it heals when a rank is lost (Open MPI ULFM).

Elastic mode (``syncdp-run --min-np M``, ``--max-np K`` or ``--elastic``) starts mpirun with
``--with-ft ulfm``: a rank that dies no longer ends the job. The survivors notice in a collective
(:class:`~syncdp.base.errors.RankFailureError`), and :func:`recover` heals the job in place:

1. revoke the job's communicator, so every survivor leaves whatever collective it was in;
2. ``Shrink`` it to the survivors (they keep their order: ranks are renumbered consistently,
   the lowest surviving rank becomes rank 0);
3. rank 0 decides how many replacements to start: back to the target size, at most the free
   slots the host discovery script reports (hosts it stopped listing are never used again);
4. ``Spawn`` them (each runs the same program under the launcher's supervisor) and ``Merge``
   them in after the survivors.

The runtime then rebuilds everything on the merged communicator, the same code a replacement
runs in ``init()`` (:func:`join_parent` gives it its side of the merge), and rank 0 sends the
launcher a ``membership`` report. A failure during recovery (a survivor or a replacement lost
meanwhile) starts it over from the shrink.

With warm spares (:mod:`syncdp.membership.spares`) :func:`reseat` does the same on the *reserve*
(ranks and spares together): the spares alive take the lost places, and only what they cannot
fill is spawned.

The :class:`Plan` (target size, limits, labels, hosts) lives on every rank and is broadcast by
rank 0 whenever the membership changes, so replacements learn it too.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from syncdp.base import mpi
from syncdp.base.errors import ConfigError, ElasticAbortError
from syncdp.membership import jobenv, spares
from syncdp.watch import report

__all__ = [
    "Member",
    "Plan",
    "me",
    "join_parent",
    "join_reserve",
    "recover",
    "reseat",
    "grow",
    "revoke",
    "discover_slots",
    "discovery_slots",
    "Looker",
]

REPLACEMENT_VAR = "SYNCDP_REPLACEMENT"
LOST_HOSTS_VAR = "SYNCDP_LOST_HOSTS"
# The membership changes and restarts earlier runtimes of the job used (--reset-limit counts on).
RESETS_USED_VAR = "SYNCDP_RESETS_USED"
# The slots of a discovery script's host printed without a count (--slots-per-host).
DISCOVERY_SLOTS_VAR = "SYNCDP_DISCOVERY_SLOTS"
# Recovery attempts in a row before the job ends instead (each one follows a new failure).
RECOVERY_ATTEMPTS = 5
# A host discovery script that does not answer within this long is treated as listing nothing.
_DISCOVERY_TIMEOUT_SECONDS = 30.0
# The fewest seconds between two runs of the discovery script to look for new slots.
DISCOVERY_INTERVAL_SECONDS = 2.0
# The discovery script's lines already said to be ignored.
_IGNORED_LINES: set[str] = set()
# One line of the discovery script's output: a host name or address, then ":slots" or nothing.
_DISCOVERY_LINE = re.compile(r"(?P<host>[^\s:]+)(?::(?P<slots>\d+))?")


@dataclasses.dataclass(frozen=True)
class Member:
    """One rank's process: where it runs and the label its output lines carry."""

    host: str
    pid: int
    label: int


@dataclasses.dataclass
class Plan:
    """What every rank knows about the elastic job; rank 0's copy wins at each change.

    Attributes:
        target: Ranks to keep: replacements are started up to this many.
        min_np: Fewer ranks than this end the job.
        max_np: The most ranks the job grows to when slots are added.
        next_label: The output label of the next replacement (the original ranks are 0..N-1).
        resets: Membership changes so far.
        reset_limit: The most changes allowed (0: no limit).
        script: The host discovery script, or "".
        seen_hosts: Every host the script has listed; one it stops listing has vanished.
        vanished: Hosts never to be used again: the script stopped listing them, or a
            replacement could not start there.
        command: What a replacement runs: the program as this job started it.
        spares: The warm spares waiting (:mod:`syncdp.membership.spares`); they hold slots too.
        spare_target: The spares to keep (``--spares``): rank 0 starts new ones in the
            background when fewer wait (:mod:`syncdp.membership.refill`).
    """

    target: int
    min_np: int
    max_np: int
    next_label: int
    resets: int = 0
    reset_limit: int = 0
    script: str = ""
    seen_hosts: tuple[str, ...] = ()
    vanished: tuple[str, ...] = ()
    command: tuple[str, ...] = ()
    spares: tuple[Member, ...] = ()
    spare_target: int = 0


def me() -> Member:
    """This process as a Member."""
    label = os.environ.get(REPLACEMENT_VAR) or os.environ.get("OMPI_COMM_WORLD_RANK") or "0"
    return Member(socket.gethostname(), os.getpid(), int(label))


def first_plan(config, size: int, waiting: tuple[Member, ...] = ()) -> Plan:
    """The plan of a job that just started with ``size`` ranks and the spares ``waiting``
    (labelled after the ranks: replacements are labelled after both)."""
    return Plan(
        target=size,
        min_np=config.min_np or size,
        max_np=max(config.max_np or size, size),
        next_label=size + len(waiting),
        spares=tuple(waiting),
        spare_target=len(waiting),
        reset_limit=config.reset_limit,
        resets=int(os.environ.get(RESETS_USED_VAR) or 0),
        script=config.host_discovery_script,
        vanished=lost_hosts(),
        command=(sys.executable, *sys.orig_argv[1:]),
    )


def lost_hosts(environ=None) -> tuple[str, ...]:
    """The hosts an earlier runtime of this job lost, under every name the launcher knows them
    by (``SYNCDP_LOST_HOSTS``): never grown onto again, whatever the discovery script lists."""
    text = (os.environ if environ is None else environ).get(LOST_HOSTS_VAR, "")
    return tuple(sorted({h for h in text.split(",") if h}))


def join_parent():
    """A replacement's side of the merge: the job's communicator with this rank in it.

    Returns:
        The merged intracommunicator, or None when this process was not spawned by a recovery
        (a spare started in the background joins through :func:`syncdp.membership.refill.join`).
    """
    if not os.environ.get(REPLACEMENT_VAR) or os.environ.get(spares.NEW_SPARE_VAR):
        return None
    MPI = mpi.load()
    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        return None
    merged = parent.Merge(high=True)
    parent.Disconnect()  # see _spawn
    merged.Agree(1)
    return merged


def refuse(label: str, lacking: list[str]) -> None:
    """A spawned process without its job's settings or identity: it never trains.

    Training would make it a job of its own (a second rank 0, a second chief). Leaving before
    MPI starts would leave the spawning ranks waiting in ``MPI_Comm_spawn`` forever (Open MPI
    5.0.11), and leaving before the merge, in ``Merge``; so it takes its side of the merge and
    dies there by SIGKILL, where ULFM tells the spawning ranks at once: their recovery fails and
    starts over (:data:`RECOVERY_ATTEMPTS` at most), or a new spare counts as not started.

    Raises:
        ConfigError: The process was not spawned at all (``SYNCDP_REPLACEMENT`` set by hand).
    """
    message = (
        f"syncdp: process [{label}] on {socket.gethostname()} was spawned for an elastic job "
        f"but lacks the job's settings and identity ({', '.join(lacking)}): the process that "
        "spawned it did not pass them on. It will not train (it would be a rank 0 of a job of "
        "its own); it ends, and the job goes on without it."
    )
    MPI = mpi.load()
    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        raise ConfigError(
            f"{REPLACEMENT_VAR} is set ({label!r}) but this process was not spawned by a job: "
            "unset it; only syncdp-run's supervisor sets it."
        )
    print(message, file=sys.stderr, flush=True)
    try:
        parent.Merge(high=True)
        parent.Disconnect()
    except MPI.Exception:
        pass
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def join_reserve(merged):
    """A replacement's side of :func:`reseat` once merged (a job with spares): its seat.

    Returns:
        ``(reserve, training)``: the new reserve, and the training communicator (None when
        this process is to wait as a spare).
    """
    return _take_seats(merged, merged.bcast(None, root=0))


def _local(host: str) -> str:
    return socket.gethostname() if host in ("localhost", "127.0.0.1", "") else host


def discovery_slots(environ=None) -> int:
    """The slots of a discovery script's host printed without a count.

    Args:
        environ: Where to read ``SYNCDP_DISCOVERY_SLOTS`` (the launcher's
            ``--slots-per-host``). Defaults to ``os.environ``.

    Returns:
        That number, or 1 when it is not set.
    """
    text = (os.environ if environ is None else environ).get(DISCOVERY_SLOTS_VAR, "")
    return int(text) if text.isdigit() and int(text) > 0 else 1


def discover_slots(
    script: str, default_slots: int | None = None, *, strict: bool = False
) -> dict[str, int] | None:
    """Runs the host discovery script; returns host -> slots (None if it failed).

    The script prints one host per line, ``host:slots`` or ``host``, as horovodrun's
    ``--host-discovery-script``; blank lines are skipped. ``script`` is a program's path, or,
    as in Horovod, a shell command line (``python discover.py``).

    Args:
        script: The script's path, or a command line for ``sh``.
        default_slots: The slots of a host printed without a count. Defaults to
            :func:`discovery_slots`.
        strict: A line that is not ``host[:slots]`` fails the look (the launcher's check
            before the job starts), instead of being left out with a warning.

    Returns:
        Host -> slots, or None when the script could not run or exited non-zero (the reason
        is printed to stderr).
    """
    if default_slots is None:
        default_slots = discovery_slots()
    # A file in the working directory is run by its path (exec looks only on PATH).
    command = [os.path.abspath(script)] if os.path.isfile(script) else ["sh", "-c", script]
    try:
        out = subprocess.run(
            command, capture_output=True, text=True, timeout=_DISCOVERY_TIMEOUT_SECONDS
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"syncdp: host discovery script {script!r} failed: {e}", file=sys.stderr)
        return None
    if out.returncode != 0:
        print(
            f"syncdp: host discovery script {script!r} exited with {out.returncode}: "
            f"{out.stderr.strip()}",
            file=sys.stderr,
        )
        return None
    slots: dict[str, int] = {}
    for line in out.stdout.splitlines():
        line = line.strip()
        if not line:
            continue
        found = _DISCOVERY_LINE.fullmatch(line)
        if found is None or (found["slots"] is not None and int(found["slots"]) < 1):
            what = f"host discovery script {script!r} printed {line!r}, not 'host' or 'host:slots'"
            if strict:
                print(f"syncdp: {what}", file=sys.stderr)
                return None
            if line not in _IGNORED_LINES:  # once: rank 0 looks every few seconds
                _IGNORED_LINES.add(line)
                print(f"syncdp: ignoring a line: {what}", file=sys.stderr)
            continue
        count = found["slots"]
        slots[_local(found["host"])] = int(count) if count is not None else default_slots
    return slots


def free_slots(
    plan: Plan, alive: list[Member], slots: dict[str, int] | None = None
) -> tuple[int | None, list[str]]:
    """Free slots by the discovery script (None: no script, no limit) and their hosts.

    Updates ``plan.seen_hosts`` and ``plan.vanished``.

    Args:
        plan: The job's plan.
        alive: The job's members (and spares: they hold slots too).
        slots: What a look already found (:class:`Looker`). Defaults to running the script.
    """
    if not plan.script:
        return None, []
    if slots is None:
        slots = discover_slots(plan.script)
    if slots is None:
        return 0, []
    gone = set(plan.seen_hosts) - set(slots)
    plan.vanished = tuple(sorted(set(plan.vanished) | gone))
    plan.seen_hosts = tuple(sorted(set(plan.seen_hosts) | set(slots)))
    hosts = []
    # Hosts where ranks still run come first: Open MPI 5.0's runtime (PRRTE 3) can lose its
    # daemon on a host whose every rank died when a replacement is spawned there, and that
    # ends the whole job; the other hosts follow in name order.
    busy = {m.host for m in alive}
    for host, count in sorted(slots.items(), key=lambda item: (item[0] not in busy, item[0])):
        if host in plan.vanished:
            continue
        used = sum(1 for m in alive if m.host == host)
        hosts += [host] * max(0, count - used)
    return len(hosts), hosts


def spawn_where(hosts: list[str]):
    """The MPI info a spawn gets: this directory, the job's id and secret
    (:func:`syncdp.membership.jobenv.spawn_parts`), and ``hosts`` when one of them is another
    host (the caller frees it)."""
    MPI = mpi.load()
    info = MPI.Info.Create()
    info.Set("wdir", os.getcwd())
    _, envar = jobenv.spawn_parts()
    if envar:
        info.Set("PMIX_ENVAR", envar)
    if any(h != socket.gethostname() for h in hosts):
        info.Set("host", ",".join(hosts))
    return info


def worker_args(label: int, command, *, spare: bool = False) -> list[str]:
    """The arguments of a spawned process: the launcher's supervisor with the job's settings
    (:mod:`syncdp.membership.jobenv`), its output label, and the job's command."""
    args, _ = jobenv.spawn_parts()
    spare_flag = ["--spare"] if spare else []
    # -P: not the user's modules from the working directory (see syncdp.launch.run.build_command).
    return [
        "-P",
        "-m",
        "syncdp.launch.worker",
        *args,
        "--replacement",
        str(label),
        *spare_flag,
        *command,
    ]


# One spawn at a time in a process: a recovery's spawn waits for a spare being started in the
# background (syncdp.membership.refill) to finish; the two at once hung Open MPI 5.0.11.
SPAWN_LOCK = threading.Lock()
# How long a recovery waits for that spare before it spawns anyway.
SPAWN_WAIT_SECONDS = 60.0


def _spawn(comm, plan: Plan, count: int, hosts: list[str], first_label: int):
    """Starts ``count`` replacements, labelled from ``first_label``, and merges them in after
    ``comm``'s ranks (collective). :meth:`_Spawns.spawn` is how the changes call it."""
    args = worker_args(first_label, plan.command)
    info = spawn_where(hosts[:count])
    locked = SPAWN_LOCK.acquire(timeout=SPAWN_WAIT_SECONDS)
    try:
        inter = comm.Spawn(sys.executable, args, maxprocs=count, root=0, info=info)
    finally:
        info.Free()
        if locked:
            SPAWN_LOCK.release()
    merged = inter.Merge(high=False)
    # Disconnected while everyone is alive: MPI_Finalize would otherwise disconnect it at
    # exit, and spin forever if a process on the other side has died by then.
    inter.Disconnect()
    # Failures are not reported uniformly: agree that every rank got here, or all start over.
    merged.Agree(1)
    return merged


def _decide(comm, plan: Plan, alive: list[Member], want: int) -> tuple[Plan, int, list[str]]:
    """Rank 0 counts the replacements to start; every rank gets its plan and the count."""
    decision = None
    if comm.Get_rank() == 0:
        free, hosts = free_slots(plan, alive)
        count = max(0, want - len(alive))
        if free is not None:
            count = min(count, free)
        decision = (plan, count, hosts)
    return comm.bcast(decision, root=0)


class _Spawns:
    """The spawns of one membership change, over its attempts (a failure meanwhile starts the
    change over): the labels each takes and those given up, and the hosts to blame.

    Labels are taken before a spawn: if it fails (rank 0 lost in it, say), a process it started
    may still run for a while, and the next spawn must not give its label to another. Rank 0
    names a spawn's labels to the launcher as it begins (a ``spawning`` report), and the
    membership report names the labels given up (``abandoned``): after a loss during a spawn,
    the launcher waits for that report before it judges the exit of a process the spawn
    started, and takes an abandoned one's as no failure. A spawn that failed although no
    process was lost with it has its hosts at fault: rank 0 leaves them out
    (:func:`_leave_out`), never a host where processes of the job run.
    """

    def __init__(self):
        self.abandoned: list[int] = []  # labels of spawns that failed (never reused)
        self._labels: list[int] = []  # the labels of the spawn under way
        self._tried: list[str] = []  # the hosts of the last spawn where none of the job ran
        self._alive = 0  # how many processes the attempt of that spawn had

    def attempt(self, comm, plan: Plan, alive: list[Member]) -> None:
        """At the start of each attempt, once ``alive`` is known and before rank 0 decides:
        rank 0 leaves out the hosts of the last spawn if it failed with nobody lost."""
        if self._tried and len(alive) == self._alive and comm.Get_rank() == 0:
            _leave_out(plan, self._tried)
        self._tried, self._alive = [], len(alive)

    def spawn(self, comm, plan: Plan, count: int, hosts: list[str], alive: list[Member]):
        """:func:`_spawn` with the next ``count`` labels, taken from ``plan`` first."""
        self._tried = sorted(set(hosts[:count]) - {m.host for m in alive})
        self._labels = list(range(plan.next_label, plan.next_label + count))
        plan.next_label += count
        if comm.Get_rank() == 0:  # the launcher may have to wait for this spawn's fate
            members = [[m.host, m.pid] for m in alive]
            report.send("spawning", 0, labels=self._labels, members=members)
        return _spawn(comm, plan, count, hosts, first_label=self._labels[0])

    def done(self) -> None:
        """The change is complete: the processes of its last spawn are in."""
        self._labels = []

    def failed(self, merged=None) -> None:
        """After a failed attempt: its spawn, if any, is given up, and ``merged`` (what the
        spawn made, when the failure came after it) revoked, so that the processes it started
        leave whatever collective they wait in."""
        self.abandoned += self._labels
        self._labels = []
        if merged is not None:
            revoke(merged)


def recover(base, plan: Plan, *, growing: bool = False) -> tuple[object, Plan, dict]:
    """Heals the job after a rank failure: shrink, spawn replacements, merge; or grows it.

    A collective of the survivors: every one of them must call it with the job's (revoked)
    communicator. Growing (``growing``, no failure: :func:`grow`), it spawns into the free slots
    up to ``max_np`` without a shrink; a failure meanwhile makes it a recovery (the next commit
    looks for room to grow again).

    Args:
        base: The job's MPI communicator, in which a rank failed.
        plan: This rank's plan.
        growing: Grow into free slots rather than recover. Defaults to False.

    Returns:
        ``(merged communicator, rank 0's plan, what changed)``; the change has ``survivors``
        (how many ranks shrank to), ``spawned`` (replacements started), ``abandoned`` (labels
        of spawns that failed, :class:`_Spawns`) and ``broken`` (whether ``base`` was revoked:
        a failure, not only growth).

    Raises:
        ElasticAbortError: :data:`RECOVERY_ATTEMPTS` attempts in a row failed (replacements
            that cannot start, say), instead of trying forever.
    """
    MPI = mpi.load()
    attempts = 0
    spawns = _Spawns()
    broken = not growing
    while True:
        attempts += 1
        shrunk = None
        try:
            if broken:
                revoke(base)
                shrunk = base.Shrink()
            else:
                shrunk = base
            alive = [Member(*m) for m in shrunk.allgather(dataclasses.astuple(me()))]
            spawns.attempt(shrunk, plan, alive)
            want = plan.max_np if growing else plan.target
            plan, count, hosts = _decide(shrunk, plan, alive, want)
            _check_min_np(plan, len(alive), count)
            merged = spawns.spawn(shrunk, plan, count, hosts, alive) if count else shrunk.Dup()
            spawns.done()
            if growing:
                plan.target = len(alive) + count
            change = {
                "survivors": len(alive),
                "spawned": count,
                "abandoned": spawns.abandoned,
                "broken": broken,
            }
            return merged, plan, change
        except MPI.Exception as e:
            spawns.failed()
            # Another rank (a survivor or a replacement) was lost meanwhile: start over from
            # the communicator that is left.
            _retry_or_abort(attempts, e)
            if shrunk is not None:
                base = shrunk
            broken = True
            growing = False
            time.sleep(0.1)


def _decide_seats(plan: Plan, alive: list[Member], trainers: int, growing: bool):
    """Rank 0's decision for :func:`reseat`: spares to take, processes to spawn, and where.

    After a failure the spares fill the lost places first, and processes are spawned only
    for what they cannot fill; growing spawns into free slots and leaves the spares waiting
    (:func:`reseat` raises the target once they are in). Spares hold slots: the discovery
    script's free slots are counted with them in.
    """
    waiting = len(alive) - trainers
    want = plan.max_np if growing else plan.target
    take = 0 if growing else min(waiting, max(0, want - trainers))
    free, hosts = free_slots(plan, alive)
    count = max(0, want - trainers - take)
    if free is not None:
        count = min(count, free)
    plan.spares = tuple(alive[trainers + take :])
    return plan, take, count, hosts


def _take_seats(merged, layout):
    """Splits ``merged`` into the new reserve and the training communicator (a collective of
    every process in it, each finding its own seat from the broadcast ``layout``)."""
    MPI = mpi.load()
    trains, key = spares.seat(merged.Get_rank(), *layout)
    reserve = merged.Split(0, key)
    training = reserve.Split(0 if trains else MPI.UNDEFINED, key)
    return reserve, (training if trains else None)


def revoke(*comms) -> None:
    """Revokes each of ``comms`` (None skipped), so that every rank leaves whatever collective
    it waits in; one already revoked or broken is no error."""
    MPI = mpi.load()
    for comm in comms:
        if comm is None:
            continue
        try:
            comm.Revoke()
        except MPI.Exception:
            pass


def reseat(
    reserve,
    plan: Plan | None,
    *,
    trains: bool,
    failure: bool,
    growing: bool = False,
    training=None,
    hand_over=None,
):
    """Rebuilds a job that has warm spares, on its reserve: every rank and spare calls it.

    After a failure (``failure``): revoke the reserve (and ``training``), shrink it to the
    processes alive, let spares take the lost places, spawn only what they cannot fill (at
    most the free slots), then split the new reserve and training communicators
    (:func:`syncdp.membership.spares.seat`). Growing (``growing``, no failure): spawn into free
    slots, the spares stay. A failure meanwhile starts over from the shrink, as a recovery (the
    next commit looks for room to grow again). Labels and hosts are kept as :class:`_Spawns`
    says.

    Args:
        reserve: The reserve communicator: ranks by rank, then spares.
        plan: This process's plan (a spare's is None: rank 0's is the one used).
        trains: Whether this process is a rank (True) or a spare.
        failure: Whether a process was lost.
        growing: Whether to grow into free slots. Defaults to False.
        training: The training communicator, revoked with the reserve. Defaults to None.
        hand_over: Rank 0's source of a spare being started in the background
            (:meth:`syncdp.membership.refill.Keeper.hand_over`): when processes must be spawned,
            that spare is merged in first and takes a lost place instead (a spawn of its own
            next to the background one left MPI_Finalize hanging). Defaults to None.

    Returns:
        ``(reserve, training, plan, change)``: ``training`` is None for a process that stays a
        spare; ``change`` has ``survivors`` (ranks left), ``spawned``, ``spares_used``,
        ``spares_left``, ``abandoned`` (labels of spawns that failed) and ``broken`` (whether
        the communicators passed in were revoked: a failure, not only growth).

    Raises:
        ElasticAbortError: No rank survived (a spare cannot restore the training state), or
            :data:`RECOVERY_ATTEMPTS` attempts in a row failed.
    """
    MPI = mpi.load()
    attempts = 0
    spawns = _Spawns()
    broken = failure
    while True:
        attempts += 1
        shrunk = spawned = None
        try:
            if failure:
                revoke(training, reserve)
                shrunk = reserve.Shrink()
            else:
                shrunk = reserve
            rows = shrunk.allgather((dataclasses.astuple(me()), trains))
            alive = [Member(*m) for m, _ in rows]
            trainers = sum(1 for _, t in rows if t)
            if not rows[0][1]:  # ranks come first: none is left
                raise ElasticAbortError(
                    "every training rank was lost; a spare cannot restore the training state. "
                    "Ending the job."
                )
            spawns.attempt(shrunk, plan, alive)  # rank 0 trains: it has a plan
            decision = None
            if shrunk.Get_rank() == 0:
                decision = _decide_seats(plan, alive, trainers, growing)
                port = hand_over() if decision[2] and hand_over and not growing else None
                if port is not None:
                    decision = ("adopt", port)
            decision = shrunk.bcast(decision, root=0)
            if decision[0] == "adopt":  # the spare started in the background joins first
                inter = shrunk.Connect(decision[1], root=0)
                reserve = inter.Merge(high=False)
                inter.Disconnect()
                failure = False
                continue
            plan, take, count, hosts = decision
            _check_min_np(plan, trainers, take + count)
            layout = (trainers, len(rows) - trainers, take, count)
            merged = shrunk
            if count:
                merged = spawned = spawns.spawn(shrunk, plan, count, hosts, alive)
                merged.bcast(layout, root=0)  # what the spawned learn in join_reserve
            new_reserve, new_training = _take_seats(merged, layout)
            spawns.done()
            if growing:
                plan.target = trainers + count
            change = {
                "survivors": trainers,
                "spawned": count,
                "spares_used": take,
                "spares_left": len(rows) - trainers - take,
                "abandoned": spawns.abandoned,
                "broken": broken,
            }
            return new_reserve, new_training, plan, change
        except MPI.Exception as e:
            spawns.failed(spawned)
            _retry_or_abort(attempts, e)
            if shrunk is not None:
                reserve = shrunk
            failure = broken = True
            growing = False
            time.sleep(0.1)


def _check_min_np(plan: Plan, survivors: int, added: int) -> None:
    """Raises ElasticAbortError on every rank (they share rank 0's decision) when the change
    would leave fewer ranks than ``--min-np`` (``survivors`` and the ``added`` spares and
    replacements there is room for): before anything is spawned for it."""
    if survivors + added < plan.min_np:
        raise ElasticAbortError(
            f"only {survivors + added} rank(s) left after the loss ({survivors} went on, and "
            f"there is room for {added} more); --min-np is {plan.min_np}. Ending the job."
        )


def _leave_out(plan: Plan, hosts: list[str]) -> None:
    """Rank 0, after a spawn on ``hosts`` (from the discovery script) failed although no rank
    was lost: no replacement goes there again, so the next attempt places them elsewhere or
    goes on with the ranks left (down to ``--min-np``), instead of failing the same way until
    the job ends."""
    plan.vanished = tuple(sorted(set(plan.vanished) | set(hosts)))
    print(
        f"syncdp: elastic: a replacement could not start on {', '.join(hosts)}; leaving "
        f"{'it' if len(hosts) == 1 else 'them'} out (every host the discovery script lists "
        "must be in -H or --hostfile, and reachable).",
        file=sys.stderr,
        flush=True,
    )


def _retry_or_abort(attempts: int, error: Exception) -> None:
    """After a failed recovery attempt: says so and returns (try again), or raises
    ElasticAbortError when :data:`RECOVERY_ATTEMPTS` attempts in a row have failed."""
    if attempts >= RECOVERY_ATTEMPTS:
        raise ElasticAbortError(
            f"elastic recovery failed {attempts} times in a row (last: {error}); ending the job."
        ) from None
    print(
        f"syncdp: elastic recovery attempt {attempts} failed ({error}); retrying.",
        file=sys.stderr,
        flush=True,
    )


def grow(comm, plan: Plan) -> tuple[object, Plan, dict]:
    """Adds ranks in the slots the discovery script offers, up to ``max_np`` (collective):
    :func:`recover` growing."""
    return recover(comm, plan, growing=True)


class Looker:
    """Rank 0's looks for room to grow, off the training path.

    The discovery script runs in a thread of its own, at most once every
    :data:`DISCOVERY_INTERVAL_SECONDS` after the last look ended; a commit takes what the last
    finished look found and never waits for the script (a slow or hanging cluster query would
    otherwise hold every rank at every commit).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._found: dict[str, int] | None = None  # the last look's slots, not taken yet
        self._ended = -float("inf")  # time.monotonic() when the last look ended

    def take(self, script: str) -> dict[str, int] | None:
        """The slots a look found since the last take (None: none ended, or it failed);
        starts the next look when none runs and the interval has passed."""
        with self._lock:
            found, self._found = self._found, None
            idle = self._thread is None or not self._thread.is_alive()
            due = time.monotonic() - self._ended >= DISCOVERY_INTERVAL_SECONDS
        if idle and due:
            self._thread = threading.Thread(
                target=self._look, args=(script,), name="syncdp-discovery", daemon=True
            )
            self._thread.start()
        return found

    def _look(self, script: str) -> None:
        slots = discover_slots(script)
        with self._lock:
            self._found = slots
            self._ended = time.monotonic()


def slots_added(comm, plan: Plan, alive: list[Member], looker: Looker) -> bool:
    """Whether the discovery script now offers room to grow (a collective: rank 0 tells).

    Args:
        comm: The job's :class:`~syncdp.transport.communicator.Communicator`.
        plan: This rank's plan (rank 0's is the one used).
        alive: The job's members.
        looker: Rank 0's looks (:class:`Looker`): what the last finished look found.
    """
    grow_now = False
    if comm.rank == 0 and plan.script and len(alive) < plan.max_np:
        alive = list(alive) + list(plan.spares)  # spares hold slots too
        slots = looker.take(plan.script)
        if slots is not None:
            free, _ = free_slots(plan, alive, slots)
            grow_now = bool(free)
    return bool(comm.broadcast_object(grow_now, 0, name="elastic.check_host_updates"))
