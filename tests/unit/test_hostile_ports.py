"""The launcher's ports against connections that prove nothing, without mpirun.

Anyone on the host can connect to the report and lifeline ports. Connections that never send a
signed line (idle, or a byte a second) must never keep the job's own reports and lifelines
out, and a supervisor must never conclude that the launcher is gone from one closed connection.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from syncdp.launch.lifeline import Lifeline, LifelineServer
from syncdp.launch.report_server import ReportServer
from syncdp.launch.verdict import Verdict
from syncdp.watch import report
from tests.hostile_peers import Crowd


@pytest.fixture
def reports(monkeypatch):
    """A report server (max 4 connections) whose job this process sends for."""
    job = report.Job.new()
    verdict = Verdict(2, 10.0, 60.0)
    server = ReportServer(job, max_connections=4).start(verdict.add)
    monkeypatch.setenv(report.ADDRESS_VAR, server.address)
    for name, value in job.env().items():
        monkeypatch.setenv(name, value)
    yield verdict, server
    server.close()


@pytest.mark.parametrize("trickle", [False, True])
def test_a_crowd_of_connections_never_keeps_a_report_out(reports, trickle):
    verdict, server = reports
    with Crowd(server.address, 12, trickle=trickle):
        time.sleep(1.5)  # the crowd holds every slot, and trickles into them
        began = time.monotonic()
        assert report.send("exit", 1, code=0, requested=False)
        took = time.monotonic() - began
    server.close()
    assert 1 in verdict.exits and took < 5, took
    assert server.rejected["crowded out before a signed line"] >= 1, server.rejected


def test_a_trickling_connection_is_closed_at_the_first_line_deadline(reports):
    _, server = reports
    with Crowd(server.address, 1, trickle=True) as crowd:
        deadline = time.monotonic() + 12
        while crowd.opened < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert crowd.opened >= 2  # the first was closed at 5 s, however it trickled
    server.close()
    assert server.rejected["no signed line within 5 s"] >= 1, server.rejected


def _fake_launcher(replies: list[bytes | None]):
    """A port that answers the n-th connection's line with ``replies[n]`` (None: closes it
    unanswered); returns its address and the lines it received."""
    listener = socket.create_server(("127.0.0.1", 0))
    received: list[bytes] = []

    def serve():
        for reply in replies:
            conn, _ = listener.accept()
            with conn:
                line = b""
                while not line.endswith(b"\n"):
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    line += chunk
                received.append(line)
                if reply is not None:
                    conn.sendall(reply)
        listener.close()

    threading.Thread(target=serve, daemon=True).start()
    return f"127.0.0.1:{listener.getsockname()[1]}", received


def test_a_report_is_sent_again_until_the_launcher_answers(monkeypatch):
    address, received = _fake_launcher([None, None, report.ACK])
    monkeypatch.setenv(report.ADDRESS_VAR, address)
    for name, value in report.Job.new().env().items():
        monkeypatch.setenv(name, value)
    assert report.send("exit", 0, code=0)
    # The same signed line every time (the same nonce): the launcher takes it once.
    assert len(received) == 3 and len(set(received)) == 1


def test_a_refused_report_and_a_launcher_that_is_gone_end_the_tries_at_once(monkeypatch):
    for name, value in report.Job.new().env().items():
        monkeypatch.setenv(name, value)
    address, received = _fake_launcher([report.NACK])
    monkeypatch.setenv(report.ADDRESS_VAR, address)
    assert not report.send("exit", 0, code=0) and len(received) == 1
    closed = socket.create_server(("127.0.0.1", 0))
    monkeypatch.setenv(report.ADDRESS_VAR, f"127.0.0.1:{closed.getsockname()[1]}")
    closed.close()  # nothing listens there any more
    began = time.monotonic()
    assert not report.send("exit", 0, code=0)
    assert time.monotonic() - began < 1


def _until(condition, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_a_crowd_of_idle_connections_never_keeps_a_lifeline_out():
    job = report.Job.new()
    server = LifelineServer(job).start()
    lost = []
    try:
        with Crowd(server.address, 70):
            time.sleep(0.5)
            client = Lifeline.connect(server.address, job)
            client.start(1, 4242, lost_after=10.0, on_lost=lost.append)
            assert _until(lambda: 1 in server.links(), timeout=5)
            time.sleep(2)
            assert server.links()[1].closed is None and not lost
    finally:
        server.close()
    assert server.rejected["crowded out before a signed first line"] >= 1, server.rejected


def test_a_supervisor_connects_again_when_its_lifeline_is_closed_under_it():
    # The launcher's port accepts and closes the first connection (as a crowded server would):
    # the supervisor connects again and sends its signed line again, and goes on.
    job = report.Job.new()
    listener = socket.create_server(("127.0.0.1", 0))
    hellos: list[bytes] = []
    kept: list[socket.socket] = []

    def serve():
        for keep in (False, True):
            conn, _ = listener.accept()
            hellos.append(conn.recv(65536))
            if keep:
                kept.append(conn)
                while True:
                    try:
                        conn.send(b"\n")
                    except OSError:
                        return
                    time.sleep(0.5)
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    lost = []
    client = Lifeline.connect(address, job)
    client.start(1, 4242, lost_after=10.0, on_lost=lost.append)
    try:
        assert _until(lambda: len(hellos) == 2, timeout=5), hellos
        assert all(report.decode(h, job)["kind"] == "lifeline" for h in hellos)
        time.sleep(2)
        assert not lost, lost
        listener.close()
        kept[0].close()  # now the launcher is gone: its address refuses connections
        assert _until(lambda: lost, timeout=5)
        assert lost == ["the launcher ended (its lifeline connection closed)"]
    finally:
        listener.close()
        for conn in kept:
            conn.close()
