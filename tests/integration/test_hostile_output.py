"""The launcher's output through the real launcher: ranks' unterminated last lines (one past a
piece) stay with their rank on the console and in ``--output-filename`` (as the rank wrote
them, no newline added); the console is text
after ``MPI_Abort``, with Open MPI's banners that repeat the verdict folded into one line."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from syncdp.launch import output
from tests.launcher import ROOT, python_script, rank_env, start

NOISY = r"""
import os, sys
r = int(os.environ["OMPI_COMM_WORLD_RANK"])
out = sys.stdout.buffer
for i in range(200):
    out.write(f"L{r}-{i}-".encode() + str(r).encode() * ((i * 7919) % 90000 + 1) + b"\n")
tail = str(r).encode() * (int(os.environ["PIECE"]) + 100 if r == 1 else 10)
out.write(f"partial line from rank {r} ".encode() + tail)  # no newline
out.flush()
"""

ABORTS = r"""
import sys
import syncdp
syncdp.init()
if syncdp.rank() == 0:
    sys.stdout.buffer.write(b"bytes: \x00 \xff\xfe caf\xe9\n")
    sys.stdout.flush()
    raise ValueError("boom")
syncdp.barrier()
"""


def _run(np: int, script: str, *launcher_args: str, timeout: float = 120):
    """The launcher's exit code, stdout and stderr as bytes (nothing decoded for us)."""
    cmd = [sys.executable, "-m", "syncdp.launch", "-np", str(np), *launcher_args, "python", script]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=rank_env({"PIECE": str(output.PIECE_BYTES), "SYNCDP_STALL_TIMEOUT": "60"}),
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"job did not end within {timeout} s:\n{err[-4000:]!r}")
    return proc.returncode, out, err


def test_unterminated_last_lines_stay_with_their_ranks(tmp_path):
    script = python_script(tmp_path, NOISY, name="noisy.py")
    files = tmp_path / "out"
    code, out, err = _run(3, script, "--output-filename", str(files))
    assert code == 0, err[-4000:]
    lines = out.split(b"\n")
    assert lines[-1] == b""  # the last one ends too
    for line in lines[:-1]:
        m = re.fullmatch(
            rb"\[(\d)\]<stdout>:(?:L(\d)-\d+-|partial line from rank (\d) )(\d+)", line
        )
        assert m, line[:200]
        rank = m[1]
        assert (m[2] or m[3]) == rank and set(m[4]) == {rank[0]}, line[:200]
    assert len(lines) - 1 == 3 * 201
    for r in range(3):
        # The file holds the bytes as the rank wrote them: no newline after its last line.
        digit = str(r).encode()
        wrote = b"".join(
            f"L{r}-{i}-".encode() + digit * ((i * 7919) % 90000 + 1) + b"\n" for i in range(200)
        )
        tail = digit * (output.PIECE_BYTES + 100 if r == 1 else 10)
        wrote += f"partial line from rank {r} ".encode() + tail
        mine = (files / f"rank.{r}" / "stdout").read_bytes()
        assert len(mine) == len(wrote) and mine == wrote, (r, len(mine), len(wrote))
        assert f"[{r}]<stdout>:".encode() + wrote.rsplit(b"\n", 1)[1] in lines


def test_the_console_is_text_and_repeated_banners_fold_after_mpi_abort(tmp_path):
    script = python_script(tmp_path, ABORTS, name="aborts.py")
    code, out, err = _run(2, script)
    assert code == 1, err[-4000:]
    both = out + err
    assert b"\x00" not in both
    text = out.decode() + err.decode()  # strict UTF-8
    assert "[0]<stdout>:bytes:  \ufffd\ufffd caf\ufffd\n" in text
    folded = [line for line in text.splitlines() if line.startswith("syncdp-run: Open MPI: ")]
    assert any("MPI_ABORT was invoked on rank 0" in line for line in folded), text[-3000:]
    assert "NOTE: invoking MPI_ABORT" not in text
    assert "-" * 40 not in text, text[-3000:]  # no banner left whole
    last = err.decode().splitlines()[-1]
    assert last.startswith("syncdp-run: the job failed") and "ValueError: boom" in last


MANY_LINES = r"""
import os
r = os.environ["OMPI_COMM_WORLD_RANK"]
for i in range(20000):
    print(r, i, "x" * 100)
"""


@contextlib.contextmanager
def _ended(proc: subprocess.Popen):
    """The launcher ``proc`` and its job, killed if they outlive the block."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("np", [1, 2, 3])
def test_a_slow_reader_of_the_launchers_output_gets_every_line(tmp_path, np):
    # The reader takes nothing for longer than the launcher's grace after the ranks' last
    # reports (5 s, then 5 s after SIGTERM): mpirun waits to hand over the rest, and must not be
    # stopped, nor the rest dropped, while the output still moves.
    from syncdp.launch import supervision

    with _ended(start(np, sys.executable, python_script(tmp_path, MANY_LINES))) as proc:
        time.sleep(2 * supervision.FINISHED_GRACE_SECONDS + 2)
        out, err = proc.communicate(timeout=120)
    lines = out.splitlines()
    for r in range(np):
        mine = [line for line in lines if line.startswith(f"[{r}]<stdout>:")]
        assert len(mine) == 20000, (r, len(mine), err[-2000:])
        assert mine[-1].endswith(f"{r} 19999 " + "x" * 100)
    assert proc.returncode == 0, err[-2000:]
    assert "did not exit within" not in err


EXITS_3_LATER = r"""
import sys, time
for i in range(3):
    print(i, flush=True)
time.sleep(1)
sys.exit(3)
"""


def test_a_reader_of_both_streams_that_goes_away_leaves_the_jobs_exit_status(tmp_path):
    # syncdp-run ... 2>&1 | head -1: the launcher's own last lines (the failure, the verdict)
    # find the reader gone; the exit status is still the job's, not a BrokenPipeError's 1.
    script = python_script(tmp_path, EXITS_3_LATER)
    with _ended(start(2, sys.executable, script, stderr=subprocess.STDOUT)) as proc:
        first = proc.stdout.readline()
        proc.stdout.close()
        code = proc.wait(timeout=60)
    assert first.endswith(">:0\n"), first
    assert code == 3
