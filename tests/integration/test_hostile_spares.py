"""Warm spares that misbehave never hang a job nor fail one whose ranks finished.

The job is examples/elastic_custom_loop.py under the real launcher with ``--spares`` (as in
test_spares.py): whatever happens to the spares, the job must end within a bound, exit 0, with
every rank holding one process's weights, and leave nothing running.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import numpy as np
import pytest

from tests.integration.test_elastic import EPOCHS, EXAMPLE, _expected, _results
from tests.integration.test_spares import _assert_nothing_left, _spare_pid
from tests.launcher import launch, start


def _start(data, marker, *example_args, launcher=()):
    """The example at np=2, ``--min-np 1 --spares 1``; rank 0 creates ``marker`` before batch
    2 of epoch 0 (training runs) and sleeps 0.3 s a step."""
    return start(
        2,
        "python",
        EXAMPLE,
        "--data",
        str(data),
        "--epochs",
        str(EPOCHS),
        "--step-seconds",
        "0.3",
        "--touch",
        f"0:2:{marker}",
        *example_args,
        launcher_args=("--min-np", "1", "--spares", "1", *launcher),
    )


def _await(marker, proc, seconds: float = 150) -> None:
    deadline = time.monotonic() + seconds
    while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    if not marker.exists():
        ended = proc.poll() is not None
        err = proc.communicate()[1][-4000:] if ended else ""
        pytest.fail(f"training never started (the launcher {'ended' if ended else 'runs'})\n{err}")


def _finish(proc, data, seconds: float) -> tuple[int, str, str, float]:
    """Waits at most ``seconds`` for the launcher; returns its status, output and wait."""
    began = time.monotonic()
    try:
        out, err = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        for pid in _processes_of(data):
            _kill(pid)
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the job did not end within {seconds} s\n{err[-5000:]}")
    return proc.returncode, out, err, time.monotonic() - began


def _processes_of(data) -> list[int]:
    found = subprocess.run(["pgrep", "-f", str(data)], capture_output=True, text=True).stdout
    return [int(pid) for pid in found.split()]


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _segments(pid: int) -> set[str]:
    """Open MPI's shared-memory segments process ``pid`` maps (its own and its peers')."""
    with open(f"/proc/{pid}/maps") as f:
        return {line.split()[-1] for line in f if "/dev/shm/sm_segment." in line}


def _assert_right_weights(code: int, out: str, err: str, labels: list[int]) -> None:
    log = f"--- stdout ---\n{out[-3000:]}\n--- stderr ---\n{err[-6000:]}"
    assert code == 0, log
    results = _results(out)
    assert sorted(r["label"] for r in results) == labels, log
    assert all(r["size"] == 2 and r["epoch"] == EPOCHS for r in results), log
    assert all(r["w"] == results[0]["w"] and r["b"] == results[0]["b"] for r in results), log
    w, b = _expected()
    np.testing.assert_allclose(results[0]["w"], w, rtol=1e-9, atol=1e-12)
    assert abs(results[0]["b"] - b) < 1e-9, log
    assert "SIGALRM" not in err, log  # no MPI_Finalize ran into its bound


def test_a_stopped_spare_does_not_keep_a_finished_job_alive(tmp_path):
    # Under ULFM every rank's MPI_Finalize waits for a spare that is alive but stopped: rank 0
    # names it when it does not answer its release, and the launcher kills it.
    data, marker = tmp_path / "data", tmp_path / "training"
    proc = _start(data, marker)
    try:
        _await(marker, proc)
        spare = _spare_pid(data, 2)
        assert spare is not None, "no spare process found"
        segments = _segments(spare)
        assert segments, "the spare maps no shared-memory segment"
        os.kill(spare, signal.SIGSTOP)
        # Training has ~30 steps of 0.3 s left; the release waits 5 s for the spare's answer.
        code, out, err, waited = _finish(proc, data, 90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    _assert_right_weights(code, out, err, [0, 1])
    assert f"spare [2] (pid {spare} on" in err and "did not answer its release" in err, err
    assert "elastic: no rank was lost." in err and "died while waiting" not in err, err
    assert waited < 45, f"the job took {waited:.0f} s to end after the spare stopped"
    _assert_nothing_left(data)
    # The killed spare could not remove its segment; the launcher did.
    assert not [path for path in segments if os.path.exists(path)], segments


def test_a_rank_lost_after_the_spare_stopped_recovers_at_the_stall_timeout(tmp_path):
    # The recovery must shrink the job to the processes alive, which waits for every one of
    # them: the stopped spare's supervisor kills it at the stall timeout, and a replacement is
    # spawned for the lost rank.
    data, marker = tmp_path / "data", tmp_path / "training"
    proc = _start(data, marker, launcher=("--stall-timeout", "5"))
    try:
        _await(marker, proc)
        spare, rank1 = _spare_pid(data, 2), _spare_pid(data, 1)
        assert spare is not None and rank1 is not None, "ranks not found"
        os.kill(spare, signal.SIGSTOP)
        time.sleep(1)
        os.kill(rank1, signal.SIGKILL)
        code, out, err, _ = _finish(proc, data, 150)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    _assert_right_weights(code, out, err, [0, 3])
    assert f"spare [2] (pid {spare} on" in err and "has been stopped for" in err, err
    assert "1 replacement(s) started" in err, err
    recovered = [
        float(line.rsplit("recovered in ", 1)[1].split()[0])
        for line in err.splitlines()
        if "recovered in" in line
    ]
    assert len(recovered) == 1 and recovered[0] < 5 + 15, recovered
    # The recovery (~10 s) is charged to no rank: every rank's step stays near its 0.3 s, and
    # the heading counts the survivor's steps, not the newcomer's.
    table = err[err.index("where the time went") :].splitlines()
    steps = int(re.search(r"over (\d+) steps", table[0]).group(1))
    assert steps >= 10 * EPOCHS, table
    rows = [line.split() for line in table[2:] if line.strip()[:1].isdigit()]
    column = table[1].split().index("step")  # "step ms": the tokens before it are the row's
    step_ms = [float(row[column]) for row in rows]
    assert len(rows) == 2 and all(ms < 600 for ms in step_ms), table
    _assert_nothing_left(data)


def _labels_given(err: str) -> list[int]:
    """Every output label the launcher saw given to a new process (spare or replacement)."""
    started = re.findall(r"starting a new spare \[(\d+)\]", err)
    replaced = re.findall(r"replacement\(s\) started.*?\((.*)\); size", err)
    spawned = [label for line in replaced for label in re.findall(r"output \[(\d+)\]", line)]
    return sorted(int(label) for label in started + spawned if label)


def _run_killing(tmp_path, np_, *kills, step="0.5"):
    args = ["--data", str(tmp_path / "data"), "--epochs", str(EPOCHS), "--step-seconds", step]
    for kill in kills:
        args += ["--kill", kill]
    return launch(
        np_,
        "python",
        EXAMPLE,
        *args,
        launcher_args=("--min-np", "1", "--spares", "1"),
        timeout=240,
    )


@pytest.mark.parametrize("np_", [2, 3])
def test_rank_0_lost_while_it_starts_a_spare(tmp_path, np_):
    # Rank 1 dies, the spare takes its place and rank 0 starts a new spare in the background;
    # rank 0 dies 0.6 s later, while that spare loads. The spare can never join (its start
    # waits for rank 0): the launcher kills it, the survivors spawn a replacement under a
    # label of its own, and the job ends as one kill would.
    result = _run_killing(tmp_path, np_, "1:0:3", "0:0:5", step="0.3")
    log = f"--- stdout ---\n{result.stdout[-3000:]}\n--- stderr ---\n{result.stderr[-6000:]}"
    results = _results(result.stdout)
    assert result.returncode == 0, log
    assert len(results) == np_ and len({r["label"] for r in results}) == np_, log
    assert all(r["size"] == np_ and r["epoch"] == EPOCHS for r in results), log
    w, b = _expected()
    assert all(r["w"] == results[0]["w"] for r in results), log
    np.testing.assert_allclose(results[0]["w"], w, rtol=1e-9, atol=1e-12)
    assert abs(results[0]["b"] - b) < 1e-9, log
    assert "was being started by rank 0, which was lost: it cannot join; killing it" in (
        result.stderr
    ), log
    given = _labels_given(result.stderr)
    assert len(given) == len(set(given)), given  # no label given twice
    assert "SIGALRM" not in result.stderr and "recovery failed" not in result.stderr, log


def test_the_spare_that_took_a_place_lost_six_seconds_later(tmp_path):
    # Rank 1 dies and the spare [2] takes its place; ~6 s later [2] dies too, while or after
    # the new spare [3] is started: the job takes [3] in, then starts [4]. Every process of
    # these spawns must leave MPI_Finalize at the end (it crashed or hung there before).
    result = _run_killing(tmp_path, 2, "1:0:3", "2:1:2", step="0.7")
    log = f"--- stdout ---\n{result.stdout[-3000:]}\n--- stderr ---\n{result.stderr[-6000:]}"
    results = _results(result.stdout)
    assert result.returncode == 0, log
    assert sorted(r["label"] for r in results) == [0, 3], log
    w, b = _expected()
    assert all(r["w"] == results[0]["w"] for r in results), log
    np.testing.assert_allclose(results[0]["w"], w, rtol=1e-9, atol=1e-12)
    assert "2 membership change(s); the job finished with 2 rank(s)" in result.stderr, log
    assert "SIGALRM" not in result.stderr and "SIGSEGV" not in result.stderr, log
    assert result.elapsed < 120, result.elapsed
