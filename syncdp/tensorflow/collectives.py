"""TensorFlow collectives: allreduce, allgather, broadcast on tensors, eagerly and in tf.function.

The TensorFlow face of the engine: each function here turns tensors into NumPy arrays and hands
them to :mod:`syncdp.engine` (allreduces) or the communicator (the rest), eagerly or from an
ordered graph node (:mod:`syncdp.tensorflow.graph`), so the collectives of a traced step run in
the same order on every rank. The communicator is looked up when the collective runs, not when
it is traced.

Every function here is a synchronization point: all ranks must call it, in the same order, with
tensors of the same dtype and (except allgather's first dimension) the same shape.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from syncdp import engine
from syncdp.core import runtime
from syncdp.tensorflow.compression import Compression
from syncdp.tensorflow.graph import ordered_call

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


def _resolve_op(op, average) -> ReduceOp:
    if op is not None and average is not None:
        raise ValueError("allreduce takes op or the deprecated average, not both.")
    if average is not None:
        return Average if average else Sum
    op = Average if op is None else op
    if not isinstance(op, ReduceOp):
        raise ValueError(f"op must be one of syncdp.Average, Sum, Min, Max; got {op!r}.")
    return op


def _spec(tensor) -> engine.TensorSpec:
    shape = tensor.shape
    nbytes = shape.num_elements() * tensor.dtype.size if shape.is_fully_defined() else -1
    return engine.TensorSpec(nbytes, tensor.dtype)


def _check_reducible(tensors) -> None:
    for t in tensors:  # the same error at any size, so a 1-rank test catches it
        if t.dtype not in _REDUCIBLE:
            raise TypeError(
                f"allreduce cannot reduce {t.dtype.name} tensors; use a float or integer dtype."
            )


def _reduce_bucket(members, reducer: engine.BucketReducer, step=None):
    """One bucket as one ordered host call; returns the reduced members (and the agreed step)."""
    k = len(members)

    def run(*arrays):
        results, agreed = reducer(
            runtime.communicator(), arrays[:k], arrays[k] if k < len(arrays) else None
        )
        return results if agreed is None else (*results, np.int64(agreed))

    inputs = list(members) + ([step] if step is not None else [])
    dtypes = [m.dtype for m in members] + ([tf.int64] if step is not None else [])
    shapes = [m.shape for m in members] + ([tf.TensorShape([])] if step is not None else [])
    outs = ordered_call(run, inputs, dtypes, shapes, reducer.name)
    return (outs[:k], outs[k]) if step is not None else (outs, None)


def fused_allreduce(
    tensors: Sequence[tf.Tensor],
    op: ReduceOp,
    *,
    compression=Compression.none,
    prescale: float = 1.0,
    postscale: float = 1.0,
    name: str,
    cap_bytes: int | None = None,
    first_bytes: int | None = None,
    reverse: bool = False,
    step: tf.Tensor | None = None,
):
    """Allreduces dense tensors in buckets planned by the engine; the path of every allreduce.

    Args:
        tensors: Dense tensors of reducible dtypes.
        op: The reduction.
        compression: What travels between ranks. Defaults to none.
        prescale: Multiplies every tensor before the reduction. Defaults to 1.
        postscale: Multiplies every result after it. Defaults to 1.
        name: Prefix of the buckets' names (``name.bucketN``).
        cap_bytes: Most bytes per bucket. Defaults to the ``fusion_threshold`` setting.
        first_bytes: Most bytes in the first bucket. Defaults to ``first_bucket_bytes``.
        reverse: Plan from the last tensor to the first (gradients, in backprop order).
        step: An int64 scalar every rank must agree on, carried in the first bucket (needs a
            sum or average). Defaults to None.

    Returns:
        ``(results, agreed_step)``: the reduced tensors in the order given, and the step
        tensor every rank agreed on (None without ``step``, or on one rank).
    """
    comm = runtime.communicator()
    _check_reducible(tensors)
    if comm.size == 1:
        step = None
    if comm.size == 1 and prescale == 1.0 and postscale == 1.0:
        return list(tensors), None
    config = runtime.get_config()
    cap = config.fusion_threshold if cap_bytes is None else cap_bytes
    first = config.first_bucket_bytes if first_bytes is None else first_bytes
    wire, ctxs = [], []
    for t in tensors:
        sent, ctx = compression.compress(t)
        wire.append(sent)
        ctxs.append(ctx)
    _check_reducible(wire)
    results = [None] * len(wire)
    agreed = None
    buckets = engine.plan(
        [_spec(w) for w in wire], first_bytes=first, cap_bytes=cap, reverse=reverse
    )
    for b, bucket in enumerate(buckets):
        members = [wire[i] for i in bucket.indices]
        reducer = engine.BucketReducer(
            members[0].dtype.as_numpy_dtype,
            op.value,
            prescale=prescale,
            postscale=postscale,
            name=f"{name}.bucket{b}",
            info={"bucket": b, "tensors": len(members), "op": op.value},
            carry_step=step is not None and b == 0,
        )
        with tf.name_scope(f"syncdp_bucket{b}"):
            reduced, carried = _reduce_bucket(members, reducer, step if b == 0 else None)
        agreed = carried if carried is not None else agreed
        for i, piece in zip(bucket.indices, reduced):
            results[i] = piece
    out = []
    for t, r, ctx in zip(tensors, results, ctxs):
        r = compression.decompress(r, ctx)
        out.append(r if r.dtype == t.dtype else tf.cast(r, t.dtype))
    return out, agreed


def _allreduce_sparse(
    slices: tf.IndexedSlices, op: ReduceOp, name: str, prescale=1.0, postscale=1.0
) -> tf.IndexedSlices:
    """Allreduce of IndexedSlices as Horovod does it: gather every rank's rows and indices.

    The sum of the gathered rows is linear, so both scale factors apply to the rows.
    """
    if op not in (Average, Sum):
        raise ValueError(f"IndexedSlices can only be reduced with Average or Sum; got {op}.")
    values = allgather(slices.values, name=f"{name}.values")
    indices = allgather(slices.indices, name=f"{name}.indices")
    factor = prescale * postscale / (runtime.size() if op is Average else 1)
    if factor != 1.0:
        values = values * tf.cast(factor, values.dtype)
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
            results[i] = _allreduce_sparse(
                t, op, f"{name}.sparse{i}", prescale_factor, postscale_factor
            )
    if dense_at:
        dense = [tf.convert_to_tensor(tensors[i]) for i in dense_at]
        reduced, _ = fused_allreduce(
            dense,
            op,
            compression=compression,
            prescale=prescale_factor,
            postscale=postscale_factor,
            name=name,
            cap_bytes=fusion_threshold,
            first_bytes=0,
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
        return _allreduce_sparse(tensor, op, name, prescale_factor, postscale_factor)
    runtime.communicator()
    tensor = tf.convert_to_tensor(tensor)

    def forward(x, pre, post):
        options = dict(compression=compression, prescale=pre, postscale=post, cap_bytes=0)
        return fused_allreduce([x], op, name=name, **options)[0][0]

    if not tensor.dtype.is_floating:  # custom_gradient wants differentiable inputs
        return forward(tensor, prescale_factor, postscale_factor)

    @tf.custom_gradient
    def reduce(x):
        if op in (Min, Max):
            return _min_max_with_gradient(x, op, prescale_factor, postscale_factor, name)
        y = forward(x, prescale_factor, postscale_factor)

        def grad(dy):
            # y = post * op(pre * x): the chain rule swaps the factors.
            return fused_allreduce(
                [dy],
                op,
                prescale=postscale_factor,
                postscale=prescale_factor,
                name=f"{name}.grad",
                cap_bytes=0,
            )[0][0]

        return y, grad

    return reduce(tensor)


def _min_max_with_gradient(x, op, prescale: float, postscale: float, name: str):
    """Min/Max allreduce and its gradient: it flows only to the ranks that hold the extreme.

    With ``z = prescale * x`` on each rank, ``m = min(z)`` over ranks and ``y = postscale * m``,
    and the job's loss the sum of every rank's loss, the gradient of ``x`` on rank r is
    ``prescale * [z_r == m] * postscale * sum_s dy_s / count``, where ``count`` is how many ranks
    hold the extreme (ties share it, as ``tf.reduce_min`` does).
    """
    z = x * prescale if prescale != 1.0 else x
    m = fused_allreduce([z], op, name=name, cap_bytes=0)[0][0]
    y = m * postscale if postscale != 1.0 else m

    def grad(dy):
        holds = tf.cast(tf.equal(z, m), dy.dtype)
        count, total = fused_allreduce([holds, dy], Sum, name=f"{name}.grad", cap_bytes=0)[0]
        return holds * total * (prescale * postscale) / count

    return y, grad


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
    runtime.communicator()
    tensor = tf.convert_to_tensor(tensor)
    if tensor.shape.rank == 0:
        tensor = tf.reshape(tensor, [1])
    name = name or "allgather"
    shape = tf.TensorShape([None]).concatenate(tensor.shape[1:])

    def gather(a):
        return (runtime.communicator().allgather(a, name=name),)

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
        lambda a: (runtime.communicator().broadcast(a, root_rank, name=name),),
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
    cap = runtime.get_config().fusion_threshold
    # Keras 3 variables report their dtype as a string: plan on the tensors' values.
    current = [tf.convert_to_tensor(v) for v in variables]
    buckets = engine.plan([_spec(c) for c in current], first_bytes=0, cap_bytes=cap)
    for b, bucket in enumerate(buckets):
        values = [current[i] for i in bucket.indices]
        name = f"broadcast_variables.bucket{b}"

        def run(*arrays, name=name):
            return engine.broadcast_bucket(runtime.communicator(), arrays, root_rank, name=name)

        received = ordered_call(
            run, values, [v.dtype for v in values], [v.shape for v in values], name
        )
        for i, value in zip(bucket.indices, received):
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
    (``syncdp.data.tfrecord_dataset``), so here join is a barrier that reports the straggler:
    arrivals are ordered on rank 0's clock alone, never by comparing hosts' clocks.

    Returns:
        The rank that arrived last, the same on every rank.
    """
    return runtime.communicator().join()


def _check_root(root_rank: int, size: int) -> None:
    if not 0 <= root_rank < size:
        raise ValueError(f"root_rank must be in [0, {size}); got {root_rank}.")
