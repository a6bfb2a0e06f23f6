"""Who is in the job: elastic membership on Open MPI's ULFM.

membership   recovery: revoke, shrink, spawn or take a spare, merge
spares       warm spares waiting in init() to become ranks
refill       used or dead spares replaced in the background
commits      each host's copy of the last commit on its local disk (host-loss restarts)
jobenv       what every process of a job carries, spawned ones included
"""
