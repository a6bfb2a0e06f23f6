"""Loads MPI on demand: ``import syncdp`` must not start MPI, ``syncdp.init()`` does.

``from mpi4py import MPI`` runs ``MPI_Init_thread``, so no syncdp module imports it at module
level; they call :func:`load` when they need MPI. The first load asks for
``MPI_THREAD_MULTIPLE``, because the stall watchdog talks MPI from a second thread. A program
that imported mpi4py first keeps the thread level it chose (the watchdog then only warns and
aborts, without asking the other ranks where they are).
"""

from __future__ import annotations

import sys

__all__ = ["load", "loaded"]


def loaded() -> bool:
    """Whether mpi4py's MPI module has been imported (by syncdp or by the program)."""
    return "mpi4py.MPI" in sys.modules


def load():
    """Returns mpi4py's ``MPI`` module, initializing MPI on the first call."""
    if not loaded():
        import mpi4py

        mpi4py.rc.thread_level = "multiple"
    from mpi4py import MPI

    return MPI
