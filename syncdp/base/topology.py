"""Where each rank runs, from MPI itself: ranks that share memory are on one host.

``local`` ranks are those ``MPI_Comm_split_type(COMM_TYPE_SHARED)`` puts together (the same
node, whatever the nodes call themselves: containers that are all ``localhost`` stay apart).
``cross`` ranks are, as in Horovod, the ranks that share this rank's local rank: one per host
in a homogeneous job, so ``cross_rank`` is the index of this rank's host among them.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Topology", "discover"]


@dataclasses.dataclass
class Topology:
    """This rank's place in the job, and the communicators that describe it.

    Attributes:
        local_rank: Rank among the ranks on this host (picks the GPU).
        local_size: Ranks on this host.
        cross_rank: Rank among the ranks with the same local rank.
        cross_size: Ranks with the same local rank (the number of hosts, when every host
            runs the same number of ranks).
        homogeneous: Whether every host runs the same number of ranks.
        hosts: The number of hosts (groups of ranks that share memory).
        local_comm: The MPI communicator of this host's ranks.
        cross_comm: The MPI communicator of the ranks with this local rank.
    """

    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    local_comm: object = None
    cross_comm: object = None
    homogeneous: bool = True
    hosts: int = 1

    def free(self) -> None:
        """Frees the two communicators (not a collective on other hosts' ranks)."""
        for attr in ("local_comm", "cross_comm"):
            comm = getattr(self, attr)
            if comm is not None:
                comm.Free()
                setattr(self, attr, None)


def discover(mpi_comm) -> Topology:
    """Splits ``mpi_comm`` by shared memory, then by local rank. A collective on ``mpi_comm``."""
    from syncdp.base import mpi

    MPI = mpi.load()
    rank = mpi_comm.Get_rank()
    local = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    cross = mpi_comm.Split(color=local.Get_rank(), key=rank)
    places = mpi_comm.allgather((local.Get_rank(), local.Get_size()))
    local_sizes = {size for _, size in places}
    return Topology(
        local_rank=local.Get_rank(),
        local_size=local.Get_size(),
        cross_rank=cross.Get_rank(),
        cross_size=cross.Get_size(),
        local_comm=local,
        cross_comm=cross,
        homogeneous=len(local_sizes) == 1,
        hosts=sum(1 for local_rank, _ in places if local_rank == 0),
    )
