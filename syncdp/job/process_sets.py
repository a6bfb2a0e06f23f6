"""Process sets: collectives among a subset of the ranks, as Horovod names them.

A :class:`ProcessSet` is a sorted list of world ranks, or an mpi4py communicator whose members
are the set. Registering sets is a collective of every rank: each rank splits the job's
communicator, so a set gets an MPI sub-communicator of its own, and the same id everywhere
because every rank registers the sets in the same order. A collective that names a set runs on
that communicator only; collectives of different sets never share messages, so two sets used
one after the other, or by different threads, cannot deadlock each other.

Two ways to register, as in Horovod:

- :func:`add_process_set`: every rank passes the same set, in the same order (otherwise every
  rank raises ValueError).
- ``init(process_sets=[...])``: each rank may pass its own sets. The typical case is a
  communicator split by colour, ``ProcessSet(COMM_WORLD.Split(rank % 2))``, which is the even
  ranks on even ranks and the odd ones on odd ranks. The ranks gather every rank's list and
  register the union: first set of rank 0, first set of rank 1, ..., then every rank's second
  set, and so on. A set already registered, or met earlier in that order, keeps its id. Each
  rank's :class:`ProcessSet` objects get the ids of their sets.

``global_process_set`` (id 0) is the whole job; it exists before ``init()`` and follows the
runtime's current communicator.

This module sits above :mod:`syncdp.job.runtime`: it imports the runtime, and plugs its own
hooks into it (``init(process_sets=...)``, release at shutdown and reset), so the runtime
never imports it.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from syncdp.base.errors import SyncdpError
from syncdp.job import runtime
from syncdp.transport.communicator import Communicator

__all__ = [
    "NotInProcessSetError",
    "ProcessSet",
    "global_process_set",
    "add_process_set",
    "remove_process_set",
    "communicator_of",
    "registered",
    "get_process_set_ids_and_ranks",
    "comm_process_set_id",
    "process_set_by_id",
    "process_sets",
]


class NotInProcessSetError(SyncdpError, ValueError):
    """A rank called a collective on a process set it is not in."""


class ProcessSet:
    """A group of ranks that run collectives among themselves.

    Args:
        ranks: The world ranks in the set (any order; kept sorted), or an mpi4py communicator
            whose members form the set (its ranks are read when the set is registered, so it
            can be made before ``init()``, as Horovod's programs do).

    Attributes:
        ranks: The sorted world ranks; None for a communicator's set until it is registered.
        mpi_comm: The communicator the set was made from, or None.
        process_set_id: The id every rank agrees on once registered; None before.
    """

    _removed = False  # removed by remove_process_set() and not added again

    def __init__(self, ranks: Iterable[int] | object):
        self.mpi_comm = None
        self.process_set_id: int | None = None
        self._comm: Communicator | None = None
        if hasattr(ranks, "Get_group"):  # an mpi4py communicator
            self.mpi_comm = ranks
            self.ranks = None
            return
        self.ranks = _checked_ranks(ranks)

    def _resolve(self) -> list[int]:
        """The set's world ranks, read from its communicator the first time (init() has run)."""
        if self.ranks is None:
            self.ranks = _world_ranks_of(self.mpi_comm)
        return self.ranks

    def size(self) -> int | None:
        """The number of ranks in the set; None before it is registered."""
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self) -> int | None:
        """This process's rank within the set; None before it is registered.

        Raises:
            ValueError: This rank is not in the set.
        """
        if self.process_set_id is None:
            return None
        me = runtime.rank()
        if me not in self.ranks:
            raise ValueError(f"Rank {me} is not in {self}.")
        return self.ranks.index(me)

    def root(self, root_rank: int) -> int:
        """The rank within the set of the job's rank ``root_rank`` (roots are job ranks).

        Raises:
            ValueError: ``root_rank`` is not in the set.
        """
        ranks = self._resolve()
        if root_rank not in ranks:
            raise ValueError(f"root_rank {root_rank} is not in {self}.")
        return ranks.index(root_rank)

    def included(self) -> bool | None:
        """Whether this process is one of the set's ranks; None once the set is removed (as
        Horovod's invalidated set answers), until it is added again."""
        if self._removed:
            return None
        return runtime.rank() in self._resolve()

    def __repr__(self) -> str:
        return (
            f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
            f"mpi_comm={self.mpi_comm})"
        )

    # Compared and hashed as objects, as Horovod's are: a set's ranks and id change when it is
    # registered or removed, and a dict keyed by sets must still find them.


class _GlobalProcessSet(ProcessSet):
    """The whole job: its ranks and communicator are the runtime's current ones."""

    def __init__(self):  # no ranks of its own: they are the job's, whatever it is now
        self.process_set_id = 0
        self.mpi_comm = None
        self._comm = None

    @property
    def ranks(self) -> list[int]:
        return list(range(runtime.size())) if runtime.is_initialized() else []

    def size(self) -> int:
        return runtime.size()

    def rank(self) -> int:
        return runtime.rank()

    def root(self, root_rank: int) -> int:
        if not 0 <= root_rank < runtime.size():
            raise ValueError(f"root_rank must be in [0, {runtime.size()}); got {root_rank}.")
        return root_rank

    def included(self) -> bool:
        return True

    def __eq__(self, other) -> bool:
        return isinstance(other, _GlobalProcessSet)

    def __hash__(self) -> int:
        return 0


global_process_set = _GlobalProcessSet()


def _checked_ranks(ranks) -> list[int]:
    """``ranks`` as a sorted list of ints; ValueError for anything else or a rank twice."""
    ranks = list(ranks)
    if not all(isinstance(r, (int, np.integer)) for r in ranks):
        raise ValueError(
            "ProcessSet should be initialized with a list of process ranks or an mpi4py "
            f"communicator; got {ranks!r}."
        )
    ranks = sorted(int(r) for r in ranks)
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"A process set lists each rank once; got {ranks}.")
    return ranks


def _world_ranks_of(mpi_comm) -> list[int]:
    """The ranks, in the job's communicator, of ``mpi_comm``'s members.

    Raises:
        ValueError: A member is not a rank of the job.
    """
    from syncdp.base import mpi

    MPI = mpi.load()
    world = runtime.communicator().mpi
    members = list(range(mpi_comm.Get_size()))
    ranks = list(MPI.Group.Translate_ranks(mpi_comm.Get_group(), members, world.Get_group()))
    if MPI.UNDEFINED in ranks:
        raise ValueError(
            f"A process set's communicator has {mpi_comm.Get_size()} members, and some are not "
            "ranks of this job (a communicator made before an elastic reset, or from another "
            "job?): only the job's ranks can form a set."
        )
    return sorted(int(r) for r in ranks)


# The registered sets by id, this job's; the global set is not here.
_registry: dict[int, ProcessSet] = {}
# Other objects given a registered set's id by init(process_sets=...): a second object for the
# same ranks, on this rank or another, or a set of every rank (id 0). Their ids end with the set's.
_aliases: list[ProcessSet] = []


def _sets() -> dict[int, ProcessSet]:
    runtime.communicator()
    return _registry


def registered() -> list[ProcessSet]:
    """Every registered set, the global one first, in id order."""
    return [global_process_set] + [s for _, s in sorted(_sets().items())]


def add_process_set(process_set: ProcessSet | Iterable[int]) -> ProcessSet:
    """Registers a process set; a collective that every rank of the job must call.

    Args:
        process_set: A :class:`ProcessSet` or the ranks of one.

    Returns:
        The registered set, with its ``process_set_id``.

    Raises:
        ValueError: On every rank, when the set is empty, its ranks are out of range, it is
            already registered, or ranks passed different sets.
    """
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    world = runtime.communicator()
    sets = _sets()
    world.enter("add_process_set")
    asked = _ranks_or_problem(ps)
    everyone = world.allgather_object(asked, name="add_process_set")
    problem = _first_problem([[a] for a in everyone], world.size)
    if problem:
        raise ValueError(problem)
    if any(r != asked for r in everyone):
        split = (
            " A communicator split differently on each rank is registered through "
            "init(process_sets=[...]) instead."
            if ps.mpi_comm is not None
            else ""
        )
        raise ValueError(f"add_process_set: ranks passed different sets: {everyone}.{split}")
    registered = [list(range(world.size))] + [s.ranks for s in sets.values()]  # global: id 0
    if ps.process_set_id is not None or ps.ranks in registered:
        raise ValueError(f"Attempted to add a duplicate process set: {ps.ranks}.")
    return _register(ps, world, sets)


def _ranks_or_problem(ps: ProcessSet) -> list[int] | str:
    """The set's ranks, or why they cannot be read (gathered, so that every rank raises)."""
    try:
        return ps._resolve()
    except ValueError as e:
        return str(e)


def _first_problem(everyone: list[list], size: int) -> str | None:
    """What is wrong with the first bad set of ``everyone`` (each rank's sets: rank lists or
    problems as strings), naming the rank; None when every set is good."""
    for rank, asked in enumerate(everyone):
        for ranks in asked:
            if isinstance(ranks, str):
                return f"Rank {rank}: {ranks}"
            if not ranks:
                return (
                    "A process set needs at least one rank; got an empty one (ranks=[]). Leave "
                    "out a set that would be empty, e.g. the odd ranks of a one-rank job: "
                    "`if ranks: syncdp.add_process_set(ranks)`."
                )
            if not all(0 <= r < size for r in ranks):
                return f"A process set needs ranks in [0, {size}); got {ranks}."
    return None


class _JobTimeline:
    """Where a process set's collectives go in the timeline: the job's, whichever it is when
    one ends (``start_timeline`` and ``stop_timeline`` replace it), marked with the set's id."""

    def __init__(self, process_set_id: int):
        self.process_set_id = process_set_id

    def record(self, name: str, nbytes: int, dtype: str, start: float, end: float, **info):
        timeline = runtime.communicator().timeline
        if timeline is not None:
            info["process_set"] = self.process_set_id
            timeline.record(name, nbytes, dtype, start, end, **info)


def _register(ps: ProcessSet, world, sets: dict[int, ProcessSet]) -> ProcessSet:
    """Gives ``ps`` (ranks resolved, checked) the next id and a communicator; a collective of
    every rank of ``world``, which must register the same sets in the same order."""
    from syncdp.base import mpi

    MPI = mpi.load()
    included = world.rank in ps.ranks
    sub = world.mpi.Split(0 if included else MPI.UNDEFINED, key=world.rank)
    ps.process_set_id = max(sets, default=0) + 1
    ps._removed = False
    scope = f"the process set of ranks {', '.join(map(str, ps.ranks))}"
    ps._comm = (
        Communicator(
            sub,
            world.config,
            _JobTimeline(ps.process_set_id),
            job_comm=world.mpi,
            revoke_with=(world.mpi,),
            scope=scope,
        )
        if included
        else None
    )
    sets[ps.process_set_id] = ps
    _renewed(ps.process_set_id)
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregisters a set and frees its communicator; a collective of every rank, which must
    pass the same set.

    Returns:
        True if the set was registered and is now removed; False otherwise (also for the
        global set, which cannot be removed).

    Raises:
        MismatchError: On every rank, when ranks passed different sets (nothing is removed).
    """
    world = runtime.communicator()
    sets = _sets()
    # Every rank removes the same set (or none): a rank that removed another one would number
    # the sets added later differently from the others.
    is_global = isinstance(process_set, _GlobalProcessSet) or process_set.process_set_id == 0
    world.enter(
        "remove_process_set",
        ranks="the whole job" if is_global else list(process_set.ranks or ()),
        process_set_id=0 if is_global else process_set.process_set_id,
    )
    if is_global or process_set.process_set_id is None:
        return False
    found = sets.pop(process_set.process_set_id, None)
    if found is None:
        return False
    if found._comm is not None:
        found._comm.close()
        found._comm = None
    _forget(found.process_set_id)
    _renewed(found.process_set_id)
    for removed in (found, process_set):
        removed.process_set_id = None
        removed._removed = True
    return True


_renewed_callbacks: list = []


def on_renewed(callback) -> None:
    """Calls ``callback(process_set_id)`` on this rank whenever an id stops naming its set or
    starts naming a set (``remove_process_set``, a registration: ``add_process_set``,
    ``init()``, an elastic reset), on every rank of the job at the same point."""
    _renewed_callbacks.append(callback)


def _renewed(process_set_id: int) -> None:
    for callback in _renewed_callbacks:
        callback(process_set_id)


def _forget(process_set_id: int) -> None:
    """Ends the id of every alias of one set."""
    gone = [a for a in _aliases if a.process_set_id == process_set_id]
    _aliases[:] = [a for a in _aliases if a.process_set_id != process_set_id]
    for alias in gone:
        alias.process_set_id = None
        alias._removed = True


def communicator_of(process_set: ProcessSet | None) -> Communicator:
    """The communicator a collective on ``process_set`` runs on.

    Raises:
        ValueError: The set is not registered.
        NotInProcessSetError: This rank is not in the set.
    """
    if process_set is None or isinstance(process_set, _GlobalProcessSet):
        return runtime.communicator()
    if isinstance(process_set, ProcessSet) and process_set.process_set_id == 0:
        return runtime.communicator()  # every rank's set, registered by init() as the job
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"process_set must be a ProcessSet; got {process_set!r}.")
    found = _sets().get(process_set.process_set_id)
    if found is None:
        raise ValueError(
            f"{process_set} is not registered; call syncdp.add_process_set() on every rank first."
        )
    if found._comm is None:
        raise NotInProcessSetError(
            f"Rank {runtime.rank()} is not in {found}; only its ranks may use it."
        )
    return found._comm


def _register_at_init(entries: Iterable) -> None:
    """``init(process_sets=...)``: each rank passes its own sets; every rank registers them all.

    Every rank's sets are gathered, then registered in one order on every rank: the first set
    of each rank (rank 0's first), then the second of each, and so on. A set whose ranks are
    already registered, or met earlier in that order, is not registered again: the object gets
    that set's id; a set of every rank of the job gets the global set's id 0. An empty set, a
    rank outside the job or a communicator with members outside it raises ValueError on every
    rank, before anything is registered.

    Args:
        entries: :class:`ProcessSet` objects or lists of ranks.
    """
    world = runtime.communicator()
    sets = _sets()
    mine: list[ProcessSet | None] = []
    asked: list[list[int] | str] = []
    for entry in entries:
        try:
            ps = entry if isinstance(entry, ProcessSet) else ProcessSet(entry)
        except (TypeError, ValueError) as e:
            ps = None
            asked.append(str(e))
        else:
            asked.append(_ranks_or_problem(ps))
        mine.append(ps)
    world.enter("init.process_sets")
    everyone = world.allgather_object(asked, name="init(process_sets=...)")
    problem = _first_problem(everyone, world.size)
    if problem:
        raise ValueError(f"init(process_sets=...): {problem}")
    by_ranks = {tuple(ps.ranks): ps for ps in sets.values()}
    whole = tuple(range(world.size))
    for position in range(max(map(len, everyone), default=0)):
        for rank, lists in enumerate(everyone):
            if position >= len(lists):
                continue
            ranks = tuple(lists[position])
            if ranks == whole or ranks in by_ranks:
                continue
            own = mine[position] if rank == world.rank else None
            if own is None or own.process_set_id is not None:
                own = ProcessSet(ranks)  # another rank's set, or an object already in use
            by_ranks[ranks] = _register(own, world, sets)
    for ps in mine:
        if ps is None or isinstance(ps, _GlobalProcessSet):
            continue
        found = by_ranks.get(tuple(ps.ranks))
        if found is ps:
            continue
        ps.process_set_id = 0 if found is None else found.process_set_id
        ps._removed = False
        if not any(a is ps for a in _aliases):  # by identity: equal sets are separate objects
            _aliases.append(ps)


def get_process_set_ids_and_ranks() -> dict[int, list[int]]:
    """Every registered set's id and ranks, the job's (id 0) first, as Horovod's function."""
    return {ps.process_set_id: list(ps.ranks) for ps in registered()}


def comm_process_set_id(mpi_comm) -> int:
    """The id of the registered set whose ranks are ``mpi_comm``'s members (0: the job's).

    Raises:
        ValueError: No registered set has those ranks.
    """
    ranks = _world_ranks_of(mpi_comm)
    if ranks == list(range(runtime.size())):
        return 0
    for ps in _sets().values():
        if ps.ranks == ranks:
            return ps.process_set_id
    raise ValueError(f"No process set is registered for the ranks {ranks} of this communicator.")


def process_set_by_id(process_set_id: int) -> ProcessSet:
    """The registered set with this id.

    Raises:
        ValueError: No set has it.
    """
    if process_set_id == 0:
        return global_process_set
    found = _sets().get(process_set_id)
    if found is None:
        raise ValueError(f"No known process set with id {process_set_id}.")
    return found


def process_sets() -> list[ProcessSet]:
    """Every registered set, in id order (the job's first): :func:`registered`."""
    return registered()


def _release(broken: bool) -> None:
    """Drops every set and its communicator (shutdown, reset); not a collective.

    Args:
        broken: A rank of the job failed: the sets' communicators are dropped, not freed.
    """
    for ps in _registry.values():
        if ps._comm is not None:
            ps._comm.broken = ps._comm.broken or broken
            ps._comm.close()
            ps._comm = None
        ps.process_set_id = None
    _registry.clear()
    for alias in _aliases:
        alias.process_set_id = None
    _aliases.clear()


def _communicators() -> list[Communicator]:
    """The communicators of the registered sets this rank is in."""
    return [ps._comm for ps in _registry.values() if ps._comm is not None]


runtime.plug_process_sets(
    register=_register_at_init, release=_release, communicators=_communicators
)
