"""The lifeline: a supervisor ends its rank (and whatever the rank started) when its launcher is
gone, and the launcher knows each supervisor's link.

The supervisor tests run the real ``syncdp.launch.worker`` under a stand-in launcher process (the
launcher's lifeline and report servers, nothing else) and SIGKILL that process, as a user or
the OOM killer would kill ``syncdp-run``.
"""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from syncdp.launch.lifeline import LIFELINE_VAR, Lifeline, LifelineServer
from syncdp.watch import report
from tests.launcher import ROOT, rank_env, wait_gone

# A stand-in for syncdp-run: the two servers a supervisor talks to, then nothing.
LAUNCHER = """
import time
from syncdp.launch.lifeline import LifelineServer
from syncdp.launch.report_server import ReportServer
from syncdp.watch import report
job = report.Job.from_env()
lifeline = LifelineServer(job).start()
reports = ReportServer(job).start(lambda r: None)
print(lifeline.address, reports.address, flush=True)
time.sleep(600)
"""

# A rank that starts a process of its own, then waits.
RANK = """
import subprocess, sys, time
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("pids", helper.pid, flush=True)
time.sleep(600)
"""


def _kill(proc) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_a_supervisor_ends_its_rank_group_when_the_launcher_is_sigkilled():
    job = report.Job.new()
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER],
        env=rank_env(job.env()),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    worker = None
    try:
        lifeline_addr, report_addr = launcher.stdout.readline().split()
        env = {
            **job.env(),
            LIFELINE_VAR: lifeline_addr,
            report.ADDRESS_VAR: report_addr,
            "OMPI_COMM_WORLD_RANK": "1",
        }
        worker = subprocess.Popen(
            [sys.executable, "-m", "syncdp.launch.worker", sys.executable, "-c", RANK],
            env=rank_env(env),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = worker.stdout.readline()
        assert line.startswith("[1]<stdout>:pids "), line + worker.stderr.read()
        helper = int(line.split()[-1])
        rank = int(
            open(f"/proc/{helper}/stat").read().rsplit(")", 1)[1].split()[1]
        )  # the helper's parent is the rank
        killed = time.monotonic()
        os.kill(launcher.pid, signal.SIGKILL)
        worker.wait(timeout=10)
        left = wait_gone([rank, helper], timeout=10)
        print(
            f"launcher SIGKILL -> supervisor, rank, helper gone: {time.monotonic() - killed:.1f} s"
        )
        assert left == [], f"still running: {left}"
        assert "the launcher ended (its lifeline connection closed); ending the rank" in (
            worker.stderr.read()
        )
    finally:
        _kill(launcher)
        if worker is not None:
            _kill(worker)


def test_a_supervisor_whose_launcher_is_gone_starts_nothing(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens there
    marker = tmp_path / "ran"
    env = {**report.Job.new().env(), LIFELINE_VAR: dead, "OMPI_COMM_WORLD_RANK": "0"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "syncdp.launch.worker",
            sys.executable,
            "-c",
            f"open({str(marker)!r}, 'w')",
        ],
        env=rank_env(env),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "the launcher's lifeline at" in result.stderr and "not started" in result.stderr
    assert not marker.exists()


@pytest.fixture
def server():
    servers = []

    def start():
        s = LifelineServer(report.Job.new()).start()
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.close()


def _until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_the_launcher_records_each_link_and_its_end(server):
    srv = server()
    lost = []
    client = Lifeline.connect(srv.address, srv.job)
    client.start(3, 4242, lost_after=10.0, on_lost=lost.append)
    assert _until(lambda: 3 in srv.links())
    link = srv.links()[3]
    assert (link.rank, link.pid, link.host) == (3, 4242, socket.gethostname())
    assert link.closed is None and not link.silent()
    srv.close()
    assert _until(lambda: lost, timeout=5), "the supervisor did not notice its launcher end"
    assert lost == ["the launcher ended (its lifeline connection closed)"]


def test_a_supervisor_closing_its_lifeline_is_seen(server):
    srv = server()
    client = Lifeline.connect(srv.address, srv.job)
    client.start(0, 1, lost_after=10.0, on_lost=lambda why: None)
    assert _until(lambda: 0 in srv.links())
    client._sock.close()
    assert _until(lambda: srv.links()[0].closed is not None, timeout=5)


def test_only_the_jobs_supervisors_get_a_link(server):
    srv = server()
    host, _, port = srv.address.rpartition(":")
    forged = report.encode(report.make("lifeline", 1), report.Job.new())
    with socket.create_connection((host, int(port))) as s:
        s.sendall(forged)
        assert s.recv(10) == b""  # dropped
    with socket.create_connection((host, int(port))):
        pass  # a probe: connects and closes, not counted
    time.sleep(0.5)
    assert srv.links() == {}
    assert srv.rejected == {"bad signature": 1}


def test_a_silent_launcher_counts_as_gone_only_once_its_address_refuses():
    job = report.Job.new()
    listener = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    lost = []
    client = Lifeline.connect(address, job)
    conn, _ = listener.accept()  # held open, never answered: a stopped or cut-off launcher
    try:
        client.start(0, 1, lost_after=1.0, on_lost=lost.append)
        time.sleep(3)
        assert lost == []  # silent, but its address still accepts (a launcher under Ctrl-Z)
        listener.close()  # now nothing answers there: the link is cut
        assert _until(lambda: lost, timeout=10)
        assert lost[0].startswith(f"no word from the launcher at {address} for ")
        assert lost[0].endswith("and it no longer answers")
    finally:
        conn.close()
        listener.close()


def test_a_beating_launcher_is_never_taken_for_gone(server):
    srv = server()
    lost = []
    client = Lifeline.connect(srv.address, srv.job)
    client.start(0, 1, lost_after=1.0, on_lost=lost.append)
    time.sleep(3.5)
    assert lost == []
    assert not srv.links()[0].silent()


def test_a_host_whose_supervisors_fall_silent_is_reported_lost_once():
    srv = LifelineServer(report.Job.new())
    lost = []
    srv.start(lost_after=1.0, on_lost=lambda host, links: lost.append((host, links)))
    host, _, port = srv.address.rpartition(":")
    try:
        # Two supervisors that said who they are, then nothing: a host cut off.
        quiet = []
        for rank in (2, 3):
            s = socket.create_connection((host, int(port)))
            s.sendall(report.encode({**report.make("lifeline", rank), "host": "hb"}, srv.job))
            quiet.append(s)
        assert _until(lambda: lost, timeout=10)
        time.sleep(2)
        assert len(lost) == 1
        where, links = lost[0]
        assert where == "hb" and sorted(link.rank for link in links) == [2, 3]
        assert all(link.silent_for() >= 1.0 for link in links)
    finally:
        for s in quiet:
            s.close()
        srv.close()


def test_a_lifeline_closed_before_its_watch_begins_ends_the_watch_quietly(server, monkeypatch):
    # A supervisor whose rank ends at once may close its lifeline before the watching thread
    # has started: the thread ends without an error (it used to die on a closed socket,
    # printing a traceback into the supervisor's output) and reports nothing as lost.
    import threading

    errors, lost = [], []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    srv = server()
    client = Lifeline.connect(srv.address, srv.job)
    client._sock.close()
    client.start(0, 1, lost_after=10.0, on_lost=lost.append)
    time.sleep(1.0)
    assert errors == [] and lost == []
