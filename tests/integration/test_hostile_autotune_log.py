"""An autotune log that cannot be written ends the job before training, naming the file: the
launcher refuses it before anything starts, and a program started by plain mpirun fails at
rank 0's ``init()`` (not steps into training with TensorFlow's "Graph execution error")."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import pytest

from tests.launcher import ROOT, launch, python_script, rank_env

JOB = r"""
import syncdp
syncdp.init()
print("INITIALIZED", flush=True)
"""


def test_the_launcher_refuses_it_before_anything_starts(tmp_path):
    bad = str(tmp_path / "missing" / "tune.csv")
    script = python_script(tmp_path, JOB)
    args = ("--autotune", "--autotune-log-file", bad)
    result = launch(2, "python", script, launcher_args=args, timeout=60)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "INITIALIZED" not in result.stdout and "<std" not in result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and bad in lines[0], result.stderr
    assert result.elapsed < 20


def test_rank_0_fails_at_init_under_plain_mpirun(tmp_path):
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("no mpirun on PATH")
    bad = str(tmp_path / "missing" / "tune.csv")
    script = python_script(tmp_path, JOB)
    env = rank_env(
        {
            "SYNCDP_AUTOTUNE": "1",
            "SYNCDP_AUTOTUNE_LOG_FILE": bad,
            "OMPI_ALLOW_RUN_AS_ROOT": "1",
            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "OMPI_MCA_osc": "^ucx",
        }
    )
    began = time.monotonic()
    proc = subprocess.Popen(
        [mpirun, "-np", "2", "--oversubscribe", "python", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"mpirun did not end within 120 s:\n{err[-3000:]}")
    assert proc.returncode != 0, out + err
    assert "ConfigError" in err and bad in err, err[-3000:]
    assert "Graph execution error" not in err
    print(f"plain mpirun ended {time.monotonic() - began:.1f} s after its start")
