"""The launcher end to end: ranks start, output is prefixed, and every failure ends the job."""

import os
import shutil
import signal
import subprocess
import sys
import time

from tests.launcher import ROOT, check, launch, python_script, rank_env

HELLO = "import syncdp; syncdp.init(); print('hello', syncdp.rank(), syncdp.size())"


def test_more_ranks_than_cores_with_prefixed_output():
    result = check(launch(4, "python", "-c", HELLO, timeout=240))
    for rank in range(4):
        assert f"[{rank}]<stdout>:hello {rank} 4" in result.stdout


def test_plain_mpirun_works_without_the_launcher():
    env = rank_env({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    result = subprocess.run([shutil.which("mpirun"), "-np", "2", "--oversubscribe",
                             sys.executable, "-c", HELLO], env=env, cwd=ROOT, text=True,
                            capture_output=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "hello 0 2" in result.stdout and "hello 1 2" in result.stdout


def test_exception_on_one_rank_ends_the_job_naming_it(tmp_path):
    script = python_script(tmp_path, """
import syncdp
syncdp.init()
if syncdp.rank() == 1:
    raise ValueError("bad batch on purpose")
syncdp.barrier()  # rank 0 waits here for a rank that will never come
print("rank 0 passed the barrier")
""")
    result = launch(2, "python", script, timeout=120)
    assert result.returncode != 0
    assert "rank 0 passed the barrier" not in result.stdout
    assert "syncdp: rank 1 failed with ValueError: bad batch on purpose" in result.stderr
    assert "first failure: rank 1" in result.stderr.splitlines()[-1]


def test_nonzero_exit_on_one_rank_ends_the_job_naming_it(tmp_path):
    script = python_script(tmp_path, """
import sys
import syncdp
syncdp.init()
if syncdp.rank() == 1:
    sys.exit(3)
syncdp.barrier()
""")
    result = launch(2, "python", script, timeout=120)
    assert result.returncode != 0
    assert ("syncdp: rank 1 finished its program after collective #1, but rank 0 is waiting "
            "for it in collective #2 barrier" in result.stderr)
    assert "first failure: rank 1" in result.stderr.splitlines()[-1]


def test_sigterm_stops_every_rank(tmp_path):
    marker = f"syncdp-sigterm-{os.getpid()}"
    script = python_script(tmp_path, f"""
import time
import syncdp
syncdp.init()
print("ready", syncdp.rank(), flush=True)
while True:  # {marker}
    time.sleep(0.1)
""", name=f"{marker}.py")
    proc = subprocess.Popen([sys.executable, "-m", "launch", "-np", "2", "python", script],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=rank_env(), cwd=ROOT, start_new_session=True)
    try:
        ready = 0
        deadline = time.monotonic() + 120
        while ready < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            ready += "ready" in line
        assert ready == 2, "ranks did not start"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    assert left == "", f"ranks still running: {left}"
