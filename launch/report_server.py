"""The launcher's end of the failure channel: it takes the job's reports and nothing else.

Ranks and their supervisors send one signed line per report (:mod:`syncdp.core.report`). The
server, one thread around a selector:

- listens on one address only: loopback for a job on this host, the job's interface otherwise
  (the caller chooses; :func:`launch.hosts.job_address`);
- keeps at most ``max_connections`` connections open (more wait in the listen queue), closes a
  connection idle for 5 s, and never buffers more than one line of
  :data:`~syncdp.core.report.MAX_LINE_BYTES`;
- hands each report whose HMAC checks, that names this job and whose nonce is new to the
  callback, and answers ``ok``; every other line is dropped and counted by reason in
  :attr:`ReportServer.rejected` (the launcher says how many at the end).

A forged ``exception`` report, a replayed report of another job, or a flood of junk therefore
changes nothing in the job's verdict.
"""

from __future__ import annotations

import collections
import selectors
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence

from syncdp.core import report

__all__ = ["ReportServer", "describe_rejected"]

# A sender writes its line at once; a connection silent this long is closed.
_IDLE_SECONDS = 5.0
# While closing, reports already sent are read until the connections fall quiet, but no longer
# than this (a sender that never stops must not hold up the launcher's exit).
_DRAIN_SECONDS = 2.0
_POLL_SECONDS = 0.1


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
        self._seen: set[str] = set()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="syncdp-reports", daemon=True)

    def start(self, on_report: Callable[[dict], None]) -> ReportServer:
        """Starts passing every authentic report to ``on_report``; returns self."""
        self._on_report = on_report
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
        conns: dict[socket.socket, list] = {}  # conn -> [unread bytes, time of last data]
        listening = True
        quiet_since = None
        while True:
            events = selector.select(_POLL_SECONDS)
            now = time.monotonic()
            for key, _ in events:
                if key.fileobj is self._sock:
                    self._accept(selector, conns, now)
                else:
                    self._read(selector, conns, key.fileobj, now)
            for conn, (_, last) in list(conns.items()):
                if now - last > _IDLE_SECONDS:
                    self._drop(selector, conns, conn)
            full = len(conns) >= self.max_connections
            if full and listening:
                selector.unregister(self._sock)  # the rest wait in the listen queue
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
        while len(conns) < self.max_connections:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            conn.setblocking(False)
            conns[conn] = [bytearray(), now]
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
            if state[0].strip():
                self.rejected["cut off mid-line"] += 1
            self._drop(selector, conns, conn)
            return
        buffer = state[0]
        buffer += data
        state[1] = now
        while True:
            end = buffer.find(b"\n")
            if end < 0:
                break
            line = bytes(buffer[: end + 1])
            del buffer[: end + 1]
            if self._take(line):
                try:
                    conn.send(report.ACK)
                except OSError:
                    pass
        if len(buffer) > report.MAX_LINE_BYTES:
            self.rejected["too long"] += 1
            self._drop(selector, conns, conn)

    def _take(self, line: bytes) -> bool:
        """Passes on the report in ``line`` if it is authentic; counts it otherwise."""
        try:
            got = report.decode(line, self.job)
        except report.Rejected as e:
            self.rejected[e.reason] += 1
            return False
        nonce = str(got.get("nonce"))
        if nonce in self._seen:
            self.rejected["replayed"] += 1
            return False
        self._seen.add(nonce)
        self.accepted += 1
        try:
            self._on_report(got)
        except Exception:  # the launcher must keep listening whatever one report does
            traceback.print_exc(file=sys.stderr)
        return True

    @staticmethod
    def _drop(selector, conns, conn: socket.socket) -> None:
        conns.pop(conn, None)
        try:
            selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()


def describe_rejected(rejected: Mapping[str, int]) -> str | None:
    """``rejected 3 reports that were not this job's (2 bad signature, 1 too long)``; None
    when nothing was rejected."""
    total = sum(rejected.values())
    if not total:
        return None
    reasons = ", ".join(f"{n} {why}" for why, n in sorted(rejected.items(), key=lambda i: -i[1]))
    noun = "report" if total == 1 else "reports"
    return f"rejected {total} {noun} that did not prove to be this job's ({reasons})"
