"""The launcher's end of the failure channel: it takes the job's reports and nothing else.

Ranks and their supervisors send one signed line per report (:mod:`syncdp.watch.report`). The
server, one thread around a selector:

- listens on one address only: loopback for a job on this host, the job's interface otherwise
  (the caller chooses; :func:`syncdp.launch.hosts.job_address`);
- keeps at most ``max_connections`` connections open and never buffers more than one line of
  :data:`~syncdp.watch.report.MAX_LINE_BYTES`;
- gives a connection :data:`_FIRST_LINE_SECONDS` to deliver a signed line, however it trickles
  bytes meanwhile, and when every slot is taken, makes room for a new connection by closing the
  oldest one that has not delivered one yet: anyone on the host can connect, but connections
  that prove nothing never keep the job's own reports out (senders retry, with backoff,
  :func:`syncdp.watch.report.send`);
- hands each report whose HMAC checks, that names this job and whose nonce is new to the
  callback, and answers ``ok``; a sender's retry of a report already taken (the same line, whose
  answer it missed) is answered ``ok`` again and not passed on; every other line is dropped and
  counted by reason in :attr:`ReportServer.rejected` (the launcher says how many at the end)
  and answered ``no``, so that its sender stops trying;
- answers a request (a report whose kind is one of ``answers``, :meth:`ReportServer.start`)
  with ``ok`` and the data it asks for on the same line: a process that elastic mode spawns on
  another host asks for the job's environment this way (``job_env``,
  :func:`syncdp.watch.report.ask`), so it never rides on a command line.

A forged ``exception`` report, a replayed report of another job, or a flood of junk therefore
changes nothing in the job's verdict.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import selectors
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence

from syncdp.watch import report

__all__ = ["ReportServer", "describe_rejected"]

# A sender writes its line at once: a connection that has not delivered a signed line this long
# after it was accepted is closed, whatever it sent meanwhile.
_FIRST_LINE_SECONDS = 5.0
# A sender whose report was taken closes its end; one silent this long is closed here.
_IDLE_SECONDS = 5.0
# An answer longer than the socket's buffer is sent within this long (only to the job's own
# processes: a request is answered once its signature checks).
_ANSWER_SECONDS = 5.0
# While closing, reports already sent are read until the connections fall quiet, but no longer
# than this (a sender that never stops must not hold up the launcher's exit).
_DRAIN_SECONDS = 2.0
_POLL_SECONDS = 0.1


@dataclasses.dataclass
class _Conn:
    """One connection: when it was accepted and last heard from, and what it sent."""

    opened: float
    last: float
    buffer: bytearray = dataclasses.field(default_factory=bytearray)
    received: int = 0
    proved: bool = False  # it delivered a report of this job


class ReportServer:
    """Listens for one job's reports and passes the authentic ones on.

    The address exists from construction, so it can go into the ranks' environment before
    :meth:`start`.

    Args:
        job: The job whose secret signs its reports.
        host: The address to listen on. Defaults to ``"127.0.0.1"``.
        advertise: The address, or addresses in the order to try them, the ranks are told to
            use. Defaults to ``host``.
        max_connections: Most connections open at once. Defaults to 64.

    Attributes:
        address: ``host:port`` (or several, comma-separated) for ``SYNCDP_REPORT_ADDR``.
        rejected: Lines dropped, by reason (``bad signature``, ``too long``, ...).
        accepted: How many reports were taken.
    """

    def __init__(
        self,
        job: report.Job,
        *,
        host: str = "127.0.0.1",
        advertise: str | Sequence[str] | None = None,
        max_connections: int = 64,
    ):
        self.job = job
        self.max_connections = max_connections
        self.rejected: collections.Counter[str] = collections.Counter()
        self.accepted = 0
        self._sock = socket.create_server((host, 0), backlog=1024)
        self._sock.setblocking(False)
        self.address = report.join_address(advertise or host, self._sock.getsockname()[1])
        self._on_report: Callable[[dict], None] = lambda r: None
        self._answers: Mapping[str, bytes] = {}
        self._seen: dict[str, bytes] = {}  # nonce -> digest of the line that carried it
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="syncdp-reports", daemon=True)

    def start(
        self, on_report: Callable[[dict], None], answers: Mapping[str, bytes] | None = None
    ) -> ReportServer:
        """Starts passing every authentic report to ``on_report``; returns self.

        Args:
            on_report: Called, on the server's thread, with each report taken.
            answers: Request kind -> the data (one line's worth, no newline) that an authentic
                report of that kind is answered with, after ``ok`` and a space. Defaults to
                none.
        """
        self._on_report = on_report
        self._answers = dict(answers or {})
        self._thread.start()
        return self

    def close(self) -> None:
        """Reads the reports already sent, then stops listening."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()
        self._sock.close()

    # --- The server thread. ---

    def _serve(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._sock, selectors.EVENT_READ)
        conns: dict[socket.socket, _Conn] = {}
        listening = True
        quiet_since = None
        while True:
            events = selector.select(_POLL_SECONDS)
            now = time.monotonic()
            for key, _ in events:
                if key.fileobj is not self._sock:
                    self._read(selector, conns, key.fileobj, now)
            for key, _ in events:  # after the reads: a line already here is never crowded out
                if key.fileobj is self._sock:
                    self._accept(selector, conns, now)
            for conn, state in list(conns.items()):
                if not state.proved and now - state.opened > _FIRST_LINE_SECONDS:
                    if state.buffer or state.received:
                        self.rejected[f"no signed line within {_FIRST_LINE_SECONDS:g} s"] += 1
                    self._drop(selector, conns, conn)
                elif state.proved and now - state.last > _IDLE_SECONDS:
                    self._drop(selector, conns, conn)
            # Full of connections that all proved to be the job's: the rest wait in the listen
            # queue. Otherwise accept, crowding out the oldest that proved nothing.
            full = len(conns) >= self.max_connections and all(c.proved for c in conns.values())
            if full and listening:
                selector.unregister(self._sock)
            elif not full and not listening:
                selector.register(self._sock, selectors.EVENT_READ)
            listening = not full
            if self._stopping.is_set():
                quiet_since = quiet_since or now
                if not events or now - quiet_since > _DRAIN_SECONDS:
                    break
        for conn in list(conns):
            self._drop(selector, conns, conn)
        selector.close()

    def _accept(self, selector, conns, now: float) -> None:
        # A few at a time, and never crowding out a connection accepted in this round: each
        # one gets a read (its line is usually there already) before it can be crowded out.
        for _ in range(max(1, self.max_connections // 4)):
            if len(conns) >= self.max_connections:
                unproved = [
                    (c.opened, conn) for conn, c in conns.items() if not c.proved and c.opened < now
                ]
                if not unproved:
                    return
                _, oldest = min(unproved, key=lambda item: item[0])
                self.rejected["crowded out before a signed line"] += 1
                self._drop(selector, conns, oldest)
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            conn.setblocking(False)
            conns[conn] = _Conn(opened=now, last=now)
            selector.register(conn, selectors.EVENT_READ)

    def _read(self, selector, conns, conn: socket.socket, now: float) -> None:
        state = conns.get(conn)
        if state is None:
            return
        try:
            data = conn.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            if state.buffer.strip():
                self.rejected["cut off mid-line"] += 1
            self._drop(selector, conns, conn)
            return
        buffer = state.buffer
        buffer += data
        state.last = now
        state.received += len(data)
        while True:
            end = buffer.find(b"\n")
            if end < 0:
                break
            line = bytes(buffer[: end + 1])
            del buffer[: end + 1]
            taken = self._take(line)
            state.proved = state.proved or taken is not None
            self._reply(conn, taken)
        if len(buffer) > report.MAX_LINE_BYTES:
            self.rejected["too long"] += 1
            self._drop(selector, conns, conn)

    def _take(self, line: bytes) -> dict | None:
        """Passes on the report in ``line`` if it is authentic and returns it; counts it and
        returns None otherwise."""
        try:
            got = report.decode(line, self.job)
        except report.Rejected as e:
            self.rejected[e.reason] += 1
            return None
        nonce = str(got.get("nonce"))
        if nonce in self._seen:
            # The same signed line again: a sender that missed the answer retries (a report is
            # taken once); anything else reusing a nonce is a replay.
            if self._seen[nonce] == _digest(line):
                return got
            self.rejected["replayed"] += 1
            return None
        self._seen[nonce] = _digest(line)
        self.accepted += 1
        try:
            self._on_report(got)
        except Exception:  # the launcher must keep listening whatever one report does
            traceback.print_exc(file=sys.stderr)
        return got

    def _reply(self, conn: socket.socket, taken: dict | None) -> None:
        """Answers ``no``, ``ok``, or ``ok DATA`` to a request ``answers`` knows."""
        kind = taken.get("kind") if taken is not None else None
        answer = self._answers.get(kind) if isinstance(kind, str) else None
        try:
            if answer is None:
                conn.send(report.ACK if taken is not None else report.NACK)
                return
            conn.settimeout(_ANSWER_SECONDS)  # blocking, bounded: the asker reads at once
            try:
                conn.sendall(report.ACK[:-1] + b" " + answer + b"\n")
            finally:
                conn.setblocking(False)
        except OSError:
            pass

    @staticmethod
    def _drop(selector, conns, conn: socket.socket) -> None:
        conns.pop(conn, None)
        try:
            selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()


def _digest(line: bytes) -> bytes:
    return hashlib.sha256(line.rstrip(b"\r\n")).digest()


def describe_rejected(rejected: Mapping[str, int]) -> str | None:
    """``rejected 3 reports that were not this job's (2 bad signature, 1 too long)``; None
    when nothing was rejected."""
    total = sum(rejected.values())
    if not total:
        return None
    reasons = ", ".join(f"{n} {why}" for why, n in sorted(rejected.items(), key=lambda i: -i[1]))
    noun = "report" if total == 1 else "reports"
    return f"rejected {total} {noun} that did not prove to be this job's ({reasons})"
