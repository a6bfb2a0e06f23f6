"""The launcher without mpirun: parse -> config -> env -> command, and the failure channel.

The report tests start the launcher's report server on a local port and send it what ranks and
supervisors send (``syncdp.core.report``'s JSON lines), then check the launcher's verdict: the
words of its last line.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from launch import run
from syncdp.core import report
from tests.launcher import ROOT


def test_horovodrun_command_line():
    c = run.parse_args(["-np", "4", "-H", "a:2,b:2", "python", "train.py", "--lr", "0.1"])
    assert c.num_proc == 4 and c.hosts == "a:2,b:2"
    assert c.command == ("python", "train.py", "--lr", "0.1")
    assert c.settings == {}


def test_long_spelling_and_separator():
    c = run.parse_args(["--num-proc", "2", "--", "python", "-c", "pass"])
    assert c.num_proc == 2 and c.command == ("python", "-c", "pass")


def test_settings_flags_are_kept_by_name_in_the_flags_unit():
    c = run.parse_args(
        ["-np", "2", "--stall-timeout", "5", "--chunk-mb", "0.5", "--verbose", "python"]
    )
    assert c.settings == {"stall_timeout": 5.0, "chunk_bytes": 0.5, "verbose": True}


@pytest.mark.parametrize(
    "argv, words",
    [
        (["-np", "2"], "missing the command"),
        (["-np", "0", "python"], "-np must be at least 1; got 0"),
        (["python", "x.py"], "-np"),
        (["-np", "2", "--stall-timeout", "-3", "python"], "--stall-timeout must be at least 0"),
        (["-np", "2", "--chunk-mb", "0.0001", "python"], "--chunk-mb must be at least"),
        (["-np", "2", "--verify-every", "2.5", "python"], "--verify-every"),
        (["-np", "2", "--hostfile", "/nonexistent/hosts", "python"], "does not exist"),
        (["-np", "2", "--min-np", "3", "python"], "--min-np (3) must not exceed -np (2)"),
        (["-np", "3", "--max-np", "2", "python"], "--max-np (2) must be at least -np (3)"),
        (["-np", "2", "--min-np", "-1", "python"], "--min-np must be at least 0"),
    ],
)
def test_bad_command_lines_exit_with_usage(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        run.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "syncdp-run" in err and words in err, err


def test_timeline_path_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    c = run.parse_args(["-np", "1", "--timeline-filename", "t.json", "python"])
    assert run.build_env(c, environ={})["SYNCDP_TIMELINE"] == str(tmp_path / "t.json")


def test_env_lets_root_run_and_keeps_caller_values():
    env = run.build_env(
        run.parse_args(["-np", "2", "python"]), environ={"TF_CPP_MIN_LOG_LEVEL": "0", "KEEP": "me"}
    )
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == "1" and env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    assert env["PYTHONUNBUFFERED"] == "1" and env["SYNCDP_LAUNCHER"] == "1"
    assert env["TF_CPP_MIN_LOG_LEVEL"] == "0" and env["KEEP"] == "me"
    assert report.ADDRESS_VAR not in env


def test_flag_wins_over_the_callers_variable():
    c = run.parse_args(["-np", "2", "--stall-timeout", "5", "python"])
    env = run.build_env(c, environ={"SYNCDP_STALL_TIMEOUT": "99"})
    assert env["SYNCDP_STALL_TIMEOUT"] == "5"


@pytest.mark.parametrize(
    "argv, environ, expected",
    [
        (["--start-timeout", "7"], {"SYNCDP_START_TIMEOUT": "99"}, 7.0),
        ([], {"SYNCDP_START_TIMEOUT": "99"}, 99.0),
        ([], {}, 120.0),
        ([], {"SYNCDP_START_TIMEOUT": "soon"}, 120.0),  # the ranks report the bad value
    ],
)
def test_launcher_reads_the_start_timeout_the_ranks_will_use(argv, environ, expected):
    env = run.build_env(run.parse_args(["-np", "2", *argv, "python"]), environ=environ)
    assert run._setting_value(env, "start_timeout") == expected


def test_mpirun_command_exports_the_report_address():
    c = run.parse_args(
        ["-np", "3", "-H", "h1:2,h2:1", "--mpi-args", "--mca btl self,tcp -v"]
        + ["--stall-timeout", "5", "python", "train.py"]
    )
    env = run.build_env(c, environ={"PATH": "/bin"}, report_addr="node0:5000")
    assert env[report.ADDRESS_VAR] == "node0:5000"
    cmd = run.build_command(c, env, mpirun="/opt/mpirun")
    assert cmd[:6] == ["/opt/mpirun", "-np", "3", "--oversubscribe", "--bind-to", "none"]
    assert cmd[cmd.index("--host") + 1] == "h1:2,h2:1"
    exported = {cmd[i + 1] for i, a in enumerate(cmd) if a == "-x"}
    assert {
        "SYNCDP_STALL_TIMEOUT",
        report.ADDRESS_VAR,
        "OMPI_ALLOW_RUN_AS_ROOT",
        "PYTHONUNBUFFERED",
        "PATH",
    } <= exported
    assert "--mca btl self,tcp -v" in " ".join(cmd)
    assert cmd[-5:] == [sys.executable, "-m", "launch.worker", "python", "train.py"]


def test_hostfile_is_passed_to_mpirun(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=2\n")
    c = run.parse_args(["-np", "2", "--hostfile", str(hosts), "python"])
    cmd = run.build_command(c, run.build_env(c, environ={}))
    assert cmd[cmd.index("--hostfile") + 1] == str(hosts)


# --- The failure channel. ---


@pytest.fixture
def listen():
    """Starts report servers (as run() does) and stops them after the test."""
    servers = []

    def start(num_proc=2, start_timeout=10.0, stall_timeout=60.0):
        reports = run._Reports(num_proc, start_timeout, stall_timeout)
        server = run._ReportServer().start(reports)
        servers.append(server)
        return reports, server

    yield start
    for server in servers:
        server.close()


def _send(address: str, *lines) -> None:
    """Sends reports (dicts) or raw lines (str) on one connection, as a rank would."""
    host, _, port = address.rpartition(":")
    text = "".join(line if isinstance(line, str) else json.dumps(line) + "\n" for line in lines)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(text.encode())


def _report(kind, rank, at, **fields):
    return {**report.make(kind, rank, **fields), "pid": 4200 + rank, "host": "h", "time": at}


def test_a_ranks_exception_report_is_the_first_failure(listen, monkeypatch):
    reports, server = listen()
    monkeypatch.setenv(report.ADDRESS_VAR, server.address)
    assert report.send("started", 0) and report.send("started", 1)
    assert report.send("exception", 1, "ValueError: bad batch\n(more)", type="ValueError")
    server.close()
    assert reports.failed.is_set()
    assert set(reports.started) == {0, 1}
    assert reports.cause() == (
        f"rank 1 (pid {os.getpid()} on {socket.gethostname()}) failed with ValueError: bad batch"
    )


def test_the_earliest_failure_wins_whatever_order_reports_arrive_in(listen):
    reports, server = listen()
    _send(
        server.address,
        _report("exit", 1, 105.0, code=None, signal=9, requested=False),
        _report("exit", 0, 103.0, code=None, signal=15, requested=True),
        _report("stall", 0, 101.0, ranks=[1], collective="gradients.bucket0", seq=23),
    )
    server.close()
    assert reports.cause() == (
        "rank 1 stalled: rank 0 waited for it in collective #23 gradients.bucket0 past the "
        "stall timeout (60 s)"
    )


def test_an_unrequested_exit_names_rank_pid_host_and_signal(listen):
    reports, server = listen()
    _send(server.address, _report("exit", 0, 9.0, code=None, signal=15, requested=True))
    _send(server.address, _report("exit", 1, 8.0, code=None, signal=9, requested=False))
    server.close()
    assert reports.cause() == "rank 1 (pid 4201 on h) was killed by signal 9 (SIGKILL)"


def test_early_exit_names_who_waits(listen):
    reports, server = listen(num_proc=3)
    _send(server.address, _report("exit_early", 2, 1.0, ranks=[0, 1]))
    server.close()
    assert (
        reports.cause()
        == "rank 2 (pid 4202 on h) finished its program while ranks 0, 1 wait for it"
    )


def test_malformed_lines_are_ignored(listen):
    reports, server = listen()
    _send(
        server.address,
        "not json\n",
        "[1, 2]\n",
        '{"rank": 1}\n',
        _report("exit", 1, 1.0, code=3, signal=None, requested=False),
        '{"kind": "exit", "rank"',  # cut off mid-line
    )
    server.close()
    assert reports.cause() == "rank 1 (pid 4201 on h) exited with code 3"


def test_requested_exits_are_not_failures(listen):
    reports, server = listen()
    for rank in (0, 1):
        _send(server.address, _report("exit", rank, 1.0, code=None, signal=15, requested=True))
    server.close()
    assert not reports.failed.is_set()
    assert reports.cause() == "see the output above"


def test_a_rank_without_an_exit_report_is_named_from_its_started_report(listen):
    reports, server = listen()
    _send(server.address, _report("started", 0, 1.0), _report("started", 1, 1.0))
    _send(server.address, _report("exit", 0, 2.0, code=None, signal=15, requested=True))
    server.close()
    assert not reports.failed.is_set()
    assert reports.cause() == (
        "rank 1 (pid 4201 on h) ended without a report (its supervisor was killed)"
    )


def test_nothing_reported_points_at_the_output(listen):
    reports, server = listen()
    server.close()
    assert reports.cause() == "see the output above"


def test_a_start_timeout_report_names_the_ranks_that_never_started(listen):
    reports, server = listen(num_proc=3)
    _send(server.address, _report("started", 0, 1.0), _report("started", 1, 1.0))
    _send(server.address, _report("start_timeout", 0, 11.0, ranks=[]))
    server.close()
    assert reports.cause() == "rank 2 never reached syncdp.init() within the start timeout (10 s)"


def test_launcher_ends_a_start_that_outlives_the_timeout_and_its_grace():
    reports = run._Reports(num_proc=3, start_timeout=10.0)
    assert not reports.check_start(now=time.monotonic() + 1000)  # no rank in init(): no clock
    before = time.monotonic()
    reports.add(_report("started", 1, 1.0))
    assert not reports.check_start(now=before + 10 + run._START_GRACE_SECONDS - 0.1)
    assert not reports.failed.is_set()
    assert reports.check_start(now=time.monotonic() + 10 + run._START_GRACE_SECONDS)
    assert reports.failed.is_set()
    assert reports.cause() == (
        "ranks 0, 2 never reached syncdp.init() within the start timeout (10 s)"
    )


def test_start_timeout_zero_waits_forever():
    reports = run._Reports(num_proc=2, start_timeout=0.0)
    reports.add(_report("started", 0, 1.0))
    assert not reports.check_start(now=time.monotonic() + 1e6)


def test_all_ranks_started_in_time_is_no_failure():
    reports = run._Reports(num_proc=2, start_timeout=10.0)
    reports.add(_report("started", 0, 1.0))
    reports.add(_report("started", 1, 1.0))
    assert not reports.check_start(now=time.monotonic() + 1e6)


# --- The supervisor's own report. ---


def _worker(address: str, *command: str) -> subprocess.Popen:
    env = {**os.environ, report.ADDRESS_VAR: address, "OMPI_COMM_WORLD_RANK": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "launch.worker", *command],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_supervisor_reports_how_its_rank_ended(listen):
    reports, server = listen()
    kill_self = "import os, signal; print(os.getpid(), flush=True); os.kill(os.getpid(), 9)"
    worker = _worker(server.address, sys.executable, "-c", kill_self)
    out, err = worker.communicate(timeout=60)
    server.close()
    assert worker.returncode == 128 + 9
    pid = int(out.split(":")[1])
    (sent,) = reports.exits.values()
    assert set(report.make("exit", 1)) <= set(sent)  # syncdp.core.report's field names
    assert (sent["kind"], sent["rank"], sent["pid"]) == ("exit", 1, pid)
    assert (sent["code"], sent["signal"], sent["requested"]) == (None, 9, False)
    host = socket.gethostname()
    assert reports.cause() == f"rank 1 (pid {pid} on {host}) was killed by signal 9 (SIGKILL)"
    assert f"syncdp-run: rank 1 (pid {pid} on {host}) was killed by signal 9" in err


def test_supervisor_reports_a_stop_it_forwarded_as_requested(listen):
    reports, server = listen()
    wait = "import time; print('ready', flush=True); time.sleep(60)"
    worker = _worker(server.address, sys.executable, "-c", wait)
    assert worker.stdout.readline() == "[1]<stdout>:ready\n"
    worker.send_signal(signal.SIGTERM)
    worker.communicate(timeout=60)
    server.close()
    (sent,) = reports.exits.values()
    assert (sent["signal"], sent["requested"]) == (signal.SIGTERM, True)
    assert not reports.failed.is_set()
