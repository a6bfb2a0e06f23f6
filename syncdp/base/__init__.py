"""Who this rank is: its settings, its errors, MPI itself and where it sits among the hosts.

The lowest room, no TensorFlow here (the data's way: base -> watch -> transport -> membership
-> job -> engine -> tensorflow -> keras; each room imports only the rooms before it):

    settings   the one table of settings (env var, launcher flag, init() keyword, default)
    errors     the exception hierarchy
    mpi        MPI, loaded by init(), never at import
    topology   local and cross ranks from MPI's shared-memory split
"""
