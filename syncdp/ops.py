"""TensorFlow collectives: allreduce, allgather, broadcast on tensors, eagerly and in tf.function.

Each op hands NumPy buffers to the :class:`~syncdp.comm.Communicator`, eagerly or as an ordered
graph node (:mod:`syncdp.graph`), so the collectives of a traced step run in the same order on
every rank. Float32/64 and integer buckets are summed by MPI in one pass
(:func:`_bucket_reducer`); float16 and bfloat16 buckets travel as bytes and are summed by
TensorFlow (:mod:`syncdp.halfreduce`), because MPI's and NumPy's half-precision arithmetic is
scalar code, several times slower than moving the bytes.

Every function here is a synchronization point: all ranks must call it, in the same order, with
tensors of the same dtype and (except allgather's first dimension) the same shape.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from syncdp import comm as _comm
from syncdp import halfreduce, runtime
from syncdp.compression import Compression
from syncdp.fusion import BufferPool, Layout, pack, plan_buckets, unpack
from syncdp.graph import ordered_call

__all__ = [
    "ReduceOp",
    "Average",
    "Sum",
    "Min",
    "Max",
    "allreduce",
    "grouped_allreduce",
    "allgather",
    "broadcast",
    "broadcast_variables",
    "broadcast_object",
    "allgather_object",
    "barrier",
    "join",
]


class ReduceOp(enum.Enum):
    """How allreduce combines the ranks' tensors."""

    AVERAGE = "average"
    SUM = "sum"
    MIN = "min"
    MAX = "max"


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX

_MPI_OPS = {Average: _comm.SUM, Sum: _comm.SUM, Min: _comm.MIN, Max: _comm.MAX}
_REDUCIBLE = {
    tf.float16,
    tf.bfloat16,
    tf.float32,
    tf.float64,
    tf.int32,
    tf.int64,
    tf.uint8,
    tf.int8,
    tf.int16,
    tf.uint16,
    tf.uint32,
    tf.uint64,
}

# Fused allreduce buffers, kept between steps (see syncdp.fusion.BufferPool).
_POOL = BufferPool()


def _resolve_op(op, average) -> ReduceOp:
    if op is not None and average is not None:
        raise ValueError("allreduce takes op or the deprecated average, not both.")
    if average is not None:
        return Average if average else Sum
    op = Average if op is None else op
    if not isinstance(op, ReduceOp):
        raise ValueError(f"op must be one of syncdp.Average, Sum, Min, Max; got {op!r}.")
    return op


def _bucket_reducer(
    comm,
    dtype: np.dtype,
    op: ReduceOp,
    prescale: float,
    postscale: float,
    name: str,
    info: dict,
):
    """The NumPy function that reduces one bucket: its members in, their reductions out.

    Members are copied (and scaled) into an aligned pooled buffer chunk by chunk, each chunk
    reduced in place right after it is filled, and the results returned as aligned views of
    the buffer, which TensorFlow adopts without copying. The whole bucket thus costs one pass
    over memory on top of MPI's own, whatever the number of members.
    """
    floating = np.issubdtype(dtype, np.floating)
    n = comm.size
    pre, post, divide = float(prescale), float(postscale), None
    if op is Average:
        if floating and n & (n - 1) == 0:
            pre /= n  # dividing by a power of two commutes exactly with the sum: fold it in
        else:
            divide = n  # sum first, then divide (floor-divide for integers), chunk by chunk
    layouts: dict[tuple, Layout] = {}

    def reduce(*arrays):
        flats = [a.reshape(-1) for a in arrays]
        sizes = tuple(f.size for f in flats)
        layout = layouts.get(sizes)
        if layout is None:
            layout = layouts[sizes] = Layout(sizes, dtype.itemsize)
        buf = _POOL.get(name, layout.total, dtype)
        members = list(zip(layout.offsets, sizes, flats))
        cursor = [0]  # first member not yet completely copied in

        def fill(lo, hi):
            m = cursor[0]
            while m < len(members):
                off, size, src = members[m]
                if off >= hi:
                    break
                s, e = max(lo, off), min(hi, off + size)
                if s < e:
                    dst = buf[s:e]
                    piece = src[s - off : e - off]
                    if pre == 1.0:
                        np.copyto(dst, piece)
                    elif floating:
                        np.multiply(piece, pre, out=dst)
                    else:
                        dst[...] = (piece * pre).astype(dtype)
                if off + size > hi:
                    break
                m += 1
            cursor[0] = m

        def finish(lo, hi):
            chunk = buf[lo:hi]
            if divide is not None:
                if floating:
                    np.divide(chunk, divide, out=chunk)
                else:
                    np.floor_divide(chunk, divide, out=chunk)
            if post != 1.0:
                if floating:
                    np.multiply(chunk, post, out=chunk)
                else:
                    chunk[...] = (chunk * post).astype(dtype)

        needs_finish = divide is not None or post != 1.0
        comm.allreduce_inplace(
            buf,
            _MPI_OPS[op],
            name=name,
            before=fill,
            after=finish if needs_finish else None,
            info=info,
            nbytes=sum(sizes) * dtype.itemsize,
        )
        return tuple(
            buf[off : off + size].reshape(a.shape) for (off, size, _), a in zip(members, arrays)
        )

    return reduce


def _reduce_bucket(
    members: list, op: ReduceOp, prescale: float, postscale: float, name: str, bucket: int
):
    """Allreduces tensors of one dtype as one fused buffer; returns the reduced tensors."""
    info = {"bucket": bucket, "tensors": len(members), "op": op.value}
    if members[0].dtype in halfreduce.HALF_DTYPES:
        return halfreduce.reduce_bucket(members, op.value, prescale, postscale, name, info)
    comm = runtime.communicator()
    dtype = np.dtype(members[0].dtype.as_numpy_dtype)
    fn = _bucket_reducer(comm, dtype, op, prescale, postscale, name, info)
    return ordered_call(fn, members, [m.dtype for m in members], [m.shape for m in members], name)


def _fused_allreduce(tensors, op, compression, prescale, postscale, threshold, name):
    comm = runtime.communicator()
    for t in tensors:  # the same error at any size, so a 1-rank test catches it
        if t.dtype not in _REDUCIBLE:
            raise TypeError(
                f"allreduce cannot reduce {t.dtype.name} tensors; use a float or integer dtype."
            )
    if comm.size == 1 and prescale == 1.0 and postscale == 1.0:
        return list(tensors)
    if threshold is None:
        threshold = runtime.get_config().fusion_threshold
    wire, ctxs = [], []
    for t in tensors:
        sent, ctx = compression.compress(t)
        if sent.dtype not in _REDUCIBLE:
            raise TypeError(
                f"allreduce cannot reduce {sent.dtype.name} tensors; use a float or integer dtype."
            )
        wire.append(sent)
        ctxs.append(ctx)
    results = [None] * len(wire)
    for b, bucket in enumerate(plan_buckets(wire, threshold)):
        members = [wire[i] for i in bucket.indices]
        with tf.name_scope(f"syncdp_bucket{b}"):
            reduced = _reduce_bucket(members, op, prescale, postscale, f"{name}.bucket{b}", b)
        for i, piece in zip(bucket.indices, reduced):
            results[i] = piece
    out = []
    for t, r, ctx in zip(tensors, results, ctxs):
        r = compression.decompress(r, ctx)
        out.append(r if r.dtype == t.dtype else tf.cast(r, t.dtype))
    return out


def _allreduce_sparse(slices: tf.IndexedSlices, op: ReduceOp, name: str) -> tf.IndexedSlices:
    """Allreduce of IndexedSlices as Horovod does it: gather every rank's rows and indices."""
    if op not in (Average, Sum):
        raise ValueError(f"IndexedSlices can only be reduced with Average or Sum; got {op}.")
    values = allgather(slices.values, name=f"{name}.values")
    indices = allgather(slices.indices, name=f"{name}.indices")
    if op is Average:
        values = values / tf.cast(runtime.size(), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


@tf.autograph.experimental.do_not_convert
def grouped_allreduce(
    tensors: Sequence,
    average=None,
    device_dense: str = "",
    device_sparse: str = "",
    compression=Compression.none,
    op=None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
    *,
    fusion_threshold: int | None = None,
) -> list:
    """Allreduces a list of tensors in as few fused collectives as the threshold allows.

    A synchronization point: every rank must call it with the same list of shapes and dtypes, in
    the same order relative to other collectives.

    Args:
        tensors: Tensors, ``tf.IndexedSlices`` (gathered, as Horovod does) or None (passed
            through).
        average: Deprecated Horovod spelling: True for Average, False for Sum.
        device_dense: Accepted for Horovod compatibility; placement follows the inputs.
        device_sparse: Accepted for Horovod compatibility.
        compression: ``Compression.none`` or ``Compression.fp16``. Defaults to none.
        op: ``Average``, ``Sum``, ``Min`` or ``Max``. Defaults to ``Average``.
        prescale_factor: Multiplies each tensor before the reduction. Defaults to 1.
        postscale_factor: Multiplies each result after it. Defaults to 1.
        name: Name of the collective in the timeline. Defaults to "grouped_allreduce".
        fusion_threshold: Bytes per fused buffer. Defaults to the configured threshold.

    Returns:
        The reduced tensors, in the order given.

    Example:
        >>> a, b = syncdp.grouped_allreduce([tf.ones(3), tf.ones(2)], op=syncdp.Sum)
    """
    op = _resolve_op(op, average)
    name = name or "grouped_allreduce"
    dense_at = [
        i for i, t in enumerate(tensors) if t is not None and not isinstance(t, tf.IndexedSlices)
    ]
    results = list(tensors)
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            results[i] = _allreduce_sparse(t, op, f"{name}.sparse{i}")
    if dense_at:
        dense = [tf.convert_to_tensor(tensors[i]) for i in dense_at]
        reduced = _fused_allreduce(
            dense, op, compression, prescale_factor, postscale_factor, fusion_threshold, name
        )
        for i, r in zip(dense_at, reduced):
            results[i] = r
    return results


@tf.autograph.experimental.do_not_convert
def allreduce(
    tensor,
    average=None,
    device_dense: str = "",
    device_sparse: str = "",
    compression=Compression.none,
    op=None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
):
    """Reduces ``tensor`` over all ranks; every rank gets the result.

    A synchronization point: all ranks must call it, in the same order, with the same shape and
    dtype. Differentiable: the gradient of an allreduce is the allreduce of the gradient.

    Args:
        tensor: A tensor (float16/32/64, bfloat16, int32/64, ...) or ``tf.IndexedSlices``.
        average: Deprecated Horovod spelling: True for Average, False for Sum.
        device_dense: Accepted for Horovod compatibility; placement follows the input.
        device_sparse: Accepted for Horovod compatibility.
        compression: ``Compression.none`` or ``Compression.fp16``. Defaults to none.
        op: ``Average``, ``Sum``, ``Min`` or ``Max``. Defaults to ``Average``. Integer
            averages are floor-divided.
        prescale_factor: Multiplies the tensor before the reduction. Defaults to 1.
        postscale_factor: Multiplies the result after it. Defaults to 1.
        name: Name of the collective in the timeline. Defaults to "allreduce".

    Returns:
        The reduced tensor, same shape and dtype.

    Raises:
        NotInitializedError: ``syncdp.init()`` has not been called.

    Example:
        >>> total = syncdp.allreduce(tf.constant([1.0 * syncdp.rank()]), op=syncdp.Sum)
    """
    op = _resolve_op(op, average)
    name = name or "allreduce"
    if isinstance(tensor, tf.IndexedSlices):
        return _allreduce_sparse(tensor, op, name)
    runtime.communicator()

    @tf.custom_gradient
    def reduce(x):
        y = _fused_allreduce([x], op, compression, prescale_factor, postscale_factor, 0, name)[0]

        def grad(dy):
            return _fused_allreduce(
                [dy], op, compression, postscale_factor, prescale_factor, 0, f"{name}.grad"
            )[0]

        return y, grad

    tensor = tf.convert_to_tensor(tensor)
    if not tensor.dtype.is_floating:  # custom_gradient wants differentiable inputs
        return _fused_allreduce(
            [tensor], op, compression, prescale_factor, postscale_factor, 0, name
        )[0]
    return reduce(tensor)


@tf.autograph.experimental.do_not_convert
def allgather(tensor, name: str | None = None) -> tf.Tensor:
    """Concatenates every rank's ``tensor`` along its first dimension, in rank order.

    A synchronization point. The first dimension may differ between ranks; the rest must match.

    Args:
        tensor: A tensor of any dtype and rank >= 1 (a scalar is gathered as shape [1]).
        name: Name of the collective in the timeline. Defaults to "allgather".

    Returns:
        A tensor with the rows of rank 0, then rank 1, and so on.
    """
    comm = runtime.communicator()
    tensor = tf.convert_to_tensor(tensor)
    if tensor.shape.rank == 0:
        tensor = tf.reshape(tensor, [1])
    name = name or "allgather"
    shape = tf.TensorShape([None]).concatenate(tensor.shape[1:])

    def gather(a):
        return (comm.allgather(a, name=name),)

    return ordered_call(gather, [tensor], [tensor.dtype], [shape], name)[0]


@tf.autograph.experimental.do_not_convert
def broadcast(tensor, root_rank: int = 0, name: str | None = None) -> tf.Tensor:
    """Returns rank ``root_rank``'s ``tensor`` on every rank.

    A synchronization point; every rank passes a tensor of the same shape and dtype.

    Args:
        tensor: The tensor (only the root's values matter).
        root_rank: The rank whose values everyone receives. Defaults to 0.
        name: Name of the collective in the timeline. Defaults to "broadcast".
    """
    comm = runtime.communicator()
    _check_root(root_rank, comm.size)
    tensor = tf.convert_to_tensor(tensor)
    name = name or "broadcast"
    return ordered_call(
        lambda a: (comm.broadcast(a, root_rank, name=name),),
        [tensor],
        [tensor.dtype],
        [tensor.shape],
        name,
    )[0]


@tf.autograph.experimental.do_not_convert
def broadcast_variables(variables: Sequence[tf.Variable], root_rank: int = 0):
    """Assigns rank ``root_rank``'s values to ``variables`` on every rank.

    A synchronization point. Variables are fused by dtype, so a whole model takes a few
    broadcasts. Call it after the variables exist and before the first gradient is applied.

    Args:
        variables: The variables (e.g. ``model.variables`` plus ``optimizer.variables``).
        root_rank: The rank whose values everyone receives. Defaults to 0.

    Returns:
        None eagerly; inside ``tf.function``, the assign op group.
    """
    comm = runtime.communicator()
    _check_root(root_rank, comm.size)
    variables = list(variables)
    if comm.size == 1 or not variables:
        return None
    assigns = []
    threshold = runtime.get_config().fusion_threshold
    # Keras 3 variables report their dtype as a string: plan on the tensors' values.
    current = [tf.convert_to_tensor(v) for v in variables]
    for b, bucket in enumerate(plan_buckets(current, threshold)):
        values = [current[i] for i in bucket.indices]
        received = broadcast(pack(values), root_rank, name=f"broadcast_variables.bucket{b}")
        for i, value in zip(bucket.indices, unpack(received, values)):
            assigns.append(variables[i].assign(value))
    return None if tf.executing_eagerly() else tf.group(*assigns)


def broadcast_object(obj, root_rank: int = 0, name: str | None = None):
    """Returns rank ``root_rank``'s picklable Python object on every rank (a collective)."""
    comm = runtime.communicator()
    _check_root(root_rank, comm.size)
    return comm.broadcast_object(obj, root_rank, name=name or "broadcast_object")


def allgather_object(obj, name: str | None = None) -> list:
    """Returns a list of every rank's picklable object, in rank order (a collective)."""
    return runtime.communicator().allgather_object(obj, name=name or "allgather_object")


def barrier() -> None:
    """Waits until every rank has called it (a collective)."""
    runtime.communicator().barrier()


def join() -> int:
    """Waits for every rank and returns the rank that arrived last (a collective).

    Horovod's join lets a rank that ran out of data stand in with zeros for the others'
    remaining allreduces. syncdp instead gives every rank the same number of steps
    (``syncdp.data.tfrecord_dataset``), so here join is a barrier that reports the
    straggler, measured by each rank's arrival time.
    """
    arrivals = runtime.communicator().allgather_object(time.time(), name="join")
    return int(np.argmax(arrivals))


def _check_root(root_rank: int, size: int) -> None:
    if not 0 <= root_rank < size:
        raise ValueError(f"root_rank must be in [0, {size}); got {root_rank}.")
