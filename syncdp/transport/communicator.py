"""The communicator: MPI collectives on NumPy buffers, each one watched for stalls.

Everything syncdp sends between ranks goes through :class:`Communicator`. It owns a private
duplicate of an mpi4py communicator (``init()`` makes it), so user code that also uses
``MPI.COMM_WORLD`` can never match one of syncdp's messages. Every method is a synchronization
point: all ranks must call it, in the same order, with matching shapes and dtypes.

Each collective is numbered and announced to the :class:`~syncdp.watchdog.Watchdog` before it
starts, which is how a rank that never arrives is detected and named.

Across hosts, :meth:`Communicator.allreduce_inplace` can take a topology-aware path
(:meth:`Communicator.set_hierarchy`, :mod:`syncdp.transport.hosts_allreduce`): a reduction inside
each host, a ring allreduce of each segment among the hosts, and a share back, so each host
sends one copy of the data over the network instead of one per rank. Inside one host the bytes
move through a shared-memory window (:mod:`syncdp.transport.shm`) when the ranks can map one.

Under Open MPI's ULFM (elastic mode) a collective whose peer died fails with
``MPI_ERR_PROC_FAILED`` on the ranks that notice, while the others could wait for them forever.
So the first rank to notice revokes the communicator (every rank's pending and future
operations on it then fail with ``MPI_ERR_REVOKED``), and every rank raises
:class:`~syncdp.base.errors.RankFailureError` from the collective it was in.
"""

from __future__ import annotations

import pickle
import time
import zlib
from typing import Any

import cloudpickle
import numpy as np

from syncdp.base import mpi as _mpi
from syncdp.base.errors import CollectiveError, MismatchError, RankFailureError
from syncdp.base.settings import Config
from syncdp.transport import hosts_allreduce as _hosts
from syncdp.transport import shm as _shm
from syncdp.transport.waiting import wait_politely
from syncdp.watch import stats as _stats
from syncdp.watch.watchdog import Watchdog

__all__ = ["Communicator", "OPS", "JOINED", "signature_digest"]

_JOIN_TAG = 7301  # the only point-to-point message on syncdp's private communicator

# What a rank that has called join() sends in an argument check instead of a checksum (which is
# never negative): it stands in for the collective with an identity contribution.
JOINED = -1

# Every argument check moves one record per rank: the checksum, then a step and up to
# ``Communicator.inline_bytes`` of a small reduction's own bytes (so that the check and the
# reduction are one collective). Every check of a group has records of one size, whatever the
# collective, so ranks that call different collectives still exchange matching messages and
# learn that they differ. Among ranks of one host the records of all ranks together take about
# this many bytes; across hosts a record holds no payload.
CHECK_BYTES = 32 << 10
_RECORD_HEADER = 16  # int64 checksum, int64 step

# The reductions MPI does for syncdp; Average is a sum followed by a division (engine).
OPS = ("sum", "min", "max", "prod")
_UFUNC = {"sum": np.add, "min": np.minimum, "max": np.maximum, "prod": np.multiply}


def signature_digest(signature: tuple) -> int:
    """The checksum :meth:`Communicator.agree` exchanges for ``signature``."""
    return zlib.crc32(repr(_plain(signature)).encode())


def _plain(value):
    """``value`` with NumPy scalars as the Python numbers they equal, in tuples and lists too:
    NumPy 2 writes ``np.int64(1)`` where Python writes ``1``, and a rank that passes one
    (an epoch, a seed, a root) agrees with a rank that passes the other."""
    if isinstance(value, np.generic):
        return value.item()
    if type(value) in (tuple, list):
        return type(value)(_plain(v) for v in value)
    return value


def _last_to_join(order: list[int], rounds: list[int]) -> int:
    """The rank that called ``join()`` last: of those that took part in the fewest of the
    others' collectives while joined (none), the last in ``order``, rank 0's record of every
    rank's arrival."""
    least = min(rounds)
    return [r for r in order if rounds[r] == least][-1]


def _as_bytes(array: np.ndarray) -> np.ndarray:
    """A flat uint8 view, so any dtype (bfloat16 included) can be moved without arithmetic."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def _mismatch_message(name: str, everyone: list, ranks: list | None = None) -> str:
    """What each rank passed, from every rank's ``(collective name, signature)`` (or those of
    ``ranks``, in that order, when not every rank takes part).

    Ranks in different collectives (a rank that ran one more step, or a branch taken on one
    rank only) are named with their collectives; ranks in the same one, with the fields that
    differ. Fields are compared by name: the ranks' signatures need not have the same ones.
    """
    names = [n for n, _ in everyone]
    fields = [dict(sig) for _, sig in everyone]
    ranks = list(range(len(everyone))) if ranks is None else ranks
    keys = list(dict.fromkeys(k for f in fields for k in f))
    if len(set(names)) > 1:
        where = []
        for r, n, f in zip(ranks, names, fields):
            # The collective's name leads: fields that repeat it are left out.
            own = {k: v for k, v in f.items() if k != "name" and v != n}
            where.append(f"rank {r} in {n}" + (f" ({_fields(own, keys)})" if own else ""))
        at = "; ".join(where)
        return (
            f"{name}: the ranks are in different collectives ({at}). Every rank must call the "
            "same collectives in the same order: one rank ran more steps or collectives than "
            "another (uneven data: give every rank the same number of batches, as "
            "syncdp.data.tfrecord_dataset does), took a branch the others did not (such as `if "
            "rank() == 0:` around a call every rank must make), or named the same collective "
            "differently."
        )
    differ = [k for k in keys if len({repr(f.get(k, _ABSENT)) for f in fields}) > 1]
    passed = "; ".join(f"rank {r}: {_fields(f, differ)}" for r, f in zip(ranks, fields))
    hints = "".join(f" {FIELD_HINTS[k]}" for k in differ if k in FIELD_HINTS)
    return (
        f"{name}: ranks passed different {', '.join(differ) or 'arguments'} ({passed}). Every "
        "rank must call each collective with the same dtype, shape, op, root rank and name, in "
        f"the same order.{hints}"
    )


_ABSENT = object()

# The task joined ranks get for a collective the active ranks skip while a rank has joined.
NOTHING_TO_RUN: dict = {}

# Signature fields whose difference has a known cause: what to add to the error, by field.
FIELD_HINTS: dict[str, str] = {}


def _fields(fields: dict, keys: list, limit: int = 300) -> str:
    """``k=v, ...`` of ``keys`` that ``fields`` has, cut at ``limit`` characters."""
    text = ", ".join(f"{k}={fields[k]}" for k in keys if k in fields) or "no arguments"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Communicator:
    """Collectives over a group of MPI processes.

    Args:
        mpi_comm: The group to use, a duplicate private to syncdp; the Communicator owns it and
            frees it in :meth:`close`.
        config: Settings: chunk size, stall timeouts.
        timeline: Optional object with ``record(name, nbytes, dtype, start, end)``, told about
            every collective.
        job_comm: The job's communicator, whose rank numbers the watchdog's messages use.
            Defaults to ``MPI.COMM_WORLD``.
        revoke_with: Communicators to revoke along with this one. Defaults to none.
        scope: What stall reports call this group when it is not the whole job (a process
            set). Defaults to None: the whole job.

    Attributes:
        inline_bytes: Payload bytes an argument-check record carries (CHECK_BYTES).
        record: This rank's record for the next check: checksum, step, payload.
        records: Every rank's record, as the last check gathered them (``size`` rows).
    """

    def __init__(
        self, mpi_comm, config: Config, timeline=None, *, job_comm=None, revoke_with=(), scope=None
    ):
        self._MPI = _mpi.load()
        self.mpi = mpi_comm
        self.rank = self.mpi.Get_rank()
        self.size = self.mpi.Get_size()
        self.config = config
        # Most bytes per MPI message: the setting, until autotuning picks another.
        self.chunk_bytes = config.chunk_bytes
        self.timeline = timeline
        self.seq = 0
        self._checked_at: float | None = None  # when the last argument check began
        # Rank 0 in join(): every rank's arrival (its own included), in the order it saw them.
        self._join_notes: list[int] = []
        # The engine's step check across join()s (syncdp.engine.steps.agreement): its own.
        self.steps = None
        # Set once a rank of this group was found dead: nothing more can run on it.
        self.broken = False
        # Communicators to revoke along with this one (a process set's job communicator).
        self._revoke_with = tuple(revoke_with)
        # Topology-aware allreduce (set_hierarchy): this host's communicator, the one of the
        # ranks with this local rank, and whether every host runs as many ranks.
        self.hierarchy: tuple | None = None
        self.prefer_hierarchy = False
        # The shared-memory planes (syncdp.transport.shm), opened by the first allreduce that can
        # use one: "group" over all ranks (one host), "host" over this host's ranks (the
        # topology-aware path); None when this group cannot have that one.
        self._planes: dict[str, _shm.SharedPlane | None] = {}
        self.watchdog = Watchdog(self.mpi, config, job_comm, scope) if self.size > 1 else None
        # The argument check's records (CHECK_BYTES): this rank's, and every rank's as
        # gathered by the last check.
        self.inline_bytes = self._inline_capacity()
        self.record = np.zeros(_RECORD_HEADER + self.inline_bytes, np.uint8)
        self.records = np.zeros((self.size, self.record.size), np.uint8)
        self._digest = self.record[:8].view(np.int64)
        self._digests = self.records[:, :8].view(np.int64).reshape(self.size)

    def _inline_capacity(self) -> int:
        """Bytes of payload a record carries: a share of CHECK_BYTES, in 64-byte units, when
        every rank of the group shares one host (a collective); 0 across hosts or alone."""
        if self.size < 2 or not _shm.shares_one_host(self.mpi):
            return 0
        return max(0, (CHECK_BYTES // self.size - _RECORD_HEADER) // 64 * 64)

    def close(self) -> None:
        """Stops the watchdog and frees the MPI communicator (not a collective).

        A broken communicator (a rank died) is dropped instead of freed: freeing may wait for
        the dead rank.
        """
        if self.watchdog is not None:
            self.watchdog.stop(free=not self.broken)
            self.watchdog = None
        for plane in self._planes.values():
            if plane is not None:
                plane.close(collective=not self.broken)
        self._planes = {}
        if self.mpi != self._MPI.COMM_NULL:
            if not self.broken:
                self.mpi.Free()
            self.mpi = self._MPI.COMM_NULL

    def set_hierarchy(self, local_comm, cross_comm, use: bool, even: bool = True) -> None:
        """Gives :meth:`allreduce_inplace` the host structure for its topology-aware path.

        Args:
            local_comm: The ranks on this host (``MPI_Comm_split_type`` shared memory).
            cross_comm: The ranks with this rank's local rank (one per host, when even).
            use: Whether allreduces take the topology-aware path (``prefer_hierarchy``).
            even: Whether every host runs the same number of ranks. Defaults to True.
        """
        self.hierarchy = (local_comm, cross_comm, even)
        self.prefer_hierarchy = use

    def revoke(self) -> None:
        """Marks this group broken and revokes it (ULFM), so no rank waits on it any longer.

        Not a collective: one rank's revoke interrupts every rank's operations on the group.
        Without ULFM it only marks the communicator broken.
        """
        self.broken = True
        for comm in (self.mpi, *self._revoke_with):
            try:
                comm.Revoke()
            except (self._MPI.Exception, AttributeError, NotImplementedError):
                pass  # already revoked, or an MPI without ULFM

    def _failure(self, error, name: str) -> RankFailureError | None:
        """The RankFailureError for an MPI error that means a rank is gone; None otherwise."""
        MPI = self._MPI
        lost = {
            getattr(MPI, code, None)
            for code in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
        }
        if error.Get_error_class() not in lost - {None}:
            return None
        self.revoke()
        return RankFailureError(
            f"{name}: a rank of the job failed ({error.Get_error_string()}); the collective "
            "was abandoned on every rank."
        )

    def _run(
        self,
        name: str,
        fn,
        *,
        nbytes: int = 0,
        dtype: str = "",
        timeout=None,
        info: dict | None = None,
        record: bool = True,
        phase: str = "move",
    ):
        self.seq += 1
        if self.watchdog is not None:
            self.watchdog.enter(self.seq, name, timeout)
        start = began = time.perf_counter()
        if record and self._checked_at is not None:
            # The argument check just before belongs to this collective in the timeline: it
            # is where a rank waits for the others to arrive.
            start, self._checked_at = self._checked_at, None
        try:
            if self.broken:
                raise RankFailureError(f"{name}: a rank of this job has failed; recover first.")
            return fn()
        except self._MPI.Exception as e:
            failure = self._failure(e, name)
            if failure is None:
                raise
            raise failure from None
        finally:
            end = time.perf_counter()
            if self.watchdog is not None:
                self.watchdog.leave(self.seq)
            _stats.RECORDER.add(phase, end - began, nbytes)
            if self.timeline is not None and record:
                self.timeline.record(name, nbytes, dtype, start, end, **(info or {}))

    def _op(self, op: str):
        if op not in OPS:
            raise ValueError(f"op must be one of {OPS}; got {op!r}.")
        return getattr(self._MPI, op.upper())

    def agree(
        self,
        signature: tuple,
        *,
        name: str,
        digest: int | None = None,
        join=None,
        label: str | None = None,
        info: dict | None = None,
        nbytes: int = 0,
        dtype: str = "",
    ) -> tuple[int, ...]:
        """Checks that every rank passed the same ``signature`` to the collective ``name``.

        One collective of a fixed-size record per rank (:data:`CHECK_BYTES`), which starts with
        a checksum of the signature, when the ranks agree; only when they do not does a second
        one gather every rank's signature, so the error can say what each rank passed. A caller
        may put a small reduction's step and bytes in :attr:`record` first: the check then
        gathers them too (:class:`~syncdp.engine.reducer.BucketReducer`).

        Ranks that have called :meth:`join_round` (``join()``) answer the check too: the
        others then send them ``join()``'s task, a description of the collective for them to
        run with identity contributions (zeros for a sum); a collective without one cannot
        run while a rank has joined.

        Args:
            signature: ``(field, value)`` pairs that must match, e.g. dtype, shape, op, root.
            name: The collective's name, for the message.
            digest: ``signature_digest(signature)``, when the caller computed it once for
                every call (a traced step's fixed shapes). Defaults to computing it here.
            join: A callable returning the task a joined rank runs to stand in for this
                collective (see :mod:`syncdp.engine.joining`). Defaults to None: this
                collective cannot run while a rank has joined.
            label: What stall reports and the timeline call the check when it is the whole
                collective (a barrier, a small bucket riding in the records). Defaults to
                None: ``NAME.check``, left out of the timeline (it belongs to the collective
                after it).
            info: Extra fields of the timeline event, with ``label``. Defaults to None.
            nbytes: The payload bytes the timeline reports, with ``label``. Defaults to 0.
            dtype: The payload's dtype the timeline reports, with ``label``. Defaults to "".

        Returns:
            The ranks that have joined (they stand in for this collective), usually none.

        Raises:
            MismatchError: On every rank, when any two ranks' signatures differ.
            CollectiveError: A rank has joined and this collective has no ``join`` task.
        """
        if self.size == 1:
            return ()
        checked_at = time.perf_counter()
        self._digest[0] = signature_digest(signature) if digest is None else digest
        self._run(
            label or f"{name}.check",
            lambda: wait_politely(self.mpi.Iallgather(self.record, self.records)),
            record=label is not None,
            phase="wait",
            info=info,
            nbytes=nbytes,
            dtype=dtype,
        )
        digests = self._digests.tolist()
        if digests.count(digests[0]) == len(digests):
            if label is None:
                self._checked_at = checked_at
            return ()
        if min(digests) < 0:
            return self._serve_joined(signature, self._digests, name, join)
        raise MismatchError(_mismatch_message(name, self.mpi.allgather((name, _plain(signature)))))

    def allreduce(self, array: np.ndarray, op: str = "sum", *, name: str = "allreduce"):
        """Element-wise reduction of ``array`` over all ranks; every rank gets the result.

        Args:
            array: Contiguous data with an arithmetic dtype MPI knows (float16/32/64, ints).
            op: "sum", "min" or "max". Defaults to "sum".
            name: What the timeline and stall reports call this collective.

        Returns:
            A new array holding the reduction.
        """
        send = np.ascontiguousarray(array).reshape(-1)
        out = np.empty_like(send)

        def copy(lo, hi, dst):
            dst[...] = send[lo:hi]

        self.allreduce_inplace(out, op, name=name, before=copy)
        return out.reshape(np.shape(array))

    def allreduce_inplace(
        self,
        buffer: np.ndarray,
        op: str = "sum",
        *,
        name: str = "allreduce",
        before=None,
        after=None,
        info: dict | None = None,
        nbytes: int | None = None,
    ) -> np.ndarray:
        """Reduces a writable 1-D ``buffer`` over all ranks, in place, one piece at a time.

        When every rank of this group shares one host (and ``config.shared_memory`` allows
        it), the bytes move through a shared-memory window where each rank reduces its own
        slice (:mod:`syncdp.transport.shm`), in segments of about 1 MiB. Otherwise the buffer goes
        to MPI in chunks of ``config.chunk_bytes`` with ``MPI.IN_PLACE`` (Open MPI is several
        times faster on a few MiB that stay in cache than on one large message, and in place
        it skips its own copy of the send buffer), or through the topology-aware path across
        hosts. ``before(lo, hi, dst)`` writes elements ``[lo, hi)`` into ``dst`` just before
        they are reduced (``dst`` is ``buffer[lo:hi]``, or this rank's shared slot) and
        ``after(lo, hi)`` finishes ``buffer[lo:hi]`` just after, so packing, scaling and
        unpacking touch each piece while it is still in cache instead of making passes of
        their own over the whole buffer.

        A synchronization point: all ranks must call it in the same order with buffers of the
        same size and dtype. It is one collective for the watchdog and the timeline, however
        many pieces it takes.

        Args:
            buffer: A contiguous, writable 1-D array.
            op: "sum", "min" or "max". Defaults to "sum".
            name: What the timeline and stall reports call this collective.
            before: Optional ``fn(lo, hi, dst)`` that writes elements ``[lo, hi)`` into
                ``dst``. Defaults to None (``buffer`` already holds them).
            after: Optional ``fn(lo, hi)`` that post-processes ``buffer[lo:hi]``. Defaults to
                None.
            info: Extra fields for the timeline event. Defaults to None.
            nbytes: Bytes the timeline reports (the payload, without padding). Defaults to
                the whole buffer.

        Returns:
            ``buffer``, now holding the reduction.
        """
        step = max(1, self.chunk_bytes // max(1, buffer.itemsize))
        size = buffer.size
        if self.size == 1:  # no collective, only the local passes
            for lo in range(0, size, step):
                hi = min(size, lo + step)
                if before is not None:
                    before(lo, hi, buffer[lo:hi])
                if after is not None:
                    after(lo, hi)
            return buffer
        mpi, in_place, mpi_op = self.mpi, self._MPI.IN_PLACE, self._op(op)
        hierarchy = self.hierarchy if self.prefer_hierarchy else None

        def reduce():
            plane = self._shared_plane()
            if plane is not None:
                across = None
                if hierarchy is not None:  # this host's part; a ring among the hosts between
                    cross, ufunc = hierarchy[1], _UFUNC[op]
                    across = lambda piece: _hosts.ring_allreduce(cross, piece, ufunc)  # noqa: E731
                plane.allreduce(buffer, op, before=before, after=after, across=across)
                return
            for lo in range(0, size, step):
                hi = min(size, lo + step)
                if before is not None:
                    before(lo, hi, buffer[lo:hi])
                if hierarchy is None:
                    mpi.Allreduce(in_place, buffer[lo:hi], mpi_op)
                else:
                    _hosts.reduce_by_host(buffer[lo:hi], mpi_op, _UFUNC[op], *hierarchy)
                if after is not None:
                    after(lo, hi)

        nbytes = buffer.nbytes if nbytes is None else nbytes
        self._run(name, reduce, nbytes=nbytes, dtype=str(buffer.dtype), info=info)
        return buffer

    def moves_through_mpi(self) -> bool:
        """Whether an allreduce here sends its bytes through Open MPI in chunks (so the chunk
        size matters), not through a shared-memory plane. A collective the first time (it may
        open the plane): every rank must ask at the same point."""
        return self.size > 1 and self._shared_plane() is None

    def _shared_plane(self) -> _shm.SharedPlane | None:
        """The shared-memory plane for the current path, opened on first use (a collective:
        every rank is in the same allreduce when it happens): over the whole group when it
        shares one host; over this host's ranks when the topology-aware path runs across hosts
        with as many ranks on each; None otherwise or when switched off."""
        hierarchy = self.hierarchy if self.prefer_hierarchy else None
        kind = "group" if hierarchy is None else "host"
        if kind not in self._planes:
            plane = None
            if self.config.shared_memory == "off":
                pass
            elif hierarchy is None:
                plane = _shm.open_plane(self.mpi)
            elif hierarchy[2]:  # even: local rank i's slice is the same on every host
                plane = _shm.open_plane(hierarchy[0], agree_comm=self.mpi)
            self._planes[kind] = plane
        return self._planes[kind]

    def broadcast(
        self, array: np.ndarray, root: int = 0, *, name: str = "broadcast", in_place: bool = False
    ) -> np.ndarray:
        """Returns rank ``root``'s ``array`` on every rank (shapes and dtypes must match).

        With ``in_place`` a contiguous ``array`` itself receives the values; otherwise a copy
        does and ``array`` is left alone.
        """
        if in_place and array.flags.c_contiguous:
            buf = array
        else:
            buf = np.array(array, copy=True, order="C")
        if self.size > 1:
            raw = buf.reshape(-1).view(np.uint8)
            self._run(
                name,
                lambda: self.mpi.Bcast(raw, root=root),
                nbytes=buf.nbytes,
                dtype=str(buf.dtype),
            )
        return buf

    def allgather(self, array: np.ndarray, *, name: str = "allgather") -> np.ndarray:
        """Concatenates every rank's ``array`` along axis 0, in rank order.

        The first dimension may differ between ranks; the others must match.
        """
        array = np.ascontiguousarray(array)
        if self.size == 1:
            return array.copy()
        if array.ndim == 0:
            array = array.reshape(1)
        rows = self._run(f"{name}.sizes", lambda: self.mpi.allgather(array.shape[0]))
        row_bytes = array.itemsize * int(np.prod(array.shape[1:], dtype=np.int64))
        counts = [r * row_bytes for r in rows]
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64).tolist()
        out = np.empty((sum(rows),) + array.shape[1:], dtype=array.dtype)
        recv = out.reshape(-1).view(np.uint8)
        self._run(
            name,
            lambda: self.mpi.Allgatherv(_as_bytes(array), [recv, counts, displs, self._MPI.BYTE]),
            nbytes=array.nbytes,
            dtype=str(array.dtype),
        )
        return out

    def alltoall(self, array: np.ndarray, *, name: str = "alltoall", out=None, info=None):
        """Row ``j`` of ``array`` goes to rank ``j``; row ``j`` of the result came from rank ``j``.

        Moves bytes only (no arithmetic), so any dtype works. ``array`` has shape
        ``[size, ...]`` on every rank, the same everywhere. ``out``, if given, receives the
        result (same shape and dtype).
        """
        array = np.ascontiguousarray(array)
        out = np.empty_like(array) if out is None else out.reshape(array.shape)
        if self.size == 1:
            out[...] = array
            return out
        return self._move_bytes(name, self.mpi.Alltoall, array, out, info)

    def alltoallv(self, array: np.ndarray, splits, *, name: str = "alltoall"):
        """Sends ``splits[j]`` consecutive rows of ``array`` to rank ``j``; any dtype.

        Args:
            array: Shape ``[sum(splits), ...]``; the trailing dimensions match on every rank.
            splits: Rows for each rank, ``size`` non-negative integers.
            name: What the timeline and stall reports call this collective.

        Returns:
            ``(received, received_splits)``: the rows from rank 0, then rank 1, ..., and how
            many came from each.
        """
        array = np.ascontiguousarray(array)
        send_rows = np.asarray(splits, dtype=np.int64).reshape(-1)
        if self.size == 1:
            return array.copy(), send_rows.copy()
        recv_rows = np.empty(self.size, dtype=np.int64)
        self._run(f"{name}.splits", lambda: self.mpi.Alltoall(send_rows, recv_rows))
        row_bytes = array.itemsize * int(np.prod(array.shape[1:], dtype=np.int64))
        out = np.empty((int(recv_rows.sum()),) + array.shape[1:], dtype=array.dtype)

        def spec(buf, rows):
            counts = (rows * row_bytes).tolist()
            displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64).tolist()
            return [_as_bytes(buf), counts, displs, self._MPI.BYTE]

        self._run(
            name,
            lambda: self.mpi.Alltoallv(spec(array, send_rows), spec(out, recv_rows)),
            nbytes=array.nbytes,
            dtype=str(array.dtype),
        )
        return out, recv_rows

    def reduce_scatter(self, array: np.ndarray, counts, op: str = "sum", *, name: str, info=None):
        """Reduces the 1-D ``array`` over all ranks; rank ``j`` keeps ``counts[j]`` elements.

        Rank ``j``'s piece starts at ``sum(counts[:j])``. MPI does the arithmetic, so the
        dtype must be one MPI reduces (not float16/bfloat16; the engine handles those).
        """
        array = np.ascontiguousarray(array).reshape(-1)
        counts = [int(c) for c in counts]
        if self.size == 1:
            return array.copy()
        out = np.empty(counts[self.rank], dtype=array.dtype)
        self._run(
            name,
            lambda: self.mpi.Reduce_scatter(array, out, counts, op=self._op(op)),
            nbytes=array.nbytes,
            dtype=str(array.dtype),
            info=info,
        )
        return out

    def allgather_equal(self, array: np.ndarray, *, name: str = "allgather", out=None, info=None):
        """Like :meth:`allgather` when every rank's ``array`` has the same shape: one collective
        instead of two (no sizes to exchange). Returns shape ``[size, *array.shape]``, in
        ``out`` if given."""
        array = np.ascontiguousarray(array)
        shape = (self.size,) + array.shape
        out = np.empty(shape, dtype=array.dtype) if out is None else out.reshape(shape)
        if self.size == 1:
            out[0] = array
            return out
        return self._move_bytes(name, self.mpi.Allgather, array, out, info)

    def allgather_bytes(
        self,
        send: np.ndarray,
        out: np.ndarray,
        *,
        name: str,
        info=None,
        nbytes: int | None = None,
        dtype: str = "uint8",
    ):
        """:meth:`allgather_equal` of raw bytes, for callers that keep their buffers: ``send``
        is a contiguous uint8 array, ``out`` a contiguous one ``size`` times larger.
        ``nbytes`` and ``dtype`` say what the timeline reports (the caller's payload);
        defaults: all of ``send``, as bytes."""
        self._run(
            name,
            lambda: self.mpi.Allgather(send, out),
            nbytes=send.nbytes if nbytes is None else nbytes,
            dtype=dtype,
            info=info,
        )
        return out

    def _move_bytes(self, name: str, collective, array: np.ndarray, out: np.ndarray, info):
        """Runs ``collective(send, recv)`` (e.g. ``Alltoall``) on both arrays' raw bytes."""
        self._run(
            name,
            lambda: collective(_as_bytes(array), _as_bytes(out)),
            nbytes=array.nbytes,
            dtype=str(array.dtype),
            info=info,
        )
        return out

    def enter(self, name: str, *, unless_joined: bool = False, **fields) -> tuple[int, ...]:
        """The argument check of an operation that runs several collectives of its own (a
        checkpoint's save, adding a process set), made as the operation begins: every rank
        must be entering ``name``. A rank that skipped it (a call wrapped in ``if rank() ==
        0:``) or is in another collective makes every rank raise MismatchError at once,
        naming where each rank is, instead of collectives that pair wrongly. Returns once
        every rank has entered (a barrier). ``fields`` must match too (e.g. ``step=``).

        Args:
            name: The operation.
            unless_joined: While a rank has called ``join()``, the caller skips the operation
                (the joined ranks stand in with nothing to run) instead of raising. Defaults
                to False.
            **fields: More ``(name, value)`` pairs every rank must pass alike.

        Returns:
            The ranks that have joined (with ``unless_joined``: skip the operation if any).

        Raises:
            MismatchError: On every rank, when a rank is in another collective.
            CollectiveError: A rank has called ``join()`` (without ``unless_joined``).
        """
        return self.agree(
            (("collective", name), *fields.items()),
            name=name,
            label=name,
            join=(lambda: NOTHING_TO_RUN) if unless_joined else None,
        )

    def barrier(self, *, name: str = "barrier", timeout=None) -> None:
        """Returns once every rank has called it. Not checked: for ranks that are known to
        be in step (see :meth:`enter`)."""
        if self.size > 1:
            self._run(
                name, lambda: wait_politely(self.mpi.Ibarrier()), timeout=timeout, phase="wait"
            )

    def _serve_joined(self, signature: tuple, digests, name: str, join) -> tuple[int, ...]:
        """The active ranks' half of a collective some ranks have joined: every rank learns
        what the active ranks run, and the joined ranks run it with them (see
        :meth:`join_round`). Returns the joined ranks."""
        joined = tuple(int(r) for r in np.flatnonzero(digests < 0))
        task = join() if join is not None else None
        everyone = self._run(f"{name}.join", lambda: self.mpi.allgather((name, signature, task)))
        active = [r for r, e in enumerate(everyone) if e is not None]
        if any(everyone[r][1] != everyone[active[0]][1] for r in active):
            signatures = [everyone[r][:2] for r in active]
            raise MismatchError(_mismatch_message(name, signatures, active))
        if task is None:
            who = ", ".join(str(r) for r in joined)
            raise CollectiveError(
                f"{name}: rank(s) {who} have called join(), and this collective cannot run "
                "without them. While a rank has joined, the others can run allreduce, "
                "grouped_allreduce, allgather and gradient reductions (the joined ranks add "
                "nothing); "
                "call join() on every rank before any other collective."
            )
        return joined

    def join_round(self, served: int, *, name: str = "join"):
        """One round of a joined rank's wait in ``join()``: answers the next argument check.

        A rank that has joined takes part in every argument check of the others (sending
        :data:`JOINED` instead of a checksum) until every rank has joined. It waits without a
        stall timeout: the others may train for long between collectives.

        Args:
            served: How many collectives this rank has stood in for since it joined.
            name: What stall reports call the wait.

        Returns:
            None once every rank has joined; otherwise the task the active ranks sent (what
            to run with identity contributions), or False when there is nothing to run (the
            collective cannot take joined ranks, or its ranks disagree: they raise).
        """
        self._digest[0] = JOINED
        digests = self._digests

        def wait():
            request = self.mpi.Iallgather(self.record, self.records)
            if self.rank != 0:
                return wait_politely(request)
            while not request.Test():  # rank 0 hears the others arrive meanwhile, in order
                self._join_notes += self._received_join_notes()
                time.sleep(100e-6)

        self._run(
            f"{name} (rank {self.rank} joined, {served} served)",
            wait,
            timeout=-1,
            phase="wait",
        )
        if (digests < 0).all():
            return None
        everyone = self._run(f"{name}.task", lambda: self.mpi.allgather(None))
        active = [e[1:] for e in everyone if e is not None]  # (signature, task)
        if any(e != active[0] for e in active) or active[0][1] is None:
            return False
        return active[0][1]

    def join_arrive(self) -> None:
        """Notes this rank's arrival in ``join()`` on rank 0's clock (a message to rank 0; not
        a collective)."""
        self._join_notes = []
        if self.size == 1:
            return
        if self.rank != 0:
            self.mpi.send(None, dest=0, tag=_JOIN_TAG)
            return
        self._join_notes = [*self._received_join_notes(), 0]

    def _received_join_notes(self) -> list[int]:
        """The ranks whose arrival notes have reached rank 0, in the order received."""
        status, sources = self._MPI.Status(), []
        while self.mpi.iprobe(source=self._MPI.ANY_SOURCE, tag=_JOIN_TAG):
            self.mpi.recv(source=self._MPI.ANY_SOURCE, tag=_JOIN_TAG, status=status)
            sources.append(status.Get_source())
        return sources

    def join_last(self, rounds: int, *, name: str = "join") -> int:
        """Once every rank has joined: the rank that arrived last, the same on every rank.

        Args:
            rounds: In how many of the others' collectives this rank took part in ``join()``
                (stood in for, or answered the argument check of).

        A rank that arrived before another's collective took part in it; the last to arrive
        took part in none. Ranks that took part in none (that arrived with no collective
        between them) are ordered on one clock, rank 0's (:meth:`join_arrive`): the notes
        waiting when rank 0 arrived came before it, and it receives the rest as they come
        while it waits in :meth:`join_round`. Clocks of different hosts are never compared.
        The notes alone cannot order ranks a collective separates: a note can reach rank 0
        after a collective its sender took part in later (relayed by another rank).
        """
        if self.size == 1:
            return 0
        MPI = self._MPI

        def run():
            rounds_of = self.mpi.allgather(rounds)
            if self.rank != 0:
                return self.mpi.bcast(None, root=0)
            status = MPI.Status()
            order = list(self._join_notes)
            for _ in range(self.size - len(order)):
                self.mpi.recv(source=MPI.ANY_SOURCE, tag=_JOIN_TAG, status=status)
                order.append(status.Get_source())
            return self.mpi.bcast(_last_to_join(order, rounds_of), root=0)

        return self._run(name, run)

    def all_agree(self, flag: int, *, name: str = "agree") -> int:
        """The bitwise AND of every rank's ``flag``, the same on every rank even when a rank
        fails meanwhile (ULFM's fault-tolerant agreement; a plain allreduce without ULFM).

        Raises:
            RankFailureError: On every surviving rank alike, when a rank of the group is gone.
        """
        if self.size == 1:
            return flag
        if hasattr(self.mpi, "Agree") and self.config.elastic:
            return self._run(name, lambda: self.mpi.Agree(flag))
        return self._run(name, lambda: self.mpi.allreduce(flag, op=self._MPI.BAND))

    def broadcast_object(self, obj: Any, root: int = 0, *, name: str = "broadcast_object"):
        """Returns rank ``root``'s ``obj`` on every rank: the root gets ``obj`` itself, the
        others an unpickled copy.

        Objects travel pickled by cloudpickle, as Horovod's do, so lambdas and functions or
        classes defined in ``__main__`` or inside a function can be sent. The root pickles
        first and tells everyone whether it could: an object that cannot be pickled raises
        :class:`~syncdp.base.errors.CollectiveError` on every rank, naming the root and the
        cause, instead of leaving the others waiting for bytes that never come.
        """
        payload, problem = None, None
        if self.rank == root:
            payload, problem = _pickled(obj)
        if self.size == 1:
            _raise_if_failed(name, {root: problem})
            return obj

        def run():
            head = self.mpi.bcast((problem, len(payload) if payload else 0), root=root)
            if head[0] is not None:
                return head
            raw = payload if self.rank == root else bytearray(head[1])
            self.mpi.Bcast([raw, self._MPI.BYTE], root=root)
            return None, raw

        failed, raw = self._run(name, run)
        _raise_if_failed(name, {root: failed})
        return obj if self.rank == root else pickle.loads(raw)

    def allgather_object(self, obj: Any, *, name: str = "allgather_object", timeout=None):
        """Returns the list of every rank's ``obj`` (unpickled copies, this rank's too), in rank
        order.

        Objects travel pickled by cloudpickle, as in :meth:`broadcast_object`. A rank whose
        object cannot be pickled still takes part: every rank then raises
        :class:`~syncdp.base.errors.CollectiveError` naming it and the cause.
        """
        payload, problem = _pickled(obj)
        if self.size == 1:
            _raise_if_failed(name, {0: problem})
            return [pickle.loads(payload)]
        everyone = self._run(name, lambda: self.mpi.allgather(problem or payload), timeout=timeout)
        _raise_if_failed(name, {r: p for r, p in enumerate(everyone) if isinstance(p, str)})
        return [pickle.loads(p) for p in everyone]


def _pickled(obj: Any) -> tuple[bytes | None, str | None]:
    """``(pickle of obj, None)``, or ``(None, why not)`` when it cannot be pickled.

    cloudpickle pickles functions and classes that plain pickle can only name (lambdas, those
    of ``__main__`` or defined inside a function) by value; plain ``pickle.loads`` reads it.
    """
    try:
        return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), None
    except Exception as e:  # noqa: BLE001 - any pickling failure must reach every rank
        return None, f"{type(e).__name__}: {e}"


def _raise_if_failed(name: str, problems: dict) -> None:
    """Raises CollectiveError naming every rank whose input could not be sent."""
    failed = {r: p for r, p in problems.items() if p is not None}
    if failed:
        who = "; ".join(f"rank {r}: {p}" for r, p in sorted(failed.items()))
        raise CollectiveError(
            f"{name}: could not send the object of {who}. Every rank's object must be "
            "picklable; the collective was abandoned on every rank and the job goes on."
        )
