"""The launcher's verdict on a job: from what the ranks reported, never from mpirun's exit code.

A job succeeded only when every rank's supervisor reported that its program exited 0 (an
``exit`` report, :mod:`syncdp.watch.report`; the supervisor sends it for every program, also one
that never calls ``syncdp.init()``) and no rank reported a failure. mpirun's exit code is not
evidence either way: Open MPI exits 0 after losing a daemon whose ranks never finished, and
non-zero after a replacement was killed in a job that recovered.

Otherwise the job failed, and the launcher's last line says how::

    syncdp-run: the job failed (1 of 2 ranks exited cleanly); first failure: rank 1
    (pid 4242 on node3) was killed by signal 9 (SIGKILL)

The first failure is the earliest failure report by the time it was sent. Ranks that never
reported how they ended are named with their hosts and the reason, as far as the lifelines
(:mod:`syncdp.launch.lifeline`) tell it: the supervisor's connection closed without a report (it was
killed), the host fell silent (unreachable, or its daemon lost), the supervisor still ran when
mpirun ended (its daemon was lost), or no supervisor ever connected (never started). That line
comes just before the last one when there was a first failure, and is the last one otherwise.

The exit status is the first failure's own (its exit code, or 128 + its signal) when it has
one, 1 otherwise.
"""

from __future__ import annotations

import dataclasses
import math
import re
import signal
import threading
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from syncdp.launch.worker import describe_exit

# mpirun's banner for a rank's own MPI_Abort, its words joined by single spaces.
_ABORTED = re.compile(
    r"MPI_ABORT was invoked on rank (\d+) in communicator MPI_COMM_WORLD .*?Errorcode: (-?\d+)"
)
# mpirun's banner for a process that ended without MPI_Finalize after others called MPI_Init
# (os._exit() after init(), for one): Open MPI then stops the others.
_IMPROPER = re.compile(r"process rank (\d+) with PID (\d+) on node (\S+) exiting improperly")

if TYPE_CHECKING:
    from syncdp.launch.elastic import ElasticLog
    from syncdp.launch.lifeline import Link

__all__ = ["Verdict", "Outcome", "START_GRACE_SECONDS", "ranks_text"]

# Beyond the start timeout, left for a rank's own start timeout to end the job before the
# launcher does. Short: under Open MPI 5 a rank that arrived waits inside MPI_Init itself
# (which waits for every rank), so its own timeout cannot run, and the launcher must act.
START_GRACE_SECONDS = 1.0
# Report kinds that are failures by themselves; an "exit" report is one when it says so.
_FAILURE_KINDS = frozenset(
    {"exception", "stall", "start_timeout", "exit_early", "elastic_abort", "lost"}
)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """The launcher's exit status and the lines it prints for it (the verdict last)."""

    code: int
    lines: tuple[str, ...] = ()


def ranks_text(ranks: Iterable[int]) -> str:
    """``rank 3``, ``ranks 0, 2`` or ``ranks 0-99, 104``: runs of three or more as a range, so
    that a job of many ranks gets a line, not a page."""
    ranks = sorted(ranks)
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{ranks[i]}-{ranks[j]}")
        else:
            parts += [str(r) for r in ranks[i : j + 1]]
        i = j + 1
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def _who(report: Mapping[str, Any]) -> str:
    """``rank 1 (pid 4242 on node3)``, from a report's fields."""
    where = ""
    if report.get("pid") is not None and report.get("host"):
        where = f" (pid {report['pid']} on {report['host']})"
    return f"rank {report.get('rank', '?')}{where}"


def _report_time(report: Mapping[str, Any]) -> float:
    try:
        return float(report["time"])
    except (KeyError, TypeError, ValueError):
        return math.inf


def _exit_status(report: Mapping[str, Any]) -> int:
    """The launcher's exit status for a first failure: its own code when it has one."""
    if report.get("kind") != "exit":
        return 1
    if report.get("signal"):
        return 128 + int(report["signal"])
    code = report.get("code")
    return code if isinstance(code, int) and 0 < code < 256 else 1


class Verdict:
    """What the ranks reported, and the launcher's verdict on the job from it.

    Thread-safe: the report server adds, the launcher's main loop asks.

    Args:
        num_proc: The number of ranks.
        start_timeout: Seconds every rank has to reach ``init()`` after the first did, and
            Open MPI to start any process of the job at all (counted from here); 0 for no
            limit.
        stall_timeout: The stall timeout, for the words of a stall. Defaults to 0.
        elastic: The elastic log, in elastic mode (it takes the exit and membership reports).
            Defaults to None.
    """

    def __init__(
        self,
        num_proc: int,
        start_timeout: float,
        stall_timeout: float = 0.0,
        elastic: ElasticLog | None = None,
    ):
        self.num_proc = num_proc
        self.elastic = elastic
        if elastic is not None:
            elastic.on_abort = self.add  # a recovery that cannot finish ends the job
        self.start_timeout = start_timeout
        self.stall_timeout = stall_timeout
        self.started: dict[int, dict] = {}
        self.exits: dict[int, dict] = {}
        self.failed = threading.Event()
        self._failures: list[dict] = []
        self._first_start: float | None = None  # time.monotonic() of the first "started"
        self._created = time.monotonic()  # just before mpirun starts
        self._lock = threading.Lock()
        # Rank -> error code of an MPI_Abort its own code called (mpirun's banner says so).
        self.aborted: dict[int, int] = {}
        # Rank -> (pid, host) of a process mpirun says ended without MPI_Finalize.
        self.improper: dict[int, tuple[int, str]] = {}

    def on_banner(self, words: str) -> None:
        """For :func:`syncdp.launch.output.copy_output`: notes a rank that called
        ``MPI_Abort`` or ended without ``MPI_Finalize`` (outside elastic mode, its rank in
        ``MPI_COMM_WORLD`` is the job's). Either exits 0, and must not count as a clean exit
        when the job failed by it."""
        found = _ABORTED.search(words)
        if found and self.elastic is None:
            with self._lock:
                self.aborted.setdefault(int(found[1]), int(found[2]))
        found = _IMPROPER.search(words)
        if found and self.elastic is None:
            with self._lock:
                self.improper.setdefault(int(found[1]), (int(found[2]), found[3]))

    def add(self, report: dict) -> None:
        """Records one report; sets :attr:`failed` when it is a failure."""
        kind = report.get("kind")
        if self.elastic is not None and self.elastic.handle(report):
            return
        with self._lock:
            failure = None  # the report that names the failure, if this one makes one
            if kind == "started":
                if self._first_start is None:
                    self._first_start = time.monotonic()
                self.started.setdefault(report.get("rank"), report)
                # A rank that already ended without init() never will: the one that arrived
                # would wait for it until the start timeout.
                failure = self._ended_before_init()
            elif kind == "exit":
                self.exits[report.get("rank")] = report
                failed = report.get("code") or report.get("signal")
                if failed and not report.get("requested"):
                    failure = report
                else:
                    failure = self._ended_before_init()
            elif kind in _FAILURE_KINDS:
                failure = report
            if failure is not None:
                self._failures.append(failure)
        if failure is not None:
            self.failed.set()

    def _ended_before_init(self) -> dict | None:
        """A failure for a rank that exited cleanly without reaching ``syncdp.init()`` while
        another rank did (a program that never calls it ends well: no rank starts); None if
        there is none. Called with the lock held."""
        if self._first_start is None or self._failures:
            return None
        for rank, ended in sorted(self.exits.items(), key=lambda item: str(item[0])):
            if rank is not None and rank not in self.started and not ended.get("requested"):
                waiting = sorted(r for r in self.started if r is not None)
                return {
                    "kind": "exit_before_init",
                    "rank": rank,
                    "ranks": waiting,
                    "code": ended.get("code") or 0,
                    "host": ended.get("host"),
                    "pid": ended.get("pid"),
                    "time": _report_time(ended),
                }
        return None

    def _not_started(self) -> list[int]:
        return [r for r in range(self.num_proc) if r not in self.started]

    def check_start(self, now: float | None = None, *, anything_started: bool = True) -> bool:
        """Records a start timeout if the ranks have not all arrived in time, or if Open MPI
        started nothing at all within the start timeout (a daemon that cannot start: an
        ``srun`` waiting for CPUs it will never get would otherwise wait forever).

        Args:
            now: ``time.monotonic()``'s value. Defaults to now.
            anything_started: Whether any process of the job (a rank's supervisor) has been
                heard from. Defaults to True.

        Returns:
            Whether this call found the start timeout exceeded (the launcher then ends the job).
        """
        now = time.monotonic() if now is None else now
        with self._lock:
            if self.start_timeout <= 0 or self._failures:
                return False
            missing = self._not_started()
            before_init = self._first_start is None  # no rank has reached init() yet
            if before_init:
                late = not anything_started and now >= self._created + self.start_timeout
            else:
                late = bool(missing) and (
                    now >= self._first_start + self.start_timeout + START_GRACE_SECONDS
                )
            if not late:
                return False
            self._failures.append(
                {
                    "kind": "start_timeout",
                    "rank": None,
                    "ranks": missing,
                    "no_process": before_init,  # only then can it be late: nothing started
                    "time": time.time(),
                }
            )
        self.failed.set()
        return True

    def first_failure(self) -> dict | None:
        """The earliest failure report, by the time it was sent; None if there was none."""
        with self._lock:
            if not self._failures:
                return None
            order = range(len(self._failures))
            first = min(order, key=lambda i: (_report_time(self._failures[i]), i))
            return self._failures[first]

    def lost(self, host: str | None, links: Iterable[Link]) -> None:
        """Records that ``host``'s supervisors fell silent (from the lifeline): a failure."""
        links = list(links)
        self.add(
            {
                "kind": "lost",
                "rank": None,
                "ranks": sorted(link.rank for link in links),
                "host": host,
                "seconds": max(link.silent_for() for link in links),
                "time": time.time(),
            }
        )

    def unreported(self) -> list[int]:
        """The ranks whose supervisors have not reported how their programs ended."""
        with self._lock:
            return [r for r in range(self.num_proc) if r not in self.exits]

    def never_reported(self) -> list[int]:
        """The ranks that never reported how they ended: outside elastic mode those of
        :meth:`unreported`; in elastic mode the members of the final membership (by output
        label) that sent no exit report."""
        if self.elastic is None:
            return self.unreported()
        unfinished = self.elastic.unfinished(self.num_proc)
        return sorted(label for label, report in unfinished.items() if report is None)

    def decide(
        self, links: Mapping[int, Link] | None = None, *, mpirun_code: int | None = None
    ) -> Outcome:
        """The verdict, once mpirun has ended.

        Args:
            links: Each rank's lifeline (:meth:`syncdp.launch.lifeline.LifelineServer.links`),
                to say why a rank never reported. Defaults to none known.
            mpirun_code: mpirun's exit status, only to mention when no rank ever started.
                Defaults to None.

        Returns:
            The exit status (0 only when every rank reported a clean exit and none a failure)
            and the lines to print.
        """
        links = links or {}
        first = self.first_failure()
        if self.elastic is not None:
            return self._decide_elastic(first, links, mpirun_code)
        with self._lock:
            clean = [
                r
                for r, e in self.exits.items()
                if r in range(self.num_proc)
                and not e.get("code")
                and not e.get("signal")
                and r not in self.aborted
            ]
            aborted = sorted(r for r in self.exits if r in self.aborted)
        # After a failure the job is ended on purpose, and supervisors killed in the teardown
        # are its casualties, not news; hosts gone silent or ranks never started still are.
        silent = self._unreported_text(links, mpirun_code, teardown=first is not None)
        # Where the job failed, a rank that exited 0 without MPI_Finalize is no clean exit.
        improper = sorted(r for r in clean if r in self.improper)
        tally = f"{len(clean) - len(improper)} of {self.num_proc} ranks exited cleanly"
        if first is not None:
            lines = [silent] if silent else []
            lines.append(f"the job failed ({tally}); first failure: {self.describe(first)}")
            return Outcome(_exit_status(first), tuple(lines))
        if silent:
            return Outcome(1, (f"the job failed ({tally}): {silent}",))
        if aborted:
            r = aborted[0]
            return Outcome(
                1,
                (
                    f"the job failed ({tally}): rank {r} called MPI_Abort with error code "
                    f"{self.aborted[r]}, and its process exited {self.exits[r].get('code', 0)}",
                ),
            )
        if len(clean) < self.num_proc:
            # A rank that exited 0 without MPI_Finalize while others still ran made Open MPI
            # stop them: it is the cause, not a clean exit. (Where every rank did so, each
            # finished its program: no rank was stopped, and the job succeeded.)
            cause = "".join(
                f"rank {r} (pid {self.improper[r][0]} on {self.improper[r][1]}) exited 0 "
                "without finalizing MPI (as os._exit() after init() does), so Open MPI "
                "ended the job: "
                for r in improper
            )
            return Outcome(1, (f"the job failed ({tally}): {cause}{self._stopped_text()}",))
        return Outcome(0)

    def _decide_elastic(
        self, first: dict | None, links: Mapping[int, Link], mpirun_code: int | None
    ) -> Outcome:
        elastic = self.elastic
        if first is not None:
            return Outcome(
                _exit_status(first),
                (f"the job failed (elastic); first failure: {self.describe(first)}",),
            )
        lost = elastic.unexplained()
        if not lost and elastic.finished(self.num_proc):
            return Outcome(0, (f"elastic: {elastic.summary()}",))
        # Name every rank that kept the job from finishing: a failure no membership change
        # recovered from, a member of the final membership that ended otherwise than with 0,
        # and a member that never reported (with why, from its lifeline).
        parts = [
            self.describe(r)
            + ("" if r.get("signal") == signal.SIGALRM else "; no recovery followed")
            for r in lost
        ]
        unfinished = elastic.unfinished(self.num_proc)
        parts += [
            self.describe(report)
            for _, report in sorted(unfinished.items())
            if report is not None and report not in lost
        ]
        silent = [label for label, report in unfinished.items() if report is None]
        never = self._unreported_text(links, mpirun_code, among=silent) if silent else None
        if never:
            parts.append(never)
        if not parts:  # the counts disagree with the reports: say so rather than guess
            parts.append("not every rank of the final membership reported a clean exit")
        final = len(elastic.members(self.num_proc))
        tally = f"{final - len(unfinished)} of the final {final} ranks exited cleanly"
        return Outcome(1, (f"the job failed ({tally}): {'; '.join(parts)}",))

    def _stopped_text(self) -> str:
        """Every rank reported, none failed, yet some did not exit 0: they were stopped."""
        with self._lock:
            stopped = {r: e for r, e in self.exits.items() if e.get("code") or e.get("signal")}
        how = sorted(
            {
                describe_exit(-e["signal"] if e.get("signal") else e["code"])
                for e in stopped.values()
            }
        )
        verb = "was" if len(stopped) == 1 else "were"
        return f"{ranks_text(stopped)} {verb} stopped before finishing ({'; '.join(how)})"

    def _unreported_text(
        self,
        links: Mapping[int, Link],
        mpirun_code: int | None,
        *,
        teardown: bool = False,
        among: Iterable[int] | None = None,
    ) -> str | None:
        """The ranks that never reported how they ended, grouped by why; None when none.

        With ``teardown``, ranks whose supervisors died without a word are left out: the
        launcher ended the job, and they were killed doing so. ``among`` gives the ranks
        (output labels) known not to have reported; by default those of :meth:`unreported`.
        """
        with self._lock:
            named = {r for f in self._failures if f.get("kind") == "lost" for r in f["ranks"]}
        candidates = self.unreported() if among is None else sorted(among)
        missing = [r for r in candidates if r not in named]
        if not missing:
            return None
        now = time.monotonic()
        with self._lock:
            started = dict(self.started)
        killed, silent, running, never = [], [], [], []
        for r in missing:
            link = links.get(r)
            if link is None:
                never.append(r)
            elif link.closed is not None:
                killed.append(r)
            elif link.silent(now):
                silent.append(r)
            else:
                running.append(r)
        parts = []
        if killed and not teardown:
            who = [_who(started.get(r) or self._from_link(links[r])) for r in killed]
            their = "its supervisor was" if len(who) == 1 else "their supervisors were"
            parts.append(f"{', '.join(who)} ended without a report ({their} killed)")
        for host, ranks in _by_host(silent, links):
            longest = max(links[r].silent_for(now) for r in ranks)
            they = "it" if len(ranks) == 1 else "they"
            parts.append(
                f"{ranks_text(ranks)} (on {host}) never reported how {they} ended: no word from "
                f"{host} for {longest:.0f} s (host unreachable, or its daemon lost)"
            )
        for host, ranks in _by_host(running, links):
            they = "it ends" if len(ranks) == 1 else "they end"
            parts.append(
                f"{ranks_text(ranks)} (on {host}) still ran when mpirun ended (the daemon there "
                f"was lost); {they} with the launcher"
            )
        if never:
            why = "no supervisor reached the launcher"
            if mpirun_code:
                why += f"; mpirun exited with code {mpirun_code}, see its output above"
            verb = "never started" if len(never) < self.num_proc else "none started"
            parts.append(f"{ranks_text(never)} {verb} ({why})")
        return "; ".join(parts) or None

    @staticmethod
    def _from_link(link: Link) -> dict:
        return {"rank": link.rank, "pid": link.pid, "host": link.host}

    def _on_hosts(self, ranks) -> str:
        """`` (on h3)``: the hosts of ``ranks``, from their ``started`` reports; "" when unknown
        or when the whole job runs on one host."""
        with self._lock:
            every = {report.get("host") for report in self.started.values()}
            hosts = sorted({self.started[r].get("host") for r in ranks if r in self.started})
        return f" (on {', '.join(hosts)})" if hosts and len(every) > 1 else ""

    def describe(self, report: Mapping[str, Any]) -> str:
        """One failure report in words, for the launcher's last line."""
        kind, ranks = report.get("kind"), report.get("ranks") or []
        if kind == "exception":
            return f"{_who(report)} failed with {_error_line(report)}"
        if kind == "stall":
            where = f"collective #{report.get('seq')} {report.get('collective')}"
            limit = f"the stall timeout ({self.stall_timeout:g} s)"
            if not ranks:
                return f"rank {report.get('rank')} stalled: {where} ran past {limit}"
            them = "it" if len(ranks) == 1 else "them"
            found = report.get("where") or {}
            places = "; ".join(f"rank {r}: {found[str(r)]}" for r in ranks if str(r) in found)
            return (
                f"{ranks_text(ranks)}{self._on_hosts(ranks)} stalled: rank {report.get('rank')} "
                f"waited for {them} in {where} past {limit}" + (f" ({places})" if places else "")
            )
        if kind == "start_timeout":
            with self._lock:
                missing = ranks or self._not_started()
            limit = f"the start timeout ({self.start_timeout:g} s)"
            if not missing:
                return f"{_who(report)} timed out in syncdp.init() after {limit}"
            if report.get("no_process"):
                return (
                    f"Open MPI started no process of the job within {limit}: its daemons "
                    "could not start on the hosts (--log-level DEBUG shows mpirun's command)"
                )
            return f"{ranks_text(missing)} never reached syncdp.init() within {limit}"
        if kind == "lost":
            host = report.get("host")
            return (
                f"{ranks_text(ranks)} (on {host}) fell silent: no word from {host} for "
                f"{report.get('seconds', 0):.0f} s (host unreachable, or its daemon lost)"
            )
        if kind == "elastic_abort":
            return f"elastic mode could not go on: {report.get('message')}"
        if kind == "exit_before_init":
            them = (
                f"{ranks_text(ranks)} {'waits' if len(ranks) == 1 else 'wait'}"
                if ranks
                else "other ranks wait"
            )
            return (
                f"{_who(report)} exited with code {report.get('code', 0)} before it reached "
                f"syncdp.init(), where {them} for it: every rank must call init()"
            )
        if kind == "exit_early":
            waiting = "other ranks wait"
            if ranks:
                waiting = f"{ranks_text(ranks)} {'waits' if len(ranks) == 1 else 'wait'}"
            how = "finished its program"
            with self._lock:
                ended = self.exits.get(report.get("rank"))
            # A process that vanished (os._exit) is reported by a waiting rank, with "gone";
            # one that left through syncdp's exit handshake reports itself and ends by abort.
            if report.get("gone") and ended is not None and not ended.get("signal"):
                how = f"exited (code {ended.get('code') or 0})"
            if report.get("shut_down"):
                how = "shut syncdp down (shutdown())"
            place = ""
            if report.get("collective"):
                place = f" in collective #{report.get('seq')} {report['collective']}"
            return f"{_who(report)} {how} while {waiting} for it{place}"
        code = -report["signal"] if report.get("signal") else report.get("code") or 0
        return f"{_who(report)} {describe_exit(code)}"


def _by_host(ranks: list[int], links: Mapping[int, Link]) -> list[tuple[str, list[int]]]:
    hosts: dict[str, list[int]] = {}
    for r in ranks:
        hosts.setdefault(links[r].host or "an unknown host", []).append(r)
    return sorted(hosts.items())


def _error_line(report: Mapping[str, Any]) -> str:
    """An exception report's message in one line: ``Type: text``.

    A multi-line message ends with what went wrong (TensorFlow's "TypeError: in user code:"
    puts the traceback of the traced function between its first line and the error's own
    message, on the last line), so the last line is the one kept, with its type in front.
    """
    kind = report.get("type") or "an exception"
    lines = [line.strip() for line in (report.get("message") or "").splitlines() if line.strip()]
    if lines and lines[-1].startswith("[... cut"):
        return lines[0]  # the end was cut off: the first line is all there is
    if len(lines) <= 1:
        return lines[0] if lines else kind
    last = lines[-1]
    head, _, rest = last.partition(": ")
    names = head.split(".")
    if rest and all(n.isidentifier() for n in names) and names[-1][:1].isupper():
        return last  # the last line names its own type ("TypeError: ...")
    return f"{kind}: {last}"
