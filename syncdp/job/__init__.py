"""The job as a whole: init() and shutdown(), the current communicator, and process sets.

runtime        init(), shutdown(), rank/size queries, the job's configuration and
               communicator, tying the rooms below together
process_sets   one sub-communicator per process set
"""
