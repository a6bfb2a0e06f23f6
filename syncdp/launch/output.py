"""The job's output on the launcher: mpirun's two streams copied to its own, line by line.

Every rank's supervisor (:mod:`syncdp.launch.worker`) tags its rank's lines ``[N]<stdout>:`` or
``[N]<stderr>:``, and mpirun brings them to the launcher on its stdout and stderr. Two of
horovodrun's flags act here, on the launcher's host, whichever hosts the ranks run on:

- ``--prefix-output-with-timestamp``: every line starts with the time the launcher received it,
  as ``time.asctime()`` writes it (horovodrun's layout:
  ``Tue May  6 10:12:01 2025[0]<stdout>:epoch 1``);
- ``--output-filename DIR``: each rank's lines also go to ``DIR/rank.N/stdout`` and
  ``DIR/rank.N/stderr`` (``N`` zero-padded to the width of the last rank, so the directories
  sort in rank order), as the rank wrote them, without the tag (and with the time in front
  when lines are stamped). The files of ranks 0..N-1 exist from the start, empty for a rank
  that writes nothing; a replacement rank in elastic mode gets its own when it first writes.

Lines without a rank's tag (mpirun's own, a supervisor's report of how its rank ended) go only
to the console.

Open MPI forwards a line in time quadratic in its length (one 10 MiB line took 20 s), so a
supervisor sends a line longer than :data:`PIECE_BYTES` in pieces, each but the last ending in
:data:`CONTINUED` and a newline; the launcher joins a rank's pieces back into the one line
before it prints or writes anything. A supervisor ends a rank's last line with a newline when
the rank did not, so that it never runs into another rank's.

What the launcher prints is text, whatever mpirun sends: NUL bytes (Open MPI ends a help
message after ``MPI_Abort`` with one) are dropped and bytes that are not UTF-8 become U+FFFD.
The rank files keep the bytes as the rank wrote them.

Open MPI's banners (a block of text between lines of dashes) that only say again what
syncdp's own last line says (a rank called ``MPI_Abort``, exited non-zero or was killed) are
folded into one line, their first sentence; ``--log-level DEBUG`` (``full_banners``) prints
them whole. Other banners (Open MPI's advice on what it cannot do) pass unchanged.

In elastic mode the lines in which ranks and Open MPI describe a recovery (the ranks' notes on
the collective a failure abandoned, TensorFlow's warnings of the ``RankFailureError`` a host call
raised with the traceback each carries, ``NBC_Progress`` errors and the empty line after each,
"N more processes have sent help message help-mpi-ft", a supervisor's word on its lost rank,
mpirun's banner on a daemon that failed to report back or was lost, whose host the launcher
names, and ULFM's banner on components "not tested for post-failure operation" at every start)
are left off the console, with one line saying so: the launcher's own account of each recovery (lost
whom, why, how long, the new size) says it. ``--log-level DEBUG`` prints them, and
``--output-filename`` files keep the ranks' lines.

TensorFlow's start-up chatter on every rank (absl's note on early log messages, oneDNN's notice,
the CPU-instructions notice, "Could not find cuda drivers" and, on a rank that said that, the
cuInit failure that follows from it), and Open MPI's error that its UCX one-sided component's
query failed (a host with an RDMA device it cannot use; the empty line after it too), are left
off the console, with one line saying so;
``--log-level DEBUG`` (``chatter``) prints it, and ``--output-filename`` files keep it. Nothing
else is hidden: any other warning or error of TensorFlow passes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import BinaryIO

__all__ = ["Flow", "CONTINUED", "UNTERMINATED", "PIECE_BYTES", "RankFiles", "copy_output"]

# Longest piece of a line a supervisor sends through mpirun, and the mark that says more of the
# same line follows (bytes no program writes by accident: ASCII record separators).
PIECE_BYTES = 64 * 1024
CONTINUED = b"\x1e\x1esyncdp-continued\x1e\x1e"
# The mark that ends a rank's last line when the rank wrote no newline after it: the console
# gets the line, --output-filename's file the bytes as the rank wrote them.
UNTERMINATED = b"\x1e\x1esyncdp-no-newline\x1e\x1e"

_TAG = re.compile(rb"\[([0-9]+)\]<(stdout|stderr)>:")

# The edge of an Open MPI banner (its help messages are framed by lines of 74 dashes).
_RULE = re.compile(rb"^-{20,}\r?\n$")
# Banners that repeat what the launcher's verdict says (their first words, joined by spaces).
_REPEATS = re.compile(
    rb"MPI_ABORT was invoked on rank"
    rb"|\S+ has exited due to process rank"
    rb"|\S+ detected that one or more processes exited with non-zero status"
    rb"|Primary job +terminated normally, but"
    rb"|\S+ noticed that process rank \d+ with PID \d+ on node \S+ exited on signal"
)
# A block this long is no banner of those: it is printed as it came.
_BANNER_LINES = 40

# TensorFlow's start-up chatter, as a rank's line (after its tag) starts; absl's prefix is
# "I1126 02:13:39.123456    7629 file.cc:31] " (level, date, time, thread, source).
_ABSL = rb"[IW]\d{4} [\d:.]+ +\d+ "
_CHATTER = re.compile(
    rb"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    rb"|" + _ABSL + rb"port\.cc:\d+\] oneDNN custom operations are on"
    rb"|" + _ABSL + rb"cpu_feature_guard\.cc:\d+\] This TensorFlow binary is optimized"
    rb"|To enable the following instructions: .* rebuild TensorFlow with the appropriate"
)
_NO_DRIVER = re.compile(_ABSL + rb"cudart_stub\.cc:\d+\] Could not find cuda drivers")
_CUINIT = re.compile(rb"E\d{4} [\d:.]+ +\d+ cuda_platform\.cc:\d+\] failed call to cuInit")
# Open MPI's UCX one-sided component, on a host with an RDMA device it cannot use, says once per
# rank that its query failed (another component serves the windows), then prints an empty line.
_OSC_UCX_QUERY = re.compile(
    rb"\[\S+\] \S*osc_ucx_component\.c:\d+ +Error: OSC UCX component priority"
)
_CHATTER_NOTE = (
    b"syncdp-run: start-up messages (TensorFlow's oneDNN, CPU instructions and no CUDA driver; "
    b"Open MPI's UCX query) are not shown; --log-level DEBUG shows them\n"
)


class RankFiles:
    """``DIR/rank.N/stdout`` and ``DIR/rank.N/stderr`` for every rank (horovodrun's layout).

    Args:
        directory: The directory (``--output-filename``); made if missing.
        num_proc: The job's ranks: their files are made at once, and the last one's number
            sets the padding.

    Raises:
        OSError: The directory or a file cannot be made.
    """

    def __init__(self, directory: str, num_proc: int):
        self.directory = directory
        self._width = len(str(max(num_proc - 1, 0)))
        self._files: dict[tuple[int, str], BinaryIO] = {}
        self._open_lines: set[tuple[int, str]] = set()  # the last write ended mid-line
        self._lock = threading.Lock()
        os.makedirs(directory, exist_ok=True)
        for rank in range(num_proc):
            for stream in ("stdout", "stderr"):
                self._file(rank, stream)

    def path(self, rank: int, stream: str) -> str:
        """The file of ``rank``'s ``stream`` (``"stdout"`` or ``"stderr"``)."""
        return os.path.join(self.directory, f"rank.{rank:0{self._width}d}", stream)

    def _file(self, rank: int, stream: str) -> BinaryIO:
        with self._lock:
            f = self._files.get((rank, stream))
            if f is None:
                os.makedirs(os.path.dirname(self.path(rank, stream)), exist_ok=True)
                f = self._files[(rank, stream)] = open(self.path(rank, stream), "wb")
            return f

    def write(self, rank: int, stream: str, line: bytes) -> None:
        """Appends one line to ``rank``'s ``stream`` file; a file that cannot be written is
        dropped (the console still has the line)."""
        try:
            f = self._file(rank, stream)
            f.write(line)
            f.flush()
        except OSError:
            pass
        with self._lock:
            if line.endswith(b"\n"):
                self._open_lines.discard((rank, stream))
            elif line:
                self._open_lines.add((rank, stream))

    def end_open_lines(self) -> None:
        """Ends with a newline each file whose rank's last words had none: a restarted job's
        ranks write on in the same files, and their first line must not join that one."""
        with self._lock:
            ended, self._open_lines = self._open_lines, set()
        for rank, stream in sorted(ended):
            self.write(rank, stream, b"\n")

    def close(self) -> None:
        """Closes every file."""
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()


def _stamp() -> bytes:
    return time.asctime().encode()


def _text(raw: bytes) -> bytes:
    """``raw`` as text: NULs dropped, bytes that are not UTF-8 replaced by U+FFFD."""
    raw = raw.replace(b"\0", b"")
    try:
        raw.decode()
        return raw
    except UnicodeDecodeError:
        return raw.decode(errors="replace").encode()


def _fold(block: list[bytes]) -> bytes | None:
    """One line for a banner that repeats the verdict (``block``: its lines, rules included):
    the first sentence of its first paragraph, else its first line; None for other banners."""
    paragraph: list[bytes] = []
    for line in block[1:-1]:
        if line.strip():
            paragraph.append(b" ".join(line.split()))
        elif paragraph:
            break
    words = b" ".join(paragraph)
    if not _REPEATS.match(words):
        return None
    sentence = re.match(rb"(.+?[.!])(?: |$)", words)
    first = sentence[1] if sentence is not None else paragraph[0]
    return b"syncdp-run: Open MPI: " + first + b" (in full at --log-level DEBUG)\n"


# Elastic mode: the lines in which the ranks and Open MPI describe a recovery the launcher gives
# its own account of (ranks' lines, after their tag; mpirun's own lines).
_RECOVERY_RANK_LINES = re.compile(
    rb"NBC_Progress: an error \d+ was found during schedule"
    rb"|syncdp: rank \d+: .*: a rank of the job failed \(MPI_ERR_[A-Z_]+:.*Recovering from the "
    rb"last commit\."
    rb"|syncdp: elastic recovery attempt \d+ failed \(.*\); retrying\."
)
_RECOVERY_MPIRUN_LINES = re.compile(
    rb"\d+ more process(?:es)? (?:has|have) sent help message help-mpi-ft"
    rb"|Set MCA parameter \"orte_base_help_aggregate\" to 0"
    # A supervisor's word on its rank, which the elastic log already gives as a loss.
    rb"|syncdp-run: rank \d+ \(pid \d+ on \S+\) (?:was killed by signal|exited with code)"
)
# TensorFlow's record of a RankFailureError raised in a host call (op_kernel.cc, then
# local_rendezvous.cc), and the lines that continue such a record: the Python traceback it
# carries, the error's own line, empty lines and the node it names.
_TF_RANK_FAILURE = re.compile(rb"[WE]\d{4} [\d:.]+ +\d+ \w+\.cc:\d+\] .*RankFailureError")
_TF_CONTINUED = re.compile(
    rb"\s|$|Traceback \(most recent call last\):|[\w.]*RankFailureError: |HorovodInternalError"
)
# ULFM's warnings on components it has not tested after a failure, at every elastic start:
# syncdp rebuilds every communicator and window after a recovery (syncdp.job.runtime).
_ULFM_UNTESTED = re.compile(rb".*is (?:not|insuficiently) tested (?:for|in) post-failure")
# mpirun's banners on a daemon that did not start or was lost: the launcher names that host
# (syncdp.launch.restart) and says whether the job starts again without it.
_DAEMON_LOST = re.compile(
    rb"A daemon failed to report back|\S+ has lost communication with a remote daemon"
)
_RECOVERY_NOTE = (
    b"syncdp-run: the ranks' and Open MPI's notes on the recovery (MPI_ERR_REVOKED, "
    b"NBC_Progress) are not shown; --log-level DEBUG shows them, --output-filename keeps them\n"
)


class _Recovery:
    """Which lines describe an elastic recovery the launcher gives its own account of."""

    def __init__(self):
        self._in_record: set[bytes] = set()  # rank tags inside TensorFlow's failure record

    def rank_line(self, raw: bytes, tag) -> bool:
        line = raw[tag.end() :]
        if tag[0] in self._in_record:
            if _TF_CONTINUED.match(line):
                return True
            self._in_record.discard(tag[0])
        if tag[2] == b"stderr" and _TF_RANK_FAILURE.match(line):
            self._in_record.add(tag[0])
            return True
        if not line.strip():  # Open MPI's empty line after its NBC note
            return tag[2] == b"stderr"
        return _RECOVERY_RANK_LINES.match(line) is not None

    @staticmethod
    def mpirun_line(raw: bytes) -> bool:
        return _RECOVERY_MPIRUN_LINES.match(raw) is not None

    @staticmethod
    def banner(block: list[bytes]) -> bool:
        words = b" ".join(b" ".join(line.split()) for line in block[1:-1])
        return _ULFM_UNTESTED.match(words) is not None or _DAEMON_LOST.match(words) is not None


class _Chatter:
    """Which of the ranks' lines are TensorFlow's start-up chatter (the module's docstring)."""

    def __init__(self):
        self.no_driver: set[bytes] = set()  # ranks (their number) that found no CUDA driver
        self.after_ucx: set[bytes] = set()  # ranks whose last line was the UCX query's error

    def __call__(self, raw: bytes, tag) -> bool:
        line = raw[tag.end() :]
        if tag[1] in self.after_ucx:
            self.after_ucx.discard(tag[1])
            if not line.strip():
                return True
        if _OSC_UCX_QUERY.match(line):
            self.after_ucx.add(tag[1])
            return True
        if _NO_DRIVER.match(line):
            self.no_driver.add(tag[1])
            return True
        if _CUINIT.match(line):
            return tag[1] in self.no_driver
        return _CHATTER.match(line) is not None


class Flow:
    """Whether mpirun's output still moves through the launcher: when a line last arrived or
    was written, and how many writes are under way (a slow reader of the launcher's own
    output, ``| less`` or a stalled ``tee``, holds them). While it moves, mpirun is not stuck:
    it waits for the launcher to take its output, and stopping it then would lose that."""

    def __init__(self):
        self.moved = time.monotonic()
        self.writing = 0
        self._lock = threading.Lock()  # two pumps (stdout, stderr) count writes

    def writes(self, by: int) -> None:
        """Counts a write begun (+1) or ended (-1)."""
        with self._lock:
            self.writing += by
            self.moved = time.monotonic()

    def active(self, within: float) -> bool:
        """Whether a write is under way, or output moved in the last ``within`` seconds."""
        return self.writing > 0 or time.monotonic() - self.moved < within


def _pump(
    source,
    sink,
    *,
    timestamps: bool,
    files: RankFiles | None,
    full_banners: bool = False,
    quiet: _Chatter | None = None,
    on_banner: Callable[[str], None] | None = None,
    recovery: _Recovery | None = None,
    said: set[bytes] | None = None,
    flow: Flow | None = None,
) -> None:
    said = set() if said is None else said  # the notes printed so far (each once per job)
    flow = Flow() if flow is None else flow
    pending: dict[bytes, list[bytes]] = {}  # a rank's tag -> pieces of its unfinished line
    banner: list[bytes] | None = None  # mpirun's lines since a rule, while it may be a banner
    marked = CONTINUED + b"\n"
    unterminated = UNTERMINATED + b"\n"
    is_chatter = quiet
    gone = False  # the reader of the launcher's own output went away

    def emit(raw: bytes, tag=None, *, newline: bool = True) -> None:
        # newline False: the rank wrote none after this line (raw has one, for the console).
        nonlocal gone
        stamp = _stamp() if timestamps else b""
        out = []  # what goes to the console
        quiet = tag is not None and is_chatter is not None and is_chatter(raw, tag)
        if quiet and _CHATTER_NOTE not in said:
            said.add(_CHATTER_NOTE)
            out.append(_CHATTER_NOTE)
        if not quiet and recovery is not None:
            if tag is None:
                quiet = recovery.mpirun_line(raw)
            elif recovery.rank_line(raw, tag):
                quiet = True
                if _RECOVERY_NOTE not in said and raw[tag.end() :].strip():
                    said.add(_RECOVERY_NOTE)
                    out.append(_RECOVERY_NOTE)
        if not quiet:
            out.append(stamp + _text(raw))
        flow.writes(+1)
        try:
            if not gone:
                for piece in out:
                    sink.write(piece)
                sink.flush()
        except BrokenPipeError:
            # The reader went away (| head): mpirun's output is still read to its end, and
            # still written to --output-filename's files, so that nothing waits on it.
            gone = True
        finally:
            flow.writes(-1)
        if files is not None and tag is not None:
            text = raw[tag.end() :] if newline else raw[tag.end() : -1]
            files.write(int(tag[1]), tag[2].decode(), stamp + text)

    def end_banner(closed: bool) -> None:
        nonlocal banner
        if on_banner is not None:
            on_banner(" ".join(_text(b" ".join(banner)).decode().split()))
        folded = _fold(banner) if closed and not full_banners else None
        if recovery is not None and closed and recovery.banner(banner):
            pass  # --log-level DEBUG (no recovery filter) prints it
        elif folded is not None:
            emit(folded)
        else:
            for line in banner:
                emit(line)
        banner = None

    for raw in iter(source.readline, b""):
        flow.moved = time.monotonic()
        if not raw.endswith(b"\n"):  # mpirun's last words may lack one; ours start on a new line
            raw += b"\n"
        raw = raw.lstrip(b"\0")  # Open MPI's help messages end in one: not the next line's
        tag = _TAG.match(raw)
        if tag is None:
            if banner is not None:
                banner.append(raw)
                if _RULE.match(raw) or len(banner) > _BANNER_LINES:
                    end_banner(closed=len(banner) <= _BANNER_LINES)
            elif _RULE.match(raw):
                banner = [raw]
            else:
                emit(raw)
            continue
        if raw.endswith(marked):
            pending.setdefault(tag[0], []).append(raw[tag.end() : -len(marked)])
            continue
        if tag[0] in pending:
            raw = tag[0] + b"".join(pending.pop(tag[0])) + raw[tag.end() :]
            tag = _TAG.match(raw)
        if raw.endswith(unterminated):
            emit(raw[: -len(unterminated)] + b"\n", tag, newline=False)
            continue
        emit(raw, tag)
    if banner is not None:
        end_banner(closed=False)
    for key, pieces in pending.items():  # a rank that ended in the middle of a long line
        emit(key + b"".join(pieces) + b"\n")
    if not gone:
        try:
            sink.flush()
        except BrokenPipeError:
            pass
    source.close()


def copy_output(
    process: subprocess.Popen,
    *,
    timestamps: bool = False,
    files: RankFiles | None = None,
    full_banners: bool = False,
    chatter: bool = False,
    on_banner: Callable[[str], None] | None = None,
    recovery_notes: bool = True,
    said: set[bytes] | None = None,
    flow: Flow | None = None,
) -> list[threading.Thread]:
    """Starts copying mpirun's stdout and stderr to the launcher's; returns the two threads.

    Args:
        process: mpirun, its output on pipes.
        timestamps: Start every line with the time it arrived. Defaults to False.
        files: Where each rank's lines also go, or None. Defaults to None.
        full_banners: Print Open MPI's banners that repeat the verdict whole instead of one
            line each (``--log-level DEBUG``). Defaults to False.
        chatter: Print TensorFlow's start-up chatter too (``--log-level DEBUG``). Defaults to
            False.
        on_banner: Called with the words of each of Open MPI's banners (one line), whatever
            is printed of it, or None. Defaults to None.
        recovery_notes: Print the ranks' and Open MPI's notes on an elastic recovery too;
            False in elastic mode below ``--log-level DEBUG``, where the launcher gives its own
            account. Defaults to True.
        said: The notes on lines left off (start-up chatter, a recovery) printed so far;
            each is printed once, and added here. Pass the same set to every runtime of one
            job, so that a job started again does not say them again. Defaults to a new set.
        flow: Told when the output moves (:class:`Flow`). Defaults to a new one.
    """
    said = set() if said is None else said  # one for both streams: one note in all
    flow = Flow() if flow is None else flow
    quiet = None if chatter else _Chatter()
    recovery = None if recovery_notes else _Recovery()
    pumps = [
        threading.Thread(
            target=_pump,
            args=(stream, sink),
            kwargs=dict(
                flow=flow,
                timestamps=timestamps,
                files=files,
                full_banners=full_banners,
                quiet=quiet,
                on_banner=on_banner,
                recovery=recovery,
                said=said,
            ),
            daemon=True,
        )
        for stream, sink in (
            (process.stdout, sys.stdout.buffer),
            (process.stderr, sys.stderr.buffer),
        )
    ]
    for p in pumps:
        p.start()
    return pumps
