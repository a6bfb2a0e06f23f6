"""Allgather and broadcast of tensors, grouped and in place, with their gradients.

Part of :mod:`syncdp.tensorflow.collectives` (its docstring says what every collective
promises).
"""

from __future__ import annotations

import tensorflow as tf

from syncdp.engine import joining
from syncdp.job.process_sets import global_process_set
from syncdp.tensorflow.collectives._common import (
    _check_sendable,
    _comm,
    _root,
    _signature,
    _value,
)
from syncdp.tensorflow.graph import ordered_call

__all__ = ["allgather", "grouped_allgather", "broadcast", "average_gradients_with"]

# The gradients of allgather and broadcast average ``dy`` over the ranks. The allreduce family
# uses allgather (for sparse tensors), so it sits above this module and hands its allreduce
# down through average_gradients_with when it is imported (the package imports both).
_average = None


def average_gradients_with(average) -> None:
    """Sets ``average(tensor, name=..., process_set=...)``, which the gradients here use."""
    global _average
    _average = average


def _gather(tensor, name: str, process_set):
    """The allgather itself, as an ordered call; no gradient."""
    shape = tf.TensorShape([None]).concatenate(tensor.shape[1:])

    def gather(a):
        comm = _comm(process_set)
        signature = _signature(name, a, rank=a.ndim, trailing=a.shape[1:])
        # A rank that has called join() stands in with no rows.
        comm.agree(signature, name=name, join=lambda: joining.gather_task(a, name))
        return (comm.allgather(a, name=name),)

    return ordered_call(gather, [tensor], [tensor.dtype], [shape], name)[0]


def _own_rows(grad, rows, name: str, process_set):
    """This rank's rows of ``grad``, a tensor gathered from ``rows`` rows of every rank."""
    comm = _comm(process_set)
    # Each rank's (rank, row count): a rank that has called join() gathers no rows at all, so
    # the counts are placed by the ranks they name, not by their order.
    mine = tf.stack([tf.constant(comm.rank, tf.int64), tf.shape(rows, out_type=tf.int64)[0]])
    pairs = _gather(tf.reshape(mine, [1, 2]), f"{name}.rows", process_set)
    counts = tf.math.unsorted_segment_sum(pairs[:, 1], pairs[:, 0], comm.size)
    start = tf.reduce_sum(counts[: comm.rank])
    return grad[start : start + counts[comm.rank]]


@tf.autograph.experimental.do_not_convert
def allgather(
    tensor, name: str | None = None, ignore_name_scope: bool = False, process_set=global_process_set
) -> tf.Tensor:
    """Concatenates every rank's ``tensor`` along its first dimension, in rank order.

    A synchronization point. The first dimension may differ between ranks; the rest must match.
    Differentiable as in Horovod: the gradient is this rank's rows of the average of every
    rank's gradient.

    Args:
        tensor: A tensor of a numeric or bool dtype and rank >= 1 (a scalar is gathered as
            shape [1]).
        name: Name of the collective in the timeline. Defaults to "allgather".
        ignore_name_scope: Accepted for Horovod compatibility.
        process_set: The ranks that gather together. Defaults to the whole job.

    Returns:
        A tensor with the rows of the set's first rank, then its second, and so on.
    """
    _comm(process_set)
    tensor = _value(tensor)
    _check_sendable(tensor.dtype, "allgather")
    if tensor.shape.rank == 0:
        tensor = tf.reshape(tensor, [1])
    name = name or "allgather"
    if not tensor.dtype.is_floating:
        return _gather(tensor, name, process_set)

    @tf.custom_gradient
    def gather(x):
        def grad(dy):
            total = _average(dy, name=f"{name}.grad", process_set=process_set)
            return _own_rows(total, x, f"{name}.grad", process_set)

        return _gather(x, name, process_set), grad

    return gather(tensor)


@tf.autograph.experimental.do_not_convert
def grouped_allgather(
    tensors,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set=global_process_set,
) -> list:
    """:func:`allgather` of each tensor of a list; every rank passes the same list of dtypes."""
    name = name or "grouped_allgather"
    return [
        allgather(t, name=f"{name}.{i}", process_set=process_set) for i, t in enumerate(tensors)
    ]


def _bcast(tensor, root_rank: int, name: str, process_set):
    root = _root(process_set, root_rank)

    def run(a):
        comm = _comm(process_set)
        comm.agree(_signature(name, a, shape=a.shape, root=root_rank), name=name)
        return (comm.broadcast(a, root, name=name),)

    return ordered_call(run, [tensor], [tensor.dtype], [tensor.shape], name)[0]


@tf.autograph.experimental.do_not_convert
def broadcast(
    tensor,
    root_rank: int = 0,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set=global_process_set,
) -> tf.Tensor:
    """Returns rank ``root_rank``'s ``tensor`` on every rank.

    A synchronization point; every rank passes a tensor of the same shape and dtype and the
    same root. Differentiable as in Horovod: the root's gradient is the average of every rank's
    gradient; the others' is zero.

    Args:
        tensor: The tensor (only the root's values matter).
        root_rank: The rank whose values everyone receives, numbered in the job (as in
            Horovod, also with a process set). Defaults to 0.
        name: Name of the collective in the timeline. Defaults to "broadcast".
        ignore_name_scope: Accepted for Horovod compatibility.
        process_set: The ranks that take part. Defaults to the whole job.
    """
    _comm(process_set)
    root = _root(process_set, root_rank)
    tensor = _value(tensor)
    _check_sendable(tensor.dtype, "broadcast")
    name = name or "broadcast"
    if not tensor.dtype.is_floating:
        return _bcast(tensor, root_rank, name, process_set)

    @tf.custom_gradient
    def bcast(x):
        def grad(dy):
            total = _average(dy, name=f"{name}.grad", process_set=process_set)
            return total if _comm(process_set).rank == root else total * 0

        return _bcast(x, root_rank, name, process_set), grad

    return bcast(tensor)
