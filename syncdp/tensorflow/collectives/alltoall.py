"""Alltoall and reducescatter of tensors, grouped, with their gradients.

Part of :mod:`syncdp.tensorflow.collectives` (its docstring says what every collective
promises).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from syncdp import engine
from syncdp.job.process_sets import global_process_set
from syncdp.tensorflow.collectives._common import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    _check_reducible,
    _check_sendable,
    _comm,
    _resolve_op,
    _scale_fields,
    _signature,
    _value,
)
from syncdp.tensorflow.collectives.gather import allgather
from syncdp.tensorflow.compression import Compression, for_transport
from syncdp.tensorflow.graph import InvalidArgument, ordered_call

__all__ = ["alltoall", "reducescatter", "grouped_reducescatter"]


def _alltoall_call(tensor, splits, name: str, process_set):
    shape = tf.TensorShape([None]).concatenate(tensor.shape[1:])

    def run(a, s):
        comm = _comm(process_set)
        s = np.asarray(s, dtype=np.int64).reshape(-1)
        if s.size == 0:  # no splits: equal parts
            if a.shape[0] % comm.size:
                bad = f"first dimension {a.shape[0]} not divisible by {comm.size} ranks"
            else:
                bad = ""
                s = np.full(comm.size, a.shape[0] // comm.size, dtype=np.int64)
        elif s.size != comm.size or (s < 0).any() or s.sum() > a.shape[0]:
            bad = f"splits {s.tolist()} for {comm.size} ranks and {a.shape[0]} rows"
        else:
            bad = ""
        comm.agree(_signature(name, a, rank=a.ndim, trailing=a.shape[1:], ok=not bad), name=name)
        if bad:  # every rank got here with a bad input of its own: each one says so
            raise InvalidArgument(
                f"{name}: {bad}; splits must be {comm.size} non-negative counts adding up "
                "to at most the first dimension."
            )
        # Rows past the splits' sum stay here, as in Horovod (a buffer of fixed capacity,
        # partly filled).
        out, received = comm.alltoallv(a[: int(s.sum())], s, name=name)
        return out, received.astype(np.int32)

    out, received = ordered_call(
        run, [tensor, splits], [tensor.dtype, tf.int32], [shape, tf.TensorShape([None])], name
    )
    return out, received


@tf.autograph.experimental.do_not_convert
def alltoall(
    tensor,
    splits=None,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set=global_process_set,
):
    """Sends consecutive rows of ``tensor`` to each rank and gathers what each rank sent here.

    A synchronization point. Rows ``[sum(splits[:j]), sum(splits[:j+1]))`` go to rank ``j``;
    rows past ``sum(splits)`` are not sent (as in Horovod). The result holds the rows received
    from rank 0, then rank 1, and so on. Differentiable: the gradient travels back by the
    reverse alltoall (zero for the rows not sent).

    Args:
        tensor: A tensor of rank >= 1; the trailing dimensions match on every rank.
        splits: Rows for each rank of the set (a list or int tensor adding up to at most
            the first dimension). Defaults to equal parts (the first dimension must divide
            evenly).
        name: Name of the collective in the timeline. Defaults to "alltoall".
        ignore_name_scope: Accepted for Horovod compatibility.
        process_set: The ranks that take part. Defaults to the whole job.

    Returns:
        The gathered rows; with ``splits`` given, ``(rows, received_splits)`` as in Horovod.

    Raises:
        InvalidArgument: ``splits`` add up to more than the first dimension (or are negative,
            or not one per rank), or without them the first dimension does
            not divide evenly (TensorFlow's ``InvalidArgumentError``, on every rank; when only
            some ranks passed bad splits, the others get MismatchError).
    """
    _comm(process_set)
    tensor = _value(tensor)
    _check_sendable(tensor.dtype, "alltoall")
    if tensor.shape.rank == 0:
        raise ValueError("alltoall needs a tensor of rank >= 1.")
    name = name or "alltoall"
    split_tensor = (
        tf.constant([], tf.int64)
        if splits is None
        else tf.cast(tf.convert_to_tensor(splits), tf.int64)
    )
    if tensor.dtype.is_floating:

        @tf.custom_gradient
        def exchange(x):
            out, received = _alltoall_call(x, split_tensor, name, process_set)

            def grad(dy, _unused=None):
                back, _ = _alltoall_call(dy, received, f"{name}.grad", process_set)
                # the rows past the splits' sum were not sent: their gradient is zero
                return tf.concat([back, tf.zeros_like(x[tf.shape(back)[0] :])], 0)

            return (out, tf.stop_gradient(received)), grad

        out, received = exchange(tensor)
    else:
        out, received = _alltoall_call(tensor, split_tensor, name, process_set)
    return out if splits is None else (out, received)


def _scatter_counts(rows: int, size: int) -> list[int]:
    """Rows each rank keeps from a reduce-scatter: equal parts, the first ranks one more."""
    base, extra = divmod(rows, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def _reducescatter_call(tensor, op: ReduceOp, name: str, process_set, pre=1.0, post=1.0):
    shape = tf.TensorShape([None]).concatenate(tensor.shape[1:])
    reducer = engine.BucketReducer(
        tensor.dtype.as_numpy_dtype, op.kind, prescale=pre, postscale=post, name=name
    )

    def run(a):
        comm = _comm(process_set)
        scales = dict(_scale_fields(reducer.prescale, reducer.postscale))
        comm.agree(_signature(name, a, op=op.kind, shape=a.shape, **scales), name=name)
        rows = _scatter_counts(a.shape[0], comm.size)
        row = int(np.prod(a.shape[1:], dtype=np.int64))
        out = reducer.scatter(comm, a, [r * row for r in rows])
        return (out.reshape((rows[comm.rank],) + a.shape[1:]),)

    return ordered_call(run, [tensor], [tensor.dtype], [shape], name)[0]


@tf.autograph.experimental.do_not_convert
def reducescatter(
    tensor,
    device_dense: str = "",
    compression=Compression.none,
    op=Average,
    name: str | None = None,
    process_set=global_process_set,
    ignore_name_scope: bool = False,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
):
    """Reduces ``tensor`` over the ranks and gives each rank a slice of the first dimension.

    Rank ``r`` gets rows ``[r * n // size ...)``: ``n // size`` rows each, the first
    ``n % size`` ranks one more. A synchronization point: every rank passes the same shape.
    Differentiable as in Horovod: the gradient is the allgather of the slices' gradients
    (times the number of ranks for Sum), times the two scale factors.

    Args:
        tensor: A tensor of rank >= 1 and a reducible dtype.
        device_dense: Accepted for Horovod compatibility.
        compression: ``Compression.none`` or ``Compression.fp16``. Defaults to none.
        op: ``Average``, ``Sum``, ``Min``, ``Max`` or ``Product``. Defaults to ``Average``.
        name: Name of the collective in the timeline. Defaults to "reducescatter".
        process_set: The ranks that take part. Defaults to the whole job.
        ignore_name_scope: Accepted for Horovod compatibility.
        prescale_factor: Multiplies the tensor before the reduction. Defaults to 1.
        postscale_factor: Multiplies the result after it. Defaults to 1.

    Returns:
        This rank's rows of the reduction.
    """
    op = _resolve_op(op, None)
    if op is Adasum:
        raise NotImplementedError("reducescatter does not support Adasum.")
    _comm(process_set)
    tensor = _value(tensor)
    if tensor.shape.rank == 0:
        raise ValueError("reducescatter needs a tensor of rank >= 1.")
    _check_reducible([tensor])
    name = name or "reducescatter"
    compression = for_transport(compression)
    sent, ctx = compression.compress(tensor)

    def forward(x):
        out = _reducescatter_call(x, op, name, process_set, prescale_factor, postscale_factor)
        out = compression.decompress(out, ctx)
        return out if out.dtype == tensor.dtype else tf.cast(out, tensor.dtype)

    if not tensor.dtype.is_floating or op in (Min, Max, Product):
        return forward(sent)

    @tf.custom_gradient
    def scatter(x):
        def grad(dy):
            factor = prescale_factor * postscale_factor
            if op is Sum:
                factor *= _comm(process_set).size
            dy = dy * tf.cast(factor, dy.dtype)
            return allgather(dy, name=f"{name}.grad", process_set=process_set)

        return forward(x), grad

    return scatter(sent)


@tf.autograph.experimental.do_not_convert
def grouped_reducescatter(
    tensors,
    device_dense: str = "",
    compression=Compression.none,
    op=Average,
    process_set=global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    ignore_name_scope: bool = False,
    name: str | None = None,
) -> list:
    """:func:`reducescatter` of each tensor of a list, in order (Horovod's arguments, in its
    order; ``ignore_name_scope`` and ``name`` are syncdp's own, after them)."""
    name = name or "grouped_reducescatter"
    return [
        reducescatter(
            t,
            compression=compression,
            op=op,
            name=f"{name}.{i}",
            process_set=process_set,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
        )
        for i, t in enumerate(tensors)
    ]
