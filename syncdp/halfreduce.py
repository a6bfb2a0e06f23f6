"""Allreduce of float16 and bfloat16 buckets: MPI moves the bytes, TensorFlow does the sums.

Open MPI adds float16 one element at a time in scalar code (a 64 MiB float16 SUM takes about
seven times as long as a float32 one of the same bytes) and has no bfloat16 at all; NumPy's
float16 arithmetic is no faster. TensorFlow's vectorised kernels add, cast and scale half
precision at memory speed. So a half-precision bucket is reduced as a reduce-scatter followed
by an allgather, the arithmetic in between done by TensorFlow ops:

1. pack the members into one flat buffer, padded to ``size * shard`` elements;
2. ``Alltoall``: rank ``j`` receives every rank's ``j``-th shard (bytes only);
3. scale, reduce over the ranks, divide for Average, scale: each rank now holds the reduction
   of its own shard (in float32 with more than two ranks, so partial sums are not rounded to
   half precision at every addition; see :func:`_combine`);
4. ``Allgather`` of the reduced shards: every rank holds the whole result; unpack.

Each rank sends and receives ``(size - 1) / size`` of the buffer twice, the same traffic as a
ring allreduce. Both collectives are ordered graph nodes (:func:`syncdp.graph.ordered_call`),
so every rank runs them in the same place.
"""

from __future__ import annotations

import tensorflow as tf

from syncdp import runtime
from syncdp.fusion import BufferPool
from syncdp.graph import ordered_call

__all__ = ["HALF_DTYPES", "reduce_bucket"]

HALF_DTYPES = frozenset({tf.float16, tf.bfloat16})

# Receive buffers, kept between steps: a fresh 50 MB array would be page-faulted in every step.
_POOL = BufferPool()


def _combine(rows: tf.Tensor, op: str, size: int, prescale: float, postscale: float):
    """Reduces ``rows`` (``[size, shard]``, half precision) over axis 0.

    With two ranks the sum is computed in the bucket's own dtype: one addition, rounded once,
    which is exactly the float32 sum narrowed back (and five times faster). With more ranks the
    partial sums are accumulated in float32, so they are not rounded at every step. The
    prescale acts before the sum, as it must when it is there to keep a float16 sum from
    overflowing; the division for Average and the postscale act after it.
    """
    dtype = rows.dtype
    values = rows if size <= 2 else tf.cast(rows, tf.float32)
    if prescale != 1.0:
        values = values * prescale
    parts = tf.unstack(values)
    if op in ("sum", "average"):
        out = tf.add_n(parts)
    else:
        combine = tf.minimum if op == "min" else tf.maximum
        out = parts[0]
        for p in parts[1:]:
            out = combine(out, p)
    factor = postscale / size if op == "average" else postscale
    if factor != 1.0:
        out = out * factor
    return tf.cast(out, dtype)


def reduce_bucket(members: list, op: str, prescale: float, postscale: float, name: str, info):
    """Allreduces half-precision tensors of one dtype; returns the reduced tensors.

    Args:
        members: Tensors of one dtype in :data:`HALF_DTYPES`, the same shapes on every rank.
        op: "sum", "average", "min" or "max".
        prescale: Multiplies each input before the reduction.
        postscale: Multiplies each result after it.
        name: Name of the collectives in the timeline (".scatter" and ".gather" are appended).
        info: Extra fields for the timeline events.
    """
    comm = runtime.communicator()
    size = comm.size
    dtype = members[0].dtype
    if all(m.shape.is_fully_defined() for m in members):
        sizes = [m.shape.num_elements() for m in members]
        total = sum(sizes)
        pad = -total % size
        splits = sizes + [pad]
        row_shape = tf.TensorShape([size, (total + pad) // size])
    else:
        sizes = [tf.size(m) for m in members]
        total = tf.add_n(sizes)
        pad = -total % size
        splits = tf.stack(sizes + [pad])
        row_shape = tf.TensorShape([size, None])
    # Padding goes in with the one copy that packs the members, and comes out with the split.
    flat = tf.concat([tf.reshape(m, [-1]) for m in members] + [tf.zeros([pad], dtype)], axis=0)
    if size == 1:
        combined = _combine(flat[tf.newaxis], op, 1, prescale, postscale)
    else:
        # Results land in aligned pooled buffers, which TensorFlow adopts without copying.
        def scatter(a):
            out = _POOL.get(f"{name}.scatter", a.size, a.dtype)
            return (comm.alltoall(a, name=f"{name}.scatter", out=out, info=info),)

        def gather(a):
            out = _POOL.get(f"{name}.gather", a.size * size, a.dtype)
            return (comm.allgather_equal(a, name=f"{name}.gather", out=out, info=info),)

        rows = tf.reshape(flat, [size, -1])
        mine = ordered_call(scatter, [rows], [dtype], [row_shape], f"{name}.scatter")[0]
        reduced = _combine(mine, op, size, prescale, postscale)
        everyone = ordered_call(gather, [reduced], [dtype], [row_shape], f"{name}.gather")[0]
        combined = tf.reshape(everyone, [-1])
    out = []
    for m, piece in zip(members, tf.split(combined, splits)[: len(members)]):
        r = tf.reshape(piece, tf.shape(m))
        r.set_shape(m.shape)
        out.append(r)
    return out
