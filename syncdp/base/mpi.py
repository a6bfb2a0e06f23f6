"""Loads MPI on demand: ``import syncdp`` must not start MPI, ``syncdp.init()`` does.

``from mpi4py import MPI`` runs ``MPI_Init_thread``, so no syncdp module imports it at module
level; they call :func:`load` when they need MPI. The first load asks for
``MPI_THREAD_MULTIPLE``, because the stall watchdog talks MPI from a second thread. A program
that imported mpi4py first keeps the thread level it chose (the watchdog then only warns and
aborts, without asking the other ranks where they are).

An elastic job's processes leave through :func:`bound_finalize`, which frees every
communicator left before ``MPI_Finalize``: Open MPI 5.0.11 disconnects, in ``MPI_Finalize``,
every communicator still open that spans processes of different spawns, and that disconnect
crashed (``ompi_dpm_dyn_finalize``) or never ended once a spawned process had been connected to
a process of a later spawn (a spare started in the background, taken in by a job that already
held spawned processes). Freeing is local, also on a revoked communicator; nothing is left for
``MPI_Finalize`` to disconnect. Only communicators that span spawns are freed, in the order they
were made, so that one Open MPI made for another (its collectives' sub-communicators) goes with
it; those it made for a window are left to it (:func:`windows_made`): ``MPI_Finalize`` frees
the window with them.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys

__all__ = [
    "load",
    "loaded",
    "bound_finalize",
    "free_communicators",
    "windows_made",
    "windows_freed",
]

# Fortran indices of the communicators Open MPI made for windows (never freed here).
_WINDOWS: set[int] = set()
# Past the highest communicator alive, this many indices in a row name none.
_INDEX_GAP = 256


def loaded() -> bool:
    """Whether mpi4py's MPI module has been imported (by syncdp or by the program)."""
    return "mpi4py.MPI" in sys.modules


def load():
    """Returns mpi4py's ``MPI`` module, initializing MPI on the first call."""
    if not loaded():
        import mpi4py

        if not os.path.isdir("/sys/class/infiniband"):
            # Without an RDMA device Open MPI's UCX one-sided component fails its query and
            # prints an error for every window (the shared-memory plane makes one); its
            # shared-memory component serves instead. A user's own setting wins.
            os.environ.setdefault("OMPI_MCA_osc", "^ucx")

        mpi4py.rc.thread_level = "multiple"
    from mpi4py import MPI

    return MPI


def bound_finalize(seconds: float) -> None:
    """Ends this process with SIGALRM if it is still alive ``seconds`` from now (at least 1 s,
    whole seconds): armed just before ``MPI_Finalize``, which Open MPI 5.0.11 can leave hanging
    after some spawns (elastic mode's ``--finalize-timeout``). Then frees every communicator
    left (:func:`free_communicators`)."""
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(max(1, math.ceil(seconds)))
    free_communicators()  # within the bound: what MPI_Finalize would disconnect


def _communicators(MPI) -> set[int]:
    """Fortran indices of every communicator alive in this process but WORLD, SELF and NULL
    (Open MPI numbers them densely, reusing the lowest free index)."""
    found, misses, index = set(), 0, 3
    while misses < _INDEX_GAP:
        try:
            comm = MPI.Comm.f2py(index)
        except MPI.Exception:
            misses += 1
        else:
            misses = 0
            if comm != MPI.COMM_NULL:
                found.add(index)
        index += 1
    return found


@contextlib.contextmanager
def windows_made(comm):
    """``with windows_made(comm) as made: win = MPI.Win.Allocate_shared(..., comm=comm)``:
    the communicators Open MPI makes inside the block for a window over ``comm`` (its copy of
    ``comm``) are the window's, and :func:`free_communicators` leaves them. ``made`` receives
    their indices, for :func:`windows_freed` once the window is freed."""
    MPI = load()
    before = _communicators(MPI)
    made: list[int] = []
    try:
        yield made
    finally:
        for index in sorted(_communicators(MPI) - before):
            try:  # a spare being started in another thread makes communicators too
                if MPI.Comm.Compare(MPI.Comm.f2py(index), comm) == MPI.CONGRUENT:
                    made.append(index)
            except MPI.Exception:
                pass
        _WINDOWS.update(made)


def windows_freed(made) -> None:
    """The window whose communicators :func:`windows_made` found was freed: their indices may
    name other communicators from now on."""
    _WINDOWS.difference_update(made)


def _spans_spawns(MPI, comm, world) -> bool:
    """Whether ``comm`` holds a process that is not in this process's ``MPI_COMM_WORLD``."""
    groups = [comm.Get_group()]
    if comm.Is_inter():
        groups.append(comm.Get_remote_group())
    try:
        for group in groups:
            ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world)
            if MPI.UNDEFINED in ranks:
                return True
        return False
    finally:
        for group in groups:
            group.Free()


def free_communicators() -> int:
    """Frees every communicator left in this process that spans spawns (but the windows'), so
    that ``MPI_Finalize`` has none to disconnect (see the module docstring); never raises.

    Returns:
        How many were freed.
    """
    if not loaded():
        return 0
    MPI = load()
    freed = 0
    world = MPI.COMM_WORLD.Get_group()
    try:
        for index in sorted(_communicators(MPI) - _WINDOWS):
            try:
                comm = MPI.Comm.f2py(index)  # again: freeing one may have freed this one
                if comm != MPI.COMM_NULL and _spans_spawns(MPI, comm, world):
                    comm.Free()
                    freed += 1
            except MPI.Exception:
                pass
    finally:
        world.Free()
    return freed
