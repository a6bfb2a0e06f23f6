"""The report channel end to end: only the job's own reports decide its verdict (issue 20.6).

A job runs under the real launcher; while its ranks wait, the test, knowing only the report
address (anyone on the host can find the port), sends what an attacker could: a forged failure
of a rank on host "evil", a forged clean exit, a report signed for another job, an oversized
and a malformed line. The verdict must be the one the ranks' own reports give, and the launcher
must say how many reports it rejected.
"""

import json
import socket
import subprocess
import sys
import time

from syncdp.watch import report
from tests.launcher import ROOT, python_script, rank_env

# Rank 0 prints the report address; every rank waits for the go file, then exits with its
# EXIT_<rank> code (0 by default). No syncdp.init(): the supervisors report the exits.
JOB = r"""
import os, sys, time
rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
if rank == 0:
    print("address", os.environ["SYNCDP_REPORT_ADDR"], flush=True)
while not os.path.exists(os.environ["GO_FILE"]):
    time.sleep(0.05)
sys.exit(int(os.environ.get(f"EXIT_{rank}", "0")))
"""


def _forged(kind, rank, **fields):
    return {**report.make(kind, rank, **fields), "host": "evil", "pid": 666, "time": 1.0}


def _attack(address: str, *lines: bytes) -> None:
    host, _, port = address.rpartition(":")
    for line in lines:
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(line)
            s.shutdown(socket.SHUT_WR)
            s.recv(16)  # the launcher answers nothing (or closes)


def _run_attacked(tmp_path, lines_for, env=None):
    go = tmp_path / "go"
    script = python_script(tmp_path, JOB)
    proc = subprocess.Popen(
        [sys.executable, "-m", "syncdp.launch", "-np", "2", "python", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=rank_env({"GO_FILE": str(go), **(env or {})}),
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("[0]<stdout>:address "), line + proc.stderr.read()
        address = line.split()[-1]
        assert address.startswith("127.0.0.1:")  # a job on one host listens on loopback only
        _attack(address, *lines_for(address))
        go.touch()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


def test_forged_replayed_oversized_and_malformed_reports_change_nothing(tmp_path):
    another_job = report.Job.new()

    def lines(address):
        exception = _forged("exception", 1, message="RuntimeError: the evil host says so")
        return [
            (json.dumps(exception) + "\n").encode(),  # unsigned
            b"0" * 64 + b" " + json.dumps({**exception, "nonce": "1"}).encode() + b"\n",
            report.encode(exception, another_job),  # replayed from another job
            report.encode(_forged("exit", 0, code=9), another_job),
            b"x" * (report.MAX_LINE_BYTES + 100) + b"\n",  # oversized
            b"hello\n",  # malformed
        ]

    began = time.monotonic()
    code, err = _run_attacked(tmp_path, lines)
    assert code == 0, err[-3000:]
    assert "evil" not in err and "job failed" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last == (
        "syncdp-run: rejected 6 reports that did not prove to be this job's (3 bad signature, "
        "2 malformed, 1 too long)"
    ), err[-3000:]
    assert time.monotonic() - began < 60


def test_a_forged_clean_exit_and_an_earlier_forged_failure_do_not_hide_the_real_one(tmp_path):
    another_job = report.Job.new()

    def lines(address):
        return [
            report.encode(_forged("exit", 1, code=0, signal=None, requested=False), another_job),
            (json.dumps(_forged("exception", 0, message="ValueError: framed")) + "\n").encode(),
        ]

    code, err = _run_attacked(tmp_path, lines, env={"EXIT_1": "3"})
    assert code == 3, err[-3000:]
    lines_out = err.strip().splitlines()
    assert lines_out[-2] == (
        "syncdp-run: rejected 2 reports that did not prove to be this job's (1 bad signature, "
        "1 malformed)"
    ), err[-3000:]
    assert lines_out[-1].startswith(
        "syncdp-run: the job failed (1 of 2 ranks exited cleanly); first failure: rank 1 (pid "
    ), err[-3000:]
    assert lines_out[-1].endswith(f"on {socket.gethostname()}) exited with code 3"), err[-3000:]
