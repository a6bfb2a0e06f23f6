"""The shared-memory segments a job's killed processes leave are removed, and nothing else."""

import os
import socket
import subprocess
import sys
import time

from syncdp.launch import cleanup
from syncdp.launch.cleanup import ShmLeftovers

_HOLD = """
import mmap, sys, time
with open(sys.argv[1], "r+b") as f:
    m = mmap.mmap(f.fileno(), 4096)
print("mapped", flush=True)
time.sleep(60)
"""


def test_the_jobs_segments_that_nothing_holds_are_removed(tmp_path):
    names = [
        "sm_segment.h.0.abcd0001.0",  # a killed rank's: the job's
        "sm_segment.h.0.abcd0001.1",  # a live rank's: held
        "sm_segment.h.0.abcd0002.0",  # a killed replacement's (the same mpirun spawned it)
        "sm_segment.h.0.1234aaaa.0",  # another mpirun's
        "sm_segment.other.1.abcd0001.0",  # another user's
        "osc_sm.h.abcd0001.3",  # not a segment
    ]
    for name in names:
        (tmp_path / name).write_bytes(bytes(4096))
    rank = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(tmp_path / names[1])], stdout=subprocess.PIPE, text=True
    )
    try:
        assert rank.stdout.readline() == "mapped\n"
        leftovers = ShmLeftovers(rank.pid, str(tmp_path))
        assert leftovers.remove() == []  # nothing learned yet: nothing touched
        leftovers.look()
        assert leftovers.remove() == [names[0], names[2]]
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([names[1], *names[3:]])
    finally:
        rank.kill()
        rank.wait()
    assert leftovers.remove() == [names[1]]  # its rank is gone now


def _stale_session_dir(base, pid: int) -> None:
    """What a killed mpirun leaves: ``ompi.PID`` with its PMIx rendezvous file."""
    path = base / f"ompi.{pid}"
    path.mkdir()
    (path / f"pmix.vm.tool.{pid}").write_text("pmix-server.1;tcp4://127.0.0.1:1\n")


def test_session_directories_of_processes_that_are_gone_are_removed(tmp_path):
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead = int(gone.stdout)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _stale_session_dir(tmp_path, dead)
        (tmp_path / f"prted.{dead}").mkdir()  # a killed daemon's: gone too
        _stale_session_dir(tmp_path, alive.pid)  # a running mpirun's: kept
        (tmp_path / "ompi.notapid").mkdir()  # not a session directory
        (tmp_path / "other").mkdir()
        removed = cleanup.remove_stale_session_dirs({"TMPDIR": str(tmp_path)})
    finally:
        alive.kill()
        alive.wait()
    assert sorted(removed) == [f"ompi.{dead}", f"prted.{dead}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"ompi.{alive.pid}", "ompi.notapid", "other"]
    )


def test_segments_that_earlier_jobs_left_are_removed_when_nothing_holds_them(tmp_path):
    uid, h = os.getuid(), socket.gethostname()
    old = time.time() - 2 * cleanup.STALE_SEGMENT_SECONDS
    names = {
        "killed": f"sm_segment.{h}.{uid}.abcd0001.0",  # a killed rank's, no launcher left
        "singleton": f"sm_segment.{h}.{uid}.437b0000.0",  # a process that ran without one
        "held": f"sm_segment.{h}.{uid}.abcd0001.1",  # a live process maps it
        "young": f"sm_segment.{h}.{uid}.ffff0001.0",  # just made: may be about to be mapped
        "other user": f"sm_segment.{h}.{uid + 1}.abcd0001.2",
        "other host": f"sm_segment.elsewhere.{uid}.abcd0001.4",  # its processes out of sight
        "not a segment": f"osc_sm.{h}.{uid}.abcd0001.3",
    }
    for key, name in names.items():
        path = tmp_path / name
        path.write_bytes(bytes(4096))
        if key != "young":
            os.utime(path, (old, old))
    link = tmp_path / f"sm_segment.{h}.{uid}.abcd0001.5"  # not a file of its own
    link.symlink_to(tmp_path / names["other user"])
    os.utime(link, (old, old), follow_symlinks=False)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(tmp_path / names["held"])],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "mapped\n"
        removed = cleanup.remove_stale_segments(str(tmp_path))
    finally:
        holder.kill()
        holder.wait()
    assert removed == sorted([names["killed"], names["singleton"]])
    left = {p.name for p in tmp_path.iterdir()}
    assert left == (set(names.values()) | {link.name}) - set(removed)
    assert cleanup.remove_stale_segments(str(tmp_path / "missing")) == []
