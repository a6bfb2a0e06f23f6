"""Fused allreduce at any number of ranks: expected values from the ranks' own numbers.

Every rank contributes integer-valued floats built from its rank, so sums are exact and the
expected result is a closed formula in the number of ranks.
"""

import numpy as np
import pytest
import tensorflow as tf

from syncdp.tensorflow.tape import reduce_gradients


def _rank_sum(n):
    return n * (n - 1) / 2  # 0 + 1 + ... + (n-1)


def _tensors(rank, shapes, dtype=tf.float32):
    return [tf.cast(tf.fill(s, float(rank + i % 7)), dtype) for i, s in enumerate(shapes)]


def _expected(n, shapes, op_sum=True):
    out = []
    for i, s in enumerate(shapes):
        total = _rank_sum(n) + n * (i % 7)
        out.append(np.full(s, total if op_sum else total / n, np.float64))
    return out


SHAPES = [(3, 4), (0,), (1,), (200_000,), (0, 5), (7,), ()]


@pytest.mark.parametrize("graph", [False, True])
def test_larger_than_threshold_and_zero_size(hvd, graph):
    n, r = hvd.size(), hvd.rank()
    tensors = _tensors(r, SHAPES)

    def run(ts):
        return hvd.grouped_allreduce(ts, op=hvd.Sum, fusion_threshold=4096)

    out = tf.function(run)(tensors) if graph else run(tensors)
    for o, e, s in zip(out, _expected(n, SHAPES), SHAPES):
        assert tuple(o.shape) == s
        np.testing.assert_array_equal(o.numpy(), e)


@pytest.mark.parametrize("graph", [False, True])
def test_hundreds_of_tiny_tensors_exact(hvd, graph):
    n, r = hvd.size(), hvd.rank()
    shapes = [(i % 3 + 1,) for i in range(300)]
    tensors = _tensors(r, shapes)

    def run(ts):
        return hvd.grouped_allreduce(ts, op=hvd.Sum)

    out = tf.function(run)(tensors) if graph else run(tensors)
    for o, e in zip(out, _expected(n, shapes)):
        np.testing.assert_array_equal(o.numpy(), e)


@pytest.mark.parametrize("dtype", [tf.float32, tf.float16], ids=lambda d: d.name)
def test_average_of_gradients_every_step(hvd, dtype):
    n, r = hvd.size(), hvd.rank()
    shapes = [(64, 32), (32,), (1000, 10), (10,)]

    @tf.function
    def step(ts):
        return reduce_gradients(ts)

    kept = []
    for k in range(3):  # results of earlier steps must survive buffer reuse
        tensors = [t + k for t in _tensors(r, shapes, dtype)]
        kept.append(step(tensors))
    for k, out in enumerate(kept):
        for o, e in zip(out, _expected(n, shapes, op_sum=False)):
            np.testing.assert_allclose(o.numpy(), e + k, rtol=1e-6)


@pytest.mark.parametrize("dtype", [tf.float16, tf.float64, tf.bfloat16, tf.int32, tf.int64])
def test_dtypes(hvd, dtype):
    n, r = hvd.size(), hvd.rank()
    out = hvd.grouped_allreduce(_tensors(r, [(5,), (2, 2)], dtype), op=hvd.Sum)
    for o, e in zip(out, _expected(n, [(5,), (2, 2)])):
        assert o.dtype == dtype
        np.testing.assert_array_equal(tf.cast(o, tf.float64).numpy(), e)


def test_integer_average_truncates_toward_zero(hvd):
    n, r = hvd.size(), hvd.rank()
    out = hvd.allreduce(tf.constant([r, 2 * r + 1, -r - 1], tf.int32), op=hvd.Average)
    total = [_rank_sum(n), 2 * _rank_sum(n) + n, -_rank_sum(n) - n]
    expect = [int(np.trunc(t / n)) for t in total]  # Horovod's (and C's) integer division
    np.testing.assert_array_equal(out.numpy(), expect)


@pytest.mark.parametrize("size", [3, 30_000], ids=["small", "large"])
def test_integer_average_with_a_postscale_rounds_once(hvd, size):
    """Horovod scales an integer sum once by postscale / n (in double) and rounds toward zero:
    the mean is not truncated first. Small buckets ride in the argument check, large ones not;
    reducescatter scales the same way."""
    n, r = hvd.size(), hvd.rank()
    values = np.arange(size) % 7 - 3 + r  # negative and positive sums
    total = sum(np.arange(size) % 7 - 3 + k for k in range(n))
    expect = np.trunc(total * (3.0 / n)).astype(np.int64)
    out = hvd.allreduce(tf.constant(values, tf.int32), op=hvd.Average, postscale_factor=3.0)
    np.testing.assert_array_equal(out.numpy(), expect)
    rows = tf.constant(np.tile(values, (n, 1)), tf.int64)
    mine = hvd.reducescatter(rows, op=hvd.Average, postscale_factor=3.0)
    np.testing.assert_array_equal(mine.numpy(), [expect])


def test_prescale_and_postscale(hvd):
    n, r = hvd.size(), hvd.rank()
    x = tf.constant([float(r + 1)] * 4)
    out = hvd.allreduce(x, op=hvd.Average, prescale_factor=0.5, postscale_factor=4.0)
    np.testing.assert_allclose(out.numpy(), 2.0 * (n + 1) / 2, rtol=1e-6)


def test_eager_and_graph_agree_on_mixed_dtypes(hvd):
    r = hvd.rank()
    tensors = [tf.fill([4], float(r)), tf.fill([3], r), tf.fill([2], float(r))]
    eager = hvd.grouped_allreduce(tensors, op=hvd.Sum)
    graph = tf.function(lambda ts: hvd.grouped_allreduce(ts, op=hvd.Sum))(tensors)
    for a, b in zip(eager, graph):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16], ids=lambda d: d.name)
def test_half_precision_buckets_every_op(hvd, graph, dtype):
    """Half-precision buckets (bytes through MPI, sums in TensorFlow): sizes that do not divide
    by the number of ranks, distinct values per element, every op, both scale factors."""
    n, r = hvd.size(), hvd.rank()
    shapes = [(5, 3), (0,), (1,), (7,), ()]

    def values(k):  # small integers and halves: exact in bfloat16's 8 significant bits
        return [np.arange(np.prod(s)).reshape(s) % 13 * 0.5 + k - 3 for s in shapes]

    mine = [tf.constant(v, dtype) for v in values(r)]
    every = [np.stack(vs) for vs in zip(*[values(k) for k in range(n)])]
    cases = [
        (hvd.Sum, 1.0, 1.0, lambda a: a.sum(0)),
        (hvd.Average, 1.0, 1.0, lambda a: a.mean(0)),
        (hvd.Min, -1.0, 1.0, lambda a: (-a).min(0)),
        (hvd.Max, 1.0, 2.0, lambda a: a.max(0) * 2),
        (hvd.Sum, 0.5, 4.0, lambda a: a.sum(0) * 2),
    ]
    for op, pre, post, math in cases:

        def run(ts, op=op, pre=pre, post=post):
            return hvd.grouped_allreduce(ts, op=op, prescale_factor=pre, postscale_factor=post)

        out = tf.function(run)(mine) if graph else run(mine)
        for o, a, s in zip(out, every, shapes):
            assert o.dtype == dtype and tuple(o.shape) == s
            expected = tf.cast(math(a), dtype)  # the exact result, rounded once
            np.testing.assert_array_equal(tf.cast(o, tf.float64), tf.cast(expected, tf.float64))


def test_half_precision_bucket_with_unknown_shapes(hvd):
    n, r = hvd.size(), hvd.rank()
    spec = tf.TensorSpec([None], tf.float16)
    run = tf.function(lambda a, b: hvd.grouped_allreduce([a, b], op=hvd.Sum), [spec, spec])
    a, b = run(tf.fill([3], tf.constant(r, tf.float16)), tf.ones([6], tf.float16))
    np.testing.assert_array_equal(a.numpy(), np.full([3], _rank_sum(n)))
    np.testing.assert_array_equal(b.numpy(), np.full([6], n))


def test_float16_prescale_acts_before_the_sum(hvd):
    """A prescale is how a float16 sum is kept from overflowing: 2 x 40000 is past float16's
    largest value (65504), 2 x (40000 / 2) is not."""
    n = hvd.size()
    x = tf.fill([5], tf.constant(40000, tf.float16))
    out = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5)
    np.testing.assert_array_equal(out.numpy(), np.full([5], 20000.0 * n, np.float16))
