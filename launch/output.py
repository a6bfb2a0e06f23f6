"""The job's output on the launcher: mpirun's two streams copied to its own, line by line.

Every rank's supervisor (:mod:`launch.worker`) tags its rank's lines ``[N]<stdout>:`` or
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
before it prints or writes anything.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from typing import BinaryIO

__all__ = ["CONTINUED", "PIECE_BYTES", "RankFiles", "copy_output"]

# Longest piece of a line a supervisor sends through mpirun, and the mark that says more of the
# same line follows (bytes no program writes by accident: ASCII record separators).
PIECE_BYTES = 64 * 1024
CONTINUED = b"\x1e\x1esyncdp-continued\x1e\x1e"

_TAG = re.compile(rb"\[([0-9]+)\]<(stdout|stderr)>:")


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

    def close(self) -> None:
        """Closes every file."""
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()


def _stamp() -> bytes:
    return time.asctime().encode()


def _pump(source, sink, *, timestamps: bool, files: RankFiles | None) -> None:
    pending: dict[bytes, list[bytes]] = {}  # a rank's tag -> pieces of its unfinished line
    marked = CONTINUED + b"\n"
    for raw in iter(source.readline, b""):
        if not raw.endswith(b"\n"):  # mpirun's last words may lack one; ours start on a new line
            raw += b"\n"
        tag = _TAG.match(raw)
        if tag is not None:
            if raw.endswith(marked):
                pending.setdefault(tag[0], []).append(raw[tag.end() : -len(marked)])
                continue
            if tag[0] in pending:
                raw = tag[0] + b"".join(pending.pop(tag[0])) + raw[tag.end() :]
        stamp = _stamp() if timestamps else b""
        sink.write(stamp + raw)
        sink.flush()
        if files is not None:
            if tag:
                files.write(int(tag[1]), tag[2].decode(), stamp + raw[tag.end() :])
    for key, pieces in pending.items():  # a rank that ended in the middle of a long line
        sink.write(key + b"".join(pieces) + b"\n")
    sink.flush()
    source.close()


def copy_output(
    process: subprocess.Popen, *, timestamps: bool = False, files: RankFiles | None = None
) -> list[threading.Thread]:
    """Starts copying mpirun's stdout and stderr to the launcher's; returns the two threads.

    Args:
        process: mpirun, its output on pipes.
        timestamps: Start every line with the time it arrived. Defaults to False.
        files: Where each rank's lines also go, or None. Defaults to None.
    """
    pumps = [
        threading.Thread(
            target=_pump,
            args=(stream, sink),
            kwargs=dict(timestamps=timestamps, files=files),
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
