"""Allreduce: fused buckets of tensors through the engine, sparse and grouped variants, Min/Max
with their gradients, and Adasum.

Part of :mod:`syncdp.tensorflow.collectives` (its docstring says what every collective
promises).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from syncdp import engine
from syncdp.engine import joining
from syncdp.job import runtime
from syncdp.job.process_sets import global_process_set
from syncdp.tensorflow import autotuning as _autotuning
from syncdp.tensorflow.collectives._common import (
    Adasum,
    Average,
    Max,
    Min,
    ReduceOp,
    Sum,
    _check_reducible,
    _comm,
    _resolve_op,
    _scale_fields,
    _signature,
    _spec,
    _tunable,
    _value,
)
from syncdp.tensorflow.collectives.gather import allgather, average_gradients_with
from syncdp.tensorflow.compression import Compression, for_transport
from syncdp.tensorflow.graph import in_v1_graph, ordered_call
from syncdp.transport.communicator import signature_digest

__all__ = ["allreduce", "grouped_allreduce", "fused_allreduce", "adasum_tree"]


# A bucket whose members average at most this many bytes crosses into its host call as one
# tensor, concatenated by TensorFlow, and comes back as one: each tensor that crosses a host
# call costs a few microseconds of conversion, more than TensorFlow takes to copy this much.
PACK_MEAN_BYTES = 32 << 10


def _flat(tensor: tf.Tensor) -> tf.Tensor:
    """``tensor`` as 1-D; a 1-D tensor as it is (every op in a step costs a few microseconds)."""
    return tensor if tensor.shape.rank == 1 else tf.reshape(tensor, [-1])


def _reduce_bucket(
    members,
    reducer: engine.BucketReducer,
    step=None,
    process_set=None,
    *,
    output_step=True,
    fields: tuple = (),
):
    """One bucket as one ordered host call; returns the reduced members (and the agreed step).

    ``step`` is an int64 scalar tensor, or a callable giving this rank's step (an int) when
    the bucket runs, so that counting the step costs no host call of its own. The agreed step
    is an output of the call only with ``output_step`` (each output costs a conversion).
    ``fields`` are more ``(name, value)`` pairs of the bucket's argument check.
    """
    k = len(members)
    # The scale factors too: ranks that scale differently would end with different results.
    # A caller that scales in TensorFlow instead (Min/Max) passes its own factors in ``fields``,
    # which come later and so win.
    fields = (*_scale_fields(reducer.prescale, reducer.postscale), *fields)
    # A traced step's shapes are fixed: its signature and checksum are computed once, here.
    fixed = fixed_digest = None
    if all(m.shape.is_fully_defined() for m in members):
        like = np.empty(0, members[0].dtype.as_numpy_dtype)
        shapes = tuple(tuple(m.shape.as_list()) for m in members)
        fixed = _signature(reducer.name, like, op=reducer.op, shapes=shapes, **dict(fields))
        fixed_digest = signature_digest(fixed)
    # The bucket's bytes, once traced (the timeline reports them of a bucket riding in its check).
    payload = sum(m.shape.num_elements() * m.dtype.size for m in members) if fixed else None
    packed = k > 1 and payload is not None and payload <= PACK_MEAN_BYTES * k
    count_step = step if callable(step) else None
    sent = [tf.concat([_flat(m) for m in members], 0)] if packed else list(members)
    j = len(sent)

    def run(*arrays):
        comm = _comm(process_set)
        signature = fixed
        if signature is None:
            shapes = tuple(np.shape(a) for a in arrays[:k])
            signature = _signature(
                reducer.name, arrays[0], op=reducer.op, shapes=shapes, **dict(fields)
            )
        if count_step is not None:
            step = count_step()
        else:
            step = arrays[j] if j < len(arrays) else None

        def check(label):  # first, inside the reducer: a small bucket rides in it
            return comm.agree(
                signature,
                name=reducer.name,
                digest=fixed_digest,
                join=lambda: joining.task(reducer, [np.size(a) for a in arrays[:j]]),
                label=label,
                info=reducer.info,
                nbytes=payload if payload is not None else sum(a.nbytes for a in arrays[:j]),
                dtype=reducer.dtype_name,
            )

        results, agreed = reducer(
            comm, arrays[:j], step, check_step=runtime.steps_agree(), check=check
        )
        return results if not carries else (*results, np.int64(agreed))

    carries = step is not None and output_step
    inputs = sent + ([] if step is None or count_step is not None else [step])
    dtypes = [m.dtype for m in sent] + ([tf.int64] if carries else [])
    shapes = [m.shape for m in sent] + ([tf.TensorShape([])] if carries else [])
    gradient = None
    if reducer.op in (Average.kind, Sum.kind) and sent[0].dtype.is_floating:
        op = ReduceOp[reducer.op.upper()]
        gradient = _bucket_gradient(
            op, reducer.prescale, reducer.postscale, reducer.name, process_set, j
        )
    outs = ordered_call(run, inputs, dtypes, shapes, reducer.name, gradient=gradient)
    reduced = outs[:j]
    if packed:
        sizes = [m.shape.num_elements() for m in members]
        pieces = tf.split(reduced[0], sizes)
        reduced = [
            p if m.shape.rank == 1 else tf.reshape(p, m.shape) for p, m in zip(pieces, members)
        ]
    return (reduced, outs[j]) if carries else (reduced, None)


def _bucket_gradient(
    op: ReduceOp, prescale: float, postscale: float, name: str, process_set, count: int
) -> Callable:
    """The gradient of a reduction ``y = postscale * op(prescale * x)`` (Average or Sum) of
    ``count`` tensors: it is linear, so each input's gradient is the same reduction of the
    outputs' gradients with the factors swapped, as Horovod's allreduce op registers. Returns
    ``fn(inputs, outputs, *dys)`` for :func:`~syncdp.tensorflow.graph.ordered_call` (anything
    after the ``count`` tensors, a step carried in, gets none); holds no tensor.

    It is every Average and Sum reduction's gradient: the tape's, the optimizers'
    (``reduce_gradients``), :func:`allreduce`'s and :func:`grouped_allreduce`'s. Kept with the
    graph (:func:`~syncdp.tensorflow.graph.ordered_call`), it is freed with it, where a
    ``tf.custom_gradient`` (Min/Max, Product, Adasum) stays in TensorFlow's registry."""

    def gradient(inputs, outputs, *dys):
        outs = outputs[:count]
        dys = [tf.zeros_like(o) if d is None else d for o, d in zip(outs, dys[:count])]
        back, _ = fused_allreduce(
            dys,
            op,
            prescale=postscale,
            postscale=prescale,
            name=f"{name}.grad",
            process_set=process_set,
        )
        return [*back, *[None] * (len(inputs) - count)]

    return gradient


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
    step=None,
    process_set=None,
    return_step: bool = True,
    fields: tuple = (),
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
        step: An int64 scalar tensor every rank must agree on, or a callable returning
            this rank's step as an int when the first bucket runs; carried in the first
            bucket (needs a sum or average). Defaults to None.
        process_set: The ranks that reduce together. Defaults to the whole job.
        return_step: Return the agreed step as a tensor (the step is checked either way).
            Defaults to True.
        fields: More ``(name, value)`` pairs every bucket's argument check compares between
            ranks (see :func:`syncdp.tensorflow.tape.reduce_gradients`). Defaults to none.

    Returns:
        ``(results, agreed_step)``: the reduced tensors in the order given, and the step
        tensor every rank agreed on (None without ``step`` or ``return_step``, or on one
        rank).
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
                op.kind,
                prescale=prescale,
                postscale=postscale,
                name=f"{name}.bucket{b}",
                info={"bucket": b, "tensors": len(members), "op": op.kind},
                carry_step=step is not None and b == 0,
            )
            with tf.name_scope(f"syncdp_bucket{b}"):
                reduced, carried = _reduce_bucket(
                    members,
                    reducer,
                    step if b == 0 else None,
                    process_set,
                    output_step=return_step,
                    fields=fields,
                )
            agreed = carried if carried is not None else agreed
            for i, piece in zip(bucket.indices, reduced):
                results[i] = piece
        return results, agreed

    tuning = None
    if reverse and _tunable(process_set):
        tuning = _autotuning.tuner()
    elif reverse:
        _autotuning.say_untuned(
            "in a TF1 graph" if in_v1_graph() else "on a process set other than the job",
            speaker=min((process_set or global_process_set).ranks),
        )
    if op is Adasum:  # per tensor (its dot products are the tensor's own), never bucketed
        # Each call's check names its place among the tensors (and the caller's fields): ranks
        # that differ in the tensors they reduce (a gradient None on one rank) must not pair
        # one tensor with another of the same shape.
        place = [("tensor", (k, len(wire))) for k in range(len(wire))]
        results = [
            _adasum(w, name, process_set, prescale, postscale, (*fields, where))
            for w, where in zip(wire, place)
        ]
        agreed = None
    elif tuning is not None:  # gradients, with the fusion threshold and first bucket tuned
        site = (name, tuple((s.nbytes, s.dtype) for s in specs))  # all a plan depends on
        results, agreed = _autotuning.reduce_tuned(
            tuning, plan_for, run_plan, site, with_step=step is not None and return_step
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
    and dtypes, in the same order relative to other collectives. Differentiable (its float
    tensors): the gradients are grouped-allreduced the same way; for Min and Max they go to the
    ranks holding the extreme, as :func:`allreduce`'s do, and the extreme is found without
    ``compression``.

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
    dense = [_value(tensors[i]) for i in dense_at]
    options = dict(
        compression=compression,
        cap_bytes=fusion_threshold,
        first_bytes=0,
        process_set=process_set,
    )

    def forward(xs, pre, post, label):
        return fused_allreduce(xs, op, prescale=pre, postscale=post, name=label, **options)[0]

    # Average and Sum buckets carry their own gradient (_bucket_gradient), which lives and dies
    # with the graph: no tf.custom_gradient, whose registry keeps every graph it was used in.
    if op in (Average, Sum):
        for i, r in zip(dense_at, forward(dense, prescale_factor, postscale_factor, name)):
            results[i] = r
        return results
    # Floating tensors are differentiable (custom_gradient wants only them); the others
    # (integers, bool) are reduced in a call of their own before them, on every rank alike.
    floating = [k for k, t in enumerate(dense) if t.dtype.is_floating]
    integral = [k for k, t in enumerate(dense) if not t.dtype.is_floating]
    if integral:
        label = f"{name}.integral" if floating else name
        reduced = forward([dense[k] for k in integral], prescale_factor, postscale_factor, label)
        for k, r in zip(integral, reduced):
            results[dense_at[k]] = r
    if floating:

        @tf.custom_gradient
        def reduce(*xs):
            if op in (Min, Max):
                # Uncompressed, as a single allreduce's: the gradient finds the ranks holding
                # the extreme by comparing their values with it.
                uncompressed = {k: v for k, v in options.items() if k != "compression"}
                return _min_max_with_gradient(
                    list(xs), op, prescale_factor, postscale_factor, name, **uncompressed
                )

            def grad(*dys):  # Product and Adasum: the same reduction of the gradients
                return forward(list(dys), postscale_factor, prescale_factor, f"{name}.grad")

            return forward(list(xs), prescale_factor, postscale_factor, name), grad

        for k, r in zip(floating, reduce(*[dense[k] for k in floating])):
            results[dense_at[k]] = r
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
            ``Average``. Integer averages are truncated toward zero.
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
    tensor = _value(tensor)

    def forward(x, pre, post, label=name, how=op):
        options = dict(compression=compression, prescale=pre, postscale=post, cap_bytes=0)
        return fused_allreduce([x], how, name=label, process_set=process_set, **options)[0][0]

    # Integers are not differentiable (custom_gradient wants only differentiable inputs), and
    # an Average or Sum bucket carries its own gradient (_bucket_gradient), which lives and
    # dies with the graph: tf.custom_gradient's registry keeps every graph it was used in.
    if not tensor.dtype.is_floating or op in (Average, Sum):
        return forward(tensor, prescale_factor, postscale_factor)

    @tf.custom_gradient
    def reduce(x):
        if op in (Min, Max):
            ys, grad = _min_max_with_gradient(
                [x],
                op,
                prescale_factor,
                postscale_factor,
                name,
                process_set=process_set,
                cap_bytes=0,
            )
            return ys[0], lambda dy: grad(dy)[0]
        y = forward(x, prescale_factor, postscale_factor)

        def grad(dy):
            # y = post * op(pre * x): the chain rule swaps the factors. Horovod's gradient of
            # a Product or Adasum is the same reduction of the gradient; so is ours (an
            # Average's or Sum's is its bucket's, _bucket_gradient).
            return forward(dy, postscale_factor, prescale_factor, f"{name}.grad")

        return y, grad

    return reduce(tensor)


def _min_max_with_gradient(xs, op, prescale: float, postscale: float, name: str, **fuse):
    """Min/Max allreduce of the tensors ``xs`` and its gradient: it flows only to the ranks
    that hold the extreme. Returns ``(ys, grad)``, ``grad`` taking one ``dy`` per tensor.

    With ``z = prescale * x`` on each rank, ``m = min(z)`` over ranks and ``y = postscale * m``,
    and the job's loss the sum of every rank's loss, the gradient of ``x`` on rank r is
    ``prescale * [z_r == m] * postscale * sum_s dy_s / count``, where ``count`` is how many ranks
    hold the extreme (ties share it, as ``tf.reduce_min`` does). ``fuse`` are
    :func:`fused_allreduce`'s options (``process_set``, bucketing, compression).
    """
    zs = [x * prescale if prescale != 1.0 else x for x in xs]
    ms = fused_allreduce(zs, op, name=name, fields=_scale_fields(prescale, postscale), **fuse)[0]
    ys = [m * postscale if postscale != 1.0 else m for m in ms]

    def grad(*dys):
        holds = [tf.cast(tf.equal(z, m), dy.dtype) for z, m, dy in zip(zs, ms, dys)]
        sums = fused_allreduce([*holds, *dys], Sum, name=f"{name}.grad", **fuse)[0]
        counts, totals = sums[: len(xs)], sums[len(xs) :]
        scale = prescale * postscale
        return [h * t * scale / c for h, t, c in zip(holds, totals, counts)]

    return ys, grad


def _adasum(
    tensor,
    name: str,
    process_set,
    prescale: float = 1.0,
    postscale: float = 1.0,
    fields: tuple = (),
):
    """Adasum of ``tensor`` over the ranks: a binary tree of pairwise Adasum combinations.

    Adasum (Maleki et al., 2020) combines two gradients ``a`` and ``b`` as
    ``(1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b``: orthogonal gradients are summed,
    parallel ones averaged. Ranks are combined pairwise, (0, 1), (2, 3), ..., then the pairs'
    results pairwise, up the tree; a rank left without a partner at some level is carried up
    unchanged. Every rank gathers the others' tensors and computes the same tree in float64,
    so every rank gets bit-identical results. Adasum commutes with scaling, so ``prescale``
    and ``postscale`` simply multiply the result. ``fields`` are more ``(name, value)`` pairs
    the ranks' argument check compares (the tensor's place among a call's, say).
    """
    tensor = _value(tensor)
    if not tensor.dtype.is_floating:
        raise ValueError(f"Adasum reduces floating-point tensors; got {tensor.dtype.name}.")

    def run(array):
        comm = _comm(process_set)
        checked = dict((*_scale_fields(prescale, postscale), *fields))
        comm.agree(
            _signature(name, array, op="adasum", shape=array.shape, **checked),
            name=name,
            join=lambda: joining.adasum_task(array, name),
        )
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


average_gradients_with(
    lambda tensor, name, process_set: allreduce(
        tensor, op=Average, name=name, process_set=process_set
    )
)
