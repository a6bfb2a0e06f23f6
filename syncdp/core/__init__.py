"""The core: who this rank is and how it talks to the others. No TensorFlow here.

    settings       the one table of settings (env var, launcher flag, init() keyword, default)
    errors         the exception hierarchy
    mpi            MPI, loaded by init(), never at import
    runtime        init(), shutdown(), rank/size queries, the current communicator
    communicator   collectives on NumPy buffers, each numbered and watched
    watchdog       names the ranks a stalled collective waits for, then ends the job
    topology       local and cross ranks from MPI's shared-memory split
    timeline       a Chrome trace of every collective
    report         the failure channel to the launcher: (kind, rank, host, message) as data

Imports point down: core imports nothing else from syncdp.
"""
