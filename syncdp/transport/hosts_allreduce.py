"""Allreduce across hosts: each host reduces once, and only that crosses the network.

:class:`~syncdp.transport.communicator.Communicator` takes these paths when the topology-aware
allreduce is on (``--hierarchical-allreduce``). With the shared-memory plane
(:mod:`syncdp.transport.shm`) each host sums in shared memory and :func:`ring_allreduce` carries
each
rank's slice among the hosts; without it, :func:`reduce_by_host` does the whole path in MPI.
"""

from __future__ import annotations

import numpy as np

from syncdp.base import mpi as _mpi

__all__ = ["reduce_by_host", "ring_allreduce"]


def reduce_by_host(chunk: np.ndarray, op, ufunc, local, cross, even: bool) -> None:
    """Topology-aware allreduce of ``chunk`` in place.

    When every host runs the same number of ranks (``even``): a reduce-scatter inside each
    host (shared memory) leaves local rank ``i`` with segment ``i`` summed over its host; the
    ranks with local rank ``i`` (one per host, ``cross``) allreduce that segment in a ring, so
    every rank carries an equal share of the traffic between hosts, in parallel; an allgather
    inside each host puts the segments together. Otherwise each host reduces to its local
    rank 0, those leaders allreduce in a ring, and each host broadcasts from its leader.
    Either way every byte crosses between hosts once per host, not once per rank.
    """
    MPI = _mpi.load()
    if even:
        n, k, me = chunk.size, local.Get_size(), local.Get_rank()
        counts = [n // k + (1 if i < n % k else 0) for i in range(k)]
        displs = [sum(counts[:i]) for i in range(k)]
        mine = np.empty(counts[me], chunk.dtype)
        local.Reduce_scatter(chunk, mine, counts, op=op)
        ring_allreduce(cross, mine, ufunc)
        local.Allgatherv(mine, [chunk, (counts, displs)])
        return
    leader = local.Get_rank() == 0
    local.Reduce(MPI.IN_PLACE if leader else chunk, chunk if leader else None, op=op, root=0)
    if leader:
        ring_allreduce(cross, chunk, ufunc)
    local.Bcast(chunk, root=0)


def ring_allreduce(comm, chunk: np.ndarray, ufunc) -> None:
    """Ring allreduce (reduce-scatter, then allgather) of ``chunk`` in place.

    Every link carries ``2 (h - 1) / h`` of the data, both ways at once, whatever Open MPI
    would pick: its allreduce (and reduce-scatter) of two ranks reduces one way and sends the
    result back, twice the time on a slow link. Every rank receives each reduced segment from
    the one rank that owns it, so all hold the same bits.
    """
    h, me = comm.Get_size(), comm.Get_rank()
    if h == 1:
        return
    edges = [chunk.size * i // h for i in range(h + 1)]
    segment = [chunk[edges[i] : edges[i + 1]] for i in range(h)]
    right, left = (me + 1) % h, (me - 1) % h
    incoming = np.empty(max(s.size for s in segment), chunk.dtype)
    for step in range(h - 1):  # afterwards this rank owns segment (me + 1) % h, reduced
        out, into = segment[(me - step) % h], segment[(me - step - 1) % h]
        comm.Sendrecv(out, dest=right, recvbuf=incoming[: into.size], source=left)
        ufunc(into, incoming[: into.size], out=into)
    for step in range(h - 1):
        out, into = segment[(me + 1 - step) % h], segment[(me - step) % h]
        comm.Sendrecv(out, dest=right, recvbuf=into, source=left)
