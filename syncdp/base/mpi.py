"""Loads MPI on demand: ``import syncdp`` must not start MPI, ``syncdp.init()`` does.

``from mpi4py import MPI`` runs ``MPI_Init_thread``, so no syncdp module imports it at module
level; they call :func:`load` when they need MPI. The first load asks for
``MPI_THREAD_MULTIPLE``, because the stall watchdog talks MPI from a second thread. A program
that imported mpi4py first keeps the thread level it chose (the watchdog then only warns and
aborts, without asking the other ranks where they are).
"""

from __future__ import annotations

import math
import os
import signal
import sys

__all__ = ["load", "loaded", "bound_finalize"]


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
    after some spawns (elastic mode's ``--finalize-timeout``)."""
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(max(1, math.ceil(seconds)))
