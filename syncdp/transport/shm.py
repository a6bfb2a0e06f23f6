"""The intra-host data plane: allreduce through an MPI-3 shared-memory window.

When every rank of a communicator runs on one host, moving bytes through MPI's generic
allreduce is far from what the memory allows (on a 16-core host Open MPI's default algorithm
reduced ResNet-50's 102 MB 2-2.3x slower than the bound below). :class:`SharedPlane` instead
gives each rank a slot in one window that every rank of the host maps
(``MPI_Win_allocate_shared``), and reduces a buffer segment by segment:

1. every rank writes its segment into its own slot (packing straight into it);
2. barrier; rank ``i`` reduces slice ``i`` of the segment over every slot, in rank order, and
   writes the result back into slice ``i`` of its own slot (only rank ``i`` reads that slice);
3. after the next barrier, every rank copies each slice ``j`` from rank ``j``'s slot into its
   buffer.

Each element is reduced once, by one rank, in one fixed order, and copied by everyone: the
ranks hold bit-identical results by construction. Each byte is read and written a handful of
times at memory speed, and the work of reducing is split evenly over the ranks.

One barrier per segment (and one at the end) serves twice: past barrier ``k`` every rank has
filled segment ``k`` and reduced its slice of segment ``k-1``. Three sets of slots take turns,
so the set segment ``k+1`` is written into was last read (segment ``k-2``'s copy-out) before
every rank reached barrier ``k``.

The barriers are MPI barriers on the communicator (waited for politely, see
:mod:`syncdp.transport.waiting`), so a rank that never arrives is seen by
the stall watchdog and a rank that dies raises ``MPI_ERR_PROC_FAILED`` under ULFM, exactly as
for any other collective. ``MPI_Win_sync`` around each barrier orders the memory accesses as
MPI's unified memory model asks.

The window lives in a file of Open MPI's backing directory (``/dev/shm`` unless
``OMPI_MCA_osc_sm_backing_directory`` says otherwise), whose pages a tmpfs only finds when they
are first touched: a filesystem that fills after the window was made would kill the rank with
SIGBUS in the middle of a later allreduce. So every rank claims its slots' pages when the plane
opens (``MADV_POPULATE_WRITE``, or ``posix_fallocate`` on the window's file where the kernel is
older than 5.14), the ranks agree on the outcome, and where any rank could not claim its pages
no plane opens: collectives go through MPI and rank 0 says why, naming the directory.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys

import numpy as np

from syncdp.base import mpi as _mpi
from syncdp.transport.waiting import wait_politely

__all__ = ["SharedPlane", "SEGMENT_BYTES", "open_plane", "shares_one_host"]

# Bytes of one segment in one slot. Small enough that a segment of every rank stays in the
# cache hierarchy while it is reduced, large enough that the barrier per segment
# (microseconds) are noise against moving it.
SEGMENT_BYTES = 1 << 20

# Sets of slots that take turns (see SharedPlane.allreduce).
_SETS = 3

# How long a rank polls at a segment's barrier before it sleeps between polls.
_SPIN_SECONDS = 2e-3

_UFUNC = {"sum": np.add, "min": np.minimum, "max": np.maximum, "prod": np.multiply}

# madvise(2) advice that faults pages in writable, failing with EFAULT where touching them
# would raise SIGBUS (Linux 5.14; Python's mmap module only names it for its own maps).
_MADV_POPULATE_WRITE = 23


def backing_dir() -> str:
    """The directory Open MPI puts shared windows' files in (its ``osc_sm_backing_directory``)."""
    return os.environ.get("OMPI_MCA_osc_sm_backing_directory") or "/dev/shm"


def shares_one_host(mpi_comm) -> bool:
    """Whether every rank of ``mpi_comm`` runs on one host (a collective; every rank gets the
    same answer)."""
    MPI = _mpi.load()
    local = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=mpi_comm.Get_rank())
    one_host = local.Get_size() == mpi_comm.Get_size()
    local.Free()
    return one_host


def open_plane(
    mpi_comm,
    *,
    agree_comm=None,
    segment_bytes: int | None = None,
    shm_dir: str | None = None,
):
    """A :class:`SharedPlane` over ``mpi_comm`` when all its ranks share a host; else None.

    A collective of every rank of ``agree_comm`` (defaults to ``mpi_comm``), all of which get
    the same answer: with ``mpi_comm`` one host's ranks and ``agree_comm`` the job, every host
    opens its plane or none does. The window
    is only made when the host's shared-memory filesystem has room for it with a wide margin:
    a window larger than a small ``/dev/shm`` (containers default to 64 MiB) would not fail
    at allocation but kill the rank with SIGBUS when touched. Once made, every rank claims its
    pages and the ranks agree that all could; otherwise the window is freed and None returned
    (rank 0 of ``agree_comm`` prints why, naming ``shm_dir``).

    Args:
        mpi_comm: The ranks that would share the window.
        agree_comm: The ranks that must all agree. Defaults to ``mpi_comm``.
        segment_bytes: Bytes of one slot. Defaults to ``SEGMENT_BYTES``.
        shm_dir: Where the window's file lives. Defaults to :func:`backing_dir`.
    """
    MPI = _mpi.load()
    segment_bytes = segment_bytes or SEGMENT_BYTES
    shm_dir = shm_dir or backing_dir()
    agree_comm = mpi_comm if agree_comm is None else agree_comm
    size = mpi_comm.Get_size()
    if agree_comm.Get_size() < 2:
        return None
    one_host = shares_one_host(mpi_comm)
    need = _SETS * segment_bytes * size
    room = _free_bytes(shm_dir)
    fits = room is None or room >= 4 * need
    # Every rank must take the same path: agree on the room too (hosts see one filesystem,
    # but a rank may read it at a different moment).
    if not agree_comm.allreduce(bool(size > 1 and one_host and fits), op=MPI.LAND):
        return None
    plane = SharedPlane(mpi_comm, segment_bytes)
    problem = plane.claim()
    problems = agree_comm.allgather(problem)
    if not any(problems):
        return plane
    plane.close()
    if agree_comm.Get_rank() == 0:
        rank, problem = next((r, p) for r, p in enumerate(problems) if p)
        print(
            f"syncdp: the shared-memory plane needs {need / 2**20:.0f} MiB per host in {shm_dir}, "
            f"and rank {rank} could not claim its part ({problem}); allreduce goes through MPI "
            f"instead. Free space in {shm_dir} (or enlarge it: docker --shm-size), or set "
            "SYNCDP_SHARED_MEMORY=off to silence this.",
            file=sys.stderr,
            flush=True,
        )
    return None


def _fallocate_mapping(address: int, length: int) -> str | None:
    """Reserves ``length`` bytes from ``address`` in the file mapped there; None when done,
    else why not. Open MPI unlinks the window's file once mapped, so it is reached through
    ``/proc/self/map_files`` (which takes root, or Linux 4.3 and later)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if lo <= address < hi:
                    break
            else:
                return "no mapping found for the window"
        if fields[1][3] != "s" or len(fields) < 6:
            return None  # private memory (a window of one process): no file to run out of
        fd = os.open(f"/proc/self/map_files/{fields[0]}", os.O_RDWR)
        try:
            os.posix_fallocate(fd, int(fields[2], 16) + address - lo, length)
        finally:
            os.close(fd)
    except OSError as e:
        return e.strerror or str(e)
    return None


def _free_bytes(path: str) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class SharedPlane:
    """Slots in one shared window: three per rank, ``segment_bytes`` each.

    Args:
        mpi_comm: Ranks that all share this host (a collective on it).
        segment_bytes: Bytes of one slot.
    """

    def __init__(self, mpi_comm, segment_bytes: int = SEGMENT_BYTES):
        MPI = _mpi.load()
        self.comm = mpi_comm
        self.size = mpi_comm.Get_size()
        self.rank = mpi_comm.Get_rank()
        self.segment_bytes = segment_bytes
        with _mpi.windows_made(mpi_comm) as self._made:  # Open MPI's, freed with the window
            self.win = MPI.Win.Allocate_shared(_SETS * segment_bytes, 1, comm=mpi_comm)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        # slots[s][r]: rank r's slot of set s, as raw bytes; typed views are made per call.
        self._raw = [
            np.frombuffer(self.win.Shared_query(r)[0], dtype=np.uint8, count=_SETS * segment_bytes)
            for r in range(self.size)
        ]
        self._set = 0

    def claim(self) -> str | None:
        """Makes the filesystem back every page of this rank's slots now, so that no later
        touch can raise SIGBUS; not a collective. Returns None when done, else why not."""
        raw = self._raw[self.rank]
        page = mmap.PAGESIZE
        lo = raw.ctypes.data // page * page
        hi = -(-(raw.ctypes.data + raw.nbytes) // page) * page
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if libc.madvise(lo, hi - lo, _MADV_POPULATE_WRITE) == 0:
            return None
        code = ctypes.get_errno()
        if code == errno.EFAULT:  # a page the filesystem has no room for
            return os.strerror(errno.ENOSPC)
        if code != errno.EINVAL:  # EINVAL: a kernel before 5.14
            return os.strerror(code)
        return _fallocate_mapping(lo, hi - lo)

    def close(self, *, collective: bool = True) -> None:
        """Frees the window (a collective), or only drops it when ``collective`` is False (a
        rank of the group is gone and freeing would wait for it)."""
        if self.win is None:
            return
        self._raw = []
        if collective:
            self.win.Unlock_all()
            self.win.Free()
            _mpi.windows_freed(self._made)
        self.win = None

    def _slots(self, dtype: np.dtype, count: int) -> list[np.ndarray]:
        """The next set's slots, typed, ``count`` elements each (the sets take turns)."""
        start = self._set * self.segment_bytes
        self._set = (self._set + 1) % _SETS
        end = start + count * dtype.itemsize
        return [raw[start:end].view(dtype) for raw in self._raw]

    def allreduce(
        self, buffer: np.ndarray, op: str, *, before=None, after=None, across=None
    ) -> None:
        """Reduces the 1-D ``buffer`` over every rank, in place; a synchronization point.

        With ``across``, the plane is one host's part of a job on several hosts: each rank's
        slice, reduced over its host, is handed to ``across(slice)`` to be reduced in place
        with the same slice of the other hosts (a ring among the ranks with this local rank)
        before the host shares it, so every byte crosses between hosts once per host.

        Args:
            buffer: Contiguous, writable, the same size and dtype on every rank.
            op: "sum", "min", "max" or "prod".
            before: Optional ``fn(lo, hi, dst)`` writing elements ``[lo, hi)`` into ``dst``
                (this rank's slot); without it the elements are copied from ``buffer``.
            after: Optional ``fn(lo, hi)`` post-processing ``buffer[lo:hi]``, once reduced.
            across: Optional ``fn(array)`` reducing this rank's slice with the other hosts'
                in place. Defaults to None (one host).
        """
        ufunc = _UFUNC[op]
        step = max(1, self.segment_bytes // buffer.itemsize)
        n, me = self.size, self.rank
        sync, comm = self.win.Sync, self.comm

        def barrier():
            # The ranks entered in step (the argument check came first): these waits are short,
            # so spin through them; only a rank held up by the scheduler makes the others sleep.
            sync()
            wait_politely(comm.Ibarrier(), spin=_SPIN_SECONDS)
            sync()

        def copy_out(lo, slots, edges):
            for r in range(n):
                if r != me and edges[r + 1] > edges[r]:
                    part = slice(edges[r], edges[r + 1])
                    np.copyto(buffer[lo + part.start : lo + part.stop], slots[r][part])
            if after is not None:
                after(lo, lo + slots[me].size)

        done = None  # (lo, slots, edges) of the segment reduced but not yet copied out
        for lo in range(0, buffer.size, step):
            hi = min(buffer.size, lo + step)
            count = hi - lo
            slots = self._slots(buffer.dtype, count)
            if before is None:
                np.copyto(slots[me], buffer[lo:hi])
            else:
                before(lo, hi, slots[me])
            # Past this barrier every rank has filled this segment and reduced its slice of
            # the previous one (which is why three sets of slots take turns: the set filled
            # next was copied out by everyone before they reached this barrier).
            barrier()
            if done is not None:
                copy_out(*done)
            edges = [count * i // n for i in range(n + 1)]
            a, b = edges[me], edges[me + 1]
            mine = buffer[lo + a : lo + b]
            if b > a:
                ufunc(slots[0][a:b], slots[1][a:b], out=mine)
                for r in range(2, n):
                    ufunc(mine, slots[r][a:b], out=mine)
            if across is not None:
                across(mine)  # every rank: its slice may be empty
            if b > a:
                np.copyto(slots[me][a:b], mine)
            done = (lo, slots, edges)
        if done is not None:
            barrier()
            copy_out(*done)
