"""The report channel and the verdict, without mpirun.

The launcher's report server is started on a local port and sent what ranks and supervisors
send (``syncdp.watch.report``'s signed lines), and what an attacker might send instead: unsigned
or forged reports, a report signed for another job, a replay, oversized and malformed lines.
The verdict must be the one the authentic reports give, and every other line counted.
"""

import json
import os
import socket
import subprocess
import threading
import time

import pytest

from syncdp.launch import hosts, supervision
from syncdp.launch.lifeline import Link
from syncdp.launch.report_server import ReportServer, describe_rejected
from syncdp.launch.verdict import START_GRACE_SECONDS, Verdict
from syncdp.watch import report


@pytest.fixture
def listen():
    """Starts report servers (as run() does) and stops them after the test."""
    servers = []

    def start(num_proc=2, start_timeout=10.0, stall_timeout=60.0, **options):
        job = report.Job.new()
        verdict = Verdict(num_proc, start_timeout, stall_timeout)
        server = ReportServer(job, **options).start(verdict.add)
        servers.append(server)
        return verdict, server

    yield start
    for server in servers:
        server.close()


def _send(address: str, *lines, wait: bool = True) -> bytes:
    """Sends signed lines (bytes) or raw text (str) on one connection; returns the replies."""
    host, _, port = address.rpartition(":")
    data = b"".join(line if isinstance(line, bytes) else line.encode() for line in lines)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        replies = b""
        while wait:
            chunk = s.recv(4096)
            if not chunk:
                break
            replies += chunk
    return replies


def _report(kind, rank, at, **fields):
    return {**report.make(kind, rank, **fields), "pid": 4200 + rank, "host": "h", "time": at}


def _exit(rank, at=1.0, code=0, signal=None, requested=False):
    return _report("exit", rank, at, code=code, signal=signal, requested=requested)


def _signed(server, *reports) -> list[bytes]:
    return [report.encode(r, server.job) for r in reports]


def _last(verdict, links=None):
    outcome = verdict.decide(links)
    return outcome.code, (outcome.lines[-1] if outcome.lines else "")


# --- Reports and the verdict. ---


def test_a_ranks_exception_report_is_the_first_failure(listen, monkeypatch):
    verdict, server = listen()
    monkeypatch.setenv(report.ADDRESS_VAR, server.address)
    for name, value in server.job.env().items():
        monkeypatch.setenv(name, value)
    assert report.send("started", 0) and report.send("started", 1)  # answered: delivered
    # TensorFlow's error from a traced function: the error's own message is on its last line.
    traced = (
        'TypeError: in user code:\n\n    File "train.py", line 9, in step  *\n'
        "        opt.variables()\n\n    TypeError: 'list' object is not callable"
    )
    assert report.send("exception", 1, traced, type="TypeError")
    server.close()
    assert verdict.failed.is_set()
    assert set(verdict.started) == {0, 1}
    code, last = _last(verdict)
    assert code == 1
    assert last == (
        "the job failed (0 of 2 ranks exited cleanly); first failure: rank 1 "
        f"(pid {os.getpid()} on {socket.gethostname()}) failed with TypeError: 'list' object "
        "is not callable"
    )


@pytest.mark.parametrize(
    "message, line",
    [
        ("ValueError: bad batch", "ValueError: bad batch"),
        (
            "ValueError: shapes differ:\n  rank 0: (2, 3)\n  rank 1: (2, 4)",
            "ValueError: rank 1: (2, 4)",
        ),
        (
            "tensorflow.python.framework.errors_impl.InvalidArgumentError: in user code:\n\n"
            "    File ...\n\n    InvalidArgumentError: indices[0] = 9 is not in [0, 3)",
            "InvalidArgumentError: indices[0] = 9 is not in [0, 3)",
        ),
        ("", "KeyError"),
        (
            "ValueError: " + "x" * 20 + "\n[... cut: the report was too long]",
            "ValueError: " + "x" * 20,
        ),
    ],
    ids=["one-line", "multi-line", "traced", "empty", "cut"],
)
def test_the_failure_line_carries_the_errors_own_message(message, line):
    from syncdp.launch.verdict import _error_line

    assert _error_line({"message": message, "type": message and "ValueError" or "KeyError"}) == line


def test_every_rank_reporting_a_clean_exit_is_the_only_success(listen):
    verdict, server = listen(num_proc=3)
    _send(server.address, *_signed(server, _exit(0), _exit(1), _exit(2)))
    server.close()
    assert verdict.decide().code == 0
    assert server.accepted == 3 and not server.rejected


def test_the_earliest_failure_wins_whatever_order_reports_arrive_in(listen):
    verdict, server = listen()
    _send(
        server.address,
        *_signed(
            server,
            _exit(1, 105.0, code=None, signal=9),
            _exit(0, 103.0, code=None, signal=15, requested=True),
            _report("stall", 0, 101.0, ranks=[1], collective="gradients.bucket0", seq=23),
        ),
    )
    server.close()
    assert _last(verdict)[1].endswith(
        "first failure: rank 1 stalled: rank 0 waited for it in collective #23 "
        "gradients.bucket0 past the stall timeout (60 s)"
    )


def test_an_unrequested_exit_names_rank_pid_host_and_signal_and_sets_the_status(listen):
    verdict, server = listen()
    _send(server.address, *_signed(server, _exit(0, 9.0, code=None, signal=15, requested=True)))
    _send(server.address, *_signed(server, _exit(1, 8.0, code=None, signal=9)))
    server.close()
    code, last = _last(verdict)
    assert code == 128 + 9
    assert last.endswith("first failure: rank 1 (pid 4201 on h) was killed by signal 9 (SIGKILL)")


def test_a_ranks_exit_code_is_the_launchers(listen):
    verdict, server = listen()
    _send(server.address, *_signed(server, _exit(0), _exit(1, code=3)))
    server.close()
    assert _last(verdict) == (
        3,
        "the job failed (1 of 2 ranks exited cleanly); first failure: rank 1 (pid 4201 on h) "
        "exited with code 3",
    )


def test_early_exit_names_who_waits(listen):
    verdict, server = listen(num_proc=3)
    _send(server.address, *_signed(server, _report("exit_early", 2, 1.0, ranks=[0, 1])))
    server.close()
    assert _last(verdict)[1].endswith(
        "rank 2 (pid 4202 on h) finished its program while ranks 0, 1 wait for it"
    )


def test_ranks_stopped_without_a_failure_still_fail_the_job(listen):
    # Something ended them (mpirun, a lost daemon) and no rank said why: not a success.
    verdict, server = listen()
    for rank in (0, 1):
        _send(server.address, *_signed(server, _exit(rank, code=None, signal=15, requested=True)))
    server.close()
    assert not verdict.failed.is_set()
    assert _last(verdict) == (
        1,
        "the job failed (0 of 2 ranks exited cleanly): ranks 0, 1 were stopped before "
        "finishing (was killed by signal 15 (SIGTERM))",
    )


def test_a_start_timeout_report_names_the_ranks_that_never_started(listen):
    verdict, server = listen(num_proc=3)
    _send(server.address, *_signed(server, _report("started", 0, 1.0), _report("started", 1, 1.0)))
    _send(server.address, *_signed(server, _report("start_timeout", 0, 11.0, ranks=[])))
    server.close()
    assert _last(verdict)[1].endswith(
        "first failure: rank 2 never reached syncdp.init() within the start timeout (10 s)"
    )


def test_launcher_ends_a_start_that_outlives_the_timeout_and_its_grace():
    verdict = Verdict(num_proc=3, start_timeout=10.0)
    assert not verdict.check_start(now=time.monotonic() + 1000)  # no rank in init(): no clock
    before = time.monotonic()
    verdict.add(_report("started", 1, 1.0))
    assert not verdict.check_start(now=before + 10 + START_GRACE_SECONDS - 0.1)
    assert not verdict.failed.is_set()
    assert verdict.check_start(now=time.monotonic() + 10 + START_GRACE_SECONDS)
    assert verdict.failed.is_set()
    assert _last(verdict)[1].endswith(
        "first failure: ranks 0, 2 never reached syncdp.init() within the start timeout (10 s)"
    )


def test_a_job_open_mpi_starts_nothing_of_ends_after_the_start_timeout():
    # No supervisor ever heard from (a daemon's srun waiting for CPUs it never gets): the job
    # ends once the start timeout has passed since the runtime began, not never.
    created = time.monotonic()
    verdict = Verdict(num_proc=2, start_timeout=10.0)
    assert not verdict.check_start(now=created + 1000)  # a supervisor is heard from
    assert not verdict.check_start(now=created + 9.9, anything_started=False)
    assert not verdict.failed.is_set()
    assert verdict.check_start(now=time.monotonic() + 10, anything_started=False)
    assert verdict.failed.is_set()
    assert _last(verdict)[1].endswith(
        "first failure: Open MPI started no process of the job within the start timeout "
        "(10 s): its daemons could not start on the hosts (--log-level DEBUG shows mpirun's "
        "command)"
    )
    # With no start timeout, nothing ends it.
    assert not Verdict(2, start_timeout=0.0).check_start(
        now=time.monotonic() + 1e6, anything_started=False
    )


def test_the_launcher_stops_an_mpirun_that_starts_no_process():
    # The supervision loop asks the lifeline whether anything started: a stand-in mpirun that
    # never starts a process (no supervisor on the lifeline) is stopped after the start
    # timeout, and one that ends by itself with nothing heard is not called a start failure
    # before its time.
    stuck = subprocess.Popen(["sleep", "60"], start_new_session=True)
    verdict = Verdict(num_proc=2, start_timeout=0.5)
    began = time.monotonic()
    try:
        supervision.supervise(stuck, verdict, links=lambda: {})
    finally:
        if stuck.poll() is None:
            stuck.kill()
            stuck.wait()
    assert time.monotonic() - began < 10
    assert "Open MPI started no process of the job" in _last(verdict)[1]
    quick = subprocess.Popen(["sleep", "0.2"], start_new_session=True)
    verdict = Verdict(num_proc=2, start_timeout=30.0)
    supervision.supervise(quick, verdict, links=lambda: {})
    assert quick.returncode == 0 and not verdict.failed.is_set()


def test_start_timeout_zero_waits_forever():
    verdict = Verdict(num_proc=2, start_timeout=0.0)
    verdict.add(_report("started", 0, 1.0))
    assert not verdict.check_start(now=time.monotonic() + 1e6)


def test_all_ranks_started_in_time_is_no_failure():
    verdict = Verdict(num_proc=2, start_timeout=10.0)
    verdict.add(_report("started", 0, 1.0))
    verdict.add(_report("started", 1, 1.0))
    assert not verdict.check_start(now=time.monotonic() + 1e6)


# --- Ranks that never reported: named, with why, from their lifelines. ---


def _link(rank, host="h", *, closed=False, silent_for=0.0):
    now = time.monotonic()
    return Link(rank, host, 4200 + rank, now - 60, now - silent_for, now if closed else None)


def test_a_rank_whose_supervisor_died_is_named_as_killed():
    verdict = Verdict(num_proc=2, start_timeout=10.0)
    verdict.add(_exit(0))
    links = {0: _link(0, closed=True), 1: _link(1, closed=True)}
    assert _last(verdict, links) == (
        1,
        "the job failed (1 of 2 ranks exited cleanly): rank 1 (pid 4201 on h) ended without "
        "a report (its supervisor was killed)",
    )


def test_ranks_on_a_silent_host_are_named_with_the_host():
    # mpirun exits 0 after "A daemon failed to report back": the ranks on hB never reported.
    verdict = Verdict(num_proc=4, start_timeout=10.0)
    verdict.add(_exit(0))
    verdict.add(_exit(1))
    links = {0: _link(0, "hA"), 1: _link(1, "hA")}
    links |= {2: _link(2, "hB", silent_for=12), 3: _link(3, "hB", silent_for=11)}
    assert _last(verdict, links) == (
        1,
        "the job failed (2 of 4 ranks exited cleanly): ranks 2, 3 (on hB) never reported how "
        "they ended: no word from hB for 12 s (host unreachable, or its daemon lost)",
    )


def test_ranks_still_running_and_ranks_never_started_are_told_apart():
    verdict = Verdict(num_proc=3, start_timeout=10.0)
    verdict.add(_exit(0))
    _, last = _last(verdict, {0: _link(0), 1: _link(1, "hB")})
    assert last.endswith(
        "rank 1 (on hB) still ran when mpirun ended (the daemon there was lost); it ends with "
        "the launcher; rank 2 never started (no supervisor reached the launcher)"
    )


def test_no_rank_started_mentions_mpiruns_code():
    outcome = Verdict(num_proc=2, start_timeout=10.0).decide({}, mpirun_code=213)
    assert outcome.code == 1
    assert outcome.lines[-1].endswith(
        "ranks 0, 1 none started (no supervisor reached the launcher; mpirun exited with code "
        "213, see its output above)"
    )


def test_silent_ranks_are_named_before_the_first_failure():
    verdict = Verdict(num_proc=4, start_timeout=10.0, stall_timeout=5.0)
    verdict.add(_exit(0, code=1, requested=True))
    verdict.add(_exit(1, code=1, requested=True))
    verdict.add(_report("stall", 0, 5.0, ranks=[2, 3], collective="step", seq=40))
    links = {r: _link(r, "hB", silent_for=9) for r in (2, 3)}
    outcome = verdict.decide(links)
    assert outcome.lines[0].startswith("ranks 2, 3 (on hB) never reported how they ended")
    assert outcome.lines[1].endswith(
        "first failure: ranks 2, 3 stalled: rank 0 waited for them "
        "in collective #40 step past the stall timeout (5 s)"
    )


# --- Only the job's own reports count. ---


def test_a_forged_failure_changes_nothing_and_is_counted(listen):
    verdict, server = listen()
    forged = {**_report("exception", 1, 0.5), "host": "evil", "message": "RuntimeError: boom"}
    other_job = report.Job.new()
    replies = _send(
        server.address,
        json.dumps(forged) + "\n",  # unsigned, as before the channel was signed
        "0" * 64 + " " + json.dumps({**forged, "job": server.job.id, "nonce": "x"}) + "\n",
        report.encode(forged, other_job),  # signed for another job
    )
    assert replies == report.NACK * 3  # nothing taken
    _send(server.address, *_signed(server, _exit(0), _exit(1)))
    server.close()
    assert not verdict.failed.is_set()
    assert verdict.decide().code == 0
    assert server.rejected == {"malformed": 1, "bad signature": 2}


def test_a_forged_clean_exit_does_not_make_a_silent_rank_succeed(listen):
    verdict, server = listen()
    _send(server.address, *_signed(server, _exit(0)))
    forged = report.encode(_exit(1), report.Job.new())
    _send(server.address, forged)
    server.close()
    code, last = _last(verdict, {1: _link(1, closed=True)})
    assert code == 1 and "rank 1 (pid 4201 on h) ended without a report" in last
    assert sum(server.rejected.values()) == 1


def test_a_report_replayed_from_another_job_is_rejected(listen):
    # The same bytes an earlier job's rank sent: that job's secret signed them.
    earlier = report.Job.new()
    line = report.encode(_report("exception", 1, 0.1, message="ValueError: old"), earlier)
    assert report.decode(line, earlier)["kind"] == "exception"  # authentic there
    verdict, server = listen()
    _send(server.address, line)
    # Same secret, other job id: the id is bound into the MAC too.
    cousin = report.Job("someotherjob", server.job.secret)
    _send(server.address, report.encode(_report("exception", 1, 0.1), cousin))
    server.close()
    assert not verdict.failed.is_set()
    assert server.rejected == {"bad signature": 2}
    with pytest.raises(report.Rejected, match="bad signature"):
        report.decode(report.encode(_exit(0), cousin), server.job)


def test_a_report_replayed_within_the_job_counts_once(listen):
    verdict, server = listen()
    (line,) = _signed(server, _exit(1, code=3))
    assert _send(server.address, line) == report.ACK
    # The same line again is a sender's retry after a missed answer: answered, taken once.
    assert _send(server.address, line) == report.ACK
    # Another report under a nonce already used is a replay (only the job's processes could
    # sign it, but a report is taken once).
    body = {**json.loads(line.split(b" ", 1)[1]), "code": 0}
    text = json.dumps(body).encode()
    replayed = server.job.mac(text).encode() + b" " + text + b"\n"
    assert _send(server.address, replayed) == report.NACK
    server.close()
    assert server.accepted == 1 and server.rejected == {"replayed": 1}
    assert verdict.exits[1]["code"] == 3


def test_oversized_and_malformed_lines_are_dropped_and_counted(listen):
    verdict, server = listen()
    _send(
        server.address,
        "not json\n",
        "[1, 2]\n",
        "abc {}\n",
        *_signed(server, _exit(0)),
        '{"kind": "exit", "rank"',  # cut off mid-line
    )
    _send(server.address, b"x" * (report.MAX_LINE_BYTES + 10))  # no newline: never buffered all
    big = _exit(1)
    _send(
        server.address, report.encode(big, server.job)[:-1] + b" " * report.MAX_LINE_BYTES + b"\n"
    )
    _send(server.address, *_signed(server, _exit(1)))
    server.close()
    assert verdict.decide().code == 0
    assert server.rejected == {"malformed": 3, "cut off mid-line": 1, "too long": 2}
    assert describe_rejected(server.rejected) == (
        "rejected 6 reports that did not prove to be this job's (3 malformed, 2 too long, "
        "1 cut off mid-line)"
    )


def test_a_long_message_is_cut_to_fit_the_line_limit(listen):
    verdict, server = listen()
    long = _report("exception", 1, 1.0, message="ValueError: " + "x" * 200_000)
    (line,) = _signed(server, long)
    assert len(line) < report.MAX_LINE_BYTES
    assert _send(server.address, line) == report.ACK
    server.close()
    assert "failed with ValueError: xxx" in _last(verdict)[1]


def test_idle_connections_cannot_lock_the_job_out(listen):
    verdict, server = listen(max_connections=4)
    host, _, port = server.address.rpartition(":")
    idle = [socket.create_connection((host, int(port))) for _ in range(6)]
    try:
        got = []
        sender = threading.Thread(
            target=lambda: got.append(_send(server.address, *_signed(server, _exit(1, code=3))))
        )
        sender.start()
        sender.join(timeout=20)  # the idle ones are closed after 5 s
        assert got == [report.ACK]
    finally:
        for s in idle:
            s.close()
    server.close()
    assert verdict.failed.is_set()


def test_a_one_host_job_listens_on_loopback_only(listen):
    _, server = listen()
    assert server.address.startswith("127.0.0.1:")
    assert hosts.job_address([]) == ("127.0.0.1", ("127.0.0.1",))
    assert hosts.job_address([hosts.Host("localhost", 2)]) == ("127.0.0.1", ("127.0.0.1",))


def test_a_multi_host_job_listens_on_the_interface_towards_its_hosts():
    address, advertised = hosts.job_address([hosts.Host("192.0.2.7", 2)])  # TEST-NET-1
    assert advertised == (address,) and address not in ("0.0.0.0", "127.0.0.1")


def test_remote_ranks_are_never_told_a_loopback_interface():
    # --network-interface lo,eth0 (or lo alone) with a remote host: loopback is skipped, as it
    # is for a name that resolves there.
    remote = [hosts.Host("192.0.2.7", 2)]
    assert hosts.loopback_interface("lo") and hosts.loopback_interface("127.0.0.0/8")
    for interfaces in (["lo"], ["127.0.0.0/8"], ["lo", "192.0.2.0/24"]):
        address, advertised = hosts.job_address(remote, network_interfaces=interfaces)
        assert not address.startswith("127.") and not any(a.startswith("127.") for a in advertised)


def test_a_send_without_the_jobs_secret_is_not_delivered(listen, monkeypatch):
    verdict, server = listen()
    monkeypatch.setenv(report.ADDRESS_VAR, server.address)
    for name, value in report.Job.new().env().items():  # someone else's job
        monkeypatch.setenv(name, value)
    assert not report.send("exception", 1, "RuntimeError: forged")
    server.close()
    assert not verdict.failed.is_set() and server.rejected == {"bad signature": 1}


def test_a_request_is_answered_with_its_data_only_to_the_job(listen, monkeypatch):
    # A spawned supervisor asks for the launcher's environment (job_env): the answer may be
    # larger than a socket buffer, and only a request signed with the job's secret gets it.
    job = report.Job.new()
    verdict = Verdict(2, 10.0, 60.0)
    data = {"DATA_DIR": "/data", "BIG": "x" * 3_000_000}
    server = ReportServer(job).start(verdict.add, {"job_env": json.dumps(data).encode()})
    try:
        monkeypatch.setenv(report.ADDRESS_VAR, server.address)
        for name, value in job.env().items():
            monkeypatch.setenv(name, value)
        assert report.ask("job_env", 3) == data
        # A signed report whose kind is not a string is no request: the server goes on.
        assert _send(server.address, report.encode(report.make(["job_env"], 3), job)) == b"ok\n"
        assert report.ask("job_env", 3) == data
        assert report.send("exception", 1, "RuntimeError: x")  # a report is answered "ok"
        assert report.ask("unknown_request", 3) is None  # "ok" without data
        for name, value in report.Job.new().env().items():  # someone else's job
            monkeypatch.setenv(name, value)
        assert report.ask("job_env", 3) is None
    finally:
        server.close()
    assert server.rejected == {"bad signature": 1} and verdict.failed.is_set()


def test_a_host_lost_from_the_lifelines_is_a_failure_named_once():
    verdict = Verdict(num_proc=4, start_timeout=10.0)
    verdict.add(_exit(0, code=None, signal=15, requested=True))
    verdict.add(_exit(1, code=None, signal=15, requested=True))
    links = {r: _link(r, "hb", silent_for=10.2) for r in (2, 3)}
    verdict.lost("hb", [links[3], links[2]])
    assert verdict.failed.is_set()
    outcome = verdict.decide(links)
    assert outcome.lines == (
        "the job failed (0 of 4 ranks exited cleanly); first failure: ranks 2, 3 (on hb) fell "
        "silent: no word from hb for 10 s (host unreachable, or its daemon lost)",
    )


def test_a_rank_open_mpi_says_left_without_finalizing_is_the_failure_not_a_clean_exit():
    # Rank 1 exited 0 without MPI_Finalize (os._exit after init) while rank 0 computed; Open
    # MPI then stopped rank 0. Where every rank left so at the end, none was stopped: success.
    banner = (
        "prterun has exited due to process rank 1 with PID 4201 on node h exiting improperly. "
        "There are three reasons this could occur:"
    )
    verdict = Verdict(num_proc=2, start_timeout=10.0)
    verdict.on_banner(banner)
    verdict.add(_exit(1, 1.0))
    verdict.add(_exit(0, 1.1, signal=15, requested=True))  # stopped as the job ended
    code, last = _last(verdict)
    assert code == 1
    assert last == (
        "the job failed (0 of 2 ranks exited cleanly): rank 1 (pid 4201 on h) exited 0 without "
        "finalizing MPI (as os._exit() after init() does), so Open MPI ended the job: rank 0 "
        "was stopped before finishing (was killed by signal 15 (SIGTERM))"
    )
    everyone = Verdict(num_proc=2, start_timeout=10.0)
    everyone.on_banner(banner)
    everyone.add(_exit(0, 1.0))
    everyone.add(_exit(1, 1.0))
    assert _last(everyone)[0] == 0
