"""Anyone on the host can connect to a job's ports; no one can fail a healthy job through them.

The real launcher runs a job while :class:`tests.hostile_peers.Crowd` holds more connections to
its report port (``SYNCDP_REPORT_ADDR``) or its lifeline port (``SYNCDP_LIFELINE_ADDR``) than
the launcher keeps open, each proving nothing: the job must end as it would alone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.hostile_peers import Crowd
from tests.integration.test_elastic import EPOCHS, EXAMPLE, _expected, _results
from tests.integration.test_spares import _assert_nothing_left, _spare_pid
from tests.launcher import ROOT, python_script, rank_env, start

# Rank 0 prints the report address; every rank waits for the go file, then exits 0. No
# syncdp.init(): the supervisors' exit reports alone decide the verdict.
JOB = r"""
import os, sys, time
if os.environ["OMPI_COMM_WORLD_RANK"] == "0":
    print("address", os.environ["SYNCDP_REPORT_ADDR"], flush=True)
while not os.path.exists(os.environ["GO_FILE"]):
    time.sleep(0.05)
"""


def test_a_crowd_on_the_report_port_does_not_fail_a_healthy_job(tmp_path):
    # 80 connections a byte a second, more than the launcher keeps open (64 + 2 per process):
    # the ranks' exit reports still get through, and the job succeeds.
    go = tmp_path / "go"
    proc = subprocess.Popen(
        [sys.executable, "-m", "syncdp.launch", "-np", "2", "python", python_script(tmp_path, JOB)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=rank_env({"GO_FILE": str(go)}),
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("[0]<stdout>:address "), line + proc.stderr.read()
        with Crowd(line.split()[-1], 80, trickle=True):
            time.sleep(2)  # every slot is taken, each connection trickling
            go.touch()
            out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the job did not end\n{err[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-4000:]
    assert "the job failed" not in err, err[-4000:]
    assert "rejected" in err and "crowded out before a signed line" in err, err[-4000:]


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = f.read().decode(errors="replace").split("\0")
    return dict(item.split("=", 1) for item in items if "=" in item)


def test_a_crowd_on_the_lifeline_port_does_not_fail_an_elastic_recovery(tmp_path):
    # 70 idle connections (more than the 64 the launcher lets wait for a first line), then a
    # rank is killed: its replacement's supervisor connects to the lifeline and must stay.
    data, marker = tmp_path / "data", tmp_path / "training"
    proc = start(
        2,
        "python",
        EXAMPLE,
        "--data",
        str(data),
        "--epochs",
        str(EPOCHS),
        "--step-seconds",
        "0.2",
        "--touch",
        f"0:2:{marker}",
        launcher_args=("--min-np", "2"),
    )
    try:
        deadline = time.monotonic() + 150
        while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert marker.exists(), "training never started"
        rank0, rank1 = _spare_pid(data, 0), _spare_pid(data, 1)
        assert rank0 is not None and rank1 is not None
        with Crowd(_environ(rank0)["SYNCDP_LIFELINE_ADDR"], 70):
            os.kill(rank1, signal.SIGKILL)
            out, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the job did not end\n{err[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log = f"--- stdout ---\n{out[-3000:]}\n--- stderr ---\n{err[-6000:]}"
    assert proc.returncode == 0, log
    assert "the launcher ended" not in err and "ending the rank" not in err, log
    results = _results(out)
    assert sorted(r["label"] for r in results) == [0, 2], log
    w, b = _expected()
    assert all(r["w"] == results[0]["w"] for r in results), log
    np.testing.assert_allclose(results[0]["w"], w, rtol=1e-9, atol=1e-12)
    assert abs(results[0]["b"] - b) < 1e-9, log
    _assert_nothing_left(data)
