"""Watching the job: what every rank reports to the launcher, and where its time goes.

report     the report channel to the launcher: (kind, rank, host, message) as data
stats      where each rank's step time went (computing, waiting, moving bytes)
timeline   a Chrome trace of every collective
watchdog   names the ranks a stalled collective waits for, then ends the job
"""
