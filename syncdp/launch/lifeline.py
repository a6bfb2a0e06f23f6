"""The lifeline: every supervisor holds a connection to the launcher, and each watches the other.

The job must not outlive its launcher, however the launcher ends (SIGKILL included, when it can
clean up nothing), and the launcher must know which ranks' hosts went quiet. So the launcher
listens at ``SYNCDP_LIFELINE_ADDR`` (:class:`LifelineServer`), and every supervisor
(:mod:`syncdp.launch.worker`), on every host, connects before it starts its rank and keeps the
connection (:class:`Lifeline`):

- its first line is a signed ``lifeline`` report (:mod:`syncdp.watch.report`: rank, host, the
  rank's pid), so only the job's supervisors count; then both ends send a byte a second;
- the supervisor takes the launcher as gone when its address refuses connections (the kernel
  closes the launcher's sockets the moment its process ends, whatever killed it), or when it has
  heard nothing for ``lost_after`` seconds *and* the launcher's address no longer accepts
  connections (a link cut between hosts). One closed or reset connection proves neither: the
  supervisor connects again at once and sends its signed line again. A launcher that is merely
  stopped (Ctrl-Z) still accepts, so its job waits for it. The supervisor then ends its rank's
  process group and Open MPI's daemon above it (:func:`syncdp.launch.worker.main`);
- the launcher records, per rank, when the supervisor connected, when it was last heard from
  and whether its connection closed; the verdict (:mod:`syncdp.launch.verdict`) names from this why
  a rank never reported how it ended (supervisor killed, host unreachable, never started). When
  a host's supervisors stay silent for ``lost_after`` seconds (the time after which they give
  up on the launcher too), the launcher is told once per host (``on_lost``) and ends the job:
  those ranks will never report, and Open MPI may wait for their daemon for a long time.
  A launcher that was itself stopped (Ctrl-Z) judges no silence from the time it was stopped;
- anyone on the host can connect to the launcher's port: a connection has
  :data:`_HELLO_SECONDS` to show it is the job's, and when :data:`_MAX_PENDING` have not yet,
  the oldest of them makes room for a new one, so connections that prove nothing never keep a
  supervisor out.
- in elastic mode a silent host is not a reason to end the job but to start it again without
  that host (:mod:`syncdp.launch.restart`), after :data:`ELASTIC_LOST_SECONDS` whatever the stall
  timeout; the supervisors there give up on the launcher as soon.
"""

from __future__ import annotations

import collections
import dataclasses
import resource
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence

from syncdp.base import settings
from syncdp.watch import report

__all__ = [
    "LIFELINE_VAR",
    "ELASTIC_LOST_SECONDS",
    "Link",
    "LifelineServer",
    "Lifeline",
    "lost_after",
]

LIFELINE_VAR = "SYNCDP_LIFELINE_ADDR"
# Each end sends a byte this often.
_BEAT_SECONDS = 1.0
# A connection must show it is the job's (its signed first line) within this long.
_HELLO_SECONDS = 10.0
# Most connections at once that have not yet shown they are the job's.
_MAX_PENDING = 64
# A supervisor whose connection closed connects again after this pause, doubling up to a beat.
_RECONNECT_FIRST_PAUSE = 0.05
# The launcher calls a link silent past this long without a byte.
_SILENT_SECONDS = 3.0
# Either end gives up on the other after the stall timeout of silence, but never sooner.
_LOST_MIN_SECONDS = 10.0


# In elastic mode a silent host is not waited for: the job starts again without it
# (syncdp.launch.restart) after this long, and the supervisors there give up as soon.
ELASTIC_LOST_SECONDS = _LOST_MIN_SECONDS


def lost_after(stall_timeout: float) -> float:
    """Seconds of silence after which either end of a lifeline gives up on the other (outside
    elastic mode; in it, :data:`ELASTIC_LOST_SECONDS`)."""
    return max(_LOST_MIN_SECONDS, stall_timeout)


def _elastic() -> bool:
    """Whether this supervisor's job runs in elastic mode (from the job's settings)."""
    try:
        return settings.from_env_or_default().elastic
    except Exception:  # noqa: BLE001 - a bad setting is the rank's to report, not ours
        return False


@dataclasses.dataclass
class Link:
    """What the launcher knows of one supervisor's lifeline.

    Attributes:
        rank: The rank the supervisor runs.
        host: Its host.
        pid: The rank's process id (None if its program could not start).
        connected: ``time.monotonic()`` when its signed first line arrived.
        last_heard: ``time.monotonic()`` of the last byte from it.
        closed: ``time.monotonic()`` when its connection closed, or None while open.
        address: The address its connection came from (one of its host's addresses), or None.
    """

    rank: int | None
    host: str | None
    pid: int | None
    connected: float
    last_heard: float
    closed: float | None = None
    address: str | None = None

    def silent_for(self, now: float | None = None) -> float:
        """Seconds since the supervisor was last heard from."""
        return (time.monotonic() if now is None else now) - self.last_heard

    def silent(self, now: float | None = None) -> bool:
        """Whether the connection is open but nothing came for a while (host unreachable?)."""
        return self.closed is None and self.silent_for(now) > _SILENT_SECONDS


def _raise_open_files_limit() -> None:
    """Every supervisor holds a connection: allow as many files as the hard limit does."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError):
        pass


class LifelineServer:
    """The launcher's end: accepts the supervisors' lifelines, beats, and records each link.

    Args:
        job: The job whose secret signs the supervisors' first lines.
        host: The address to listen on. Defaults to ``"127.0.0.1"``.
        advertise: The address, or addresses in the order to try them, supervisors are told to
            use. Defaults to ``host``.

    Attributes:
        address: ``host:port`` (or several, comma-separated) for ``SYNCDP_LIFELINE_ADDR``.
        rejected: Connections dropped, by reason, like the report server's.
    """

    def __init__(
        self,
        job: report.Job,
        *,
        host: str = "127.0.0.1",
        advertise: str | Sequence[str] | None = None,
    ):
        _raise_open_files_limit()
        self.job = job
        self.lost_after: float | None = None
        self.on_lost: Callable[[str | None, list[Link]], None] | None = None
        self.rejected: collections.Counter[str] = collections.Counter()
        self._sock = socket.create_server((host, 0), backlog=1024)
        self._sock.setblocking(False)
        self.address = report.join_address(advertise or host, self._sock.getsockname()[1])
        self._links: list[Link] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="syncdp-lifeline", daemon=True)

    def start(
        self,
        *,
        lost_after: float | None = None,
        on_lost: Callable[[str | None, list[Link]], None] | None = None,
    ) -> LifelineServer:
        """Starts accepting and beating; returns self.

        Args:
            lost_after: Seconds of silence after which a supervisor counts as lost, or None
                for never. Defaults to None.
            on_lost: Called from the server's thread with a host and its links that fell
                silent past ``lost_after`` (once per link). Defaults to None.
        """
        self.lost_after, self.on_lost = lost_after, on_lost
        self._thread.start()
        return self

    def close(self) -> None:
        """Closes every lifeline (supervisors still running then end their ranks)."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()
        self._sock.close()

    def links(self) -> dict[int, Link]:
        """The latest link of each rank, by rank (a copy)."""
        with self._lock:
            return {
                link.rank: dataclasses.replace(link)
                for link in self._links
                if isinstance(link.rank, int)
            }

    # --- The server thread. ---

    def _serve(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._sock, selectors.EVENT_READ)
        pending: dict[socket.socket, list] = {}  # conn -> [bytes so far, time accepted]
        open_links: dict[socket.socket, Link] = {}
        next_beat = 0.0
        previous = time.monotonic()
        lost: set[int] = set()  # id() of the links already reported lost
        while not self._stopping.is_set():
            now = time.monotonic()
            if now - previous > 2 * _BEAT_SECONDS:
                # This process was stopped (or starved): the silence is its own, not theirs.
                with self._lock:
                    for link in open_links.values():
                        link.last_heard = max(link.last_heard, now)
            previous = now
            # New connections last: one already here shows its first line before any of them
            # can crowd it out.
            events = selector.select(min(_BEAT_SECONDS, 0.2))
            for key, _ in sorted(events, key=lambda event: event[0].fileobj is self._sock):
                conn = key.fileobj
                if conn is self._sock:
                    self._accept(selector, pending, now)
                elif conn in pending:
                    self._hello(selector, pending, open_links, conn, now)
                else:
                    self._heard(selector, open_links, conn, now)
            for conn, (_, since) in list(pending.items()):
                if now - since > _HELLO_SECONDS:
                    self.rejected["lifeline without a signed first line"] += 1
                    self._drop(selector, conn)
                    del pending[conn]
            if now >= next_beat:
                next_beat = now + _BEAT_SECONDS
                for conn in list(open_links):
                    try:
                        conn.send(b"\n")
                    except (BlockingIOError, InterruptedError):
                        pass  # a full buffer: the host is slow or gone; its silence tells
                    except OSError:
                        self._closed(selector, open_links, conn, now)
                self._check_silence(open_links, lost, now)
        for conn in [*pending, *open_links]:
            self._drop(selector, conn)
        selector.close()

    def _check_silence(self, open_links: dict, lost: set[int], now: float) -> None:
        if self.on_lost is None or self.lost_after is None:
            return
        hosts = {
            link.host
            for link in open_links.values()
            if id(link) not in lost and link.silent_for(now) >= self.lost_after
        }
        for host in hosts:
            # The host's other silent links too: they went quiet together, a beat apart, and
            # the verdict names all of the host's ranks at once.
            links = [
                link
                for link in open_links.values()
                if link.host == host
                and id(link) not in lost
                and (link.silent(now) or link.silent_for(now) >= self.lost_after)
            ]
            lost.update(id(link) for link in links)
            self.on_lost(host, links)

    def _accept(self, selector, pending, now: float) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            if len(pending) >= _MAX_PENDING:
                # The oldest connection accepted before this round that has not shown it is
                # the job's makes room (a supervisor sends its first line at once).
                older = [c for c, (_, since) in pending.items() if since < now]
                if not older:
                    self.rejected["too many connections"] += 1
                    conn.close()
                    continue
                oldest = min(older, key=lambda c: pending[c][1])
                self.rejected["crowded out before a signed first line"] += 1
                self._drop(selector, oldest)
                del pending[oldest]
            conn.setblocking(False)
            pending[conn] = [bytearray(), time.monotonic()]
            selector.register(conn, selectors.EVENT_READ)

    def _hello(self, selector, pending, open_links, conn, now: float) -> None:
        buffer = pending[conn][0]
        try:
            data = conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        buffer += data
        end = buffer.find(b"\n")
        if not data or end < 0:
            if not data or len(buffer) > report.MAX_LINE_BYTES:
                if buffer:  # a supervisor's probe (connect, close) sends nothing: not counted
                    self.rejected["lifeline without a signed first line"] += 1
                del pending[conn]
                self._drop(selector, conn)
            return
        del pending[conn]
        try:
            hello = report.decode(bytes(buffer[: end + 1]), self.job)
        except report.Rejected as e:
            self.rejected[e.reason] += 1
            self._drop(selector, conn)
            return
        if hello.get("kind") != "lifeline":
            self.rejected["malformed"] += 1
            self._drop(selector, conn)
            return
        try:
            address = conn.getpeername()[0]
        except (OSError, IndexError):
            address = None
        link = Link(hello.get("rank"), hello.get("host"), hello.get("pid"), now, now)
        link.address = address
        open_links[conn] = link
        with self._lock:
            self._links.append(link)

    def _heard(self, selector, open_links, conn, now: float) -> None:
        try:
            data = conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            with self._lock:
                open_links[conn].last_heard = now
        else:
            self._closed(selector, open_links, conn, now)

    def _closed(self, selector, open_links, conn, now: float) -> None:
        link = open_links.pop(conn, None)
        if link is not None:
            with self._lock:
                link.closed = now
        self._drop(selector, conn)

    @staticmethod
    def _drop(selector, conn: socket.socket) -> None:
        try:
            selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()


class Lifeline:
    """A supervisor's end: holds the connection, beats, and calls back when the launcher is gone.

    Use :meth:`connect` before starting the rank (no launcher: start nothing), then
    :meth:`start` once the rank runs.
    """

    def __init__(self, sock: socket.socket, address: str, job: report.Job):
        self._sock = sock
        self._address = address
        self._job = job
        self._hello: dict | None = None

    @classmethod
    def connect(cls, address: str, job: report.Job, timeout: float = 10.0) -> Lifeline:
        """Connects to the launcher's lifeline at ``address`` (``host:port``, or several,
        comma-separated: the first that answers, :func:`syncdp.watch.report.connect`).

        Raises:
            OSError: The launcher cannot be reached (it is gone, or the address is wrong).
        """
        sock = report.connect(address, timeout)
        return cls(sock, address, job)

    def start(
        self,
        rank: int | None,
        pid: int | None,
        *,
        lost_after: float,
        on_lost: Callable[[str], None],
    ) -> None:
        """Sends the signed first line, then watches the launcher from a daemon thread.

        Args:
            rank: This supervisor's rank.
            pid: Its rank's process id.
            lost_after: Seconds of silence (with the launcher's address refusing connections)
                after which the launcher counts as gone; in elastic mode at most
                :data:`ELASTIC_LOST_SECONDS` (the launcher has restarted the job without this
                host by then).
            on_lost: Called once, from the watching thread, with the reason in words.
        """
        if _elastic():
            lost_after = min(lost_after, ELASTIC_LOST_SECONDS)
        self._hello = report.make("lifeline", rank, pid=pid)
        try:
            self._sock.sendall(report.encode(self._hello, self._job))
            sent = True
        except OSError:
            sent = False  # the watch connects again: one closed connection proves nothing
        threading.Thread(
            target=self._watch,
            args=(lost_after, on_lost, sent),
            name="syncdp-lifeline",
            daemon=True,
        ).start()

    def _watch(self, lost_after: float, on_lost: Callable[[str], None], sent: bool) -> None:
        sock = self._sock
        try:
            sock.settimeout(_BEAT_SECONDS)
        except OSError:  # closed before this thread began: this supervisor is ending
            return
        last_heard = last_sent = time.monotonic()
        broken = not sent
        while True:
            if broken:
                sock.close()
                sock, why = self._reconnect(last_heard, lost_after)
                if sock is None:
                    return on_lost(why)
                self._sock, broken = sock, False
            now = time.monotonic()
            if now - last_sent >= _BEAT_SECONDS:
                last_sent = now
                try:
                    sock.send(b"\n")
                except TimeoutError:
                    pass
                except OSError:
                    if sock.fileno() < 0:
                        return  # closed here: this supervisor is ending
                    broken = True
                    continue
            try:
                data = sock.recv(4096)
            except TimeoutError:
                data = None
            except OSError:
                data = b""
            if data == b"" and sock.fileno() < 0:
                return  # closed here: this supervisor is ending
            if data == b"":  # closed or reset: the launcher may be gone, or may not
                broken = True
                continue
            now = time.monotonic()
            if data:
                last_heard = now
            elif now - last_heard >= lost_after and not self._answers():
                return on_lost(
                    f"no word from the launcher at {self._address} for "
                    f"{now - last_heard:.0f} s, and it no longer answers"
                )

    def _reconnect(self, last_heard: float, lost_after: float) -> tuple[socket.socket | None, str]:
        """A new lifeline connection with the signed first line sent, or None and why the
        launcher is gone: its address refuses connections, or nothing came from it for
        ``lost_after`` seconds and no connection can be made."""
        pause = _RECONNECT_FIRST_PAUSE
        while True:
            try:
                sock = report.connect(self._address, _BEAT_SECONDS)
                sock.sendall(report.encode(self._hello, self._job))
                sock.settimeout(_BEAT_SECONDS)
                return sock, ""
            except ConnectionRefusedError:
                return None, "the launcher ended (its lifeline connection closed)"
            except (OSError, ValueError):
                pass
            silent = time.monotonic() - last_heard
            if silent >= lost_after:
                return None, (
                    f"no word from the launcher at {self._address} for {silent:.0f} s, and it "
                    "no longer answers"
                )
            time.sleep(pause)
            pause = min(2 * pause, _BEAT_SECONDS)

    def _answers(self) -> bool:
        try:
            with report.connect(self._address, _BEAT_SECONDS):
                return True
        except (OSError, ValueError):
            return False
