"""Runs the real ``syncdp-run`` launcher from tests, always with a timeout.

A multi-process test must fail, not hang: :func:`launch` kills the whole process group of a job
that outlives its timeout and fails the test with the output seen so far.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def rank_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a test job gets: the repo importable, one intra-op thread per rank."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["TF_NUM_INTRAOP_THREADS"] = "1"
    env["TF_NUM_INTEROP_THREADS"] = "2"
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env.update(extra or {})
    return env


def start(
    np: int,
    *command: str,
    env: dict[str, str] | None = None,
    launcher_args: tuple[str, ...] = (),
    cwd: str | os.PathLike | None = None,
    launcher: str = "syncdp-run",
    stderr=subprocess.PIPE,
    stdin=None,
) -> subprocess.Popen:
    """Starts ``syncdp-run -np NP [launcher_args] COMMAND`` in its own session, text pipes
    (``stderr=subprocess.STDOUT``: both streams on one, as ``2>&1``).

    For tests that act while the job runs (kill a rank, cut a link); the caller must end it
    (``os.killpg(proc.pid, SIGKILL)``) if it outlives the test. ``launcher="horovodrun"`` runs
    the installed ``horovodrun`` command instead (it must be on PATH).
    """
    if launcher == "horovodrun":
        found = shutil.which("horovodrun")
        if found is None:
            pytest.fail("horovodrun is not on PATH: install syncdp as the README says")
        head = [found]
    else:
        head = [sys.executable, "-m", "syncdp.launch"]
    cmd = [*head, "-np", str(np), *launcher_args, *command]
    return subprocess.Popen(
        cmd,
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=rank_env(env),
        cwd=cwd or ROOT,
        start_new_session=True,
    )


def launch(
    np: int,
    *command: str,
    timeout: float = 180,
    env: dict[str, str] | None = None,
    launcher_args: tuple[str, ...] = (),
    cwd: str | os.PathLike | None = None,
    launcher: str = "syncdp-run",
    input: str | None = None,
) -> subprocess.CompletedProcess:
    """Runs ``syncdp-run -np NP [launcher_args] COMMAND`` and returns the finished process.

    ``input``, when given, is written to the launcher's standard input (a pipe), then closed.

    Its ``stdout``/``stderr`` are text, ``elapsed`` holds the wall time in seconds, and
    ``started_at``/``ended_at`` the ``time.time()`` of the launch and of the launcher's exit (to
    compare with times the ranks print). Fails the test (after killing every process of the job)
    when the job outlives ``timeout``.
    """
    started_at = time.time()
    began = time.monotonic()
    proc = start(
        np,
        *command,
        env=env,
        launcher_args=launcher_args,
        cwd=cwd,
        launcher=launcher,
        stdin=None if input is None else subprocess.PIPE,
    )
    cmd = proc.args
    try:
        out, err = proc.communicate(input=input, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(
            f"job did not end within {timeout} s: {' '.join(cmd)}\n"
            f"--- stdout ---\n{out[-5000:]}\n--- stderr ---\n{err[-5000:]}"
        )
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    result.elapsed = time.monotonic() - began
    result.started_at, result.ended_at = started_at, time.time()
    return result


def pytest_on_ranks(
    np: int, *args: str, env: dict[str, str] | None = None, timeout: float = 900
) -> subprocess.CompletedProcess:
    """Runs one pytest session per rank (``python -m pytest -x -q ARGS``) under the launcher;
    ``-x`` makes a failing rank exit at once, and the launcher then ends the others."""
    command = ("python", "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *args)
    return launch(np, *command, env=env, timeout=timeout)


def python_script(tmp_path: Path, source: str, name: str = "job.py") -> str:
    """Writes ``source`` to a file under ``tmp_path`` and returns its path."""
    path = tmp_path / name
    path.write_text(source)
    return str(path)


def check(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """Fails the test with the job's output unless it exited 0."""
    if result.returncode != 0:
        pytest.fail(
            f"job failed with {result.returncode}: {' '.join(result.args)}\n"
            f"--- stdout ---\n{result.stdout[-6000:]}\n--- stderr ---\n"
            f"{result.stderr[-6000:]}"
        )
    return result


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids, timeout: float) -> list[int]:
    """Waits up to ``timeout`` seconds for the processes ``pids`` to end; returns those left."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if alive(p)]
