"""The supervisor ends its rank's process group so that the rank is reaped, stopped or not
(the jobs are in tests/integration/test_hostile_reap.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

from syncdp.launch import worker


def _rank(source: str) -> subprocess.Popen:
    # In its own process group, as the supervisor starts its rank.
    child = subprocess.Popen(
        [sys.executable, "-c", source], process_group=0, stdout=subprocess.PIPE
    )
    assert child.stdout.readline() == b"up\n"
    threading.Thread(target=child.wait, daemon=True).start()  # the supervisor's main thread
    return child


def test_a_stopped_rank_gets_sigterm_and_is_reaped():
    child = _rank(
        "import os, signal; print('up', flush=True); os.kill(os.getpid(), signal.SIGSTOP)"
    )
    began = time.monotonic()
    worker._end_rank(child, 5.0)
    worker._await_reaped(child, 5.0)
    assert child.returncode == -signal.SIGTERM
    assert time.monotonic() - began < 2.0


def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace():
    child = _rank(
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('up', flush=True); time.sleep(60)"
    )
    began = time.monotonic()
    worker._end_rank(child, worker._ASKED_GRACE_SECONDS)
    worker._await_reaped(child, 5.0)
    assert child.returncode == -signal.SIGKILL
    assert time.monotonic() - began < 1.0
