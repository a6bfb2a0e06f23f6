"""The launcher end to end: ranks start, output is prefixed, and every failure ends the job."""

import contextlib
import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import time

import pytest

from syncdp.launch import cleanup
from tests.launcher import ROOT, check, launch, python_script, rank_env, start

HELLO = "import syncdp; syncdp.init(); print('hello', syncdp.rank(), syncdp.size())"

# Rank LATE_RANK reaches syncdp.init() a minute after the others; the others print the moment
# they arrive. Only the ranks that arrive import syncdp (TensorFlow: seconds of CPU each).
LATE = """
import os, time
if int(os.environ["OMPI_COMM_WORLD_RANK"]) == int(os.environ["LATE_RANK"]):
    time.sleep(60)
import syncdp
import syncdp.tensorflow  # TensorFlow loads before the clock starts, as it does inside init()
print(f"arriving {time.time():.3f}", flush=True)
syncdp.init()
print("every rank arrived", flush=True)
"""

# A rank's first words to the launcher, without TensorFlow: what syncdp.init() sends on arrival.
STARTED = """
import os, time
from syncdp.watch import report
if int(os.environ["OMPI_COMM_WORLD_RANK"]) == 0:
    assert report.send("started", 0)
time.sleep(60)
"""


def test_more_ranks_than_cores_with_prefixed_output():
    result = check(launch(4, "python", "-c", HELLO, timeout=240))
    for rank in range(4):
        assert f"[{rank}]<stdout>:hello {rank} 4" in result.stdout


def test_plain_mpirun_works_without_the_launcher():
    env = rank_env({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    result = subprocess.run(
        [shutil.which("mpirun"), "-np", "2", "--oversubscribe", sys.executable, "-c", HELLO],
        env=env,
        cwd=ROOT,
        text=True,
        capture_output=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "hello 0 2" in result.stdout and "hello 1 2" in result.stdout


def _nic_besides_loopback() -> str | None:
    from syncdp.launch import hosts

    return next((name for name, _ in hosts._ip_addresses() if name != "lo"), None)


@pytest.mark.parametrize(
    "n, interfaces", [(1, "lo"), (2, "lo"), (3, "127.0.0.0/8"), (2, "lo,OTHER")]
)
def test_loopback_as_the_network_interface_runs_the_job(n, interfaces):
    # horovodrun --network-interface lo, as a job on one machine may be given: Open MPI's
    # runtime takes no loopback for its own channel (no rank started; with another interface
    # beside it, mpirun crashed), so it is given only MPI's traffic.
    if "OTHER" in interfaces:
        other = _nic_besides_loopback()
        if other is None:
            pytest.skip("this machine has no interface besides loopback")
        interfaces = interfaces.replace("OTHER", other)
    code = "import os; print('up', os.environ['OMPI_COMM_WORLD_RANK'])"
    result = check(
        launch(n, "python", "-c", code, launcher_args=("--network-interface", interfaces))
    )
    assert sorted(re.findall(r"<stdout>:up (\d)", result.stdout)) == [str(r) for r in range(n)]


@pytest.mark.parametrize("n", [2, 3])
def test_a_rank_that_calls_mpi_abort_with_code_0_fails_the_job_named(tmp_path, n):
    # MPI_Abort(0) in the program's own code: the aborting process exits 0, but the job did
    # not succeed, and the rank that aborted (not one stopped as the job ended) is named.
    script = python_script(
        tmp_path,
        "import time\nfrom mpi4py import MPI\n"
        "if MPI.COMM_WORLD.Get_rank() == 1:\n    MPI.COMM_WORLD.Abort(0)\ntime.sleep(30)\n",
    )
    result = launch(n, "python", script, timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("syncdp-run: the job failed ("), last
    assert last.endswith("rank 1 called MPI_Abort with error code 0, and its process exited 0")


@pytest.mark.parametrize("n", [2, 3])
def test_a_rank_that_leaves_without_finalizing_is_named_not_the_rank_open_mpi_stopped(tmp_path, n):
    # os._exit(0) on rank 1 after MPI_Init while the others compute (in no collective, so no
    # syncdp watchdog sees it): Open MPI stops the others. The verdict named a stopped rank as
    # the failure and counted rank 1, the cause, as a clean exit. Where every rank leaves so
    # at the end, each finished its program, and the job succeeds (its ranks' reports decide).
    script = python_script(
        tmp_path,
        "import os, sys, time\nfrom mpi4py import MPI\nMPI.COMM_WORLD.Barrier()\n"
        "if sys.argv[1] == 'all' or MPI.COMM_WORLD.Get_rank() == 1:\n    os._exit(0)\n"
        "time.sleep(30)\n",
    )
    result = launch(n, "python", script, "one", timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"syncdp-run: the job failed (0 of {n} ranks exited cleanly): "), last
    assert re.search(r": rank 1 \(pid \d+ on \S+\) exited 0 without finalizing MPI", last), last
    stopped = "rank 0 was" if n == 2 else "ranks 0, 2 were"
    assert f"so Open MPI ended the job: {stopped} stopped before finishing" in last, last
    everyone = launch(n, "python", script, "all", timeout=120)
    assert everyone.returncode == 0, everyone.stderr[-3000:]


def test_exception_on_one_rank_ends_the_job_naming_it(tmp_path):
    script = python_script(
        tmp_path,
        """
import syncdp
syncdp.init()
if syncdp.rank() == 1:
    raise ValueError("bad batch on purpose")
syncdp.barrier()  # rank 0 waits here for a rank that will never come
print("rank 0 passed the barrier")
""",
    )
    result = launch(2, "python", script, timeout=120)
    assert result.returncode != 0
    assert "rank 0 passed the barrier" not in result.stdout
    assert "syncdp: rank 1 failed with ValueError: bad batch on purpose" in result.stderr
    last = result.stderr.splitlines()[-1]
    assert "first failure: rank 1 (pid " in last, result.stderr[-3000:]
    assert last.endswith("failed with ValueError: bad batch on purpose"), last


def test_nonzero_exit_on_one_rank_ends_the_job_naming_it(tmp_path):
    script = python_script(
        tmp_path,
        """
import sys
import syncdp
syncdp.init()
if syncdp.rank() == 1:
    sys.exit(3)
syncdp.barrier()
""",
    )
    result = launch(2, "python", script, timeout=120)
    assert result.returncode != 0
    # The collectives' numbers depend on how many collectives init() itself runs.
    assert re.search(
        r"syncdp: rank 1 finished its program after collective #\d+, but rank 0 is waiting "
        r"for it in collective #\d+ barrier; ending the job\. If the ranks' data differ in "
        r"length, give every rank the same number of batches, or call syncdp\.join\(\)",
        result.stderr,
    ), result.stderr[-3000:]
    last = result.stderr.splitlines()[-1]
    assert (
        "first failure: rank 1 (pid " in last and "finished its program while rank 0 waits" in last
    )


def test_a_rank_that_exits_while_its_process_set_waits_is_named_at_once(tmp_path):
    # Rank 2 leaves after one collective of the set {0, 2}; rank 0 waits in the set's second.
    # The exit handshake asks on every communicator, so the job ends at once (not at the
    # stall timeout) naming the set.
    script = python_script(
        tmp_path,
        """
import sys
import tensorflow as tf
import syncdp
pair = syncdp.ProcessSet([0, 2])
syncdp.init(process_sets=[pair])
if syncdp.rank() != 1:
    syncdp.allreduce(tf.ones([2]), process_set=pair)
    if syncdp.rank() == 2:
        sys.exit(0)
    syncdp.allreduce(tf.ones([2]), process_set=pair)
""",
    )
    # No stall timeout: only the handshake can end this job before the launch's timeout.
    result = launch(3, "python", script, timeout=120, env={"SYNCDP_STALL_TIMEOUT": "0"})
    assert result.returncode != 0
    assert re.search(
        r"syncdp: rank 2 finished its program after collective #1 of the process set of ranks "
        r"0, 2, but rank 0 is waiting for it in collective #2 allreduce\S* of the process set "
        r"of ranks 0, 2; ending the job",
        result.stderr,
    ), result.stderr[-3000:]


SHUT_DOWN_EARLY = """
import sys, time
import tensorflow as tf
import syncdp
syncdp.init()
r, last = syncdp.rank(), syncdp.size() - 1
mode = sys.argv[1]
pair = syncdp.add_process_set([0, last]) if mode == "set" else None
if mode == "everyone":  # the same collectives, then shutdown() and init() again everywhere
    syncdp.allreduce(tf.ones([2]))
    if r == 0:
        time.sleep(1)  # the others' shutdown() reaches rank 0 before its own
    syncdp.shutdown()
    if r == last:
        time.sleep(1)  # and the last rank last the second time
    syncdp.init()
    for _ in range(10):  # past the collectives before: a note from then is not taken now
        total = syncdp.allreduce(tf.ones([2]) * r, op=syncdp.Sum).numpy().tolist()
    syncdp.shutdown()
    print(f"rank {r} done, sum {total}", flush=True)
elif r == last:  # shuts syncdp down after one collective, then its program goes on
    syncdp.allreduce(tf.ones([2]), process_set=pair if mode == "set" else None)
    syncdp.shutdown()
    time.sleep(600)
elif mode == "set":
    if r == 0:
        syncdp.allreduce(tf.ones([2]), process_set=pair)
        syncdp.allreduce(tf.ones([2]), process_set=pair)
else:
    syncdp.allreduce(tf.ones([2]))
    syncdp.join()  # no stall timeout: the last rank must never come
"""


@pytest.mark.parametrize(
    "np_, mode", [(2, "join"), (3, "join"), (3, "set"), (1, "everyone"), (3, "everyone")]
)
def test_a_rank_that_shuts_syncdp_down_ends_the_job_where_another_waits_for_it(tmp_path, np_, mode):
    # shutdown() before the end of the program: the ranks still to come to a collective of
    # the one that shut down (a join() that waits with no stall timeout, a process set's
    # collective) end the job at once, naming it, rather than wait for it forever. Ranks that
    # ran the same collectives shut down (and start again) as they please.
    script = python_script(tmp_path, SHUT_DOWN_EARLY)
    start = time.monotonic()
    result = launch(np_, "python", script, mode, timeout=120, env={"SYNCDP_STALL_TIMEOUT": "0"})
    if mode == "everyone":
        assert result.returncode == 0, result.stderr[-3000:]
        total = [float(sum(range(np_)))] * 2
        for r in range(np_):
            assert f"rank {r} done, sum {total}" in result.stdout
        return
    assert time.monotonic() - start < 60, "the job waited for the rank that shut down"
    assert result.returncode != 0
    last = np_ - 1
    scope = f" of the process set of ranks 0, {last}" if mode == "set" else ""
    assert re.search(
        rf"syncdp: rank {last} shut syncdp down \(shutdown\(\)\) after collective #\d+{scope}, "
        rf"but rank \d waits for it in collective #\d+ (join|allreduce)",
        result.stderr,
    ), result.stderr[-3000:]
    final = result.stderr.splitlines()[-1]
    assert f"first failure: rank {last} (pid " in final, final
    assert re.search(r"shut syncdp down \(shutdown\(\)\) while rank \d waits for it", final), final


def test_a_killed_mpiruns_session_directory_does_not_stop_a_later_job(tmp_path):
    # A killed mpirun leaves ompi.PID with its PMIx rendezvous file under $TMPDIR; an mpirun
    # that later gets the same process id stopped at once ("The PMIx server's listener thread
    # failed to start", exit 213). Such directories for the next few hundred process ids
    # (mpirun gets one of them) must not stop the job, and are removed.
    base = tmp_path / "tmp"
    base.mkdir()
    with open("/proc/sys/kernel/ns_last_pid") as f:
        last = int(f.read())
    stale = range(last + 1, last + 400)
    for pid in stale:
        (base / f"ompi.{pid}").mkdir()
        (base / f"ompi.{pid}" / f"pmix.{os.uname().nodename}.tool.{pid}").write_text("stale\n")
    result = launch(1, sys.executable, "-c", "print('ran')", env={"TMPDIR": str(base)}, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ran" in result.stdout, result.stdout
    # Gone, but for those of processes that were running when mpirun started (the launcher's).
    left = [p.name for p in base.iterdir() if p.name.startswith("ompi.")]
    assert len(left) < 20, left


def test_segments_that_killed_processes_left_are_gone_after_the_next_job(tmp_path):
    # A process that ends without MPI_Finalize (killed, or os._exit) keeps its Open MPI segment
    # in /dev/shm; with no launcher of its own (here a singleton) nothing removed it.
    leaver = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os\n"
            "from mpi4py import MPI\n"
            "from syncdp.launch.cleanup import _mapped\n"
            "MPI.COMM_WORLD.Barrier()\n"
            "print(*_mapped(os.getpid(), '/dev/shm'), flush=True)\n"
            "os._exit(0)\n",
        ],
        env=rank_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    left = leaver.stdout.split()
    assert leaver.returncode == 0 and len(left) == 1, (leaver.stdout, leaver.stderr[-2000:])
    assert os.path.exists(left[0])
    old = time.time() - 2 * cleanup.STALE_SEGMENT_SECONDS
    os.utime(left[0], (old, old))
    result = launch(1, sys.executable, "-c", "print('ran')", timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not os.path.exists(left[0])


@pytest.mark.parametrize("shadow", ["launch.py", "launch/__init__.py"])
def test_a_launch_module_on_the_users_path_is_the_users_not_the_launchers(tmp_path, shadow):
    # A project's own launch.py (or launch/ package), in the working directory and on the
    # PYTHONPATH ahead of syncdp (PYTHONPATH=. is common), is neither run by the launcher or its
    # supervisors nor does it stop the job: the launcher is syncdp.launch.
    (tmp_path / shadow).parent.mkdir(exist_ok=True)
    (tmp_path / shadow).write_text("print('THE USERS LAUNCH RAN', flush=True)\n")
    (tmp_path / "train.py").write_text(
        "import launch, os\nprint('rank', os.environ['OMPI_COMM_WORLD_RANK'], launch.__file__)\n"
    )
    env = rank_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-m", "syncdp.launch", "-np", "2", sys.executable, "train.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # The program itself imports the user's module, as Python does for a script.
    ran = re.findall(r"rank (\d) (\S+)", result.stdout)
    assert sorted(r for r, _ in ran) == ["0", "1"], result.stdout
    assert all(path.startswith(str(tmp_path)) for _, path in ran), ran
    assert result.stdout.count("THE USERS LAUNCH RAN") == 2  # once per rank, by train.py


def test_sigterm_stops_every_rank(tmp_path):
    marker = f"syncdp-sigterm-{os.getpid()}"
    script = python_script(
        tmp_path,
        f"""
import time
import syncdp
syncdp.init()
print("ready", syncdp.rank(), flush=True)
while True:  # {marker}
    time.sleep(0.1)
""",
        name=f"{marker}.py",
    )
    proc = start(2, "python", script)
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


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_hosts_are_checked_stops_the_launcher_and_its_checks(tmp_path, signum):
    # Before any rank starts, the launcher checks each remote host over the remote shell (up
    # to 30 s). Stopped then, it ends as it would later (128 + the signal, one line, no
    # traceback) and leaves no remote shell running.
    marker = f"syncdp-hostcheck-{os.getpid()}-{signum}"
    agent = tmp_path / "agent.sh"
    sleep = f"exec {sys.executable} -c 'import time; time.sleep(60)' {marker}"
    agent.write_text(f"#!/bin/sh\necho $$ > {tmp_path}/agent.pid\n{sleep}\n")
    agent.chmod(0o755)
    proc = start(
        2,
        "python",
        "-c",
        "print('never')",
        launcher_args=(
            "-H",
            "localhost:1,192.0.2.1:1",
            "--mpi-args",
            f"--mca plm_rsh_agent {agent}",
        ),
    )
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "agent.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (tmp_path / "agent.pid").exists(), "the host check never started"
        time.sleep(0.5)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + signum, err[-3000:]
    name = signal.Signals(signum).name
    assert f"stopped by {name} while checking the hosts; no rank was started." in err, err
    assert "Traceback" not in err, err
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    assert left == "", f"host checks still running: {left}"


@pytest.mark.parametrize("np", [2, 3])
def test_a_rank_late_for_init_ends_the_job_naming_it(tmp_path, np):
    start_timeout = 10
    late = np - 1
    script = python_script(tmp_path, LATE)
    result = launch(
        np,
        "python",
        script,
        env={"LATE_RANK": str(late)},
        launcher_args=("--start-timeout", str(start_timeout)),
        timeout=150,
    )
    output = result.stdout[-3000:] + result.stderr[-3000:]
    assert "every rank arrived" not in result.stdout, f"the job waited for rank {late}:\n{output}"
    assert result.returncode != 0, output
    arrivals = [float(t) for t in re.findall(r"<stdout>:arriving ([\d.]+)", result.stdout)]
    assert len(arrivals) == np - 1, output
    # The bound holds from the first rank's arrival in init(): start timeout + 10 s. What comes
    # before (the launcher's and the ranks' TensorFlow imports) depends on the machine, so it is
    # measured here and allowed for, not guessed.
    imports = min(arrivals) - result.started_at
    print(
        f"np={np}: launch -> exit {result.elapsed:.1f} s, of which launch -> first init() "
        f"{imports:.1f} s and first init() -> exit {result.ended_at - min(arrivals):.1f} s"
    )
    assert result.elapsed < imports + start_timeout + 10, output
    last = result.stderr.strip().splitlines()[-1]
    assert last.endswith(
        f"first failure: rank {late} never reached syncdp.init() within the start "
        f"timeout ({start_timeout} s)"
    ), output


def test_launcher_ends_a_start_no_rank_ended_itself(tmp_path):
    # Rank 0 says it arrived and rank 1 never does, and no rank ends the job by itself: the
    # launcher does, once the start timeout and its 1 s of grace have passed.
    script = python_script(tmp_path, STARTED)
    result = launch(2, "python", script, launcher_args=("--start-timeout", "2"), timeout=120)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.endswith(
        "first failure: rank 1 never reached syncdp.init() within the start timeout (2 s)"
    ), result.stderr[-3000:]
    assert result.elapsed < 50  # the ranks would sleep 60 s


def test_a_program_without_init_is_never_stopped_for_the_start_timeout(tmp_path):
    script = python_script(tmp_path, "import time; time.sleep(8); print('done', flush=True)")
    result = check(launch(2, "python", script, launcher_args=("--start-timeout", "1"), timeout=120))
    assert "[0]<stdout>:done" in result.stdout and "[1]<stdout>:done" in result.stdout


LEAVES_CHILDREN = """
import subprocess, sys
import syncdp

syncdp.init()
marker = sys.argv[1]
if syncdp.rank() == syncdp.size() - 1:
    # One child in a session of its own that keeps the rank's output pipes open, one that
    # stays in the rank's process group.
    subprocess.Popen(["sleep", marker], start_new_session=True)
    subprocess.Popen(["sleep", marker], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
syncdp.barrier()
print("done", flush=True)
"""


def _running_with(marker: str) -> list[int]:
    """Processes whose command line holds ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                pass
    return found


@pytest.mark.parametrize("np", [1, 2, 3])
def test_what_a_rank_starts_and_leaves_running_ends_with_the_job(tmp_path, np):
    """A child that outlives its rank (holding the rank's stdout, or in a new session) neither
    keeps the job from ending nor survives it."""
    marker = str(4000 + os.getpid() % 1000 + np)  # seconds of sleep, unique to this test
    script = python_script(tmp_path, LEAVES_CHILDREN)
    try:
        result = check(launch(np, "python", script, marker, timeout=60))
        assert result.stdout.count("done") == np
        assert result.elapsed < 30, result.elapsed
        assert _running_with(marker) == []
    finally:
        for pid in _running_with(marker):
            os.kill(pid, signal.SIGKILL)


BEFORE_INIT = """
import os, sys
if os.environ["OMPI_COMM_WORLD_RANK"] == "1":
    sys.exit(0)  # never reaches init(): the others would wait for it
import syncdp
syncdp.init()
syncdp.barrier()
"""


@pytest.mark.parametrize("np", [2, 3])
def test_a_rank_that_exits_cleanly_before_init_ends_the_job_at_once(tmp_path, np):
    script = python_script(tmp_path, BEFORE_INIT)
    result = launch(np, "python", script, timeout=90)
    assert result.returncode != 0
    assert result.elapsed < 60, result.elapsed  # not the start timeout (120 s)
    assert "rank 1 (pid" in result.stderr and "exited with code 0 before it reached" in (
        result.stderr
    ), result.stderr[-3000:]


@pytest.mark.parametrize("np_", [1, 2, 3])
def test_a_rank_that_reads_its_input_to_the_end_is_not_left_waiting(np_):
    # Open MPI forwards a pipe to rank 0 without its end: every rank's input is empty instead.
    read = "import sys; print('read', repr(sys.stdin.read()), flush=True)"
    result = check(launch(np_, "python", "-c", read, timeout=60, input="hello\n"))
    assert result.stdout.count("read ''") == np_, result.stdout


def _on_a_terminal(np_: int, source: str, typed: bytes, *, background: bool = False):
    """Runs the launcher on a terminal of its own (its controlling one, as a shell starts it),
    with ``typed`` waiting on it; in the terminal's foreground job, or a background one.
    Returns the launcher's exit code and what the terminal showed."""
    pid, terminal = pty.fork()
    if pid == 0:  # the session's leader, on the terminal
        try:
            command = [sys.executable, "-m", "syncdp.launch", "-np", str(np_), "python", "-c"]
            os.chdir(ROOT)
            if background:  # the launcher in a process group of its own, as `syncdp-run &`
                launcher = os.fork()
                if launcher == 0:
                    os.setpgid(0, 0)
                    os.execve(sys.executable, [*command, source], rank_env())
                os._exit(os.waitstatus_to_exitcode(os.waitpid(launcher, 0)[1]))
            os.execve(sys.executable, [*command, source], rank_env())
        finally:
            os._exit(127)
    os.write(terminal, typed)  # typed at once: the terminal keeps the line until read
    seen, deadline = b"", time.monotonic() + 90
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([terminal], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(terminal, 65536)
                except OSError:  # the launcher has exited: the terminal is closed
                    break
                if not chunk:
                    break
                seen += chunk
        else:
            for member in [pid, *cleanup.session_members(pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(member, signal.SIGKILL)
            pytest.fail(f"the job did not end: {seen.decode(errors='replace')[-3000:]}")
    finally:
        os.close(terminal)
        _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), seen.decode(errors="replace")


@pytest.mark.parametrize("np_", [1, 2, 3])
def test_a_line_typed_on_the_launchers_terminal_reaches_rank_0(np_):
    # Rank 0 reads the line typed there, the others an empty input. mpirun, in a session of
    # its own, never read the terminal, and rank 0 waited for the line forever.
    read = (
        "import os; line = input() if os.environ['OMPI_COMM_WORLD_RANK'] == '0' else ''; "
        "print('read', repr(line), flush=True)"
    )
    code, text = _on_a_terminal(np_, read, b"hello\n")
    assert code == 0, text[-3000:]
    assert "[0]<stdout>:read 'hello'" in text, text[-3000:]
    assert text.count("read ''") == np_ - 1, text[-3000:]


def test_a_launcher_in_the_background_of_its_terminal_runs_its_job_to_the_end():
    # `syncdp-run ... &` from a shell: the launcher must not read the terminal (the kernel
    # would stop it, and with it the job's output), and its job ends as in the foreground.
    code, text = _on_a_terminal(2, "print('ran', flush=True)", b"for the shell\n", background=True)
    assert code == 0, text[-3000:]
    assert text.count("<stdout>:ran") == 2, text[-3000:]


def test_a_failing_ranks_output_reaches_a_slow_reader_whole(tmp_path):
    # The reader is away longer than the launcher's grace for a failed job; everything the
    # failing rank wrote, its last line included, still arrives, and its exit status.
    lines = 40000
    script = python_script(
        tmp_path,
        f"""
import os, sys, time
if os.environ["OMPI_COMM_WORLD_RANK"] == "1":
    for i in range({lines}):
        sys.stderr.write(f"err line {{i}} " + "y" * 60 + "\\n")
    sys.stderr.write("LAST LINE\\n")
    sys.exit(5)
time.sleep(60)
""",
    )
    proc = start(2, "python", script, stderr=subprocess.STDOUT)
    try:
        time.sleep(12)  # the launcher's grace for a failed job is 5 s
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 5, out[-2000:]
    assert out.count("err line ") == lines and "[1]<stderr>:LAST LINE" in out, out[-2000:]


LEAVES_A_STUBBORN_CHILD = """
import subprocess, sys, time
marker = sys.argv[1]
ignore = "signal.signal(signal.SIGTERM, signal.SIG_IGN); " if sys.argv[2] == "ignore" else ""
code = f"import signal, time; {ignore}print('child up', flush=True); time.sleep(600)"
subprocess.Popen([sys.executable, "-c", code, marker + "-child"], start_new_session=True)
time.sleep(600)
"""


@pytest.mark.parametrize(
    ("np_", "signum", "child"),
    [(1, signal.SIGKILL, "plain"), (2, signal.SIGTERM, "ignore"), (3, signal.SIGKILL, "ignore")],
)
def test_what_a_rank_started_outside_its_group_ends_when_the_launcher_is_stopped(
    tmp_path, np_, signum, child
):
    # A rank's child in a session of its own (one that ignores SIGTERM too) is gone within
    # seconds of the launcher being stopped, however it was stopped.
    marker = f"syncdp-test-{os.getpid()}-{np_}"
    script = python_script(tmp_path, LEAVES_A_STUBBORN_CHILD)
    proc = start(np_, "python", script, marker, child, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while len(_running_with(f"{marker}-child")) < np_ and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(_running_with(f"{marker}-child")) == np_
        time.sleep(0.5)  # the children have set their signal handling
        os.kill(proc.pid, signum)  # the launcher alone, not its process group
        proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and (
            _running_with(f"{marker}-child") or _running_with(marker)
        ):
            time.sleep(0.2)
        assert _running_with(f"{marker}-child") == [] and _running_with(marker) == []
    finally:
        for pid in _running_with(marker) + _running_with(f"{marker}-child"):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("closed", [1, 2], ids=["stdout", "stderr"])
def test_a_launcher_started_with_a_closed_stream_gives_the_jobs_exit_status(closed):
    command = [sys.executable, "-m", "syncdp.launch", "-np", "2"]
    command += ["python", "-c", "import sys; sys.exit(3)"]
    done = subprocess.run(
        command,
        env=rank_env(),
        cwd=ROOT,
        timeout=120,
        preexec_fn=lambda: os.close(closed),  # as `>&-` or `2>&-` in a shell
        capture_output=False,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 3
