"""Horovod's other collectives against the mathematics, at any number of ranks.

alltoall, reducescatter, grouped_allgather/reducescatter, Product, Adasum, broadcast_; their
gradients against finite differences; arguments that differ between ranks (an error on every
rank, and the job goes on); the errors Horovod programs expect.
"""

import numpy as np
import pytest
import tensorflow as tf

from tests.compressors import QuarterCompressor

MODES = ["eager", "function"]


def run(mode, fn, *args):
    return (fn if mode == "eager" else tf.function(fn))(*args)


def rows_of(rank, n_rows, width=2):
    """Rank ``rank``'s rows: row i holds ``100 * rank + i`` (so every row says where it was)."""
    return np.array([[100 * rank + i] * width for i in range(n_rows)], np.float64).reshape(
        n_rows, width
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [tf.float16, tf.float32, tf.int32, tf.int64, tf.uint8])
def test_alltoall_with_splits_sends_each_rank_its_rows(hvd, mode, dtype):
    r, n = hvd.rank(), hvd.size()
    splits = [(r + j) % 3 for j in range(n)]  # uneven, zeros included
    # two rows more than the splits send: they stay here, as in Horovod (a partly filled buffer)
    x = rows_of(r, sum(splits) + 2) % 200
    out, received = run(
        mode, lambda t: hvd.alltoall(t, splits=splits), tf.constant(x, dtype.as_numpy_dtype)
    )
    expected_rows = [(s + r) % 3 for s in range(n)]  # what rank s sends here
    assert received.numpy().tolist() == expected_rows
    pieces = []
    for s in range(n):  # rank s's rows for rank r start after those for ranks 0 .. r-1
        split_s = [(s + j) % 3 for j in range(n)]
        start = sum(split_s[:r])
        pieces.append(rows_of(s, sum(split_s))[start : start + split_s[r]])
    expected = np.concatenate(pieces) % 200
    assert out.dtype == dtype and out.shape == (sum(expected_rows), 2)
    np.testing.assert_array_equal(out.numpy(), expected.reshape(-1, 2))


def test_alltoall_without_splits_divides_evenly_and_returns_one_tensor(hvd):
    r, n = hvd.rank(), hvd.size()
    out = hvd.alltoall(tf.constant(rows_of(r, 2 * n)))
    assert isinstance(out, tf.Tensor)
    expected = np.concatenate([rows_of(s, 2 * n)[2 * r : 2 * r + 2] for s in range(n)])
    np.testing.assert_array_equal(out.numpy(), expected)
    empty = hvd.alltoall(tf.zeros([n, 0]))
    assert empty.shape == (n, 0)


def test_alltoall_bad_splits_raise_invalid_argument_on_every_rank(hvd):
    n = hvd.size()
    if n > 1:
        with pytest.raises(tf.errors.InvalidArgumentError, match="divisible"):
            hvd.alltoall(tf.ones([n + 1]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="adding up to at most"):
        hvd.alltoall(tf.ones([n - 1]), splits=[1] * n)
    assert hvd.allreduce(tf.ones([1]), op=hvd.Sum).numpy()[0] == n  # the job goes on


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [tf.float16, tf.float32, tf.float64, tf.int32, tf.int64])
@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_reducescatter_gives_each_rank_its_rows_of_the_reduction(hvd, mode, dtype, op):
    r, n = hvd.rank(), hvd.size()
    rows = 2 * n + n // 2  # uneven: the first n % size ranks get one row more
    x = tf.constant(rows_of(r, rows) % 50, dtype.as_numpy_dtype)
    out = run(mode, lambda t: hvd.reducescatter(t, op=getattr(hvd, op)), x)
    counts = [rows // n + (1 if s < rows % n else 0) for s in range(n)]
    start = sum(counts[:r])
    total = sum(rows_of(s, rows) % 50 for s in range(n))[start : start + counts[r]]
    expected = total if op == "Sum" else np.trunc(total / n)
    if op == "Average" and dtype.is_floating:
        expected = total / n
    assert out.dtype == dtype and out.shape == (counts[r], 2)
    np.testing.assert_allclose(out.numpy().astype(np.float64), expected, rtol=1e-3)


def test_reducescatter_scales_like_allreduce(hvd):
    r, n = hvd.rank(), hvd.size()
    x = tf.constant(rows_of(r, 2 * n))
    out = hvd.reducescatter(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    expected = 1.5 * sum(rows_of(s, 2 * n) for s in range(n))[2 * r : 2 * r + 2]
    np.testing.assert_allclose(out.numpy(), expected)


def test_grouped_allgather_and_reducescatter_match_the_single_calls(hvd):
    r, n = hvd.rank(), hvd.size()
    a, b = tf.constant(rows_of(r, r + 1)), tf.constant([[r]] * 2, tf.int32)
    ga, gb = hvd.grouped_allgather([a, b])
    np.testing.assert_array_equal(ga.numpy(), np.concatenate([rows_of(s, s + 1) for s in range(n)]))
    np.testing.assert_array_equal(gb.numpy().ravel(), np.repeat(np.arange(n), 2))
    sa, sb = hvd.grouped_reducescatter([tf.ones([n, 3]), tf.ones([2 * n], tf.int32)], op=hvd.Sum)
    np.testing.assert_array_equal(sa.numpy(), np.full([1, 3], n))
    np.testing.assert_array_equal(sb.numpy(), [n, n])


@pytest.mark.parametrize("dtype", [tf.float16, tf.float32, tf.float64, tf.int32, tf.int8])
def test_product(hvd, dtype):
    r, n = hvd.rank(), hvd.size()
    x = tf.constant([r + 1, -(r + 2), 1], dtype.as_numpy_dtype)
    out = hvd.allreduce(x, op=hvd.Product)
    expected = [np.prod([s + 1 for s in range(n)]), np.prod([-(s + 2) for s in range(n)]), 1]
    assert out.dtype == dtype
    np.testing.assert_array_equal(out.numpy(), np.array(expected).astype(dtype.as_numpy_dtype))


def test_adasum_sums_orthogonal_gradients_and_keeps_identical_ones(hvd):
    r, n = hvd.rank(), hvd.size()
    orthogonal = hvd.allreduce(tf.one_hot(r, n, dtype=tf.float64), op=hvd.Adasum)
    np.testing.assert_allclose(orthogonal.numpy(), np.ones(n))
    scaled = hvd.allreduce(
        tf.one_hot(r, n, dtype=tf.float64), op=hvd.Adasum, prescale_factor=2.0, postscale_factor=3.0
    )
    np.testing.assert_allclose(scaled.numpy(), np.full(n, 6.0))  # Adasum commutes with scaling
    same = hvd.allreduce(tf.constant([3.0, -4.0]), op=hvd.Adasum)
    np.testing.assert_allclose(same.numpy(), [3.0, -4.0], rtol=1e-6)
    if n == 2:  # the pairwise rule itself
        a, b = np.array([1.0, 2.0]), np.array([3.0, -1.0])
        mine = tf.constant(a if r == 0 else b)
        dot = a @ b
        expected = (1 - dot / (2 * a @ a)) * a + (1 - dot / (2 * b @ b)) * b
        np.testing.assert_allclose(hvd.allreduce(mine, op=hvd.Adasum).numpy(), expected)


def test_broadcast_in_place(hvd):
    r, n = hvd.rank(), hvd.size()
    v = tf.Variable([float(r)] * 3)
    w = tf.Variable([r, r], dtype=tf.int64)
    root = n - 1
    values = hvd.broadcast_([v, w], root)
    np.testing.assert_array_equal(v.numpy(), [root] * 3)
    np.testing.assert_array_equal(values[1].numpy(), [root, root])


# ---- gradients, against finite differences of the objective Horovod's gradient belongs to ----


def _finite_difference(hvd, x, loss_of, eps=1e-6):
    """d loss / d x on this rank, where each rank perturbs in turn (all take part each time)."""
    r, n = hvd.rank(), hvd.size()
    grad = np.zeros_like(x)
    sizes = hvd.allgather_object(x.size)
    for owner in range(n):
        for j in range(sizes[owner]):  # every rank takes part in every evaluation
            values = []
            for sign in (1, -1):
                xp = x.copy()
                if r == owner:
                    xp.flat[j] += sign * eps
                values.append(loss_of(tf.constant(xp)))
            if r == owner:
                grad.flat[j] = (values[0] - values[1]) / (2 * eps)
    return grad


def _rank_weights(hvd, shape):
    """A weighting of the output that differs on every rank, so the gradient is not trivial."""
    return tf.constant(np.arange(np.prod(shape)).reshape(shape) * 0.1 + hvd.rank() + 1.0)


def test_allgather_gradient_is_that_of_the_mean_of_every_ranks_loss(hvd):
    r, n = hvd.rank(), hvd.size()
    x = rows_of(r, r + 1) / 100.0
    out_rows = sum(s + 1 for s in range(n))

    def loss_of(t):  # mean over ranks of each rank's loss, a number every rank agrees on
        local = tf.reduce_sum(tf.sin(hvd.allgather(t)) * _rank_weights(hvd, [out_rows, 2]))
        return float(hvd.allreduce(local, op=hvd.Average))

    t = tf.Variable(x)
    with tf.GradientTape() as tape:
        local = tf.reduce_sum(tf.sin(hvd.allgather(t)) * _rank_weights(hvd, [out_rows, 2]))
    np.testing.assert_allclose(
        tape.gradient(local, t).numpy(), _finite_difference(hvd, x, loss_of), rtol=1e-5, atol=1e-7
    )


def test_alltoall_gradient_is_that_of_the_sum_of_every_ranks_loss(hvd):
    r, n = hvd.rank(), hvd.size()
    splits = [1 + (r + j) % 2 for j in range(n)]
    x = rows_of(r, sum(splits) + 1) / 100.0  # the last row is not sent: its gradient is zero
    out_rows = sum(1 + (s + r) % 2 for s in range(n))

    def loss_of(t):
        out, _ = hvd.alltoall(t, splits=splits)
        local = tf.reduce_sum(tf.sin(out) * _rank_weights(hvd, [out_rows, 2]))
        return float(hvd.allreduce(local, op=hvd.Sum))

    t = tf.Variable(x)
    with tf.GradientTape() as tape:
        out, _ = hvd.alltoall(t, splits=splits)
        local = tf.reduce_sum(tf.sin(out) * _rank_weights(hvd, [out_rows, 2]))
    np.testing.assert_allclose(
        tape.gradient(local, t).numpy(), _finite_difference(hvd, x, loss_of), rtol=1e-5, atol=1e-7
    )


@pytest.mark.parametrize("grouped", [False, True], ids=["single", "grouped"])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (2.0, 0.5), (3.0, 1.0), (1.0, -0.25)])
@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_reducescatter_gradient_is_size_times_that_of_the_sum_of_losses(hvd, op, scales, grouped):
    """Horovod's convention (kept for its programs): the sum-of-losses gradient, times the
    number of ranks; the scale factors are in the loss, so in the gradient too."""
    r, n = hvd.rank(), hvd.size()
    x = rows_of(r, 2 * n) / 100.0
    red = getattr(hvd, op)
    pre, post = scales

    def scatter(t):
        if grouped:
            (out,) = hvd.grouped_reducescatter(
                [t], op=red, prescale_factor=pre, postscale_factor=post
            )
            return out
        return hvd.reducescatter(t, op=red, prescale_factor=pre, postscale_factor=post)

    def loss_of(t):
        local = tf.reduce_sum(tf.sin(scatter(t)) * _rank_weights(hvd, [2, 2]))
        return float(hvd.allreduce(local, op=hvd.Sum))

    t = tf.Variable(x)
    with tf.GradientTape() as tape:
        local = tf.reduce_sum(tf.sin(scatter(t)) * _rank_weights(hvd, [2, 2]))
    np.testing.assert_allclose(
        tape.gradient(local, t).numpy(),
        n * _finite_difference(hvd, x, loss_of),
        rtol=1e-5,
        atol=1e-7,
    )


def test_broadcast_and_grouped_allreduce_gradients_follow_horovod(hvd):
    r, n = hvd.rank(), hvd.size()
    t = tf.Variable(tf.ones([3], tf.float64) * r)
    with tf.GradientTape(persistent=True) as tape:
        b = hvd.broadcast(t, 0)
        s1, s2 = hvd.grouped_allreduce([t, 2.0 * t], op=hvd.Sum)
    # broadcast: the average of every rank's gradient goes to the root, zero elsewhere
    np.testing.assert_array_equal(tape.gradient(b, t).numpy(), [1.0 if r == 0 else 0.0] * 3)
    np.testing.assert_array_equal(tape.gradient(s2, t).numpy(), [2.0 * n] * 3)
    np.testing.assert_array_equal(tape.gradient(s1, t).numpy(), [float(n)] * 3)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_grouped_allreduce_gradients_with_an_integer_member_or_min_max(hvd, mode):
    """A group holding an integer tensor, and a Min or Max group, still differentiate their
    float members as the single allreduce does: the sum's gradient is the sum of every rank's
    (n here), Max's goes whole to the rank holding the extreme (rank n - 1)."""
    r, n = hvd.rank(), hvd.size()
    a = tf.Variable([1.0, 2.0])

    def gradients():
        with tf.GradientTape(persistent=True) as tape:
            x = a * (r + 1.0)
            total, count = hvd.grouped_allreduce([x, tf.constant([r], tf.int32)], op=hvd.Sum)
            (top,) = hvd.grouped_allreduce([x], op=hvd.Max, postscale_factor=2.0)
            single = hvd.allreduce(x, op=hvd.Max, postscale_factor=2.0)
            # a lossy compressor would round 1.001: the extreme is found exactly, as a single
            # Max finds it (else no rank's value equals it, and the gradient is 0 / 0)
            (near,) = hvd.grouped_allreduce([x * 1.001], op=hvd.Max, compression=QuarterCompressor)
        ys = (total, top, single, near)
        return total, count, top, near, [tape.gradient(y, a) for y in ys]

    total, count, top, near, (d_total, d_top, d_single, d_near) = (
        gradients() if mode == "eager" else tf.function(gradients)()
    )
    np.testing.assert_allclose(near.numpy(), [n * 1.001, n * 2.002], rtol=1e-6)
    holds = 1.0 if r == n - 1 else 0.0  # rank n - 1 holds the maximum
    np.testing.assert_allclose(d_near.numpy(), [holds * n * (r + 1) * 1.001] * 2, rtol=1e-6)
    np.testing.assert_array_equal(total.numpy(), [n * (n + 1) / 2, n * (n + 1)])
    np.testing.assert_array_equal(count.numpy(), [n * (n - 1) // 2])
    np.testing.assert_array_equal(top.numpy(), [2.0 * n, 4.0 * n])
    np.testing.assert_array_equal(d_total.numpy(), [n * (r + 1.0)] * 2)
    np.testing.assert_array_equal(d_top.numpy(), [holds * 2.0 * n * (r + 1.0)] * 2)
    np.testing.assert_array_equal(d_single.numpy(), d_top.numpy())


# ---- arguments that differ between ranks ----


@pytest.mark.parametrize("mode", ["eager", "tf1_graph"])
def test_mismatched_arguments_raise_failed_precondition_on_every_rank(hvd, mode):
    r, n = hvd.rank(), hvd.size()
    if n == 1:
        pytest.skip("one rank cannot disagree with itself")
    cases = {
        "shape": lambda: hvd.allreduce(tf.ones([3 + r])),
        "dtype": lambda: hvd.allreduce(tf.ones([3], tf.int32 if r % 2 else tf.float32)),
        "root": lambda: hvd.broadcast(tf.ones([2]), r),
        "trailing shape": lambda: hvd.allgather(tf.ones([2, 1 + r])),
        "name": lambda: hvd.allreduce(tf.ones([2]), name=f"tensor{r}"),
        "op": lambda: hvd.allreduce(tf.ones([2]), op=hvd.Sum if r else hvd.Max),
        # A bucket small enough to ride in the argument check against one that is not (the
        # second is 400 KB): both checks still move records of one size.
        "size across the inline bound": lambda: hvd.allreduce(tf.ones([4 if r else 100_000])),
        "collective": lambda: hvd.allreduce(tf.ones([2])) if r else hvd.allgather(tf.ones([2])),
        # Scale factors: ranks that scale differently would end with different results.
        "postscale": lambda: hvd.allreduce(tf.ones([2]), op=hvd.Sum, postscale_factor=r + 1.0),
        "prescale, large bucket": lambda: hvd.allreduce(tf.ones([100_000]), prescale_factor=r + 1),
        "grouped postscale": lambda: hvd.grouped_allreduce([tf.ones(2)], postscale_factor=r + 2),
        "reducescatter prescale": lambda: hvd.reducescatter(tf.ones([n, 2]), prescale_factor=r + 1),
        # Min and Max scale in TensorFlow, around a reduction of their own
        "max postscale": lambda: hvd.allreduce(tf.ones([2]), op=hvd.Max, postscale_factor=r + 1),
        "grouped min prescale": lambda: hvd.grouped_allreduce(
            [tf.ones([2])], op=hvd.Min, prescale_factor=r + 1
        ),
    }
    for what, build in cases.items():
        if mode == "eager":
            with pytest.raises(tf.errors.FailedPreconditionError) as info:
                build()
            assert isinstance(info.value, hvd.MismatchError)
            assert "rank 0" in str(info.value) and "rank 1" in str(info.value), what
        else:
            with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
                with pytest.raises(tf.errors.FailedPreconditionError):
                    sess.run(build())
    assert hvd.allreduce(tf.ones([1]), op=hvd.Sum).numpy()[0] == n  # the job goes on


def test_scale_factors_that_differ_raise_on_every_rank_and_equal_ones_do_not(hvd):
    """Horovod refuses a collective whose ranks sent different scale factors; ranks that write
    one factor as an int and another as a float agree. The tape's predivide is a scale."""
    r, n = hvd.rank(), hvd.size()
    same = hvd.allreduce(tf.ones([2]), op=hvd.Sum, postscale_factor=2 if r % 2 else 2.0)
    np.testing.assert_array_equal(same.numpy(), [2.0 * n] * 2)
    zero = hvd.allreduce(tf.ones([2]), op=hvd.Max, postscale_factor=-0.0 if r % 2 else 0.0)
    np.testing.assert_array_equal(np.abs(zero.numpy()), [0.0, 0.0])
    if n == 1:
        pytest.skip("one rank cannot disagree with itself")
    w = tf.Variable([1.0, 2.0])
    with hvd.DistributedGradientTape(tf.GradientTape(), gradient_predivide_factor=r + 1.0) as t:
        loss = tf.reduce_sum(w * w)
    with pytest.raises(hvd.MismatchError):
        t.gradient(loss, [w])
    with pytest.raises(hvd.MismatchError):
        hvd.allreduce(tf.ones([2]), op=hvd.Adasum, postscale_factor=r + 1.0)
    assert hvd.allreduce(tf.ones([1]), op=hvd.Sum).numpy()[0] == n  # the job goes on


def test_object_collectives_and_barrier_that_differ_raise_on_every_rank(hvd):
    # They used to share one checksum: a barrier met a broadcast_object, or one object
    # collective another, and the job hung; ranks naming different roots each got their own
    # object back, a silent wrong result.
    r, n = hvd.rank(), hvd.size()
    if n == 1:
        pytest.skip("one rank cannot disagree with itself")
    cases = {
        "different collectives (rank 0 in barrier; rank 1 in broadcast_object (root=0)": lambda: (
            hvd.barrier() if r == 0 else hvd.broadcast_object(r, 0)
        ),
        "different collectives (rank 0 in broadcast_object (root=0); rank 1 in allgather_object": (
            lambda: hvd.broadcast_object(r, 0) if r == 0 else hvd.allgather_object(r)
        ),
        "different root (rank 0: root=0; rank 1: root=1": lambda: hvd.broadcast_object(r, r),
    }
    for expected, build in cases.items():
        with pytest.raises(hvd.MismatchError) as info:
            build()
        assert expected in str(info.value), str(info.value)
    assert hvd.broadcast_object(r, 1) == 1  # the job goes on
    assert hvd.allgather_object(r) == list(range(n))


def test_any_two_different_collectives_at_one_point_raise_on_every_rank(hvd):
    # Rank 0 calls one collective, the others another: every ordered pair, each under its
    # default name and then all under one name, must end in MismatchError on every rank (no
    # hang, no silent pairing), and the job goes on.
    r, n = hvd.rank(), hvd.size()
    if n == 1:
        pytest.skip("one rank cannot disagree with itself")
    v = tf.Variable([1.0, 2.0])
    calls = {
        "allreduce": lambda name: hvd.allreduce(tf.ones([2]), name=name),
        "allreduce Sum": lambda name: hvd.allreduce(tf.ones([2]), op=hvd.Sum, name=name),
        "allgather": lambda name: hvd.allgather(tf.ones([2]), name=name),
        "grouped_allgather": lambda name: hvd.grouped_allgather([tf.ones([2])], name=name),
        "broadcast": lambda name: hvd.broadcast(tf.ones([2]), 0, name=name),
        "broadcast_variables": lambda name: hvd.broadcast_variables([v], 0),
        "alltoall": lambda name: hvd.alltoall(tf.ones([2 * n]), name=name),
        "reducescatter": lambda name: hvd.reducescatter(tf.ones([2 * n]), name=name),
        "broadcast_object": lambda name: hvd.broadcast_object(1, 0, name=name),
        "allgather_object": lambda name: hvd.allgather_object(1, name=name),
        "barrier": lambda name: hvd.barrier(),
    }
    for name in (None, "x"):
        for first in calls:
            for other in calls:
                if first == other:
                    continue
                try:
                    calls[first if r == 0 else other](name)
                    outcome = "no error"
                except hvd.MismatchError:
                    outcome = "MismatchError"
                seen = hvd.allgather_object(outcome)
                assert seen == ["MismatchError"] * n, (first, other, name, seen)
    assert hvd.allreduce(tf.ones([1]), op=hvd.Sum).numpy()[0] == n


def test_collectives_run_in_a_tf1_graph_and_session(hvd):
    r, n = hvd.rank(), hvd.size()
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        x = tf.compat.v1.placeholder(tf.float32, [2])
        total = hvd.allreduce(x, op=hvd.Sum)
        gathered = hvd.allgather(tf.fill([r + 1], r))
        grad = tf.gradients(hvd.allreduce(x * x, op=hvd.Sum), x)[0]
        out = sess.run([total, gathered, grad], {x: [r, 1.0]})
    np.testing.assert_array_equal(out[0], [n * (n - 1) / 2, n])
    np.testing.assert_array_equal(out[1], np.repeat(np.arange(n), np.arange(1, n + 1)))
    np.testing.assert_array_equal(out[2], [2.0 * n * r, 2.0 * n])


def test_indexed_slices_follow_horovod(hvd):
    r, n = hvd.rank(), hvd.size()
    slices = tf.IndexedSlices(tf.constant([[r, 1]] * 2), tf.constant([r, r + 1]))
    for op in ("Min", "Max", "Product", "Adasum"):
        with pytest.raises(NotImplementedError):
            hvd.allreduce(slices, op=getattr(hvd, op))
    with pytest.raises(NotImplementedError):
        hvd.allreduce(slices, op=hvd.Sum, prescale_factor=0.5)
    avg = hvd.allreduce(slices, op=hvd.Average)
    assert avg.values.dtype == tf.float64  # a true division, as Horovod's
    np.testing.assert_allclose(avg.values.numpy()[::2, 0], np.arange(n) / n)
    np.testing.assert_array_equal(
        avg.indices.numpy(), np.stack([np.arange(n), np.arange(n) + 1], 1).ravel()
    )


def test_introspection_answers_truthfully(hvd):
    assert hvd.mpi_built() and hvd.mpi_enabled()
    assert not (hvd.gloo_built() or hvd.gloo_enabled() or hvd.nccl_built() or hvd.ddl_built())
    assert not (hvd.ccl_built() or hvd.cuda_built() or hvd.rocm_built())
    assert hvd.mpi_threads_supported()
    assert int(hvd.rank_op()) == hvd.rank() and int(hvd.size_op()) == hvd.size()
    assert int(hvd.local_rank_op()) == hvd.local_rank()
    assert int(hvd.local_size_op()) == hvd.local_size()
    assert hvd.is_homogeneous()
    assert hvd.gpu_available() == bool(tf.config.list_physical_devices("GPU"))


def test_horovods_integer_ops_name_the_same_reductions(hvd):
    # Horovod's ops are its C++ enum's integers: 0 Average, 1 Sum, 2 Adasum, 3 Min, 4 Max,
    # 5 Product. Rank r holds r + 1.
    r, n = hvd.rank(), hvd.size()
    x = tf.fill([3], float(r + 1))
    total = n * (n + 1) / 2
    for number, expected in [
        (0, total / n),
        (1, total),
        (3, 1.0),
        (4, float(n)),
        (5, float(np.prod(np.arange(1, n + 1)))),
    ]:
        np.testing.assert_allclose(hvd.allreduce(x, op=number).numpy(), [expected] * 3)
        np.testing.assert_allclose(hvd.allreduce(x, op=np.int64(number)).numpy(), [expected] * 3)
    rows = hvd.reducescatter(tf.fill([n, 2], float(r + 1)), op=1)
    np.testing.assert_allclose(rows.numpy(), [[total, total]])
    for bad in (6, -1, True, 1.0):
        with pytest.raises(ValueError, match="op must be"):
            hvd.allreduce(x, op=bad)


@pytest.mark.parametrize("mode", MODES)
def test_a_tape_and_an_optimizer_take_horovods_integer_op(hvd, mode):
    import keras

    import syncdp.keras as hvd_keras

    r, n = hvd.rank(), hvd.size()
    w = tf.Variable([1.0, 2.0])

    def summed():  # op=1 is Sum: the gradient of (r + 1) * sum(w) summed over the ranks
        with tf.GradientTape() as tape:
            loss = float(r + 1) * tf.reduce_sum(w)
        return hvd.DistributedGradientTape(tape, op=1).gradient(loss, [w])[0]

    np.testing.assert_allclose(run(mode, summed).numpy(), [n * (n + 1) / 2] * 2)
    assert hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1), op=1).op is hvd.Sum
    # horovod.tensorflow's factory: 0 is Average, so a predivide factor is allowed
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=0, gradient_predivide_factor=2)
    assert opt.op is hvd.Average
    with pytest.raises(ValueError, match="op must be"):
        hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1), op=7)


@pytest.mark.parametrize("module", ["syncdp.keras", "horovod.tensorflow.keras", "horovod.keras"])
def test_the_keras_modules_collectives_take_horovods_keras_order(hvd, module):
    # horovod.keras: allreduce(value, name, average, prescale, postscale, op, compression),
    # reducescatter(value, name, op); horovod.tensorflow's order differs.
    import importlib

    face = importlib.import_module(module)
    r, n = hvd.rank(), hvd.size()
    value = np.full([2], r + 1.0, np.float32)
    total = n * (n + 1) / 2
    np.testing.assert_allclose(face.allreduce(value, "loss", False).numpy(), [total] * 2)
    np.testing.assert_allclose(face.allreduce(value, "loss", True).numpy(), [total / n] * 2)
    scaled = face.allreduce(value, "scaled", None, 2.0, 0.5, hvd.Max)
    np.testing.assert_allclose(scaled.numpy(), [2.0 * 0.5 * n] * 2)
    np.testing.assert_allclose(face.allreduce(r + 1.0, op=hvd.Sum).numpy(), total)
    rows = face.reducescatter(np.full([n, 2], r + 1.0, np.float32), "rows", hvd.Sum)
    np.testing.assert_allclose(rows.numpy(), [[total, total]])
    np.testing.assert_allclose(face.allgather(np.array([r]), "ranks").numpy(), np.arange(n))
    np.testing.assert_allclose(face.broadcast(np.array([r]), n - 1, "last").numpy(), [n - 1])


def test_a_numpy_integer_agrees_with_the_python_integer_it_equals(hvd, tmp_path_factory):
    """A root, epoch or seed that is a NumPy integer on some ranks (a result of join(), a
    NumPy loop) and a Python one on others is the same argument: no MismatchError."""
    import syncdp.data

    r, n = hvd.rank(), hvd.size()
    numpy_here = r % 2 == 0
    v = tf.Variable([float(r), 1.0])
    last = n - 1
    hvd.broadcast_variables([v], root_rank=np.int64(last) if numpy_here else last)
    np.testing.assert_array_equal(v.numpy(), [float(last), 1.0])
    got = hvd.broadcast(tf.constant([r]), root_rank=np.int32(0) if numpy_here else 0)
    np.testing.assert_array_equal(got.numpy(), [0])
    # Every rank names the same files (in a directory of rank 0's, shared through the job).
    folder = hvd.broadcast_object(str(tmp_path_factory.mktemp("files")) if r == 0 else None)
    files = [f"{folder}/part-{i}.tfrecord" for i in range(2 * n)]
    if r == 0:
        for i, path in enumerate(files):
            with tf.io.TFRecordWriter(path) as w:
                for k in range(i + 1):
                    w.write(b"x" * k)
    hvd.barrier()
    mine = syncdp.data.shard_files(
        files,
        seed=np.int64(7) if numpy_here else 7,
        epoch=np.int64(1) if numpy_here else 1,
    )
    everyone = hvd.allgather_object(sorted(mine))
    assert sorted(p for part in everyone for p in part) == sorted(files)
