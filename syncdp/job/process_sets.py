"""Process sets: collectives among a subset of the ranks, as Horovod names them.

A :class:`ProcessSet` is a sorted list of world ranks. Registering it (``init(process_sets=...)``
or :func:`add_process_set`) is a collective of every rank: each rank splits the job's
communicator, so the set gets an MPI sub-communicator of its own, and the same id everywhere
because every rank registers sets in the same order. A collective that names a set runs on
that communicator only; collectives of different sets never share messages, so two sets used
one after the other, or by different threads, cannot deadlock each other.

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
]


class NotInProcessSetError(SyncdpError, ValueError):
    """A rank called a collective on a process set it is not in."""


class ProcessSet:
    """A group of ranks that run collectives among themselves.

    Args:
        ranks: The world ranks in the set (any order; kept sorted), or an mpi4py communicator
            whose members form the set.

    Attributes:
        ranks: The sorted world ranks.
        process_set_id: The id every rank agrees on once registered; None before.
    """

    def __init__(self, ranks: Iterable[int] | object):
        if hasattr(ranks, "Get_group"):  # an mpi4py communicator
            ranks = _world_ranks_of(ranks)
        ranks = list(ranks)
        if not all(isinstance(r, (int, np.integer)) for r in ranks):
            raise ValueError(
                "ProcessSet should be initialized with a list of process ranks or an mpi4py "
                f"communicator; got {ranks!r}."
            )
        ranks = sorted(int(r) for r in ranks)
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"A process set lists each rank once; got {ranks}.")
        self.ranks = ranks
        self.process_set_id: int | None = None
        self._comm: Communicator | None = None

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
        if root_rank not in self.ranks:
            raise ValueError(f"root_rank {root_rank} is not in {self}.")
        return self.ranks.index(root_rank)

    def included(self) -> bool:
        """Whether this process is one of the set's ranks."""
        return runtime.rank() in self.ranks

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    def __eq__(self, other) -> bool:
        if not isinstance(other, ProcessSet):
            return NotImplemented
        return self.ranks == other.ranks and self.process_set_id == other.process_set_id

    def __hash__(self) -> int:
        return hash((tuple(self.ranks), self.process_set_id))


class _GlobalProcessSet(ProcessSet):
    """The whole job: its ranks and communicator are the runtime's current ones."""

    def __init__(self):  # no ranks of its own: they are the job's, whatever it is now
        self.process_set_id = 0
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


def _world_ranks_of(mpi_comm) -> list[int]:
    """The ranks, in the job's communicator, of ``mpi_comm``'s members."""
    from syncdp.base import mpi

    MPI = mpi.load()
    world = runtime.communicator().mpi
    members = list(range(mpi_comm.Get_size()))
    return list(MPI.Group.Translate_ranks(mpi_comm.Get_group(), members, world.Get_group()))


# The registered sets by id, this job's; the global set is not here.
_registry: dict[int, ProcessSet] = {}


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
    everyone = world.allgather_object(ps.ranks, name="add_process_set")
    if any(r != ps.ranks for r in everyone):
        raise ValueError(f"add_process_set: ranks passed different sets: {everyone}.")
    if not ps.ranks:
        # Checked after the gather, so that every rank raises here together.
        raise ValueError(
            "A process set needs at least one rank; got an empty one (ranks=[]). Leave out a "
            "set that would be empty, e.g. the odd ranks of a one-rank job: "
            "`if ranks: syncdp.add_process_set(ranks)`."
        )
    if not all(0 <= r < world.size for r in ps.ranks):
        raise ValueError(f"A process set needs ranks in [0, {world.size}); got {ps.ranks}.")
    if ps.process_set_id is not None or any(s.ranks == ps.ranks for s in sets.values()):
        raise ValueError(f"Attempted to add a duplicate process set: {ps.ranks}.")
    from syncdp.base import mpi

    MPI = mpi.load()
    included = world.rank in ps.ranks
    sub = world.mpi.Split(0 if included else MPI.UNDEFINED, key=world.rank)
    ps.process_set_id = max(sets, default=0) + 1
    scope = f"the process set of ranks {', '.join(map(str, ps.ranks))}"
    ps._comm = (
        Communicator(sub, world.config, job_comm=world.mpi, revoke_with=(world.mpi,), scope=scope)
        if included
        else None
    )
    sets[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregisters a set and frees its communicator; a collective of every rank.

    Returns:
        True if the set was registered and is now removed; False otherwise (also for the
        global set, which cannot be removed).
    """
    if isinstance(process_set, _GlobalProcessSet) or process_set.process_set_id is None:
        return False
    world = runtime.communicator()
    sets = _sets()
    world.enter("remove_process_set")
    found = sets.pop(process_set.process_set_id, None)
    if found is None:
        return False
    if found._comm is not None:
        found._comm.close()
        found._comm = None
    found.process_set_id = None
    process_set.process_set_id = None
    return True


def communicator_of(process_set: ProcessSet | None) -> Communicator:
    """The communicator a collective on ``process_set`` runs on.

    Raises:
        ValueError: The set is not registered.
        NotInProcessSetError: This rank is not in the set.
    """
    if process_set is None or isinstance(process_set, _GlobalProcessSet):
        return runtime.communicator()
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


def _register_at_init(sets: Iterable, only_new: bool) -> None:
    """``init(process_sets=...)``: registers the sets in order; with ``only_new``, those not
    registered yet (Horovod programs may call ``init()`` again)."""
    for ps in sets:
        if only_new and isinstance(ps, ProcessSet) and ps.process_set_id is not None:
            continue
        add_process_set(ps)


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


def _communicators() -> list[Communicator]:
    """The communicators of the registered sets this rank is in."""
    return [ps._comm for ps in _registry.values() if ps._comm is not None]


runtime.plug_process_sets(
    register=_register_at_init, release=_release, communicators=_communicators
)
