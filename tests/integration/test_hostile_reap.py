"""A rank the job ends is reaped by its supervisor before the launcher exits: never left a
zombie under init (which may reap slowly), whether it was stalled (stopped by SIGSTOP) or
ignores SIGTERM."""

from __future__ import annotations

import os
import re

from tests.launcher import launch, python_script

STALLS = r"""
import os, signal, time
import syncdp

syncdp.init()
syncdp.barrier()
if syncdp.rank() == 1:
    print(f"RANK {os.getpid()}", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)  # stalled: it never comes to the next barrier
time.sleep(0.5)
syncdp.barrier()
"""

IGNORES_SIGTERM = r"""
import os, signal, sys, time
if os.environ["OMPI_COMM_WORLD_RANK"] == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(f"RANK {os.getpid()}", flush=True)
    time.sleep(120)
time.sleep(1.5)
sys.exit(3)
"""


def _state(pid: int) -> str | None:
    """``"Z 1"`` (state and parent) while ``pid`` exists, None once it was reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return f"{fields[0]} {fields[1]}"


def _ended_rank(result) -> int:
    found = re.search(r"\[1\]<stdout>:RANK (\d+)", result.stdout)
    assert found, result.stdout[-2000:] + result.stderr[-3000:]
    return int(found[1])


def test_a_stalled_rank_is_reaped_when_the_job_ends(tmp_path):
    script = python_script(tmp_path, STALLS, name=f"reap_stall_{os.getpid()}.py")
    result = launch(2, "python", script, env={"SYNCDP_STALL_TIMEOUT": "3"}, timeout=120)
    left = _state(_ended_rank(result))  # at once: the launcher has just exited
    assert result.returncode != 0
    assert left is None, f"the stalled rank is still there as {left!r} (state, parent)"
    assert "rank 1 stalled" in result.stderr.strip().splitlines()[-1], result.stderr[-3000:]
    assert re.search(
        r"stopped rank 1 \(pid \d+ on \S+\) with SIGTERM as the job ends", result.stderr
    )


def test_a_rank_that_ignores_sigterm_is_killed_and_reaped(tmp_path):
    script = python_script(tmp_path, IGNORES_SIGTERM, name=f"reap_ignore_{os.getpid()}.py")
    result = launch(2, "python", script, timeout=60)
    left = _state(_ended_rank(result))
    assert result.returncode == 3, result.stderr[-3000:]
    assert left is None, f"the rank is still there as {left!r} (state, parent)"
    assert "first failure: rank 0" in result.stderr.strip().splitlines()[-1]
    assert result.elapsed < 20
