"""'Where the time went': the launcher's per-rank table at the end of a training job."""

import os
import re
import signal
import subprocess

import pytest

from tests.launcher import check, launch, python_script, start

JOB = """
import time
import tensorflow as tf
import syncdp.tensorflow as hvd

hvd.init()
w = tf.Variable(tf.ones([50_000]))

@tf.function
def step():
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * w)
    tape = hvd.DistributedGradientTape(tape)
    (g,) = tape.gradient(loss, [w])
    w.assign_sub(0.001 * g)

for i in range(25):
    if hvd.rank() == hvd.size() - 1:
        time.sleep(0.03)  # the straggler: every other rank waits for it
    step()
t = hvd.timing()
assert t["steps"] == 25 and abs(t["computing"] + t["waiting"] + t["moving"] - 1) < 1e-6, t
"""


@pytest.mark.parametrize("np", [2, 3])
def test_the_launcher_prints_each_ranks_split_and_names_the_straggler(np, tmp_path):
    result = check(launch(np, "python", python_script(tmp_path, JOB), timeout=180))
    err = result.stderr
    assert "syncdp-run: where the time went (per rank, over 25 steps):" in err, err[-2000:]
    rows = re.findall(r"^\s+(\d+)\s+\S+\s+([\d.]+)\s+(\d+)%\s+(\d+)%\s+(\d+)%", err, re.M)
    assert sorted(int(r[0]) for r in rows) == list(range(np)), err[-2000:]
    waiting = {int(r[0]): int(r[3]) for r in rows}
    straggler = np - 1
    # Everyone else waits ~30 ms of a ~30+ ms step for the straggler, which waits for no one.
    assert all(waiting[r] > waiting[straggler] + 20 for r in range(np - 1)), err[-2000:]
    assert re.search(rf"slowest: rank {straggler} on \S+ \(waits \d+% of its step", err), err
    # No table for a program that trains nothing.
    quiet = check(launch(np, "python", "-c", "import syncdp; syncdp.init()", timeout=120))
    assert "where the time went" not in quiet.stderr


def test_sigusr1_prints_the_figures_so_far_and_the_job_goes_on(tmp_path):
    script = python_script(tmp_path, "import time\nprint('up', flush=True)\ntime.sleep(4)\n")
    proc = start(2, "python", script)
    try:
        assert "up" in proc.stdout.readline()
        os.kill(proc.pid, signal.SIGUSR1)  # the launcher's default for it would be to die
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-2000:]
    assert "syncdp-run: no timing reports yet" in err, err[-2000:]
