"""The failure channel: ranks tell the launcher what happened, as data, and prove who they are.

Under ``syncdp-run`` every rank finds ``SYNCDP_REPORT_ADDR=host:port`` in its environment: the
launcher listens there. Where the launcher cannot tell which of its addresses the ranks reach
(host names that resolve nowhere on its host), it gives several, ``a:port,b:port``, and
:func:`connect` takes the first that answers. A report is one JSON object on one line::

    {"kind": "stall", "rank": 0, "host": "node3", "pid": 4242, "time": 1795433058.9,
     "message": "collective #23 gradients.bucket0 waited 60.0 s ...", "ranks": [1]}

Its ``kind`` says what happened; the launcher reads the fields and never parses the message:

    started        the rank reached ``init()`` (the launcher counts arrivals against
                   ``--start-timeout``)
    exception      an exception escaped on the rank (``message``: its type and text)
    stall          a collective waited past the stall timeout; ``ranks`` did not arrive
    start_timeout  not every rank reached ``init()`` in time; ``ranks`` lists the ones that
                   did not, when this rank can tell (empty otherwise)
    exit_early     the rank finished its program while ``ranks`` wait for it in a collective
    trained        rank 0, elastic mode: every rank finished training (``elastic.run``
                   returned), so a host lost from now on needs no restart
    exit           written by the rank's supervisor (``syncdp.launch.worker``): the program ended;
                   ``code`` (exit status) or ``signal`` (number); ``requested`` is true when
                   it was stopped because the job was ending
    lifeline       written by the supervisor on its lifeline connection
                   (``syncdp.launch.lifeline``): this rank's program started with ``pid``
    job_env        a request (:func:`ask`), from the supervisor of a process elastic mode
                   spawned: the launcher answers ``ok`` and the environment it gave the job's
                   first ranks, as JSON on the same line

Every report proves it comes from this job. The launcher makes a random secret and a job id for
each job and gives them only to the job's processes, in their environment
(``SYNCDP_REPORT_SECRET``, ``SYNCDP_JOB_ID``; never on a command line or in a file). A report
carries the job id and a random nonce, and travels as ``MAC JSON`` where MAC is the hex
HMAC-SHA256 of the job id and the JSON text under the secret. The launcher drops (and counts) a
line whose MAC does not check, that names another job, that repeats a nonce, or that is longer
than :data:`MAX_LINE_BYTES`, and answers ``no``; it answers ``ok`` to each report it took, so
:func:`send` knows it was delivered. Until one of the two answers comes, :func:`send` tries
again with growing pauses (anyone on the host can open connections to the launcher's port; the
launcher makes room for the job's own), the same line, which the launcher takes only once.

Without the launcher (plain ``mpirun``) there is no address and :func:`send` only returns; the
same words are printed to stderr by the caller either way.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import hmac
import json
import os
import secrets
import select
import socket
import time
from collections.abc import Mapping, Sequence

__all__ = [
    "ADDRESS_VAR",
    "SECRET_VAR",
    "JOB_VAR",
    "MAX_LINE_BYTES",
    "ACK",
    "NACK",
    "Job",
    "Rejected",
    "make",
    "encode",
    "decode",
    "connect",
    "join_address",
    "send",
    "ask",
]

ADDRESS_VAR = "SYNCDP_REPORT_ADDR"
SECRET_VAR = "SYNCDP_REPORT_SECRET"
JOB_VAR = "SYNCDP_JOB_ID"
# The longest line the launcher reads; a report's message is cut to fit well within it.
MAX_LINE_BYTES = 64 * 1024
_MAX_MESSAGE_CHARS = 16 * 1024
# Each try to deliver a report waits this long to connect, then for the launcher's answer.
_CONNECT_SECONDS = 2.0
_REPLY_SECONDS = 3.0
# A report the launcher has not answered is sent again, after pauses that grow from the first to
# the last, for this long in all: connections that prove nothing (anyone on the host can open
# them) may crowd the launcher's port for a moment, and the launcher's server makes room.
_PATIENCE_SECONDS = 15.0
_FIRST_PAUSE_SECONDS, _LAST_PAUSE_SECONDS = 0.05, 2.0
# What the launcher answers to each report it took, and to each line it read and refused.
ACK = b"ok\n"
NACK = b"no\n"
# The longest answer to a request (ask) read: an environment, bounded by Linux well below this.
_MAX_ANSWER_BYTES = 16 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Job:
    """What makes one job's reports its own: its id (not secret) and its secret.

    Attributes:
        id: Random text naming the job; bound into every report's MAC.
        secret: The HMAC key, random per job; only the job's processes have it.
    """

    id: str
    secret: str = dataclasses.field(repr=False)

    @classmethod
    def new(cls) -> Job:
        """A fresh job: a new id and a new 256-bit secret."""
        return cls(secrets.token_hex(8), secrets.token_hex(32))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Job | None:
        """The job this process belongs to, from its environment; None without a launcher."""
        environ = os.environ if environ is None else environ
        if JOB_VAR not in environ or SECRET_VAR not in environ:
            return None
        return cls(environ[JOB_VAR], environ[SECRET_VAR])

    def env(self) -> dict[str, str]:
        """The variables that give a process this job (for the launcher to set)."""
        return {JOB_VAR: self.id, SECRET_VAR: self.secret}

    def mac(self, body: bytes) -> str:
        """The hex HMAC-SHA256 of this job's id and ``body``."""
        return hmac.new(
            self.secret.encode(), self.id.encode() + b"\n" + body, hashlib.sha256
        ).hexdigest()


class Rejected(ValueError):
    """A line is not a report of this job; ``reason`` says why in a few words."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def make(kind: str, rank: int | None, message: str = "", **fields) -> dict:
    """One report as a dict: kind, rank, host, pid, time, message and any extra fields."""
    return {
        "kind": kind,
        "rank": rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "time": time.time(),
        "message": message,
        **fields,
    }


def encode(report: Mapping, job: Job) -> bytes:
    """One report as its signed line: ``MAC JSON\\n``, with the job id and a nonce added.

    The message is cut to 16,000 characters (with a note), so that every report fits the
    launcher's line limit.
    """
    body = dict(report)
    message = body.get("message")
    if isinstance(message, str) and len(message) > _MAX_MESSAGE_CHARS:
        body["message"] = message[:_MAX_MESSAGE_CHARS] + "\n[... cut: the report was too long]"
    body["job"] = job.id
    body["nonce"] = secrets.token_hex(12)
    text = json.dumps(body, default=str).encode()
    return job.mac(text).encode() + b" " + text + b"\n"


def decode(line: bytes, job: Job) -> dict:
    """The report in a line that ``job``'s processes signed (:func:`encode`).

    Args:
        line: One line as received, with or without its newline.
        job: The job whose secret must have signed it.

    Returns:
        The report, a dict with at least ``kind`` and ``nonce``.

    Raises:
        Rejected: The line is too long, not ``MAC JSON``, its MAC does not check (forged, or
            from another job), it names another job, or it is not a report.
    """
    if len(line) > MAX_LINE_BYTES:
        raise Rejected("too long")
    mac, _, text = line.rstrip(b"\r\n").partition(b" ")
    if not text or len(mac) != 64 or mac.strip(b"0123456789abcdef"):
        raise Rejected("malformed")  # not "MAC JSON" at all
    if not hmac.compare_digest(mac, job.mac(text).encode()):
        raise Rejected("bad signature")
    try:
        report = json.loads(text)
    except ValueError:
        raise Rejected("malformed") from None
    if not isinstance(report, dict) or "kind" not in report or "nonce" not in report:
        raise Rejected("malformed")
    if report.get("job") != job.id:
        raise Rejected("another job")
    return report


# Per address list: the entry that answered last, tried alone first next time.
_ANSWERED: dict[str, tuple[str, int]] = {}


def _targets(address: str) -> list[tuple[str, int]]:
    """``"a:1,b:2"`` -> ``[("a", 1), ("b", 2)]``.

    Raises:
        ValueError: An entry is not ``host:port``.
    """
    targets = []
    for entry in address.split(","):
        host, _, port = entry.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{entry!r} is not host:port")
        targets.append((host, int(port)))
    return targets


def join_address(hosts: str | Sequence[str], port: int) -> str:
    """The address a rank is told: ``host:port``, or several, comma-separated, to try in turn.

    Args:
        hosts: One host (a name or address), or several in the order to try them.
        port: The port, the same on each.
    """
    hosts = [hosts] if isinstance(hosts, str) else list(hosts)
    return ",".join(f"{host}:{port}" for host in hosts)


def connect(address: str, timeout: float) -> socket.socket:
    """Connects to the first of ``address``'s ``host:port`` entries (comma-separated) that
    answers, trying them all at once: an address this host cannot route to fails at once, one
    that drops packets only at ``timeout``, and neither holds up the others.

    Args:
        address: ``host:port`` or ``host:port,host:port,...``.
        timeout: Seconds to wait for an answer; also the returned socket's timeout.

    Returns:
        The connected socket (blocking, with ``timeout``).

    Raises:
        ConnectionRefusedError: Every address refused the connection (nothing listens there).
        OSError: None answered; the message names each address and why.
        ValueError: ``address`` is not a list of ``host:port``.
    """
    targets = _targets(address)
    if len(targets) == 1:
        return socket.create_connection(targets[0], timeout=timeout)
    known = _ANSWERED.get(address)
    if known is not None:
        try:
            return socket.create_connection(known, timeout=min(timeout, _CONNECT_SECONDS))
        except OSError:
            pass  # it moved: try them all
    why: dict[tuple[str, int], str] = {}
    pending: dict[socket.socket, tuple[str, int]] = {}
    try:
        for target in targets:
            try:
                family, kind, proto, _, sockaddr = socket.getaddrinfo(
                    *target, type=socket.SOCK_STREAM
                )[0]
                sock = socket.socket(family, kind, proto)
            except OSError as e:
                why[target] = e.strerror or str(e)
                continue
            sock.setblocking(False)
            code = sock.connect_ex(sockaddr)
            if code in (0, errno.EINPROGRESS):
                pending[sock] = target
            else:
                why[target] = os.strerror(code)
                sock.close()
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            _, ready, _ = select.select([], list(pending), [], left)
            # Several at once: the first in the list wins, as it would in turn.
            for sock in sorted(ready, key=lambda s: targets.index(pending[s])):
                target = pending.pop(sock)
                code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if code == 0:
                    sock.setblocking(True)
                    sock.settimeout(timeout)
                    _ANSWERED[address] = target
                    return sock
                why[target] = os.strerror(code)
                sock.close()
        for target in pending.values():
            why[target] = f"no answer within {timeout:g} s"
    finally:
        for sock in pending:
            sock.close()
    refused = os.strerror(errno.ECONNREFUSED)
    every_refused = all(why.get(target) == refused for target in targets)
    raise (ConnectionRefusedError if every_refused else OSError)(
        "none of the launcher's addresses answered: "
        + ", ".join(f"{host}:{port} ({why.get((host, port), '?')})" for host, port in targets)
    )


def send(
    kind: str, rank: int | None, message: str = "", *, patience: float | None = None, **fields
) -> bool:
    """Sends one report to the launcher, if there is one; never raises.

    The report is sent again, the same signed line, until the launcher answers that it took it
    (it takes a line once, and answers a repeat again), with growing pauses, for at most
    ``patience`` seconds. A launcher that refuses connections is gone: no retry.

    Args:
        kind: What happened (see the module docstring).
        rank: The rank it is about.
        message: The human-readable text, as printed on stderr.
        patience: Seconds to keep trying. Defaults to 15.
        **fields: Extra data for that kind (``ranks``, ``code``, ``signal``...).

    Returns:
        Whether the launcher took the report (it answered that it did).
    """
    return _exchange(kind, rank, message, patience, False, fields) == ACK


def ask(kind: str, rank: int | None, *, patience: float | None = None, **fields):
    """Sends a request (a report the launcher answers with data) and returns the answer;
    never raises.

    Args:
        kind: What is asked for (``job_env``; see the module docstring).
        rank: The rank asking, if it has one.
        patience: Seconds to keep trying, as :func:`send`. Defaults to 15.
        **fields: Extra data for the request.

    Returns:
        The answer, decoded from JSON; None without a launcher, when it refused the request or
        never answered, or when it answered without data (one that does not know the request).
    """
    reply = _exchange(kind, rank, "", patience, True, fields)
    if reply is None or not reply.startswith(ACK[:-1] + b" "):
        return None
    try:
        return json.loads(reply[len(ACK) :])
    except ValueError:
        return None


def _exchange(kind, rank, message, patience, answered: bool, fields) -> bytes | None:
    """Delivers one signed report, trying again until the launcher answers (see :func:`send`);
    returns the answer's line, or None when there is no launcher or it never answered."""
    address = os.environ.get(ADDRESS_VAR)
    job = Job.from_env()
    if not address or job is None:
        return None
    try:
        line = encode(make(kind, rank, message, **fields), job)
    except ValueError:
        return None
    deadline = time.monotonic() + (_PATIENCE_SECONDS if patience is None else patience)
    pause = _FIRST_PAUSE_SECONDS
    while True:
        try:
            reply = _deliver(address, line, answered)
            if reply == NACK or reply.startswith(ACK[:-1]) and reply.endswith(b"\n"):
                return reply  # taken, or refused for good (not this job's secret)
        except ConnectionRefusedError:
            return None  # nothing listens there: the launcher is gone
        except (OSError, ValueError):
            pass
        if time.monotonic() + pause > deadline:
            return None
        time.sleep(pause)
        pause = min(2 * pause, _LAST_PAUSE_SECONDS)


def _deliver(address: str, line: bytes, answered: bool = False) -> bytes:
    """One try: sends ``line``; returns the launcher's answer (empty when none came): its
    three bytes, or with ``answered`` its whole line (a request's data)."""
    limit = _MAX_ANSWER_BYTES if answered else len(ACK)
    with connect(address, _CONNECT_SECONDS) as s:
        s.sendall(line)
        s.shutdown(socket.SHUT_WR)
        s.settimeout(_REPLY_SECONDS)
        reply = bytearray()
        while len(reply) < limit and not reply.endswith(b"\n"):
            chunk = s.recv(min(limit - len(reply), 65536))
            if not chunk:
                break
            reply += chunk
    return bytes(reply)
