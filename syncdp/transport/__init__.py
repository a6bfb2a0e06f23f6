"""How bytes move between ranks: MPI's collectives, the shared-memory plane and the ring among
hosts, behind one communicator.

    waiting           polling a request without holding a core
    shm               the shared-memory data plane of one host (an MPI-3 window)
    hosts_allreduce   the ring among hosts of a topology-aware allreduce
    communicator      collectives on NumPy buffers, each numbered, checked and watched
"""
