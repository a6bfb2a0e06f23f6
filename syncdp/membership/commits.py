"""The last commit on each host's local disk: what a job restarted after a lost host resumes from.

Open MPI's runtime cannot run on without a host's daemon, so ``syncdp-run`` survives a lost
host by starting the job again on the hosts left (:mod:`syncdp.launch.restart`). The new processes
must find the last commit, and no file system is assumed shared. Every replica holds the same
committed state, so each host keeps its own copy: in an elastic job on several hosts the
launcher sets ``SYNCDP_COMMIT_DIR`` (the same path on every host, on its local disk,
``/var/tmp/syncdp-UID/JOB``), and at every ``state.commit()`` the lowest local rank of each
host writes the state there (:class:`Store`):

- one file per commit, ``commit-COUNTER.pkl``: the job's tag (the directory's name), the commit
  counter (the same on every rank: commits run in lockstep) and the state's snapshot
  (:meth:`syncdp.elastic.State.snapshot`);
- written to a temporary file and renamed over, so a process killed while writing leaves the
  previous commit whole, and a reader never sees half a file (no ``fsync``: the processes may
  die, the host stays, and the page cache outlives them);
- the older files are removed once the new one is in place: a host keeps the newest two.

When ranks sync (at the start, and after every membership change), :func:`newest` finds where
the newest commit is, in a rank's memory or on a host's disk, and :mod:`syncdp.elastic` sends it
to every rank. The launcher removes the directory when the job ends.

Without ``SYNCDP_COMMIT_DIR`` (one host, plain ``mpirun``, outside elastic mode) nothing is
written and nothing here runs: commits stay in memory, as before.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import re
import socket
import tempfile
from typing import Any

__all__ = ["COMMIT_DIR_VAR", "Store", "Found", "store", "newest"]

COMMIT_DIR_VAR = "SYNCDP_COMMIT_DIR"
# How many commits a host keeps: the newest, and the one before while the newest is written.
_KEEP = 2
_NAME = re.compile(r"commit-(\d+)\.pkl")


class Store:
    """One host's commits of one job, in ``directory``.

    Args:
        directory: Where the commits go (made when the first is written).
    """

    def __init__(self, directory: str):
        self.directory = directory
        self.tag = os.path.basename(os.path.normpath(directory))

    def _path(self, counter: int) -> str:
        return os.path.join(self.directory, f"commit-{counter:012d}.pkl")

    def counters(self) -> list[int]:
        """The commits on this host's disk, oldest first."""
        try:
            names = os.listdir(self.directory)
        except OSError:
            return []
        return sorted(int(m.group(1)) for m in map(_NAME.fullmatch, names) if m)

    def newest(self) -> int:
        """The newest commit's counter on this host's disk; 0 when there is none."""
        found = self.counters()
        return found[-1] if found else 0

    def write(self, counter: int, snapshot: Any) -> None:
        """Writes commit ``counter`` atomically, then removes all but the newest two.

        Raises:
            OSError: The directory cannot be made or written (a full disk, say).
        """
        os.makedirs(self.directory, exist_ok=True)
        body = {"job": self.tag, "counter": counter, "snapshot": snapshot}
        fd, temporary = tempfile.mkstemp(
            prefix=f".commit-{counter}-{socket.gethostname()}-", dir=self.directory
        )
        try:
            with os.fdopen(fd, "wb") as f:
                pickle.dump(body, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(temporary, self._path(counter))
        except BaseException:
            try:
                os.unlink(temporary)
            except OSError:
                pass
            raise
        for old in self.counters()[:-_KEEP]:
            try:
                os.unlink(self._path(old))
            except OSError:
                pass  # another host's writer, on a shared file system, took it first

    def read(self, counter: int) -> Any:
        """The snapshot of commit ``counter``.

        Raises:
            OSError: It is not there (any more).
            ValueError: It is another job's, or not a commit.
        """
        with open(self._path(counter), "rb") as f:
            body = pickle.load(f)
        if not isinstance(body, dict) or body.get("job") != self.tag:
            raise ValueError(f"{self._path(counter)} is not a commit of job {self.tag}")
        if body.get("counter") != counter:
            raise ValueError(f"{self._path(counter)} holds commit {body.get('counter')}")
        return body["snapshot"]


def store() -> Store | None:
    """This process's store (``SYNCDP_COMMIT_DIR``), or None when commits stay in memory."""
    directory = os.environ.get(COMMIT_DIR_VAR)
    return Store(directory) if directory else None


@dataclasses.dataclass(frozen=True)
class Found:
    """Where the newest commit is, as every rank agrees after :func:`newest`.

    Attributes:
        counter: Its counter (0: no commit anywhere).
        rank: The rank that holds it: the lowest with it in memory, else the lowest whose
            host has it on disk.
        on_disk: Whether that rank reads it from its host's disk.
        host: That rank's host.
    """

    counter: int
    rank: int
    on_disk: bool
    host: str


def newest(rows: list[tuple[int, int, str]]) -> Found:
    """Where the newest commit is, from every rank's ``(in memory, on its host's disk, host)``
    counters in rank order (an allgather's result). Memory wins a tie: no disk is read."""
    best = max((max(memory, disk) for memory, disk, _ in rows), default=0)
    for rank, (memory, _, host) in enumerate(rows):
        if memory == best:
            return Found(best, rank, False, host)
    for rank, (_, disk, host) in enumerate(rows):
        if disk == best:
            return Found(best, rank, True, host)
    raise AssertionError("unreachable: the best counter comes from some row")
