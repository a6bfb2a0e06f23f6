"""The rank environment: ``init()``, ``shutdown()``, who this process is, and what ends the job.

``import syncdp`` starts nothing. ``init()``:

1. reads the settings (:mod:`syncdp.base.settings`) and starts MPI (:mod:`syncdp.base.mpi`);
2. tells the launcher this rank has arrived (before starting MPI, whose own start-up already
   waits for every rank), then waits at most ``start_timeout`` seconds for
   every other rank to arrive (a non-blocking duplicate of the communicator, polled against the
   deadline); if one never comes, the job ends and the launcher names it;
3. builds the :class:`~syncdp.transport.communicator.Communicator` on that private duplicate, the
   topology from shared-memory splits (:mod:`syncdp.base.topology`), and the timeline;
4. pins this rank's GPU by local rank and installs a hook that ends the whole job when an
   exception escapes on any rank, so no other rank is left waiting in a collective.

``shutdown()`` releases all of it (communicators, watchdog thread, timeline), and a later
``init()`` builds it again. The communicator is a value held here, not a global fixed at
import: every layer above asks :func:`communicator` for the current one.

In elastic mode :func:`reset` swaps it after a rank failure (:mod:`syncdp.membership.membership`:
revoke, shrink, spawn, merge) and rebuilds everything above on the new one with the same code
``init()`` runs, which a replacement runs too, so both sides make the same collectives. With
warm spares (``syncdp-run --spares K``, :mod:`syncdp.membership.spares`) the last K processes wait
inside ``init()``; a recovery makes one of them a rank, and it returns from ``init()`` as a
replacement would. ``shutdown()`` on rank 0 releases the spares still waiting.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import operator
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from typing import NamedTuple

from syncdp.base import mpi, settings
from syncdp.base.errors import (
    ConfigError,
    ElasticAbortError,
    NotInitializedError,
    RankFailureError,
)
from syncdp.base.topology import Topology, discover
from syncdp.membership import jobenv, membership, refill, spares
from syncdp.transport.communicator import Communicator
from syncdp.watch import report, stats
from syncdp.watch.timeline import Timeline, gather_and_write

__all__ = [
    "init",
    "shutdown",
    "is_initialized",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "cross_rank",
    "cross_size",
    "is_chief",
    "is_homogeneous",
    "start_timeline",
    "stop_timeline",
    "communicator",
    "get_config",
    "topology",
    "timing",
    "reset",
    "on_reset",
    "members",
    "elastic_plan",
    "tend_spares",
    "plug_process_sets",
]

_POLL_SECONDS = 0.01
# Open MPI's switch that leaves the PMIx fence out of MPI_Finalize (elastic mode sets it).
ASYNC_FINALIZE_VAR = "OMPI_MCA_async_mpi_finalize"


class _State:
    comm: Communicator | None = None
    config: settings.Config | None = None
    topology: Topology | None = None
    # A second duplicate, for the exit handshake (see _at_exit).
    exit_comm = None
    # The process-set layer's hooks (plug_process_sets): it sits above the runtime, which
    # calls into it only through these and never imports it.
    sets = None
    hook_installed = False
    atexit_registered = False
    # Elastic mode: every rank's process (rank order) and the plan (syncdp.membership.membership).
    members: list = []
    plan = None
    # Functions called after every membership change (step counters, Horovod's callbacks).
    reset_callbacks: list = []
    # Elastic mode: from a membership change (or a late join) until the next State.sync(), the
    # ranks' steps may differ by design (a replacement's optimizer counts from 0, the
    # survivors' from their last commit), so the step check is off (steps_agree()).
    steps_unsynced = False
    # Warm spares (syncdp.membership.spares): every live process of the job, ranks then spares.
    reserve = None
    # Rank 0's care of the spares (syncdp.membership.refill): new ones started in the background.
    keeper = None
    # Elastic mode: every rank finished an elastic.run (its final agreement); a rank lost from
    # then on leaves nothing to recover.
    trained = False


_state = _State()


def init(comm=None, process_sets=None, **options) -> None:
    """Initializes syncdp on this rank; starts MPI if nothing has yet.

    A synchronization point: every rank must call it. Calling it again after a successful
    ``init()`` only registers the ``process_sets`` not registered yet; after ``shutdown()`` it
    initializes again.

    Args:
        comm: The processes that train together: an mpi4py communicator (syncdp works on a
            private duplicate and leaves it to the caller), or, as in Horovod, a list of
            ``COMM_WORLD`` ranks, whose ``i``-th becomes rank ``i``. With a list, only the
            listed processes take part (the communicator is made among them alone), and a
            process not in the list raises :class:`~syncdp.base.errors.ConfigError` (Horovod's
            falls back to ``COMM_WORLD`` there, which the listed ranks never join). Under
            ``syncdp-run`` every process must reach ``init()`` within the start timeout, so
            there a process not in the list calls it too and catches the error. Defaults to
            ``MPI.COMM_WORLD``.
        process_sets: Process sets to register at once, in this order, the same on every rank
            (:class:`~syncdp.job.process_sets.ProcessSet` objects or lists of ranks); Horovod's
            ``"dynamic"`` is accepted too (sets can always be added later). Defaults to none.
        **options: Settings that override the ``SYNCDP_*`` environment variables, by name
            (see :data:`syncdp.base.settings.SETTINGS`), e.g. ``fusion_threshold=16 << 20``.

    Raises:
        ConfigError: A ``SYNCDP_*`` variable or an option is unknown or malformed; ``comm`` is
            a list that is empty, names a rank twice or one outside ``COMM_WORLD``, or does
            not name this process. A ``ValueError``, as Horovod raises.

    Example:
        >>> import syncdp
        >>> syncdp.init()
        >>> print(syncdp.rank(), syncdp.size())
        >>> syncdp.init(comm=[0, 2])  # on COMM_WORLD ranks 0 and 2 only: a job of two
    """
    if _state.comm is not None:
        _register(process_sets)  # Horovod programs may call init() again
        return
    config = settings.from_env(**options)
    stats.RECORDER.reset()
    replacement = os.environ.get(membership.REPLACEMENT_VAR)
    if replacement:  # spawned by the job: never on its own (syncdp.membership.jobenv)
        lacking = jobenv.missing(elastic=config.elastic)
        if lacking:
            membership.refuse(replacement, lacking)
    # Announce this rank before MPI starts: Open MPI's MPI_Init itself waits for every rank,
    # so a rank that is late to start would otherwise keep the others from ever reporting.
    world_rank = _rank_from_launcher()
    if world_rank is not None and not replacement:
        report.send("started", world_rank)
    if config.elastic:
        # MPI_Finalize's fence over the first ranks never completes in Open MPI 5.0.11 once a
        # host has lost every one of them (its daemon no longer takes part), spawn or not.
        # Elastic ranks leave through elastic.run's final agreement instead, so the fence
        # adds nothing they need (a program that started MPI itself gets it from syncdp-run).
        os.environ.setdefault(ASYNC_FINALIZE_VAR, "1")
    MPI = mpi.load()
    if not replacement and comm is None:  # a given communicator is the program's choice
        _check_started_together(MPI)
    if world_rank is None:
        report.send("started", MPI.COMM_WORLD.Get_rank())
    made = None  # a communicator made here, for a list of ranks
    if isinstance(comm, (list, tuple)):
        made = base = _communicator_of_ranks(MPI, comm)
    else:
        base = MPI.COMM_WORLD if comm is None else comm
    plan = None
    if config.elastic:
        spawned = membership.join_parent()
        _state.steps_unsynced = spawned is not None  # a spare's is set when it becomes a rank
        base, plan = _elastic_base(base, config, spawned=spawned)
    timeline = Timeline(config.timeline) if config.timeline else None
    # Before the communicator exists: an error past that point in init() (rank 0 cannot
    # write the timeline) ends the job, named, instead of leaving the others waiting for it.
    _install_failure_hook()
    world = _build(base, config, timeline, plan=plan)
    if world.rank == 0:
        _forget_earlier_autotune_log(config)
    if made is not None:
        made.Free()  # syncdp trains on its own duplicate
    _pin_gpu(_state.topology.local_rank)
    if not _state.atexit_registered:
        atexit.register(_at_exit)
        _state.atexit_registered = True
    _register(process_sets)
    if config.verbose:
        t = _state.topology
        print(
            f"syncdp: rank {world.rank}/{world.size} on {MPI.Get_processor_name()} "
            f"(local {t.local_rank}/{t.local_size}, cross {t.cross_rank}/{t.cross_size}, "
            f"{t.hosts} host(s), topology-aware allreduce {world.prefer_hierarchy}), "
            f"{config}",
            file=sys.stderr,
        )


def _forget_earlier_autotune_log(config: settings.Config) -> None:
    """Rank 0 of a tuned job removes an autotune log an earlier job left (Horovod truncates
    it at init too): the file then holds this job's samples, or is absent if it took none."""
    if config.autotune and not config.elastic and config.autotune_log_file:
        with contextlib.suppress(FileNotFoundError):
            os.remove(config.autotune_log_file)


def _communicator_of_ranks(MPI, ranks):
    """The communicator of the ``COMM_WORLD`` ranks listed, in the order given (Horovod's
    ``init(comm=[...])``); made among those processes alone, so only they call it.

    Raises:
        ConfigError: The list is empty, names a rank twice or one outside ``COMM_WORLD``, or
            does not name this process.
    """
    world = MPI.COMM_WORLD
    size, me = world.Get_size(), world.Get_rank()
    given = list(ranks)
    try:
        ranks = [operator.index(r) for r in given if not isinstance(r, bool)]
    except TypeError:
        ranks = []
    if len(ranks) != len(given) or not given:
        raise ConfigError(
            "init(comm=...) takes an mpi4py communicator or a non-empty list of COMM_WORLD "
            f"ranks (integers); got {given!r}."
        )
    outside = [r for r in ranks if not 0 <= r < size]
    if outside:
        raise ConfigError(
            f"init(comm={given!r}): COMM_WORLD has ranks 0 to {size - 1}; got {outside}. List "
            "ranks of the processes the job started."
        )
    twice = sorted({r for r in ranks if ranks.count(r) > 1})
    if twice:
        raise ConfigError(
            f"init(comm={given!r}) names rank(s) {twice} more than once; list each rank once."
        )
    if me not in ranks:
        raise ConfigError(
            f"init(comm={given!r}) was called on COMM_WORLD rank {me}, which is not in the "
            "list: only the listed ranks train together. On a process left out, catch this "
            "error (syncdp-run needs every process to call init()) and do not use syncdp."
        )
    everyone = world.Get_group()
    chosen = everyone.Incl(ranks)
    try:
        return world.Create_group(chosen)
    finally:
        chosen.Free()
        everyone.Free()


def _elastic_base(base, config: settings.Config, spawned):
    """The communicator this process trains on in elastic mode, and rank 0's first plan.

    A replacement (``spawned``: its side of the merge) trains with the job it was spawned
    for. With warm spares (:mod:`syncdp.membership.spares`), the last of the processes mpirun
    started
    are spares: they wait here until a recovery makes them ranks, and a released one never
    returns.
    """
    waiting = spares.count()
    if os.environ.get(spares.NEW_SPARE_VAR):  # a spare started in the background
        _state.reserve, recovering = refill.join(config.finalize_timeout)
        first = spares.Order(spares.JOIN) if recovering else None
        return _serve_as_spare(config, first), None
    if spawned is not None and not waiting:
        return spawned, None
    plan = None
    if spawned is not None:
        _state.reserve, training = membership.join_reserve(spawned)
    elif waiting and _state.reserve is None:
        training, plan = _split_off_spares(base, config, waiting)
    else:
        return base, None
    if training is None:
        training = _serve_as_spare(config)
    return training, plan


def _split_off_spares(world, config: settings.Config, waiting: int):
    """Splits the processes mpirun started into the ranks (the first) and ``waiting`` spares.

    Returns:
        ``(training, plan)``: the ranks' communicator (None on a spare), and the first plan on
        rank 0 (None elsewhere).
    """
    MPI = mpi.load()
    everyone = _arrive(world, config.start_timeout)
    found = everyone.allgather(membership.me())
    ranks = everyone.Get_size() - waiting
    if ranks < 1:
        raise ValueError(
            f"{waiting} spare(s) need at least one more process to train; the job has "
            f"{everyone.Get_size()}. Start it with syncdp-run --spares."
        )
    trains = everyone.Get_rank() < ranks
    training = everyone.Split(0 if trains else MPI.UNDEFINED, everyone.Get_rank())
    _state.reserve = everyone
    plan = None
    if everyone.Get_rank() == 0:
        plan = membership.first_plan(config, ranks, tuple(found[ranks:]))
    return (training if trains else None), plan


def _serve_as_spare(config: settings.Config, first=None):
    """A spare's life: wait; join each recovery; return the training communicator once made a
    rank, or end the process when released (the rest of the program never runs). ``first``:
    the order to act on before waiting (a recovery this spare was merged into)."""
    reserve = _state.reserve
    while True:
        order, first = first or spares.wait(reserve), None
        if order.what == spares.RELEASE:
            spares.leave(config.finalize_timeout)
        if order.what == spares.REFRESH:
            try:
                reserve, _ = refill.refresh(
                    reserve, trains=False, prune=order.prune, adopt=order.adopt
                )
                _state.reserve = reserve
                continue
            except mpi.load().Exception:  # a rank was lost meanwhile: join its recovery
                order = spares.Order(spares.FAILURE)
        try:
            reserve, training, _, _ = membership.reseat(
                reserve,
                None,
                trains=False,
                failure=order.what == spares.FAILURE,
                growing=order.what == spares.GROW,
            )
        except ElasticAbortError as e:
            print(f"syncdp: spare {membership.me().label}: {e}", file=sys.stderr, flush=True)
            sys.stderr.flush()
            os._exit(1)
        _state.reserve = reserve
        if training is not None:
            _state.steps_unsynced = True  # a spare made a rank joins with its state unsynced
            return training


def _build(base, config: settings.Config, timeline, plan) -> Communicator:
    """Makes the job's communicator, topology and exit channel on ``base`` (a collective).

    ``init()`` and :func:`reset` both come here, so a replacement joining the job and the
    survivors that spawned it run the same collectives.
    """
    private = _arrive(base, config.start_timeout)
    world = Communicator(private, config, timeline, job_comm=private)
    _state.topology = topo = discover(world.mpi)
    mode = config.hierarchical_allreduce
    # Measured on namespace hosts with limited links (benchmarks/multihost.py): 2.1x faster
    # than Open MPI's flat allreduce across 3 hosts x 2 ranks, but 0.6x across 2 x 2.
    several_per_host = 3 <= topo.hosts < world.size
    world.set_hierarchy(
        topo.local_comm,
        topo.cross_comm,
        mode == "on" or (mode == "auto" and several_per_host),
        even=topo.homogeneous,
    )
    _state.exit_comm = world.mpi.Dup()
    _state.comm = world
    _state.config = config
    if config.elastic:
        if world.rank == 0 and plan is None:
            plan = membership.first_plan(config, world.size)
        _state.plan = world.broadcast_object(plan, 0, name="elastic.plan")
        found = world.allgather_object(membership.me(), name="elastic.members")
        _state.members = list(found)
        if world.watchdog is not None:
            world.watchdog.members = [(m.host, m.pid) for m in found]
    if config.timeline:  # the setting, the same on every rank (a timeline object may not be)
        _sync_clock(world, timeline)
    return world


def _sync_clock(world: Communicator, timeline: Timeline | None) -> None:
    """Makes every rank's timeline clock read the same (a collective of :func:`_build`).

    The ranks leave one barrier together; a rank whose clock is not running yet starts it at
    rank 0's reading: 0 when the job starts, and the job's time so far for a rank that joins a
    running job (a replacement, a promoted spare), so that its events line up with the
    others'. The survivors of a reset make the same calls, so the joining rank never waits in
    a barrier the others skip.
    """
    world.mpi.Barrier()
    reading = timeline.reading() if timeline is not None and timeline.started else 0.0
    reading = world.mpi.bcast(reading, root=0)
    if timeline is None:  # stopped with stop_timeline(): the others' clocks still need rank 0's
        return
    if timeline.started:
        timeline.set_rank(world.rank)
    else:
        timeline.start(world.rank, reading)


def reset(grow: bool = False) -> dict:
    """Rebuilds the job after a rank failure, or to grow into new slots (elastic mode).

    A collective of every surviving rank (replacements and warm spares join from ``init()``).
    After a failure: revoke, shrink, spawn replacements, merge
    (:func:`syncdp.membership.membership.recover`), or with warm spares let them take the lost
    places first (:func:`syncdp.membership.membership.reseat`); with ``grow``: spawn into the
    free slots and merge (a failure meanwhile makes it a recovery). Then the communicator,
    topology and watchdog are rebuilt, registered process sets are dropped (register them
    again), the reset callbacks run, and rank 0 tells the launcher what changed.

    Returns:
        The change: ``old_size``, ``survivors``, ``spawned``, ``new_size``, ``seconds``,
        ``lost`` and ``added`` (members, as dicts); with spares also ``spares_used`` and
        ``spares_left``.

    Raises:
        ElasticAbortError: Fewer ranks than ``min_np`` would be left, or the reset limit was
            reached: raised before anything is spawned for the change.
        NotInitializedError: ``init()`` has not been called.
    """
    comm = communicator()
    started = time.monotonic()
    config, plan, before = _state.config, _state.plan, list(_state.members)
    try:
        if plan.reset_limit and plan.resets >= plan.reset_limit:
            # One change more than --reset-limit allows: the job ends before anything is
            # spawned for it, as Horovod's ends. Every rank knows the count (rank 0's plan).
            if not grow:
                membership.revoke(comm.mpi)  # every survivor leaves its collective for here
            raise ElasticAbortError(
                f"the reset limit ({plan.reset_limit}) was reached; ending the job."
            )
        merged, plan, change = _change_membership(comm, plan, grow)
    except ElasticAbortError as e:
        print(f"syncdp: elastic: {e}", file=sys.stderr, flush=True)
        report.send("elastic_abort", comm.rank, str(e))
        raise
    broken = change.pop("broken")  # growing, a failure meanwhile made it a recovery
    _drop(broken=broken)
    plan.resets += 1
    _state.steps_unsynced = True
    world = _build(merged, config, comm.timeline, plan)
    for callback in list(_state.reset_callbacks):
        callback()
    after = _state.members
    keys = {(m.host, m.pid) for m in after}
    old_keys = {(m.host, m.pid) for m in before}
    change.update(
        old_size=len(before),
        new_size=world.size,
        seconds=time.monotonic() - started,
        lost=[dict(rank=r, **vars(m)) for r, m in enumerate(before) if (m.host, m.pid) not in keys],
        added=[
            dict(rank=r, **vars(m)) for r, m in enumerate(after) if (m.host, m.pid) not in old_keys
        ],
        reason="failure" if broken else "grow",
    )
    if world.rank == 0:  # --min-np was checked before anything was spawned (membership)
        text = (
            f"membership changed: {change['old_size']} -> {change['survivors']} -> "
            f"{world.size} ranks in {change['seconds']:.2f} s"
        )
        report.send("membership", 0, text, **change)
    return change


def _change_membership(comm: Communicator, plan, grow: bool):
    """Recovers or grows, on the reserve when there are warm spares (they join in)."""
    if _state.reserve is None:
        if grow:
            return membership.grow(comm.mpi, plan)
        return membership.recover(comm.mpi, plan)
    if grow and comm.rank == 0:
        spares.wake(_state.reserve, comm.size, spares.GROW)
    hand_over = _state.keeper.hand_over if _state.keeper is not None else None
    reserve, merged, plan, change = membership.reseat(
        _state.reserve,
        plan,
        trains=True,
        failure=not grow,
        growing=grow,
        training=comm.mpi,
        hand_over=hand_over,
    )
    _state.reserve = reserve
    if change["spawned"] and _state.keeper is not None:
        _state.keeper.abandon()
    return merged, plan, change


def tend_spares() -> None:
    """Keeps the job's warm spares (a collective of the ranks; elastic mode calls it at every
    commit): rank 0 starts a new spare in the background when one was used or died, and once it
    waits, or a spare died, the ranks and spares refresh the reserve
    (:mod:`syncdp.membership.refill`).
    Does nothing in a job without spares.

    Raises:
        RankFailureError: A rank or spare was lost during the refresh (the job then recovers).
    """
    comm, plan = communicator(), _state.plan
    if _state.reserve is None or plan is None or not plan.spare_target:
        return
    order = None
    if comm.rank == 0:
        if _state.keeper is None:
            _state.keeper = refill.Keeper()
        _state.keeper.watch(_state.reserve, comm.size)
        order = _state.keeper.order(plan, list(_state.members) + list(plan.spares))
    # With rank 0's label counter: a spare it starts takes a label, and a rank 0 that follows it
    # (this one lost) must not give the same label to another process.
    order, plan.next_label = comm.broadcast_object(
        (order, plan.next_label), 0, name="elastic.spares"
    )
    if order is None:
        return
    prune, adopt = order
    port = None
    if comm.rank == 0:
        if adopt:
            port = _state.keeper.adopting()
        spares.wake(_state.reserve, comm.size, spares.REFRESH, prune=prune, adopt=adopt)
    MPI = mpi.load()
    try:
        reserve, waiting = refill.refresh(
            _state.reserve, trains=True, prune=prune, port=port, adopt=adopt
        )
    except MPI.Exception as e:
        raise RankFailureError(f"a process was lost while the spares were refreshed: {e}") from e
    _state.reserve = reserve
    plan.spares = tuple(waiting)
    if comm.rank == 0:
        _state.keeper.refreshed(adopt)
        report.send(
            "spares",
            0,
            f"spares waiting: {len(waiting)}",
            spares=[dataclasses.asdict(m) for m in waiting],
        )


def _drop(broken: bool) -> None:
    """Lets go of the job's communicators before a rebuild; ``broken`` ones are not freed."""
    if _state.sets is not None:
        _state.sets.release(broken)
    comm, _state.comm = _state.comm, None
    comm.broken = comm.broken or broken
    comm.close()
    if not broken and _state.exit_comm is not None:
        _state.exit_comm.Free()
    if not broken and _state.topology is not None:
        _state.topology.free()
    _state.exit_comm = None
    _state.topology = None


def steps_agree() -> bool:
    """Whether the ranks' training steps must agree (checked in each step's first bucket).

    False in elastic mode from a membership change until the next ``State.sync()``: Horovod's
    elastic programs may train (a reset callback's ``model.fit``) before the sync that makes a
    replacement's optimizer, and so its step, rank 0's. Every rank of the new membership turns
    the check off at the same point (survivors in :func:`reset`, newcomers when they join) and
    on at the same collective (:func:`states_synced`), so they never disagree about it.
    """
    return not _state.steps_unsynced


def states_synced() -> None:
    """Called by ``State.sync()`` on every rank: the steps agree again from here on."""
    if _state.steps_unsynced:  # a membership change: its recovery is no rank's step time
        stats.RECORDER.restart_window()
    _state.steps_unsynced = False


def training_finished(finished: bool = True) -> None:
    """Called by ``elastic.run`` on every rank once every rank has finished training (and with
    False as a run begins)."""
    _state.trained = finished


def on_reset(callback) -> None:
    """Calls ``callback()`` after every membership change, on every rank (elastic mode)."""
    _state.reset_callbacks.append(callback)


def members() -> list:
    """Every rank's process (:class:`~syncdp.membership.membership.Member`), in rank order; elastic
    mode only (empty otherwise)."""
    communicator()
    return list(_state.members)


def elastic_plan():
    """The elastic :class:`~syncdp.membership.membership.Plan` (None outside elastic mode)."""
    communicator()
    return _state.plan


def _register(process_sets) -> None:
    """Registers ``init(process_sets=...)`` (a set registered already keeps its id)."""
    if process_sets in (None, "dynamic"):
        return
    if _state.sets is None:  # nothing imported syncdp.job.process_sets, so no ProcessSet exists
        raise ValueError(
            "init(process_sets=...) takes syncdp.ProcessSet objects; got "
            f"{process_sets!r}. Pass e.g. [syncdp.ProcessSet([0, 1])]."
        )
    _state.sets.register(process_sets)


class _SetHooks(NamedTuple):
    register: Callable[[Iterable], None]
    release: Callable[[bool], None]
    communicators: Callable[[], list]


def plug_process_sets(
    *,
    register: Callable[[Iterable], None],
    release: Callable[[bool], None],
    communicators: Callable[[], list],
) -> None:
    """How :mod:`syncdp.job.process_sets`, the layer above, plugs into the runtime.

    The runtime never imports that layer; the layer hands in, when it is imported, what the
    runtime must call.

    Args:
        register: ``register(sets)`` registers ``init(process_sets=sets)`` (a collective; a
            set registered already keeps its id).
        release: ``release(broken)`` drops every registered set and its communicator (at
            shutdown and before a reset); ``broken`` communicators are dropped, not freed.
        communicators: ``communicators()`` lists the sets' communicators this rank is in.
    """
    _state.sets = _SetHooks(register, release, communicators)


def _arrive(base, timeout: float):
    """Waits for every rank of ``base``; returns a private duplicate of it.

    ``Idup`` completes only once every rank has called it, and unlike a blocking ``Dup`` it can
    be abandoned at a deadline: then this rank reports a start timeout and ends the job. The
    launcher, which counts the ``started`` reports, names the ranks that never came.
    """
    rank, size = base.Get_rank(), base.Get_size()
    if size == 1:
        return base.Dup()
    private, request = base.Idup()
    deadline = time.monotonic() + timeout if timeout else None
    while not request.Test():
        if deadline is not None and time.monotonic() > deadline:
            message = (
                f"rank {rank}: not every rank reached syncdp.init() within the start timeout "
                f"of {timeout:g} s; ending the job. Raise SYNCDP_START_TIMEOUT "
                "(syncdp-run --start-timeout) if ranks need longer to start."
            )
            print(f"syncdp: {message}", file=sys.stderr, flush=True)
            report.send("start_timeout", rank, message, ranks=[])
            mpi.load().COMM_WORLD.Abort(1)
        time.sleep(_POLL_SECONDS)
    return private


# How launchers tell a process how many they started together, first the one that decides.
_LAUNCHED_SIZES = (
    ("OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun"),
    ("PMI_SIZE", "a PMI launcher (another MPI's mpiexec, or srun --mpi=pmi2)"),
    ("SLURM_STEP_NUM_TASKS", "srun"),
)


def _check_started_together(MPI) -> None:
    """Refuses a process its launcher started as one of several, whose MPI found none of the
    others (``srun`` without ``--mpi=pmix``, another MPI's ``mpiexec``): each such process
    would train alone as rank 0 of a job of its own, every one a chief writing the same
    checkpoints, and each would end in a success of no use.

    Raises:
        ConfigError: The launcher started several processes and MPI's world has one.
    """
    if MPI.COMM_WORLD.Get_size() != 1:
        return
    for var, launcher in _LAUNCHED_SIZES:
        started = os.environ.get(var, "")
        if not started.isdigit():
            continue
        if int(started) > 1:
            raise ConfigError(
                f"{launcher} started this process as one of {started} ({var}={started}), but "
                "MPI found none of the others: it would train alone, as rank 0 of a job of "
                "one, like each of the others. Start the ranks with syncdp-run (or horovodrun), "
                "or inside a Slurm allocation with `srun --mpi=pmix`; another MPI's launcher "
                "cannot start Open MPI's processes as one job. To train alone on purpose, pass "
                "`syncdp.init(comm=MPI.COMM_SELF)`."
            )
        return


def _rank_from_launcher() -> int | None:
    """This process's world rank as mpirun announced it, read without starting MPI."""
    for key in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"):
        if key in os.environ:
            return int(os.environ[key])
    return None


def _pin_gpu(local: int) -> None:
    """Makes only the GPU numbered ``local`` (modulo the count) visible to this rank."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return
    gpu = gpus[local % len(gpus)]
    try:
        tf.config.set_visible_devices(gpu, "GPU")
        tf.config.experimental.set_memory_growth(gpu, True)
    except RuntimeError as e:  # TensorFlow already created its GPU devices
        print(
            f"syncdp: warning: could not pin GPU {local} ({e}); call syncdp.init() before "
            "building any model or tensor.",
            file=sys.stderr,
        )


def _install_failure_hook() -> None:
    """Ends every rank when an exception escapes on one, naming the rank and the exception."""
    if _state.hook_installed:
        return
    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        comm = _state.comm
        if comm is None or comm.size == 1 or issubclass(kind, KeyboardInterrupt):
            return
        text = "".join(traceback.format_exception_only(kind, value)).strip()
        if comm.config.elastic and issubclass(kind, ElasticAbortError):
            # Elastic mode cannot go on (reset() said why, and told the launcher, which ends
            # the job): every rank raises it, and none may take another rank's place.
            sys.stdout.flush()
            os._exit(1)
        if comm.config.elastic and (issubclass(kind, RankFailureError) or comm.broken):
            # Another rank's loss, surfacing outside elastic.run (e.g. in a replacement's
            # collectives before its run()): this process cannot go on, but the job can. It
            # ends as one more lost rank, which the ranks in elastic.run recover from (or the
            # launcher names, if none does), instead of ending every rank.
            lines = [line.strip() for line in text.splitlines() if line.strip()]
            why = next((line for line in lines if "a rank of" in line), lines[-1])
            after = (
                "after training had finished (elastic.run returned); this process ends, and so "
                "does the job: nothing is left to recover"
                if _state.trained
                else "outside elastic.run; this process ends, the job recovers without it"
            )
            print(
                f"syncdp: rank {comm.rank}: a rank of the job was lost {after} ({why}).",
                file=sys.stderr,
                flush=True,
            )
            sys.stdout.flush()
            os._exit(1)
        print(
            f"syncdp: rank {comm.rank} failed with {text}; ending the job.",
            file=sys.stderr,
            flush=True,
        )
        report.send("exception", comm.rank, text, type=kind.__name__)
        sys.stdout.flush()
        _farewell()
        mpi.load().COMM_WORLD.Abort(1)

    sys.excepthook = hook
    _state.hook_installed = True


def _watchdogs() -> list:
    """The watchdogs of the job's communicator and of every process set's this rank is in."""
    sets = _state.sets.communicators() if _state.sets is not None else []
    return [c.watchdog for c in [_state.comm, *sets] if c is not None and c.watchdog is not None]


def _farewell() -> None:
    """Tells every other rank that this one ends the job on purpose (see Watchdog.farewell)."""
    for dog in _watchdogs():
        dog.farewell()


def _at_exit() -> None:
    """Leaves together, or ends the job if another rank is waiting for this one.

    MPI_Finalize waits for every rank. A rank whose program ends early (``sys.exit(3)`` in the
    middle of training) would sit there while the others wait for it in a collective, and
    neither would ever finish. So each rank waits at a barrier of its own here, asking the
    others where they are, and ends the job with a message naming both sides when one of them
    is inside a collective this rank never reached.
    """
    comm, exit_comm = _state.comm, _state.exit_comm
    watchdog = comm.watchdog if comm is not None else None
    if comm is not None and (comm.config.elastic or comm.broken):
        # Elastic ranks leave through syncdp.elastic.run's final agreement instead; a rank of
        # a broken job may be gone, and no handshake with it could end.
        watchdog = None
    if watchdog is not None and watchdog.can_ask and exit_comm is not None:
        # Every communicator's: a rank may wait for this one in a process set's collective.
        dogs = _watchdogs()
        for dog in dogs:
            dog.exiting = True
        everyone_here = exit_comm.Ibarrier()
        while not everyone_here.Test():
            for dog in dogs:
                found = dog.ahead(grace=0.5)
                if found is None:
                    continue
                other, seq, name = found
                message = (
                    f"rank {comm.rank} finished its program after collective #{dog.last_done}"
                    f"{dog.of_scope}, but rank {other} is waiting for it in collective #{seq} "
                    f"{name}{dog.of_scope}"
                )
                print(
                    f"syncdp: {message}; ending the job. If the ranks' data differ in "
                    "length, give every rank the same number of batches, or call "
                    "syncdp.join() where a rank's data ends.",
                    file=sys.stderr,
                    flush=True,
                )
                report.send(
                    "exit_early",
                    comm.rank,
                    message,
                    ranks=[other],
                    collective=f"{name}{dog.of_scope}",
                    seq=seq,
                )
                _farewell()
                mpi.load().COMM_WORLD.Abort(1)
            time.sleep(0.2)
    if comm is not None:
        stats.RECORDER.send(comm.rank)  # "where the time went", printed by the launcher
    shutdown()
    if comm is not None and comm.config.elastic:
        _bound_finalize(comm.config.finalize_timeout)


def _bound_finalize(seconds: float) -> None:
    """Ends this process with SIGALRM if MPI_Finalize (run by mpi4py after this) hangs.

    In elastic mode the launcher waits for every rank's exit, and Open MPI 5.0.11's
    MPI_Finalize can wait forever: its fence once a host has lost every rank it started with
    (elastic mode turns the fence off, :data:`ASYNC_FINALIZE_VAR`, unless the user sets it),
    two spawns at once in one process. A bound turns such a hang into a named failure
    after ``seconds`` (``--finalize-timeout``, 60 by default): the exit status is no longer
    known then, so it can never count as a success. A finalize that returns in time cancels
    nothing: the process has exited by then.
    """
    if not mpi.loaded():
        return
    import mpi4py

    if not mpi4py.rc.finalize and mpi4py.rc.finalize is not None:
        return  # the program finalizes MPI itself
    mpi.bound_finalize(seconds)


def shutdown() -> None:
    """Releases syncdp's communicators, watchdog and timeline; ``init()`` may be called again.

    Called at exit automatically. Not a collective, except with the job's timeline on
    (``--timeline-filename``, ``SYNCDP_TIMELINE``): then rank 0 gathers every rank's events
    here, so every rank must call it. MPI itself stays up (MPI
    cannot be started twice in one process); mpi4py finalizes it at exit.
    """
    comm = _state.comm
    if comm is None:
        return
    timeline, comm.timeline = comm.timeline, None  # the gather itself is not recorded
    if comm.config.timeline and not comm.broken:
        # The job's timeline: the setting is the same on every rank, so every rank gathers,
        # also one whose timeline start_timeline or stop_timeline (on rank 0) replaced.
        gather_and_write(comm.mpi, timeline)
    elif timeline is not None:
        timeline.stop()  # rank 0's own events are in the file already
    if _state.reserve is not None and not comm.broken:
        if comm.rank == 0:  # training is over: the spares leave
            spares.release(_state.reserve, comm.size, _state.plan.spares if _state.plan else ())
            if _state.keeper is not None:
                _state.keeper.close()
        _state.reserve = None
    _state.keeper = None
    if not comm.broken and not comm.config.elastic:
        # A rank still to come to a collective of this one's would wait for it forever
        # (join() has no stall timeout): tell them this rank's collectives end here.
        for dog in _watchdogs():
            dog.leaving()
    _drop(broken=comm.broken)
    _state.steps_unsynced = False
    _state.config = None


def timing() -> dict:
    """Where this rank's time went so far: per-step time, and the shares spent computing,
    waiting for other ranks and moving bytes, with the bandwidth achieved (see
    :meth:`syncdp.watch.stats.Recorder.summary`). Not a collective.

    Example:
        >>> t = syncdp.timing()
        >>> print(f"{t['waiting']:.0%} of each step waiting for the slowest rank")
    """
    return stats.RECORDER.summary()


def is_initialized() -> bool:
    """Whether ``init()`` has been called (and ``shutdown()`` has not)."""
    return _state.comm is not None


def communicator() -> Communicator:
    """The Communicator of this job, as it is now.

    Raises:
        NotInitializedError: ``init()`` has not been called.
    """
    if _state.comm is None:
        raise NotInitializedError("syncdp is not initialized; call syncdp.init() first.")
    return _state.comm


def get_config() -> settings.Config:
    """The settings ``init()`` read."""
    communicator()
    return _state.config


# A collective that waits for a rank on the disk (a checkpoint's save, counting TFRecord files)
# may last this long whatever the stall timeout, and forever with the stall timeout off.
IO_TIMEOUT_SECONDS = 600.0


def io_timeout() -> float:
    """The ``timeout=`` of a collective in which ranks wait for another's disk I/O: at least
    :data:`IO_TIMEOUT_SECONDS`, 0 (none) when the stall timeout is off."""
    stall = get_config().stall_timeout
    return 0.0 if not stall else max(stall, IO_TIMEOUT_SECONDS)


def topology() -> Topology:
    """This rank's place among the hosts (see :mod:`syncdp.base.topology`)."""
    communicator()
    return _state.topology


def rank() -> int:
    """This process's rank, 0 to ``size() - 1``."""
    return communicator().rank


def size() -> int:
    """The number of ranks training together."""
    return communicator().size


def local_rank() -> int:
    """This process's rank among the ranks on its host (used to pick its GPU)."""
    return topology().local_rank


def local_size() -> int:
    """The number of ranks on this host."""
    return topology().local_size


def cross_rank() -> int:
    """This rank's index among the ranks that share its local rank (its host's index)."""
    return topology().cross_rank


def cross_size() -> int:
    """The number of ranks that share this rank's local rank (the hosts, when even)."""
    return topology().cross_size


def is_homogeneous() -> bool:
    """Whether every host runs the same number of ranks."""
    return topology().homogeneous


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Starts recording rank 0's collectives into ``file_path``, as Horovod's does: not a
    collective; on the other ranks it does nothing, so a program may call it on rank 0 only.

    Rank 0 writes each event into the file as it happens (valid JSON after each). A timeline
    already being recorded (``--timeline-filename``, or an earlier call) stops, its file kept,
    and the new file takes over. ``mark_cycles`` is accepted for Horovod compatibility.

    Raises:
        OSError: Rank 0 cannot write ``file_path``.
    """
    comm = communicator()
    if comm.rank != 0:
        return
    if comm.timeline is not None:
        comm.timeline.stop()
        comm.timeline = None
    timeline = Timeline(file_path, every_rank=False)
    timeline.start(comm.rank)
    comm.timeline = timeline


def stop_timeline() -> None:
    """Stops recording the timeline; its file holds rank 0's collectives so far. Not a
    collective (as in Horovod); does nothing without a timeline or on another rank."""
    comm = communicator()
    if comm.rank != 0 or comm.timeline is None:
        return
    timeline, comm.timeline = comm.timeline, None
    timeline.stop()


def is_chief() -> bool:
    """Whether this is rank 0, the rank that writes checkpoints and logs."""
    return rank() == 0
