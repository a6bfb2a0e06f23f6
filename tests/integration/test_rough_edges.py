"""Rough edges of failure reporting (issue 21 item 5), through the real launcher.

A rank that leaves with ``os._exit(0)`` skips ``atexit`` and with it syncdp's exit handshake;
the ranks that wait for it in a collective name it, and the collective, within seconds. A
stall names where each missing rank is.
"""

from __future__ import annotations

import os
import re

import pytest

from tests.launcher import launch, python_script

LEAVE = r"""
import os, sys, time
import syncdp

syncdp.init()
leaver = int(os.environ["LEAVER"])
idle = int(os.environ.get("IDLE", "-1"))
syncdp.barrier()
if syncdp.rank() == leaver:
    time.sleep(0.5)  # the others are waiting in the barrier below by now
    print(f"LEAVING {time.time():.3f}", flush=True)
    os._exit(0)
if syncdp.rank() == idle:
    time.sleep(3600)
syncdp.barrier()
print("PASSED", flush=True)
"""

# The job ends within seconds of the exit; Open MPI alone ends it in about 0.3 s.
GONE_LIMIT = 15.0


def _leave(tmp_path, np: int, leaver: int, idle: int = -1):
    script = python_script(tmp_path, LEAVE, name=f"leave_{np}_{leaver}_{os.getpid()}.py")
    env = {"LEAVER": str(leaver), "IDLE": str(idle), "SYNCDP_STALL_TIMEOUT": "120"}
    result = launch(np, "python", script, timeout=150, env=env)
    text = result.stdout + result.stderr
    left = re.search(rf"\[{leaver}\]<stdout>:LEAVING ([\d.]+)", text)
    assert left, text[-3000:]
    elapsed = result.ended_at - float(left.group(1))
    print(f"os._exit(0) on rank {leaver} at np={np} -> launcher exit: {elapsed:.2f} s")
    assert result.returncode != 0, text[-3000:]
    assert elapsed < GONE_LIMIT, text[-3000:]
    assert "PASSED" not in result.stdout
    return result, text


@pytest.mark.parametrize("np,leaver", [(2, 1), (3, 1), (3, 0)])
def test_os_exit_while_others_wait_names_the_rank_and_the_collective(tmp_path, np, leaver):
    result, text = _leave(tmp_path, np, leaver)
    waiting = [r for r in range(np) if r != leaver]
    who = ("rank " if len(waiting) == 1 else "ranks ") + ", ".join(map(str, waiting))
    named = re.findall(
        rf"syncdp: rank {leaver} \(pid \d+ on \S+\) exited while {who} waits? for it in "
        r"collective #\d+ barrier",
        text,
    )
    assert len(named) == 1, text[-3000:]  # the lowest waiting rank speaks for all
    assert f"[{waiting[0]}]<stderr>:syncdp: rank {leaver} (pid" in text
    last = result.stderr.strip().splitlines()[-1]
    assert f"first failure: rank {leaver} (pid " in last, last
    assert f"while {who} wait" in last, last
    assert re.search(r"exited \(code 0\) while .* in collective #\d+ barrier$", last), last


def test_os_exit_names_the_rank_that_is_elsewhere(tmp_path):
    result, text = _leave(tmp_path, 3, leaver=1, idle=2)
    assert re.search(
        r"syncdp: rank 1 \(pid \d+ on \S+\) exited while rank 0 waits for it in collective "
        r"#\d+ barrier",
        text,
    ), text[-3000:]
    assert re.search(
        r"rank 2: in no collective: computing, or stuck outside syncdp \(last finished #\d+\)",
        text,
    ), text[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "first failure: rank 1 (pid " in last and "while rank 0 waits" in last, last


STALL = r"""
import os, time
import syncdp

syncdp.init()
syncdp.barrier()
if syncdp.rank() == 1:
    time.sleep(3600)
syncdp.barrier()
"""


def test_a_stall_says_where_each_missing_rank_is(tmp_path):
    script = python_script(tmp_path, STALL, name=f"stall_where_{os.getpid()}.py")
    result = launch(3, "python", script, timeout=150, env={"SYNCDP_STALL_TIMEOUT": "4"})
    text = result.stdout + result.stderr
    assert result.returncode != 0, text[-3000:]
    # Ranks 0 and 2 wait in the barrier; rank 1 computes (sleeps) outside syncdp.
    assert re.search(
        r"ranks that have not arrived: 1 \(in no collective: computing, or stuck outside "
        r"syncdp\)",
        text,
    ), text[-3000:]
    assert re.search(r"rank 1: in no collective: computing, or stuck outside syncdp", text)
    last = result.stderr.strip().splitlines()[-1]
    assert "first failure: rank 1 stalled" in last, last


PROCESS_SETS = r"""
import tensorflow as tf
import syncdp

pair = syncdp.ProcessSet([0, 1])
syncdp.init(process_sets=[pair])
# Rank 0 reduces over the pair, the others over the whole job: different communicators, so
# no argument check can meet; the stall report says where each one is.
chosen = pair if syncdp.rank() == 0 else syncdp.global_process_set
syncdp.allreduce(tf.ones([2]), process_set=chosen)
print("PASSED", flush=True)
"""


def test_a_stall_between_process_sets_names_the_set_each_rank_is_in(tmp_path):
    script = python_script(tmp_path, PROCESS_SETS, name=f"stall_sets_{os.getpid()}.py")
    env = {"SYNCDP_STALL_TIMEOUT": "4", "SYNCDP_STALL_WARNING": "1"}
    result = launch(3, "python", script, timeout=150, env=env)
    text = result.stdout + result.stderr
    assert result.returncode != 0, text[-3000:]
    assert "PASSED" not in result.stdout
    # Rank 0's warning names its set.
    assert re.search(
        r"rank 0 has waited \d+ s in collective #\d+ allreduce\.bucket0 of the process set of "
        r"ranks 0, 1 for other ranks",
        text,
    ), text[-3000:]
    # The first report ends the job: rank 0's (ranks 1 and 2 are in the whole job's collective,
    # not computing) or one from rank 1 or 2 (rank 0 is in the pair's collective).
    from_rank_0 = re.search(
        r"rank [12]: in collective #\d+ allreduce\.bucket0 of the whole job instead\.",
        text,
    )
    from_the_others = re.search(
        r"rank 0: in collective #\d+ allreduce\.bucket0 of the process set of ranks 0, 1 "
        r"instead\.",
        text,
    )
    assert from_rank_0 or from_the_others, text[-3000:]
