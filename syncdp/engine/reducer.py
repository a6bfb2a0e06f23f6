"""The reduction engine: one bucket's members in, their reductions over all ranks out.

Every allreduce in syncdp (gradients, ``allreduce``, ``grouped_allreduce``) is a list of
buckets (:mod:`syncdp.engine.buckets`), and every bucket is reduced here, by a
:class:`BucketReducer` called with NumPy arrays on every rank:

1. **Pack.** Members are copied into one pooled, aligned buffer (:mod:`syncdp.engine.buffers`),
   each at an aligned offset, with the prescale folded into the copy. The first gradient
   bucket also carries every rank's step at its end (:mod:`syncdp.engine.steps`).
2. **Reduce.** Float32/64 and integer buffers are summed (or min/maxed) by MPI in place, in
   chunks of ``chunk_bytes``; each chunk is packed just before it is sent and finished
   (divided for Average, postscaled) just after, while it is still in cache. float16 and
   bfloat16 buffers cross MPI as bytes instead, because Open MPI adds float16 in scalar code
   and has no bfloat16: an ``Alltoall`` gives rank ``j`` every rank's ``j``-th shard, the
   rank reduces its shard in NumPy (in float32 beyond two ranks, so partial sums are not
   rounded at every addition), and an ``Allgather`` shares the reduced shards, the same traffic
   as a ring allreduce.
3. **Unpack.** The results are returned as aligned views of the buffer, which TensorFlow
   adopts without a copy; the pool hands the buffer out again only once every view is gone.

**Small buckets** (every rank's bytes together at most :data:`GATHER_BYTES`) take one
collective instead: each rank's packed row, headed by its step, goes to every rank in one
``Allgather``, and every rank sums the rows itself, in rank order. A small bucket costs the
latency of its collectives, not its bytes: the shared-memory plane's two barriers and the step
region's arithmetic cost several times one allgather of a few KB. Every rank reduces the same
rows in the same order, so the results are bit-identical everywhere, as on the other paths.

The engine knows nothing of TensorFlow: the TensorFlow face (:mod:`syncdp.tensorflow`) turns
tensors into arrays and calls it, eagerly or from an ordered graph node.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from syncdp.engine import steps as _steps
from syncdp.engine.buffers import BufferPool, Layout, aligned_empty
from syncdp.watch import stats as _stats

__all__ = ["OPS", "HALF_DTYPES", "GATHER_BYTES", "BucketReducer", "broadcast_bucket", "is_half"]

# What a bucket can do with its members over the ranks.
OPS = ("sum", "average", "min", "max", "product")

HALF_DTYPES = frozenset({"float16", "bfloat16"})

# How each op reaches MPI (an average is a sum, divided afterwards) and NumPy (half dtypes).
_MPI_OP = {"sum": "sum", "average": "sum", "min": "min", "max": "max", "product": "prod"}
_UFUNC = {
    "sum": np.add,
    "average": np.add,
    "min": np.minimum,
    "max": np.maximum,
    "product": np.multiply,
}
_NUMPY_OP = {"sum": np.sum, "average": np.sum, "min": np.min, "max": np.max, "product": np.prod}

# A bucket whose rows, one per rank, fit in this many bytes is gathered and summed by every
# rank (one collective) rather than reduced in place (a shared-memory plane's two barriers,
# or Open MPI's allreduce). At 2 ranks that is up to 128 KiB of gradients, at 16 up to 16 KiB:
# where moving the bytes costs less than a second synchronization.
GATHER_BYTES = 256 << 10

# Bytes in front of each gathered row: the rank's step, as an int64.
_HEADER = 8

# Buffers kept between steps, one set per bucket name.
_POOL = BufferPool()


def is_half(dtype) -> bool:
    """Whether ``dtype`` is reduced as bytes (float16, bfloat16) rather than by MPI."""
    return np.dtype(dtype).name in HALF_DTYPES


def _half_prescaled(values: np.ndarray, pre: float, dtype) -> np.ndarray:
    """A half-precision rank's values prescaled as Horovod does: in float32, rounded to the
    dtype."""
    return (np.asarray(values, np.float32) * np.float32(pre)).astype(dtype)


class BucketReducer:
    """Reduces the members of one bucket; built once per bucket, called once per step.

    Args:
        dtype: The NumPy dtype of every member.
        op: "sum", "average", "min", "max" or "product". Integer averages are truncated toward zero,
            as C (and Horovod) divide.
        prescale: Multiplies each member before the reduction. Defaults to 1.
        postscale: Multiplies each result after it. Defaults to 1.
        name: The bucket's name in the timeline and stall reports (``gradients.bucket0``).
        info: Extra fields for the timeline event. Defaults to none.
        carry_step: Carry every rank's step in this bucket and check they agree (sum and
            average only). Defaults to False.
    """

    def __init__(
        self,
        dtype,
        op: str,
        *,
        prescale: float = 1.0,
        postscale: float = 1.0,
        name: str,
        info: dict | None = None,
        carry_step: bool = False,
    ):
        if op not in OPS:
            raise ValueError(f"op must be one of {OPS}; got {op!r}.")
        if carry_step and op not in ("sum", "average"):
            raise ValueError("Only a sum or average bucket can carry the step.")
        self.dtype = np.dtype(dtype)
        self.dtype_name = self.dtype.name  # NumPy computes it in Python at every ask
        self.op = op
        self.prescale = float(prescale)
        # Half-precision sums are prescaled in float32 by the rank that adds the rows
        # (_combine); every other reduction is prescaled by each rank before its values leave,
        # so a joined rank's identity (join()) goes out as it is and stays neutral.
        self.scales_on_receipt = is_half(self.dtype) and op in ("sum", "average")
        self.postscale = float(postscale)
        self.name = name
        self.info = dict(info or {})
        self.carry_step = carry_step
        self.floating = self.dtype.kind == "f" or is_half(self.dtype)
        self._layouts: dict[tuple, Layout] = {}
        # By (member shapes, ranks, inline): (the records an inline plan is in, the plan).
        self._gather_plans: dict[tuple, tuple] = {}

    def __call__(
        self,
        comm,
        arrays: Sequence[np.ndarray],
        step: int | None = None,
        check_step: bool = True,
        *,
        check=None,
    ):
        """Reduces ``arrays`` over every rank of ``comm``.

        A synchronization point: every rank calls it with arrays of the same shapes.

        Args:
            comm: The :class:`~syncdp.transport.communicator.Communicator` to reduce over.
            arrays: The members, in the bucket's order.
            step: This rank's step, when the bucket carries it.
            check_step: Whether the ranks' steps must agree. False (the caller must pass the
                same on every rank): the step is still carried, and the agreed step is rank
                0's. Defaults to True.
            check: The argument check that must come first, or None when the caller made it:
                ``check(label)`` runs :meth:`Communicator.agree` (``label`` as there) and
                returns the ranks that have joined. A bucket whose packed members fit in
                ``comm.inline_bytes`` rides in the check's own records: the check and the
                reduction are one collective. Defaults to None.

        Returns:
            ``(results, agreed_step)``: the reduced members (aligned views of a pooled
            buffer, shaped like the inputs) and the step every rank agreed on (None when the
            bucket carries none).

        Raises:
            StepMismatchError: The bucket carries the step and the ranks' steps differ.
        """
        if self.carry_step:  # one gradient reduction per training step
            # Unchecked steps are taken while an elastic job re-forms: not a measure of it.
            _stats.RECORDER.step(comm.rank, measured=check_step)
        n = comm.size
        if check is not None:
            shapes = tuple([a.shape for a in arrays])
            plan = self._plan(comm, shapes, inline=True) if n > 1 else None
            if plan is not None:
                plan.fill(arrays, step)
                if not check(self.name):  # the check is the reduction: named as it
                    began = time.perf_counter()
                    done = self._finish_gathered(comm, plan, check_step)
                    # The check's time was waiting (the ranks' skew, and microseconds of
                    # transfer); reducing the rows is this bucket's own work on its bytes.
                    _stats.RECORDER.add("move", time.perf_counter() - began, plan.nbytes)
                    return done
                # A rank has joined: it runs this bucket's task, through the usual path.
            else:
                check(None)
        sizes = tuple(int(np.size(a)) for a in arrays)
        if n > 1 and n * (_HEADER + sum(sizes) * self.dtype.itemsize) <= GATHER_BYTES:
            return self._reduce_gathered(comm, arrays, step, check_step)
        flats = [np.asarray(a).reshape(-1) for a in arrays]
        step_elems = comm.size * _steps.limbs_for(self.dtype) if self.carry_step else 0
        layout = self._layout(sizes + ((step_elems,) if step_elems else ()))
        if is_half(self.dtype) and n > 1:
            buf = self._reduce_half(comm, flats, layout, step_elems, step)
        else:
            buf = self._reduce_in_place(comm, flats, layout, step_elems, step)
        agreed = None
        if step_elems:
            start = layout.offsets[-1]
            steps = _steps.decode(buf[start : start + step_elems], n)
            agreed = (
                _steps.agreement(comm, self.name).check(steps)
                if check_step
                else _steps.first_active(steps)
            )
        results = tuple(
            buf[off : off + size].reshape(np.shape(a))
            for off, size, a in zip(layout.offsets, sizes, arrays)
        )
        return results, agreed

    def _reduce_gathered(self, comm, arrays, step, check_step):
        """A small bucket: every rank's row (its step, then its packed members) gathered by
        every rank in one collective and reduced locally, in rank order. Same semantics as
        the other paths: the prescale on each rank's values, the average's division and the
        postscale after the reduction. Everything but the values is worked out once per
        bucket shape (:class:`_GatherPlan`): this path exists for its small fixed cost."""
        plan = self._plan(comm, tuple(np.shape(a) for a in arrays), inline=False)
        plan.fill(arrays, step)
        comm.allgather_bytes(
            plan.send,
            plan.rows,
            name=self.name,
            info=self.info,
            nbytes=plan.nbytes,
            dtype=self.dtype_name,
        )
        return self._finish_gathered(comm, plan, check_step)

    def _plan(self, comm, shapes: tuple, *, inline: bool) -> _GatherPlan | None:
        """The gathered path's plan for members of ``shapes`` on ``comm``, made at the first
        call and found again by the shapes at every step after (a small bucket's bookkeeping
        is all in it): with rows of its own, or (``inline``) in ``comm``'s argument-check
        records, None when the members do not fit there."""
        key = (shapes, comm.size, inline)
        known = self._gather_plans.get(key)
        # An inline plan is the records' own: a new communicator (an elastic reset) needs
        # a new one. The plan holds the records, not the communicator.
        if known is None or (inline and known[0] is not comm.record):
            sizes = tuple(int(np.prod(shape)) for shape in shapes)
            plan = None
            if not inline or self._layout(sizes).total * self.dtype.itemsize <= comm.inline_bytes:
                plan = _GatherPlan(self, shapes, comm, inline=inline)
            known = self._gather_plans[key] = (comm.record if inline else None, plan)
        return known[1]

    def _finish_gathered(self, comm, plan, check_step: bool = True):
        """The gathered rows reduced: ``(results, agreed step)``."""
        agreed = None
        if self.carry_step:
            steps = plan.steps.tolist()
            agreed = (
                _steps.agreement(comm, self.name).check(steps)
                if check_step
                else _steps.first_active(steps)
            )
        out = _POOL.take(plan.out_shelf, plan.total, self.dtype)
        plan.reduce(out)
        results = [
            out[lo:hi] if shape is None else out[lo:hi].reshape(shape)
            for lo, hi, shape in plan.results
        ]
        return tuple(results), agreed

    def _layout(self, sizes: tuple) -> Layout:
        layout = self._layouts.get(sizes)
        if layout is None:
            layout = self._layouts[sizes] = Layout(sizes, self.dtype.itemsize)
        return layout

    def _scales(self, n: int) -> tuple[float, float, int | None]:
        """(factor before the sum, factor after it, divisor after it or None)."""
        pre, post, divide = self.prescale, self.postscale, None
        if self.op == "average":
            if self.floating and n & (n - 1) == 0:
                pre /= n  # dividing by a power of two commutes exactly with the sum: fold it in
            else:
                divide = n  # sum first, then divide (truncating, for integers)
        return pre, post, divide

    def _write_step(self, buf, layout, step_elems, step, comm) -> int:
        """Writes the step region; returns where the members end (scaling stops there)."""
        if not step_elems:
            return layout.total
        start = layout.offsets[-1]
        _steps.encode(buf[start : start + step_elems], step, comm.rank, comm.size)
        return start

    def _reduce_in_place(self, comm, flats, layout, step_elems, step) -> np.ndarray:
        """Reduces the packed buffer in place, piece by piece (shared memory or MPI).

        Members are packed piece by piece just before each piece is reduced, straight into
        this rank's shared-memory slot when the ranks share a host. Even a bucket of one tensor
        is copied into the pooled buffer first on the MPI path: Open MPI reduces in place about
        twice as fast as from a separate send buffer (7 against 12 ms for 16 MiB here), which
        more than pays for the copy, made chunk by chunk while in cache.
        """
        dtype, floating = self.dtype, self.floating
        pre, post, divide = self._scales(comm.size)
        buf = _POOL.get(self.name, layout.total, dtype)
        members_end = self._write_step(buf, layout, step_elems, step, comm)
        members = list(zip(layout.offsets, (f.size for f in flats), flats))
        cursor = [0]  # first member not yet completely copied in

        def fill(lo, hi, out):
            # Writes elements [lo, hi) into out (buf[lo:hi] itself, or a shared-memory slot):
            # members scaled by the prescale, and the rest (padding, the step) from buf.
            at, m = lo, cursor[0]
            while m < len(members):
                off, size, src = members[m]
                if off >= hi:
                    break
                s, e = max(lo, off), min(hi, off + size)
                if s > at:
                    np.copyto(out[at - lo : s - lo], buf[at:s])
                if s < e:
                    dst, piece = out[s - lo : e - lo], src[s - off : e - off]
                    if pre == 1.0:
                        np.copyto(dst, piece)
                    elif floating:
                        np.multiply(piece, pre, out=dst)
                    else:
                        dst[...] = (piece * pre).astype(dtype)
                    at = e
                if off + size > hi:
                    break
                m += 1
            cursor[0] = m
            if at < hi:
                np.copyto(out[at - lo :], buf[at:hi])

        def finish(lo, hi):
            _scale_sum(buf[lo : min(hi, members_end)], divide, post, floating)

        mpi_op = _MPI_OP[self.op]
        comm.allreduce_inplace(
            buf,
            mpi_op,
            name=self.name,
            before=fill,
            after=finish if divide is not None or post != 1.0 else None,
            info=self.info,
            nbytes=sum(f.size for f in flats) * dtype.itemsize,
        )
        return buf

    def _reduce_half(self, comm, flats, layout, step_elems, step) -> np.ndarray:
        """Alltoall of shards, the rank's own shard reduced in NumPy, Allgather of results."""
        n, dtype = comm.size, self.dtype
        shard = -(-layout.total // n)
        send = _POOL.get(f"{self.name}.send", n * shard, dtype)
        members_end = self._write_step(send, layout, step_elems, step, comm)
        if self.prescale != 1.0 and not self.scales_on_receipt:  # packed prescaled
            flats = [_half_prescaled(f, self.prescale, dtype) for f in flats]
        _pack(send, layout, flats)
        received = _POOL.get(f"{self.name}.scatter", n * shard, dtype).reshape(n, shard)
        comm.alltoall(
            send.reshape(n, shard), name=f"{self.name}.scatter", out=received, info=self.info
        )
        # Which of this rank's shard elements are members (scaled) rather than step or padding.
        lo = comm.rank * shard
        scaled = max(0, min(shard, members_end - lo))
        mine = self._combine(received, scaled, n)
        gathered = _POOL.get(f"{self.name}.gather", n * shard, dtype)
        comm.allgather_equal(mine, name=f"{self.name}.gather", out=gathered, info=self.info)
        return gathered

    def scatter(self, comm, array: np.ndarray, counts: Sequence[int]) -> np.ndarray:
        """Reduce-scatter: reduces the flat ``array`` over the ranks; this rank keeps its piece.

        Rank ``j`` keeps ``counts[j]`` elements, starting at ``sum(counts[:j])``; prescale,
        postscale and the average are applied as for a bucket. A synchronization point.
        """
        flat = np.asarray(array).reshape(-1)
        n, me = comm.size, comm.rank
        if is_half(self.dtype) and n > 1:
            # Every rank sends rank j its piece; rank j reduces the n copies in float32.
            if self.prescale != 1.0 and not self.scales_on_receipt:
                flat = _half_prescaled(flat, self.prescale, self.dtype)
            rows, _ = comm.alltoallv(flat, counts, name=self.name)
            return self._combine(rows.reshape(n, counts[me]), counts[me], n)
        pre, post, divide = self._scales(n)
        send = flat * pre if pre != 1.0 else flat
        send = send.astype(self.dtype, copy=False)
        out = comm.reduce_scatter(send, counts, _MPI_OP[self.op], name=self.name, info=self.info)
        out = out.astype(self.dtype, copy=False)
        _scale_sum(out, divide, post, self.floating)
        return out

    def _combine(self, rows: np.ndarray, scaled: int, n: int) -> np.ndarray:
        """Reduces ``rows`` (``[n, shard]``) over axis 0; scales only the first ``scaled``.

        Scaling follows Horovod exactly: each rank's values are prescaled in float32 and
        rounded to the bucket's dtype (here for a sum or average; by the sending rank, with
        :func:`_half_prescaled`, for the other ops); the reduction is rounded to the dtype;
        the postscale (and the average's division) is applied to that in float32 and rounded
        once more. A sum is accumulated in float32 (partial sums are not rounded at every
        addition); a product is taken rank by rank in the dtype, as sequential multiplication
        would.
        """
        pre, post, divide = self._scales(n)
        factor = post / divide if divide is not None else post
        if self.op in ("sum", "average") and n == 2 and pre == 1.0 and factor == 1.0:
            return np.add(rows[0], rows[1])  # one addition in the dtype: rounded once
        wide = rows.astype(np.float32)
        if pre != 1.0 and self.scales_on_receipt:
            wide[:, :scaled] *= np.float32(pre)
            if self.prescale != 1.0:  # a user's prescale is rounded to the dtype, as Horovod's
                wide[:, :scaled] = wide[:, :scaled].astype(self.dtype)
        if self.op == "product":
            out = wide[0].astype(self.dtype)
            for row in wide[1:]:
                out = (out.astype(np.float32) * row).astype(self.dtype)
            out = out.astype(np.float32)
        else:
            out = _NUMPY_OP[self.op](wide, axis=0)
        if factor != 1.0:
            out = out.astype(self.dtype).astype(np.float32)
            out[:scaled] *= np.float32(factor)
        return out.astype(self.dtype)


class _GatherPlan:
    """A small bucket's gathered path for one list of member shapes and one group, worked out
    once: the row this rank sends (its step, then its packed members) and the rows it
    receives, as typed views, where each member is written and read back, and the reduction
    of the rows in rank order.

    The rows are the plan's own, or (``inline``) the communicator's argument-check records,
    which carry the step and the members after the checksum."""

    def __init__(self, reducer: BucketReducer, shapes: tuple, comm, *, inline: bool = False):
        dtype, n = reducer.dtype, comm.size
        sizes = tuple(int(np.prod(shape)) for shape in shapes)
        layout = reducer._layout(sizes)
        self.total = layout.total
        self.nbytes = sum(sizes) * dtype.itemsize
        payload = layout.total * dtype.itemsize
        if inline:
            start = 8  # after the checksum
            self.send, self.rows = comm.record, comm.records
        else:
            # Private buffers: no view of them outlives a call (results are copied out).
            start = 0
            self.send = aligned_empty(_HEADER + payload, np.uint8)
            self.send[...] = 0  # padding stays zero
            self.rows = aligned_empty(n * self.send.size, np.uint8).reshape(n, -1)
        values = start + _HEADER
        self.header = self.send[start:values].view(np.int64)
        self.values = self.send[values : values + payload].view(dtype)
        self.steps = self.rows[:, start:values].view(np.int64).reshape(n)
        self.members = self.rows[:, values : values + payload].view(dtype)
        # Where each member goes in this rank's row (shaped as it, so filling is one copy)
        # and where its result is read from the reduced buffer.
        spans = [(off, off + size) for off, size in zip(layout.offsets, sizes)]
        self.slots = [self.values[lo:hi].reshape(shape) for (lo, hi), shape in zip(spans, shapes)]
        self.results = [  # the shape None where the slice has it already
            (lo, hi, None if shape == (hi - lo,) else shape)
            for (lo, hi), shape in zip(spans, shapes)
        ]
        # The padding between members: zeroed at every fill when the records are shared
        # (another bucket's bytes may be there), once otherwise.
        ends = [hi for _, hi in spans]
        self.gaps = [(e, o) for e, o in zip(ends, [*layout.offsets[1:], self.total]) if o > e]
        self.inline = inline
        self.out_shelf = _POOL.shelf(f"{reducer.name}.out", self.total, dtype)
        self.half = is_half(dtype)
        pre, self.post, self.divide = reducer._scales(n)
        # Half: a sum's rows are scaled by _combine, in float32. A float prescale is of the
        # bucket's dtype, so that a 0-d member is scaled in that dtype under NumPy 1's casting
        # rules too.
        if self.half:
            self.pre = 1.0 if reducer.scales_on_receipt else pre
        else:
            self.pre = dtype.type(pre) if reducer.floating else pre
        self.ufunc = _UFUNC[reducer.op]
        self.floating, self.dtype, self.n = reducer.floating, dtype, n
        self._combine = reducer._combine

    def fill(self, arrays: Sequence[np.ndarray], step: int | None) -> None:
        """Writes this rank's row: its step, then its members (shaped as the plan's),
        prescaled."""
        self.header[0] = 0 if step is None else step
        values, pre = self.values, self.pre
        if self.inline:
            for lo, hi in self.gaps:
                values[lo:hi] = 0
        for dst, src in zip(self.slots, arrays):
            if pre == 1.0:
                np.copyto(dst, src)
            elif self.half:
                dst[...] = _half_prescaled(src, pre, self.dtype)
            elif self.floating:
                np.multiply(src, pre, out=dst)
            else:
                dst[...] = (np.asarray(src) * pre).astype(self.dtype)

    def reduce(self, out: np.ndarray) -> None:
        """Writes the reduction of the gathered rows into ``out``."""
        rows, n = self.members, self.n
        if self.half:
            np.copyto(out, self._combine(rows, self.total, n))
            return
        self.ufunc(rows[0], rows[1], out=out)
        for r in range(2, n):
            self.ufunc(out, rows[r], out=out)
        if self.divide is not None or self.post != 1.0:
            _scale_sum(out, self.divide, self.post, self.floating)


def _scale_sum(chunk: np.ndarray, divide: int | None, post: float, floating: bool) -> None:
    """Divides a reduced ``chunk`` by ``divide`` (an average; None: no division) and multiplies
    it by ``post``, in place. An integer chunk is divided exactly, rounding toward zero; with a
    postscale too it is scaled once by ``post / divide`` in double precision and rounded toward
    zero, as Horovod does (dividing first would round twice: 3 * 2 / 2 would give 2)."""
    if floating:
        if divide is not None:
            np.divide(chunk, divide, out=chunk)
        if post != 1.0:
            np.multiply(chunk, post, out=chunk)
    elif post != 1.0:
        factor = post / divide if divide is not None else post
        chunk[...] = (chunk * factor).astype(chunk.dtype)
    elif divide is not None:
        _truncating_divide(chunk, divide)


def _truncating_divide(values: np.ndarray, divisor: int) -> None:
    """Integer ``values //= divisor`` in place, rounding toward zero as C does."""
    negative = values < 0
    np.abs(values, out=values)
    np.floor_divide(values, divisor, out=values)
    np.negative(values, out=values, where=negative)


def _pack(buf: np.ndarray, layout: Layout, flats: Sequence[np.ndarray]) -> None:
    """Copies each flat member to its offset in ``buf``."""
    for off, src in zip(layout.offsets, flats):
        buf[off : off + src.size] = src


def broadcast_bucket(comm, arrays: Sequence[np.ndarray], root: int, *, name: str) -> tuple:
    """Rank ``root``'s ``arrays`` on every rank, packed into one buffer and one broadcast.

    A synchronization point: every rank passes arrays of the same shapes and one dtype.

    Returns:
        The root's values, shaped like ``arrays`` (views of one new buffer).
    """
    flats = [np.asarray(a).reshape(-1) for a in arrays]
    dtype = flats[0].dtype
    layout = Layout([f.size for f in flats], dtype.itemsize)
    buf = np.zeros(layout.total, dtype)
    if comm.rank == root:
        _pack(buf, layout, flats)
    buf = comm.broadcast(buf, root, name=name, in_place=True)
    return tuple(
        buf[off : off + f.size].reshape(np.shape(a))
        for off, f, a in zip(layout.offsets, flats, arrays)
    )
