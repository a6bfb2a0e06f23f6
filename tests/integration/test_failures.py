"""A rank that dies or stalls ends the whole job quickly, named, with nothing left running; and
nothing of a job outlives its launcher.

Each test starts ``syncdp-run -np 2`` on a small training loop (DistributedGradientTape inside
tf.function), breaks rank 1 mid-training, and measures from the moment of the failure to the
launcher's exit. Limits (issue 5): a dead rank ends the job within 15 s, a stalled rank within
30 s with ``SYNCDP_STALL_TIMEOUT=10``.

The verdict comes from the ranks' reports (issue 20.1): a rank whose supervisor is killed
never reports, and the job fails naming it, at np=1, 2 and 3, also for a program that never
calls ``init()``. The launcher killed any way (SIGKILL included) takes every process of its job
with it (issue 21.2): prterun, the supervisors, the ranks, found by a marker in their command
lines and environments.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.launcher import ROOT, python_script, rank_env

TRAIN = r"""
import os, signal, sys, time
import tensorflow as tf
import syncdp

syncdp.init()
mode, at = os.environ["FAIL_MODE"], int(os.environ["FAIL_STEP"])
w = tf.Variable(tf.ones([64, 8]))
opt = tf.keras.optimizers.SGD(0.01)

@tf.function
def step(x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.matmul(x, w) ** 2)
    tape = syncdp.DistributedGradientTape(tape)
    opt.apply_gradients([(tape.gradient(loss, [w])[0], w)])

for i in range(100000):
    if i == at and syncdp.rank() == 1:
        print(f"FAIL {os.getpid()} {time.time():.3f}", flush=True)
        if mode == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif mode == "wait":
            time.sleep(3600)
    step(tf.random.normal([16, 64]) * 0.01)
    time.sleep(0.01)
"""

DEAD_LIMIT = 15.0
STALL_LIMIT = 30.0


def _start(tmp_path, mode: str, at: int, extra_env: dict | None = None):
    script = python_script(tmp_path, TRAIN, name=f"failures_{mode}_{os.getpid()}.py")
    env = rank_env({"FAIL_MODE": mode, "FAIL_STEP": str(at), **(extra_env or {})})
    cmd = [sys.executable, "-m", "syncdp.launch", "-np", "2", "python", script]
    out = open(tmp_path / "out.txt", "w+")
    proc = subprocess.Popen(
        cmd,
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    return proc, out, script


def _wait_for(proc, out, pattern: str, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out.seek(0)
        match = re.search(pattern, out.read())
        if match:
            return match
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    _kill(proc)
    out.seek(0)
    pytest.fail(f"never saw {pattern!r}:\n{out.read()[-5000:]}")


def _finish(proc, out, timeout: float) -> tuple[str, float]:
    """Waits for the launcher; returns its output and the time.time() it exited."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        out.seek(0)
        pytest.fail(f"the job did not end within {timeout} s:\n{out.read()[-5000:]}")
    ended = time.time()
    out.seek(0)
    return out.read(), ended


def _kill(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _left_running(script: str) -> list[str]:
    """Processes of the job still alive (zombies excluded), by their command line."""
    ps = subprocess.run(["ps", "-eo", "pid,stat,args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines()[1:] if script in line and line.split()[1][0] != "Z"]


def test_sigkill_of_a_rank_ends_the_job_naming_it(tmp_path):
    proc, out, script = _start(tmp_path, "wait", 5)
    match = _wait_for(proc, out, r"\[1\]<stdout>:FAIL (\d+)", timeout=120)
    killed = time.time()
    os.kill(int(match.group(1)), signal.SIGKILL)
    text, ended = _finish(proc, out, timeout=60)
    elapsed = ended - killed
    print(f"SIGKILL of rank 1 -> launcher exit: {elapsed:.2f} s")
    assert proc.returncode != 0
    assert elapsed < DEAD_LIMIT, text[-3000:]
    last = text.strip().splitlines()[-1]
    assert "rank 1" in last and "signal 9 (SIGKILL)" in last, text[-3000:]
    assert _left_running(script) == []


def test_sigkill_of_a_rank_supervisor_is_named_as_silent(tmp_path):
    # Nothing is left to report how rank 1 ended; the launcher names it from its "started"
    # report as the rank whose end was never reported.
    proc, out, script = _start(tmp_path, "wait", 5)
    _wait_for(proc, out, r"\[1\]<stdout>:FAIL", timeout=120)
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    # The supervisor of rank 1 is the parent of the rank that printed FAIL.
    out.seek(0)
    child = int(re.search(r"\[1\]<stdout>:FAIL (\d+)", out.read()).group(1))
    with open(f"/proc/{child}/stat") as f:
        supervisor = int(f.read().rsplit(")", 1)[1].split()[1])
    assert f"{supervisor} " in ps
    killed = time.time()
    os.kill(supervisor, signal.SIGKILL)
    text, ended = _finish(proc, out, timeout=60)
    print(f"SIGKILL of rank 1's supervisor -> launcher exit: {ended - killed:.2f} s")
    assert proc.returncode != 0
    assert ended - killed < DEAD_LIMIT
    last = text.strip().splitlines()[-1]
    assert last.startswith("syncdp-run: the job failed (0 of 2 ranks exited cleanly): "), last
    assert last.endswith(
        f"rank 1 (pid {child} on {socket.gethostname()}) ended without a report (its supervisor "
        "was killed)"
    ), text[-3000:]
    assert "rank 0 (pid" not in last  # rank 0 was stopped by mpirun, not the cause
    assert _left_running(script) == []


def test_sigstop_of_a_rank_is_named_as_a_stall(tmp_path):
    proc, out, script = _start(tmp_path, "stop", 5, {"SYNCDP_STALL_TIMEOUT": "10"})
    match = _wait_for(proc, out, r"\[1\]<stdout>:FAIL \d+ ([\d.]+)", timeout=120)
    stopped = float(match.group(1))
    text, ended = _finish(proc, out, timeout=90)
    elapsed = ended - stopped
    print(f"SIGSTOP of rank 1 -> launcher exit: {elapsed:.2f} s")
    assert proc.returncode != 0
    assert elapsed < STALL_LIMIT, text[-3000:]
    assert re.search(r"rank 1 stalled: collective #\d+ \S+ waited", text), text[-3000:]
    assert "ranks that have not arrived: 1" in text
    assert "rank 1: did not answer" in text
    assert "has waited" in text  # the earlier warning
    last = text.strip().splitlines()[-1]
    assert "first failure: rank 1 stalled" in last, text[-3000:]
    assert _left_running(script) == []


STALL_IN_A_SET = r"""
import os, time
import tensorflow as tf
import syncdp

pair = syncdp.ProcessSet([0, 2])
syncdp.init(process_sets=[pair])
if pair.included():
    for i in range(3):
        syncdp.allreduce(tf.ones([4]), process_set=pair)
    if syncdp.rank() == 2:
        print("FAIL", flush=True)
        time.sleep(3600)
    syncdp.allreduce(tf.ones([4]), process_set=pair)
else:
    time.sleep(3600)  # rank 1 is in no collective: only the set's watchdog can speak
"""


def test_a_stall_inside_a_process_set_names_the_job_rank(tmp_path):
    """Rank 2 is rank 1 of the set {0, 2}: the report must say rank 2, the job's number."""
    from tests.launcher import launch

    script = python_script(tmp_path, STALL_IN_A_SET, name=f"set_stall_{os.getpid()}.py")
    result = launch(3, "python", script, timeout=120, env={"SYNCDP_STALL_TIMEOUT": "5"})
    text = result.stdout + result.stderr
    assert result.returncode != 0
    stalled = r"rank 2 stalled: collective #\d+ allreduce\S* of the process set of ranks 0, 2 "
    stalled += "waited"
    assert re.search(stalled, text), text[-3000:]
    assert "ranks that have not arrived: 2" in text, text[-3000:]
    last = text.strip().splitlines()[-1]
    assert "first failure: rank 2 stalled" in last, text[-3000:]
    assert _left_running(script) == []


# A program that never calls init(): only its supervisor can say how it ended.
PLAIN = r"""
import os, time
print(f"ready {os.getpid()}", flush=True)
while True:
    time.sleep(0.05)
"""


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.parametrize("np", [1, 2, 3])
def test_a_rank_whose_supervisor_never_reports_fails_the_job_named(tmp_path, np):
    script = python_script(tmp_path, PLAIN, name=f"silent_{np}_{os.getpid()}.py")
    victim = np - 1
    proc = subprocess.Popen(
        [sys.executable, "-m", "syncdp.launch", "-np", str(np), "python", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=rank_env(),
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        pids = {}
        deadline = time.monotonic() + 60
        while len(pids) < np and time.monotonic() < deadline:
            line = proc.stdout.readline()
            match = re.match(r"\[(\d+)\]<stdout>:ready (\d+)", line)
            if match:
                pids[int(match.group(1))] = int(match.group(2))
        assert len(pids) == np, "the ranks did not start"
        os.kill(_parent_of(pids[victim]), signal.SIGKILL)  # the supervisor: no report at all
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last == (
        f"syncdp-run: the job failed (0 of {np} ranks exited cleanly): rank {victim} "
        f"(pid {pids[victim]} on {socket.gethostname()}) ended without a report (its supervisor "
        "was killed)"
    ), err[-3000:]
    assert _left_running(script) == []


# Ranks in a quiet training-like loop: allreduce after allreduce, nothing printed.
QUIET = r"""
import time
import numpy as np
import syncdp
from syncdp.job import runtime
syncdp.init()
comm = runtime.communicator()
buf = np.ones(1 << 14, np.float32)
print("training", flush=True)
while True:
    comm.allreduce_inplace(buf, name="step")
    buf[:] = 1
    time.sleep(0.01)
"""


def _job_processes(marker: str) -> list[str]:
    """Live processes whose command line or environment holds ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue  # gone meanwhile
        if marker in cmdline or marker.encode() in environ:
            found.append(f"{entry}: {cmdline[:150]}")
    return found


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM, signal.SIGHUP])
def test_nothing_of_the_job_outlives_its_launcher(tmp_path, signum):
    marker = f"syncdp-orphan-{os.getpid()}-{signum}"
    script = python_script(tmp_path, QUIET, name=f"{marker}.py")
    proc = subprocess.Popen(
        [sys.executable, "-m", "syncdp.launch", "-np", "2", "python", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=rank_env({"JOB_MARKER": marker}),
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        training = 0
        deadline = time.monotonic() + 120
        while training < 2 and time.monotonic() < deadline:
            training += "training" in proc.stdout.readline()
        assert training == 2, "the ranks did not start training"
        job = _job_processes(marker)
        kinds = " ".join(job)
        assert "prterun" in kinds and "syncdp.launch.worker" in kinds and len(job) >= 6, job
        killed = time.monotonic()
        os.kill(proc.pid, signum)  # the launcher alone, not its process group
        proc.wait(timeout=30)
        left = _job_processes(marker)
        while left and time.monotonic() - killed < 20:
            time.sleep(0.2)
            left = _job_processes(marker)
        name = signal.Signals(signum).name
        print(f"{name} of syncdp-run -> job gone: {time.monotonic() - killed:.1f} s")
        assert left == [], f"still running 20 s after {name}: {left}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for line in _job_processes(marker):  # never leave them to the next test
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
