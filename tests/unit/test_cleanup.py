"""The launcher's sweep of a host (syncdp.launch.cleanup): this job's processes die, stopped or not;
no other process does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from syncdp.launch import cleanup
from syncdp.launch.hosts import Host

# Stands for a rank: sleeps, and its command line says which job's mark it carries.
SLEEPER = "import time; time.sleep(60)"


def _sleeper(env: dict[str, str] | None = None, *args: str) -> subprocess.Popen:
    full = {k: v for k, v in os.environ.items() if k != "SYNCDP_JOB_ID"}
    full.update(env or {})
    return subprocess.Popen([sys.executable, "-c", SLEEPER, *args], env=full)


def _gone(proc: subprocess.Popen, timeout: float = 5.0) -> bool:
    try:
        proc.wait(timeout=timeout)
        return True
    except subprocess.TimeoutExpired:
        return False


def test_a_sweep_kills_this_jobs_processes_stopped_or_not_and_nothing_else():
    ours = _sleeper({"SYNCDP_JOB_ID": "job-a"})
    stopped = _sleeper({"SYNCDP_JOB_ID": "job-a"})
    daemon = _sleeper({}, "--prtemca", "ess_base_nspace", "prterun-node0-4242@0")
    other_job = _sleeper({"SYNCDP_JOB_ID": "job-b"})
    other_daemon = _sleeper({}, "prterun-node0-42424@0")
    none = _sleeper()
    everyone = [ours, stopped, daemon, other_job, other_daemon, none]
    try:
        time.sleep(0.3)  # each has exec'd Python with its environment
        os.kill(stopped.pid, signal.SIGSTOP)
        out = subprocess.run(
            cleanup.sweep_command("job-a", 4242, "node0.example.org"),
            capture_output=True,
            text=True,
            timeout=30,
        )
        killed = {int(line.split()[0]) for line in out.stdout.splitlines()}
        assert killed == {ours.pid, stopped.pid, daemon.pid}, out
        assert all(_gone(p) for p in (ours, stopped, daemon))
        assert not any(p.poll() is not None for p in (other_job, other_daemon, none))
    finally:
        for p in everyone:
            p.kill()
            p.wait()


def test_a_host_that_does_not_answer_is_named_within_the_bound(tmp_path):
    agent = tmp_path / "agent.sh"
    agent.write_text("#!/bin/sh\nexec sleep 30\n")
    agent.chmod(0o755)
    sweeper = cleanup.Sweeper("job-a", [str(agent)], [Host("ha", 1), Host("hb", 1)], timeout=1.0)
    began = time.monotonic()
    line = sweeper.finish([1], {})
    assert time.monotonic() - began < 4
    assert line == (
        "cleaned up what was left of the job: hb could not be cleaned up (no answer within 1 s)"
    )


def test_each_rank_is_swept_where_its_supervisor_said_or_else_where_mpirun_put_it():
    sweeper = cleanup.Sweeper("j", ["ssh"], [Host("n1.cluster", 2), Host("n2", 1)])
    assert sweeper.host_of(0, "n2") == "n2"
    assert sweeper.host_of(2, "n1") == "n1.cluster"  # the supervisor's short hostname
    assert [sweeper.host_of(r) for r in range(4)] == ["n1.cluster", "n1.cluster", "n2", "n2"]
    assert cleanup.Sweeper("j", ["ssh"]).host_of(3, "node7") == "localhost"
