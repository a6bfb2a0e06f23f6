"""Warm spares through the real launcher (``syncdp-run --min-np M --spares K``).

The job is examples/elastic_custom_loop.py, as in test_elastic.py: whatever the failures, the
final weights must equal one process's result. A spare's output is labelled after the ranks'
(``[N]`` at ``-np N``), and a spare that takes a lost place keeps that label.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import numpy as np
import pytest

from syncdp.watch import timeline
from tests.integration.test_elastic import (
    EPOCHS,
    EXAMPLE,
    _assert_finished,
    _expected,
    _results,
    _run,
)
from tests.launcher import launch, python_script, start


def _processes(data) -> list[int]:
    """The pids of every process of a job whose command line names ``data``."""
    found = subprocess.run(["pgrep", "-f", str(data)], capture_output=True, text=True).stdout
    return [int(pid) for pid in found.split()]


def _assert_nothing_left(data) -> None:
    deadline = time.monotonic() + 5
    while _processes(data) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _processes(data), subprocess.run(
        ["ps", "-o", "pid,ppid,stat,args", "-p", ",".join(map(str, _processes(data)))],
        capture_output=True,
        text=True,
    ).stdout


@pytest.mark.parametrize(("np_", "label"), [(2, 1), (3, 0)])
def test_a_spare_takes_the_place_of_a_killed_rank(tmp_path, np_, label):
    result = _run(tmp_path, np_, f"{label}:0:4", launcher=("--spares", "1"))
    results = _assert_finished(result, size=np_, changes=1)
    assert "1 spare(s) took over, 0 replacement(s) started, 0 spare(s) left" in result.stderr
    assert f"output labelled [{np_}]" in result.stderr
    # The spare (label np_) finished as the last rank; nothing was spawned.
    assert any(r["label"] == np_ and r["rank"] == np_ - 1 for r in results)
    _assert_nothing_left(tmp_path / "data")


def test_a_spare_being_started_takes_the_next_lost_place(tmp_path):
    # Rank 1 dies (the spare, label 2, takes over; rank 0 starts spare [3] in the background),
    # then label 2 dies too, before [3] waits: the recovery waits for [3] and seats it rather
    # than spawning a process of its own (both at once left MPI_Finalize hanging).
    result = _run(tmp_path, 2, "1:0:3", "2:1:2", launcher=("--spares", "1"))
    results = _assert_finished(result, size=2, changes=2)
    assert "starting a new spare [3]" in result.stderr
    assert result.stderr.count("1 spare(s) took over, 0 replacement(s) started") == 2
    assert sorted(r["label"] for r in results) == [0, 3]
    _assert_nothing_left(tmp_path / "data")


def test_when_spares_run_out_a_replacement_is_spawned(tmp_path):
    # Two of three ranks die at the same step and there is one spare: it takes one place, and
    # a replacement is spawned for the other.
    result = _run(tmp_path, 3, "1:0:3", "2:0:3", launcher=("--spares", "1"))
    log = f"--- stdout ---\n{result.stdout[-3000:]}\n--- stderr ---\n{result.stderr[-6000:]}"
    assert result.returncode == 0, log
    results = _results(result.stdout)
    assert sorted(r["rank"] for r in results) == [0, 1, 2], log
    assert all(r["size"] == 3 and r["w"] == results[0]["w"] for r in results), log
    w, b = _expected()
    np.testing.assert_allclose(results[0]["w"], w, rtol=1e-9, atol=1e-12)
    assert "1 spare(s) took over" in result.stderr, log
    assert re.search(r"[1-9] replacement\(s\) started", result.stderr), log
    assert 3 in {r["label"] for r in results}, log  # the spare
    _assert_nothing_left(tmp_path / "data")


def _spare_pid(data, world_rank: int) -> int | None:
    """The pid of the rank process (not its supervisor) mpirun started as ``world_rank``."""
    for pid in _processes(data):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"syncdp.launch.worker" in f.read():
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except OSError:
            continue
        if env.get(b"OMPI_COMM_WORLD_RANK") == str(world_rank).encode():
            return pid
    return None


def _kill_the_waiting_spare(data, marker, *example_args):
    """Runs the example at np=2 with one spare, SIGKILLs the spare once rank 0 has created
    ``marker`` (training started), and returns ``(returncode, stdout, stderr, spare_pid)``."""
    proc = start(
        2,
        "python",
        EXAMPLE,
        "--data",
        str(data),
        "--epochs",
        str(EPOCHS),
        *example_args,
        launcher_args=("--min-np", "2", "--spares", "1"),
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert marker.exists(), "training never started"
        spare = _spare_pid(data, 2)
        assert spare is not None, "no spare process found"
        os.kill(spare, signal.SIGKILL)
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the job did not end within its timeout\n{err[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out, err, spare


def test_a_spare_killed_while_waiting_does_not_fail_the_job(tmp_path):
    data, marker = tmp_path / "data", tmp_path / "training"
    code, out, err, spare = _kill_the_waiting_spare(
        data, marker, "--step-seconds", "0.3", "--touch", f"0:2:{marker}"
    )
    log = f"--- stdout ---\n{out[-3000:]}\n--- stderr ---\n{err[-5000:]}"
    assert code == 0, log
    results = _results(out)
    assert sorted(r["label"] for r in results) == [0, 1], log
    w, b = _expected()
    assert all(r["size"] == 2 and r["epoch"] == EPOCHS for r in results), log
    np.testing.assert_allclose(results[0]["w"], w, rtol=1e-9, atol=1e-12)
    assert abs(results[0]["b"] - b) < 1e-9, log
    assert "elastic: no rank was lost. 1 spare(s) died while waiting." in err, log
    assert re.search(
        rf"spare \[2\] \(pid {spare} on .*\) was killed by signal 9 .*while waiting; 0 spare\(s\) "
        "left",
        err,
    ), err[-4000:]
    _assert_nothing_left(data)


def test_spares_do_not_hide_a_failed_rank(tmp_path):
    source = (
        "import syncdp.tensorflow as hvd\n"
        "hvd.init()\n"
        "if hvd.rank() == 1:\n"
        "    raise ValueError('broken on purpose')\n"
        "hvd.allreduce(1.0, name='x')\n"
    )
    script = python_script(tmp_path, source, name="failing_job.py")
    result = launch(2, "python", script, launcher_args=("--min-np", "2", "--spares", "1"))
    assert result.returncode != 0, result.stderr[-3000:]
    assert "ValueError: broken on purpose" in result.stderr
    assert re.search(r"syncdp-run: the job failed .*failed with ValueError", result.stderr), (
        result.stderr[-3000:]
    )
    _assert_nothing_left(script)


def test_spares_without_elastic_mode_is_a_usage_error():
    result = launch(2, "python", "-c", "pass", launcher_args=("--spares", "1"), timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--spares 1 needs elastic mode" in lines[0], result.stderr


def test_a_timeline_goes_on_through_a_spare_and_a_replacement(tmp_path):
    # Both join a running job: each starts its clock at rank 0's reading in the barrier the
    # survivors make too (before, a joining rank waited in that barrier forever).
    trace = tmp_path / "trace.json"
    result = _run(
        tmp_path,
        2,
        "1:0:3",
        "2:1:2",
        launcher=("--spares", "1", "--timeline-filename", str(trace)),
    )
    _assert_finished(result, size=2, changes=2)
    events = timeline.load(str(trace))
    assert sorted(events) == [0, 1]
    # The last rank 1 joined late: its first collective comes after rank 0's first.
    first = {r: min(e["ts"] for e in evs if e.get("ph") == "X") for r, evs in events.items()}
    assert first[1] > first[0], first
    _assert_nothing_left(tmp_path / "data")


def test_dead_and_used_spares_are_replaced_in_the_background(tmp_path):
    # The waiting spare [2] is killed: rank 0 notices, starts spare [3] while training goes on,
    # and the ranks take it in at a commit. Then rank 1 dies once [3] waits: [3] takes its
    # place (nothing spawned on the recovery path), and spare [4] is started in turn.
    data, marker = tmp_path / "data", tmp_path / "training"
    code, out, err, _ = _kill_the_waiting_spare(
        data, marker, "--step-seconds", "1.5", "--touch", f"0:1:{marker}", "--kill", "1:refilled"
    )
    log = f"--- stdout ---\n{out[-3000:]}\n--- stderr ---\n{err[-6000:]}"
    assert code == 0, log
    results = _results(out)
    assert sorted(r["label"] for r in results) == [0, 3], log
    assert all(r["size"] == 2 and r["epoch"] == EPOCHS for r in results), log
    assert results[0]["w"] == results[1]["w"], log
    w, b = _expected()
    np.testing.assert_allclose(results[0]["w"], w, rtol=1e-9, atol=1e-12)
    assert abs(results[0]["b"] - b) < 1e-9, log
    assert re.search(r"spare \[2\] \(pid \d+ on .*\) was killed by signal 9", err), log
    assert "starting a new spare [3]" in err and "starting a new spare [4]" in err, log
    assert "spares waiting: 1; training went on meanwhile." in err, log
    assert "1 spare(s) took over, 0 replacement(s) started" in err, log
    assert "elastic: 1 membership change(s); the job finished with 2 rank(s)." in err, log
    _assert_nothing_left(data)
