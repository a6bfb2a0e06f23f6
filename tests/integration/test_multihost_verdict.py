"""Verdicts and lifelines across hosts: namespace hosts ha and hb, remote from the launcher (at 2
and at 1 rank per host), or hb beside ranks on the launcher's own host.

tests/netns.py makes the hosts (own addresses on a test subnet, own hostnames; everything it
made is removed on exit, also when a test fails). The programs never call ``init()``, so only
the supervisors' reports and lifelines can tell the launcher how they ended.

- Host hb's link is cut mid-run (issue 20.1). Open MPI then prints "A daemon failed to report
  back" and may exit 0; the launcher must fail the job and name hb's ranks and why, and hb's
  supervisors must end everything there once the launcher has been unreachable long enough.
- Every process of hb (daemon, supervisors, ranks) is stopped with SIGSTOP: they cannot act, so
  the launcher fails the job naming hb's ranks, and kills what is left there through the remote
  shell (:mod:`syncdp.launch.cleanup`); nothing remains on any host.
- hb's daemon is stopped after every rank reported a clean exit: the job succeeds (the reports
  say so) although mpirun would wait for that daemon for good.
- The launcher is SIGKILLed (issue 21.2): nothing of the job may survive on any host.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from syncdp.launch.lifeline import lost_after
from tests.launcher import python_script, start
from tests.netns import NamespaceHosts, Unavailable

HOSTS = ["ha", "hb"]
STALL = 5.0  # supervisors give up on a silent, unreachable launcher after max(10 s, this)

WORK = """
import time
print("working", flush=True)
time.sleep(40)
print("done", flush=True)
"""


@pytest.fixture
def cluster(tmp_path):
    try:
        # Its own tag and subnet: other namespace tests may run at the same time.
        with NamespaceHosts(tmp_path, HOSTS, subnet="10.213.9", tag="sdv") as hosts:
            yield hosts
    except Unavailable as e:
        pytest.skip(str(e))


def _start(cluster, tmp_path, slots: int = 2, first: str = "ha", program: str = WORK):
    """Starts ``program`` on ``slots`` ranks on each of ``first`` (``"localhost"``: the
    launcher's own host) and hb; returns once every rank is working."""
    script = python_script(tmp_path, program)
    ranks = 2 * slots
    flags = (
        "-H",
        f"{first}:{slots},hb:{slots}",
        "--network-interface",
        cluster.subnet,
        "--stall-timeout",
        str(STALL),
        "--mpi-args",
        f"--mca plm_rsh_agent {cluster.agent}",
    )
    proc = start(ranks, "python", script, launcher_args=flags)
    working = 0
    deadline = time.monotonic() + 120
    while working < ranks and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        working += "working" in line
    if working < ranks:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the ranks did not start:\n{proc.stderr.read()[-3000:]}")
    return proc


def _wait_empty(cluster, timeout: float, script=None) -> dict:
    """Waits until no namespace host runs a process, nor the launcher's host one that runs
    ``script`` (a supervisor or rank there); returns what is left, by host."""
    deadline = time.monotonic() + timeout
    while True:
        left = {h: cluster.pids(h) for h in HOSTS if cluster.pids(h)}
        if script is not None:
            mine = [
                pid
                for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
                if str(script).encode() in _command(pid)
            ]
            if mine:
                left["the launcher's host"] = mine
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def _kill(pids, signum: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _on_hb(slots: int) -> str:
    """How the last line names host hb's ranks (hb is the second host)."""
    return "rank 1 (on hb)" if slots == 1 else "ranks 2, 3 (on hb)"


def _command(pid: int) -> bytes:
    """A process's command line, arguments joined by spaces (b"" once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ")
    except OSError:
        return b""


def _end_after(proc, act, what: str) -> tuple[str, float]:
    """Runs ``act()``, then waits for the launcher: its stderr and seconds from ``act`` to its
    end. Fails the test (never hangs) if the job outlives 120 s; kills it in any case."""
    try:
        started = time.monotonic()
        act()
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not end after {what}")
        return err, time.monotonic() - started
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# (ranks per host, the other host): every rank remote at 2 and at 1 per host, or the launcher's
# own host running ranks besides hb.
LAYOUTS = pytest.mark.parametrize(
    "slots, first",
    [(2, "ha"), (1, "ha"), (2, "localhost")],
    ids=["2-per-host", "1-per-host", "launcher-host-too"],
)


@LAYOUTS
def test_a_host_cut_off_mid_run_fails_the_job_naming_it(cluster, tmp_path, slots, first):
    proc = _start(cluster, tmp_path, slots, first)
    err, ended = _end_after(proc, lambda: cluster.cut("hb"), "host hb's link was cut")
    print(f"{slots} per host, {first} and hb: link of hb cut -> launcher exit: {ended:.1f} s")
    assert proc.returncode != 0, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("syncdp-run: the job failed ("), err[-3000:]
    # The launcher hears nothing from hb for 10 s (the stall timeout, at least 10 s) and ends
    # the job, or Open MPI ends it first and hb's ranks never reported: either way hb is named.
    assert f"{_on_hb(slots)} " in last and "no word from hb for " in last, last
    assert last.endswith("(host unreachable, or its daemon lost)"), last
    assert ended < lost_after(STALL) + 15, f"ended {ended:.1f} s after the cut"
    # The launcher cannot reach hb to clean up (its remote shell hangs, as ssh would, until the
    # sweep gives up): hb's supervisors end everything there themselves.
    assert "hb could not be cleaned up (no answer within" in err, err[-3000:]
    left = _wait_empty(cluster, timeout=20, script=tmp_path / "job.py")
    assert not left, f"processes left on hosts {left}"


@LAYOUTS
def test_a_host_whose_processes_are_all_stopped_fails_the_job_and_is_cleaned_up(
    cluster, tmp_path, slots, first
):
    proc = _start(cluster, tmp_path, slots, first)
    # Open MPI's daemon, the supervisors and the ranks: none of them can act any more, so only
    # the launcher can end them (through the remote shell, with SIGKILL).
    err, ended = _end_after(
        proc,
        lambda: _kill(cluster.pids("hb"), signal.SIGSTOP),
        "every process of host hb was stopped",
    )
    lines = err.strip().splitlines()
    layout = f"{slots} per host, {first} and hb"
    print(f"{layout}: hb's processes stopped -> launcher exit: {ended:.1f} s; {lines[-1]}")
    assert proc.returncode != 0, err[-3000:]
    last = lines[-1]
    assert last.startswith("syncdp-run: the job failed ("), err[-3000:]
    assert f"{_on_hb(slots)} " in last and "no word from hb for " in last, last
    assert ended < lost_after(STALL) + 15, f"ended {ended:.1f} s after the stop"
    cleaned = [line for line in lines if "cleaned up what was left of the job" in line]
    assert len(cleaned) == 1 and "on hb, " in cleaned[0], err[-3000:]
    assert "prted" in cleaned[0] and "python" in cleaned[0], cleaned[0]
    started = time.monotonic()
    left = _wait_empty(cluster, timeout=15, script=tmp_path / "job.py")
    print(f"{cleaned[0]}; hosts empty {time.monotonic() - started:.1f} s after the end")
    assert not left, f"processes left on hosts {left}"


def test_nothing_survives_a_sigkilled_launcher_on_any_host(cluster, tmp_path):
    proc = _start(cluster, tmp_path)
    try:
        killed = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        left = _wait_empty(cluster, timeout=20)
        print(f"launcher SIGKILL -> both hosts empty: {time.monotonic() - killed:.1f} s")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert not left, f"processes left on hosts {left}"


def test_every_process_of_a_host_killed_fails_the_job_naming_it(cluster, tmp_path):
    proc = _start(cluster, tmp_path)
    # Supervisors, ranks and Open MPI's daemon alike.
    err, ended = _end_after(
        proc, lambda: _kill(cluster.pids("hb")), "every process of host hb was killed"
    )
    print(f"hb's processes killed -> launcher exit: {ended:.1f} s; {err.strip().splitlines()[-1]}")
    assert proc.returncode != 0, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("syncdp-run: the job failed ("), err[-3000:]
    assert "hb" in last and ("rank 2" in last or "ranks 2, 3" in last), last
    assert ended < STALL + 15, f"ended {ended:.1f} s after the kill"
    left = _wait_empty(cluster, timeout=20)
    assert not left, f"processes left on hosts {left}"


def test_a_host_whose_open_mpi_daemon_dies_fails_the_job_naming_it(cluster, tmp_path):
    proc = _start(cluster, tmp_path)
    daemons = [pid for pid in cluster.pids("hb") if b"prted" in _command(pid).split(b" ")[0]]
    if not daemons:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("no Open MPI daemon found on hb")
    err, ended = _end_after(proc, lambda: _kill(daemons), "host hb's Open MPI daemon died")
    last = err.strip().splitlines()[-1]
    print(f"hb's daemon killed -> launcher exit: {ended:.1f} s; {last}")
    assert proc.returncode != 0, err[-3000:]
    assert last.startswith("syncdp-run: the job failed ("), err[-3000:]
    assert "hb" in last, last
    assert ended < STALL + 15, f"ended {ended:.1f} s after the kill"
    left = _wait_empty(cluster, timeout=20)
    what = {pid: _command(pid)[:150] for pids in left.values() for pid in pids}
    assert not left, f"processes left on hosts {left}: {what}"


# Each rank on hb stops Open MPI's daemon above its supervisor, then finishes: every rank
# reports a clean exit, but mpirun waits for that daemon for good.
FREEZE_DAEMON = """
import os, signal, socket, time
print("working", flush=True)
time.sleep(1)
if socket.gethostname() == "hb":
    with open(f"/proc/{os.getppid()}/stat") as f:
        os.kill(int(f.read().rsplit(")", 1)[1].split()[1]), signal.SIGSTOP)
print("done", flush=True)
"""


def test_a_job_whose_ranks_all_finished_ends_though_mpirun_waits_for_a_stopped_daemon(
    cluster, tmp_path
):
    proc = _start(cluster, tmp_path, program=FREEZE_DAEMON)
    err, ended = _end_after(proc, lambda: None, "hb's daemon was stopped")
    lines = err.strip().splitlines()
    print(f"ranks finished, hb's daemon stopped -> launcher exit: {ended:.1f} s")
    # The verdict comes from the ranks: all four reported a clean exit.
    assert proc.returncode == 0, err[-3000:]
    assert any("mpirun did not exit within" in line for line in lines), err[-3000:]
    cleaned = [line for line in lines if "cleaned up what was left of the job" in line]
    assert len(cleaned) == 1 and "on hb, " in cleaned[0] and "prted" in cleaned[0], err[-3000:]
    assert ended < 20, f"ended {ended:.1f} s after the ranks started working"
    left = _wait_empty(cluster, timeout=15)
    assert not left, f"processes left on hosts {left}"
