"""TensorFlow collectives: allreduce, allgather, broadcast on tensors, eagerly and in tf.function.

The TensorFlow face of the engine: each function here turns tensors into NumPy arrays and hands
them to :mod:`syncdp.engine` (allreduces) or the communicator (the rest), eagerly or from an
ordered graph node (:mod:`syncdp.tensorflow.graph`), so the collectives of a traced step run in
the same order on every rank. The communicator is looked up when the collective runs, not when
it is traced.

Every function here is a synchronization point: all ranks of its process set (the whole job by
default) must call it, in the same order, with tensors of the same dtype and (except the first
dimension of allgather and alltoall) the same shape. Before any data moves, the ranks agree on
each call's signature (one integer collective): ranks that passed different dtypes, shapes,
ops, roots or names get :class:`~syncdp.tensorflow.graph.MismatchError` (TensorFlow's
``FailedPreconditionError``, as in Horovod) on every rank, and the job can go on.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from syncdp import engine
from syncdp.core import process_sets, runtime
from syncdp.core.communicator import signature_digest
from syncdp.core.process_sets import global_process_set
from syncdp.tensorflow import autotuning as _autotuning
from syncdp.tensorflow import graph
from syncdp.tensorflow.compression import Compression, for_transport
from syncdp.tensorflow.graph import InvalidArgument, ordered_call, standalone

__all__ = [
    "ReduceOp",
    "Average",
    "Sum",
    "Min",
    "Max",
    "Product",
    "Adasum",
    "allreduce",
    "grouped_allreduce",
    "allgather",
    "grouped_allgather",
    "broadcast",
    "broadcast_",
    "alltoall",
    "reducescatter",
    "grouped_reducescatter",
    "broadcast_variables",
    "broadcast_global_variables",
    "broadcast_object_fn",
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
    PRODUCT = "product"
    ADASUM = "adasum"


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
Adasum = ReduceOp.ADASUM

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
        raise ValueError(
            f"op must be one of syncdp.Average, Sum, Min, Max, Product, Adasum; got {op!r}."
        )
    return op


def _comm(process_set):
    """The communicator of ``process_set`` (checked when a collective is built and run)."""
    try:
        return process_sets.communicator_of(process_set)
    except process_sets.NotInProcessSetError as e:
        raise NotInProcessSetError(str(e)) from None


def _root(process_set, root_rank: int) -> int:
    """The set's own rank number of job rank ``root_rank`` (Horovod's roots are job ranks)."""
    return (process_set or global_process_set).root(root_rank)


class NotInProcessSetError(process_sets.NotInProcessSetError, tf.errors.InvalidArgumentError):
    """A rank used a process set it is not in; also TensorFlow's ``InvalidArgumentError``,
    which is what Horovod raises then."""

    def __init__(self, message: str):
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)

    def __str__(self) -> str:
        return self.message


def _signature(name: str, tensor_like, **fields) -> tuple:
    """What every rank must pass alike to one collective (see Communicator.agree)."""
    dtype = np.dtype(tensor_like.dtype).name if hasattr(tensor_like, "dtype") else ""
    return (("name", name), ("dtype", dtype), *fields.items())


def _spec(tensor) -> engine.TensorSpec:
    shape = tensor.shape
    nbytes = shape.num_elements() * tensor.dtype.size if shape.is_fully_defined() else -1
    return engine.TensorSpec(nbytes, tensor.dtype)


def _tunable(process_set) -> bool:
    """Whether autotuning may change how this set's gradients are bucketed: the whole job's,
    in eager code or a ``tf.function`` (not a TF1 graph)."""
    whole = process_set is None or process_set is global_process_set
    return whole and not graph.in_v1_graph()


def _check_reducible(tensors) -> None:
    for t in tensors:  # the same error at any size, so a 1-rank test catches it
        if t.dtype not in _REDUCIBLE:
            raise TypeError(
                f"allreduce cannot reduce {t.dtype.name} tensors; use a float or integer dtype."
            )


def _reduce_bucket(members, reducer: engine.BucketReducer, step=None, process_set=None):
    """One bucket as one ordered host call; returns the reduced members (and the agreed step)."""
    k = len(members)
    # A traced step's shapes are fixed: its signature and checksum are computed once, here.
    fixed = fixed_digest = None
    if all(m.shape.is_fully_defined() for m in members):
        like = np.empty(0, members[0].dtype.as_numpy_dtype)
        shapes = tuple(tuple(m.shape.as_list()) for m in members)
        fixed = _signature(reducer.name, like, op=reducer.op, shapes=shapes)
        fixed_digest = signature_digest(fixed)

    def run(*arrays):
        comm = _comm(process_set)
        signature = fixed
        if signature is None:
            shapes = tuple(np.shape(a) for a in arrays[:k])
            signature = _signature(reducer.name, arrays[0], op=reducer.op, shapes=shapes)
        comm.agree(signature, name=reducer.name, digest=fixed_digest)
        step = arrays[k] if k < len(arrays) else None
        results, agreed = reducer(comm, arrays[:k], step, check_step=runtime.steps_agree())
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
    process_set=None,
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
        process_set: The ranks that reduce together. Defaults to the whole job.

    Returns:
        ``(results, agreed_step)``: the reduced tensors in the order given, and the step
        tensor every rank agreed on (None without ``step``, or on one rank).
    """
    comm = _comm(process_set)
    _check_reducible(tensors)
    config = runtime.get_config()
    # A traced step is built for the size at trace time, except in elastic mode, where the
    # job may grow from one rank later.
    alone = comm.size == 1 and not config.elastic
    if alone:
        step = None
    if alone and prescale == 1.0 and postscale == 1.0:
        return list(tensors), None
    cap = config.fusion_threshold if cap_bytes is None else cap_bytes
    first = config.first_bucket_bytes if first_bytes is None else first_bytes
    wire, ctxs = [], []
    compression = for_transport(compression)
    for t in tensors:
        sent, ctx = compression.compress(t)
        wire.append(sent)
        ctxs.append(ctx)
    _check_reducible(wire)
    specs = [_spec(w) for w in wire]

    def plan_for(first_bytes: int, cap_bytes: int) -> list:
        return engine.plan(specs, first_bytes=first_bytes, cap_bytes=cap_bytes, reverse=reverse)

    def run_plan(buckets: list) -> tuple[list, tf.Tensor | None]:
        results, agreed = [None] * len(wire), None
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
                reduced, carried = _reduce_bucket(
                    members, reducer, step if b == 0 else None, process_set
                )
            agreed = carried if carried is not None else agreed
            for i, piece in zip(bucket.indices, reduced):
                results[i] = piece
        return results, agreed

    tuning = _autotuning.tuner() if reverse and _tunable(process_set) else None
    if op is Adasum:  # per tensor (its dot products are the tensor's own), never bucketed
        results = [_adasum(w, name, process_set, prescale, postscale) for w in wire]
        agreed = None
    elif tuning is not None:  # gradients, with the fusion threshold and first bucket tuned
        site = (name, tuple((s.nbytes, s.dtype) for s in specs))  # all a plan depends on
        results, agreed = _autotuning.reduce_tuned(
            tuning, plan_for, run_plan, site, with_step=step is not None
        )
    else:
        results, agreed = run_plan(plan_for(first, cap))
    out = []
    for t, r, ctx in zip(tensors, results, ctxs):
        r = compression.decompress(r, ctx)
        out.append(r if r.dtype == t.dtype else tf.cast(r, t.dtype))
    return out, agreed


def _check_sparse(op: ReduceOp, prescale: float, postscale: float) -> None:
    """What Horovod refuses for IndexedSlices, refused before anything is touched or sent."""
    if op not in (Average, Sum):
        raise NotImplementedError(
            f"IndexedSlices can only be reduced with Average or Sum, not {op}; pass "
            "sparse_as_dense=True or densify with tf.convert_to_tensor first."
        )
    if prescale != 1.0 or postscale != 1.0:
        raise NotImplementedError(
            "prescale_factor and postscale_factor are not supported with IndexedSlices; "
            "densify them with tf.convert_to_tensor first."
        )


def _allreduce_sparse(
    slices: tf.IndexedSlices, op: ReduceOp, name: str, process_set=None
) -> tf.IndexedSlices:
    """Allreduce of IndexedSlices as Horovod does it: gather every rank's rows and indices.

    With Average the gathered rows are divided by the number of ranks (a true division, so
    integer rows come back as floats, as in Horovod).
    """
    values = allgather(slices.values, name=f"{name}.values", process_set=process_set)
    indices = allgather(slices.indices, name=f"{name}.indices", process_set=process_set)
    if op is Average:
        values = values / tf.cast(_comm(process_set).size, values.dtype)
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
    process_set=global_process_set,
    ignore_name_scope: bool = False,
    name: str | None = None,
    *,
    fusion_threshold: int | None = None,
) -> list:
    """Allreduces a list of tensors in as few fused collectives as the threshold allows.

    A synchronization point: every rank of the set must call it with the same list of shapes
    and dtypes, in the same order relative to other collectives. Differentiable: the gradients
    are grouped-allreduced the same way.

    Args:
        tensors: Tensors, ``tf.IndexedSlices`` (gathered, as Horovod does) or None (passed
            through).
        average: Deprecated Horovod spelling: True for Average, False for Sum.
        device_dense: Accepted for Horovod compatibility; placement follows the inputs.
        device_sparse: Accepted for Horovod compatibility.
        compression: ``Compression.none`` or ``Compression.fp16``. Defaults to none.
        op: ``Average``, ``Sum``, ``Min``, ``Max``, ``Product`` or ``Adasum``. Defaults to
            ``Average``.
        prescale_factor: Multiplies each tensor before the reduction. Defaults to 1.
        postscale_factor: Multiplies each result after it. Defaults to 1.
        process_set: The ranks that reduce together. Defaults to the whole job.
        ignore_name_scope: Accepted for Horovod compatibility (names are ours).
        name: Name of the collective in the timeline. Defaults to "grouped_allreduce".
        fusion_threshold: Bytes per fused buffer. Defaults to the configured threshold.

    Returns:
        The reduced tensors, in the order given.

    Example:
        >>> a, b = syncdp.grouped_allreduce([tf.ones(3), tf.ones(2)], op=syncdp.Sum)
    """
    op = _resolve_op(op, average)
    name = name or "grouped_allreduce"
    if not tensors:
        return tensors
    if any(isinstance(t, tf.IndexedSlices) for t in tensors):
        _check_sparse(op, prescale_factor, postscale_factor)
    _comm(process_set)
    results = list(tensors)
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            results[i] = _allreduce_sparse(t, op, f"{name}.sparse{i}", process_set)
    dense_at = [
        i for i, t in enumerate(tensors) if t is not None and not isinstance(t, tf.IndexedSlices)
    ]
    if not dense_at:
        return results
    dense = [tf.convert_to_tensor(tensors[i]) for i in dense_at]
    options = dict(
        compression=compression,
        cap_bytes=fusion_threshold,
        first_bytes=0,
        process_set=process_set,
    )

    def forward(xs, pre, post, label):
        return fused_allreduce(xs, op, prescale=pre, postscale=post, name=label, **options)[0]

    if op in (Min, Max) or not all(t.dtype.is_floating for t in dense):
        reduced = forward(dense, prescale_factor, postscale_factor, name)
    else:

        @tf.custom_gradient
        def reduce(*xs):
            def grad(*dys):
                return forward(list(dys), postscale_factor, prescale_factor, f"{name}.grad")

            return forward(list(xs), prescale_factor, postscale_factor, name), grad

        reduced = reduce(*dense)
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
    process_set=global_process_set,
    ignore_name_scope: bool = False,
):
    """Reduces ``tensor`` over the ranks of ``process_set``; every one of them gets the result.

    A synchronization point: all ranks of the set must call it, in the same order, with the
    same shape and dtype. Differentiable: the gradient of an allreduce is the allreduce of the
    gradient (for Min and Max it goes to the ranks that hold the extreme).

    Args:
        tensor: A tensor (float16/32/64, bfloat16, int32/64, ...) or ``tf.IndexedSlices``.
        average: Deprecated Horovod spelling: True for Average, False for Sum.
        device_dense: Accepted for Horovod compatibility; placement follows the input.
        device_sparse: Accepted for Horovod compatibility.
        compression: ``Compression.none`` or ``Compression.fp16``. Defaults to none.
        op: ``Average``, ``Sum``, ``Min``, ``Max``, ``Product`` or ``Adasum``. Defaults to
            ``Average``. Integer averages are floor-divided.
        prescale_factor: Multiplies the tensor before the reduction. Defaults to 1.
        postscale_factor: Multiplies the result after it. Defaults to 1.
        name: Name of the collective in the timeline. Defaults to "allreduce".
        process_set: The ranks that reduce together. Defaults to the whole job.
        ignore_name_scope: Accepted for Horovod compatibility (names are ours).

    Returns:
        The reduced tensor, same shape and dtype.

    Raises:
        NotInitializedError: ``syncdp.init()`` has not been called.
        MismatchError: Ranks passed different shapes, dtypes or ops (on every rank).
        ValueError: This rank is not in ``process_set``, or the set is not registered.

    Example:
        >>> total = syncdp.allreduce(tf.constant([1.0 * syncdp.rank()]), op=syncdp.Sum)
    """
    op = _resolve_op(op, average)
    name = name or "allreduce"
    if isinstance(tensor, tf.IndexedSlices):
        _check_sparse(op, prescale_factor, postscale_factor)
        return _allreduce_sparse(tensor, op, name, process_set)
    _comm(process_set)
    tensor = tf.convert_to_tensor(tensor)

    def forward(x, pre, post, label=name, how=op):
        options = dict(compression=compression, prescale=pre, postscale=post, cap_bytes=0)
        return fused_allreduce([x], how, name=label, process_set=process_set, **options)[0][0]

    if not tensor.dtype.is_floating:  # custom_gradient wants differentiable inputs
        return forward(tensor, prescale_factor, postscale_factor)

    @tf.custom_gradient
    def reduce(x):
        if op in (Min, Max):
            return _min_max_with_gradient(
                x, op, prescale_factor, postscale_factor, name, process_set
            )
        y = forward(x, prescale_factor, postscale_factor)

        def grad(dy):
            # y = post * op(pre * x): the chain rule swaps the factors. Horovod's gradient of
            # a Product or Adasum is the same reduction of the gradient; so is ours.
            return forward(dy, postscale_factor, prescale_factor, f"{name}.grad")

        return y, grad

    return reduce(tensor)


def _min_max_with_gradient(x, op, prescale: float, postscale: float, name: str, process_set):
    """Min/Max allreduce and its gradient: it flows only to the ranks that hold the extreme.

    With ``z = prescale * x`` on each rank, ``m = min(z)`` over ranks and ``y = postscale * m``,
    and the job's loss the sum of every rank's loss, the gradient of ``x`` on rank r is
    ``prescale * [z_r == m] * postscale * sum_s dy_s / count``, where ``count`` is how many ranks
    hold the extreme (ties share it, as ``tf.reduce_min`` does).
    """
    options = dict(cap_bytes=0, process_set=process_set)
    z = x * prescale if prescale != 1.0 else x
    m = fused_allreduce([z], op, name=name, **options)[0][0]
    y = m * postscale if postscale != 1.0 else m

    def grad(dy):
        holds = tf.cast(tf.equal(z, m), dy.dtype)
        count, total = fused_allreduce([holds, dy], Sum, name=f"{name}.grad", **options)[0]
        return holds * total * (prescale * postscale) / count

    return y, grad


def _adasum(tensor, name: str, process_set, prescale: float = 1.0, postscale: float = 1.0):
    """Adasum of ``tensor`` over the ranks: a binary tree of pairwise Adasum combinations.

    Adasum (Maleki et al., 2020) combines two gradients ``a`` and ``b`` as
    ``(1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b``: orthogonal gradients are summed,
    parallel ones averaged. Ranks are combined pairwise, (0, 1), (2, 3), ..., then the pairs'
    results pairwise, up the tree; a rank left without a partner at some level is carried up
    unchanged. Every rank gathers the others' tensors and computes the same tree in float64,
    so every rank gets bit-identical results. Adasum commutes with scaling, so ``prescale``
    and ``postscale`` simply multiply the result.
    """
    tensor = tf.convert_to_tensor(tensor)
    if not tensor.dtype.is_floating:
        raise ValueError(f"Adasum reduces floating-point tensors; got {tensor.dtype.name}.")

    def run(array):
        comm = _comm(process_set)
        comm.agree(_signature(name, array, op="adasum", shape=array.shape), name=name)
        rows = comm.allgather_equal(array, name=name).reshape(comm.size, -1).astype(np.float64)
        combined = adasum_tree(rows) * (prescale * postscale)
        return (combined.astype(array.dtype).reshape(array.shape),)

    return ordered_call(run, [tensor], [tensor.dtype], [tensor.shape], name)[0]


def adasum_tree(rows: np.ndarray) -> np.ndarray:
    """Adasum of the rows of ``rows`` (``[ranks, n]``), combined pairwise up a binary tree."""
    level = list(rows)
    while len(level) > 1:
        pairs = [_adasum_pair(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        level = pairs + ([level[-1]] if len(level) % 2 else [])
    return level[0]


def _adasum_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    dot, aa, bb = float(a @ b), float(a @ a), float(b @ b)
    ca = 1.0 - dot / (2.0 * aa) if aa >= 1e-8 else 1.0
    cb = 1.0 - dot / (2.0 * bb) if bb >= 1e-8 else 1.0
    return ca * a + cb * b


def _gather(tensor, name: str, process_set):
    """The allgather itself, as an ordered call; no gradient."""
    shape = tf.TensorShape([None]).concatenate(tensor.shape[1:])

    def gather(a):
        comm = _comm(process_set)
        comm.agree(_signature(name, a, rank=a.ndim, trailing=a.shape[1:]), name=name)
        return (comm.allgather(a, name=name),)

    return ordered_call(gather, [tensor], [tensor.dtype], [shape], name)[0]


def _own_rows(grad, rows, name: str, process_set):
    """This rank's rows of ``grad``, a tensor gathered from ``rows`` rows of every rank."""
    comm = _comm(process_set)
    counts = _gather(
        tf.reshape(tf.shape(rows, out_type=tf.int64)[0], [1]), f"{name}.rows", process_set
    )
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
        tensor: A tensor of any dtype and rank >= 1 (a scalar is gathered as shape [1]).
        name: Name of the collective in the timeline. Defaults to "allgather".
        ignore_name_scope: Accepted for Horovod compatibility.
        process_set: The ranks that gather together. Defaults to the whole job.

    Returns:
        A tensor with the rows of the set's first rank, then its second, and so on.
    """
    _comm(process_set)
    tensor = tf.convert_to_tensor(tensor)
    if tensor.shape.rank == 0:
        tensor = tf.reshape(tensor, [1])
    name = name or "allgather"
    if not tensor.dtype.is_floating:
        return _gather(tensor, name, process_set)

    @tf.custom_gradient
    def gather(x):
        def grad(dy):
            total = allreduce(dy, op=Average, name=f"{name}.grad", process_set=process_set)
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
    tensor = tf.convert_to_tensor(tensor)
    name = name or "broadcast"
    if not tensor.dtype.is_floating:
        return _bcast(tensor, root_rank, name, process_set)

    @tf.custom_gradient
    def bcast(x):
        def grad(dy):
            total = allreduce(dy, op=Average, name=f"{name}.grad", process_set=process_set)
            return total if _comm(process_set).rank == root else total * 0

        return _bcast(x, root_rank, name, process_set), grad

    return bcast(tensor)


@tf.autograph.experimental.do_not_convert
def broadcast_(variables, root_rank: int, name: str | None = None, process_set=global_process_set):
    """In-place broadcast: assigns rank ``root_rank``'s values to ``variables`` on every rank.

    Returns:
        The variables' new values, as tensors, in the order given.
    """
    variables = list(variables)
    done = broadcast_variables(variables, root_rank, process_set=process_set)
    if done is None:
        return [tf.convert_to_tensor(v) for v in variables]
    with tf.control_dependencies([done]):  # read the values after the assignments
        return [tf.identity(v) for v in variables]


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
        elif s.size != comm.size or (s < 0).any() or s.sum() != a.shape[0]:
            bad = f"splits {s.tolist()} for {comm.size} ranks and {a.shape[0]} rows"
        else:
            bad = ""
        comm.agree(_signature(name, a, rank=a.ndim, trailing=a.shape[1:], ok=not bad), name=name)
        if bad:  # every rank got here with a bad input of its own: each one says so
            raise InvalidArgument(
                f"{name}: {bad}; splits must be {comm.size} counts adding up to "
                "the first dimension."
            )
        out, received = comm.alltoallv(a, s, name=name)
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
    the result holds the rows received from rank 0, then rank 1, and so on. Differentiable: the
    gradient travels back by the reverse alltoall.

    Args:
        tensor: A tensor of rank >= 1; the trailing dimensions match on every rank.
        splits: Rows for each rank of the set (a list or int tensor adding up to the first
            dimension). Defaults to equal parts (the first dimension must divide evenly).
        name: Name of the collective in the timeline. Defaults to "alltoall".
        ignore_name_scope: Accepted for Horovod compatibility.
        process_set: The ranks that take part. Defaults to the whole job.

    Returns:
        The gathered rows; with ``splits`` given, ``(rows, received_splits)`` as in Horovod.

    Raises:
        InvalidArgument: ``splits`` do not add up, or without them the first dimension does
            not divide evenly (TensorFlow's ``InvalidArgumentError``, on every rank; when only
            some ranks passed bad splits, the others get MismatchError).
    """
    _comm(process_set)
    tensor = tf.convert_to_tensor(tensor)
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
                return back

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
        tensor.dtype.as_numpy_dtype, op.value, prescale=pre, postscale=post, name=name
    )

    def run(a):
        comm = _comm(process_set)
        comm.agree(_signature(name, a, op=op.value, shape=a.shape), name=name)
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
    (times the number of ranks for Sum).

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
    tensor = tf.convert_to_tensor(tensor)
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
            if op is Sum:
                dy = dy * _comm(process_set).size
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
    ignore_name_scope: bool = False,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
) -> list:
    """:func:`reducescatter` of each tensor of a list, in order."""
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


@tf.autograph.experimental.do_not_convert
def broadcast_variables(
    variables: Sequence[tf.Variable],
    root_rank: int = 0,
    process_set=global_process_set,
    inplace: bool = False,
):
    """Assigns rank ``root_rank``'s values to ``variables`` on every rank.

    A synchronization point. Variables are fused by dtype, so a whole model takes a few
    broadcasts. Call it after the variables exist and before the first gradient is applied.

    Args:
        variables: The variables (e.g. ``model.variables`` plus ``optimizer.variables``).
        root_rank: The rank whose values everyone receives (a job rank). Defaults to 0.
        process_set: The ranks that take part. Defaults to the whole job.
        inplace: Accepted for Horovod compatibility (values are always assigned in place).

    Returns:
        None eagerly; inside ``tf.function`` or a TF1 graph, the assign op group.
    """
    comm = _comm(process_set)
    root = _root(process_set, root_rank)
    variables = list(variables)
    if comm.size == 1 or not variables:
        return None if tf.executing_eagerly() else tf.no_op()
    assigns = []
    cap = runtime.get_config().fusion_threshold
    # Keras 3 variables report their dtype as a string: plan on the tensors' values.
    current = [tf.convert_to_tensor(v) for v in variables]
    buckets = engine.plan([_spec(c) for c in current], first_bytes=0, cap_bytes=cap)
    for b, bucket in enumerate(buckets):
        values = [current[i] for i in bucket.indices]
        name = f"broadcast_variables.bucket{b}"

        def run(*arrays, name=name):
            comm = _comm(process_set)
            shapes = tuple(np.shape(a) for a in arrays)
            comm.agree(_signature(name, arrays[0], shapes=shapes, root=root_rank), name=name)
            return engine.broadcast_bucket(comm, arrays, root, name=name)

        received = ordered_call(
            run, values, [v.dtype for v in values], [v.shape for v in values], name
        )
        for i, value in zip(bucket.indices, received):
            assigns.append(variables[i].assign(value))
    return None if tf.executing_eagerly() else tf.group(*assigns)


def broadcast_global_variables(root_rank: int = 0):
    """The TF1 op that assigns ``root_rank``'s values to every global variable of the graph.

    Raises:
        RuntimeError: Called eagerly, where there are no global variables; use
            :func:`broadcast_variables` with the model's and optimizer's variables instead.
    """
    if tf.executing_eagerly():
        raise RuntimeError(
            "broadcast_global_variables() does not support eager execution; use "
            "syncdp.broadcast_variables(model.variables + optimizer.variables) instead."
        )
    # Run on its own (by a hook, as the session opens): kept out of the chain of collectives,
    # so running it does not also run the training step's collectives and read a batch.
    with standalone():
        return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def broadcast_object(
    obj, root_rank: int = 0, session=None, name: str | None = None, process_set=global_process_set
):
    """Returns rank ``root_rank``'s picklable Python object on every rank (a collective).

    ``session`` is accepted for Horovod compatibility (objects never pass through a graph).
    """
    comm = _comm(process_set)
    root = _root(process_set, root_rank)
    return comm.broadcast_object(obj, root, name=name or "broadcast_object")


def broadcast_object_fn(
    root_rank: int = 0, session=None, name: str | None = None, process_set=global_process_set
):
    """Returns ``fn(obj)`` that broadcasts ``obj`` from ``root_rank`` (Horovod's TF1 helper)."""

    def fn(obj):
        return broadcast_object(obj, root_rank, name=name, process_set=process_set)

    return fn


def allgather_object(
    obj, session=None, name: str | None = None, process_set=global_process_set
) -> list:
    """Returns a list of every rank's picklable object, in rank order (a collective)."""
    return _comm(process_set).allgather_object(obj, name=name or "allgather_object")


def barrier(process_set=global_process_set) -> None:
    """Waits until every rank of ``process_set`` has called it (a collective)."""
    _comm(process_set).barrier()


def join() -> int:
    """Waits for every rank and returns the rank that arrived last (a collective).

    Horovod's join lets a rank that ran out of data stand in with zeros for the others'
    remaining allreduces. syncdp instead gives every rank the same number of steps
    (``syncdp.data.tfrecord_dataset``), so here join is a barrier that reports the straggler:
    arrivals are ordered on rank 0's clock alone, never by comparing hosts' clocks.

    Returns:
        The rank that arrived last, the same on every rank: an int eagerly; inside
        ``tf.function`` or a TF1 graph an int32 tensor, computed when the graph runs.
    """
    if tf.executing_eagerly():
        return runtime.communicator().join()
    return ordered_call(
        lambda: (np.int32(runtime.communicator().join()),), [], [tf.int32], [[]], "join"
    )[0]
