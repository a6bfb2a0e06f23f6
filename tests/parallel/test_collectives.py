"""Every collective equals the mathematics at any number of ranks, eagerly and in tf.function."""

import threading
import time

import numpy as np
import pytest
import tensorflow as tf

DTYPES = [tf.float16, tf.float32, tf.float64, tf.bfloat16, tf.int32, tf.int64]
MODES = ["eager", "function"]


def run(mode, fn, *args):
    return (fn if mode == "eager" else tf.function(fn))(*args)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_allreduce_sum_average_min_max(hvd, mode, dtype):
    r, n = hvd.rank(), hvd.size()
    x = tf.cast(tf.fill([2, 3], r + 1), dtype)
    total = n * (n + 1) // 2
    for op, expected in [
        (hvd.Sum, total),
        (hvd.Min, 1),
        (hvd.Max, n),
        (hvd.Average, total / n if dtype.is_floating else total // n),
    ]:
        out = run(mode, lambda t, op=op: hvd.allreduce(t, op=op), x)
        assert out.dtype == dtype and out.shape == x.shape
        np.testing.assert_array_equal(tf.cast(out, tf.float64).numpy(), np.full([2, 3], expected))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_allgather_concatenates_in_rank_order(hvd, mode, dtype):
    r, n = hvd.rank(), hvd.size()
    x = tf.cast(tf.fill([r + 1, 2], r), dtype)  # rank r contributes r + 1 rows of r
    out = run(mode, hvd.allgather, x)
    expected = np.concatenate([np.full([k + 1, 2], k) for k in range(n)])
    assert out.dtype == dtype
    np.testing.assert_array_equal(tf.cast(out, tf.float64).numpy(), expected)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_broadcast_gives_the_roots_value(hvd, mode, dtype):
    root = hvd.size() - 1
    x = tf.cast(tf.fill([4], hvd.rank() * 10 + 1), dtype)
    out = run(mode, lambda t: hvd.broadcast(t, root_rank=root), x)
    np.testing.assert_array_equal(tf.cast(out, tf.float64).numpy(), np.full([4], root * 10 + 1))


@pytest.mark.parametrize("mode", MODES)
def test_grouped_allreduce_mixed_dtypes_none_and_scalars(hvd, mode):
    r, n = hvd.rank(), hvd.size()
    tensors = [
        tf.fill([3], float(r)),
        None,
        tf.constant(r + 1, tf.int64),
        tf.fill([2, 2], tf.constant(r, tf.float64)),
        tf.zeros([0, 4]),
    ]
    out = run(mode, lambda ts: hvd.grouped_allreduce(ts, op=hvd.Sum), tensors)
    total = n * (n - 1) / 2
    np.testing.assert_array_equal(out[0].numpy(), np.full([3], total))
    assert out[1] is None
    assert out[2].numpy() == n * (n + 1) // 2 and out[2].dtype == tf.int64
    np.testing.assert_array_equal(out[3].numpy(), np.full([2, 2], total))
    assert out[4].shape == (0, 4)


@pytest.mark.parametrize("mode", MODES)
def test_allreduce_of_indexed_slices_gathers_rows(hvd, mode):
    r, n = hvd.rank(), hvd.size()
    slices = tf.IndexedSlices(tf.fill([1, 2], float(r + 1)), tf.constant([r]), tf.constant([n, 2]))

    def reduce(values, indices):
        out = hvd.allreduce(tf.IndexedSlices(values, indices, tf.constant([n, 2])), op=hvd.Average)
        return tf.convert_to_tensor(out)

    dense = run(mode, reduce, slices.values, slices.indices).numpy()
    expected = np.array([[(k + 1) / n] * 2 for k in range(n)])
    np.testing.assert_allclose(dense, expected, rtol=1e-6)


def test_allreduce_gradient_is_the_allreduce_of_the_gradient(hvd):
    x = tf.Variable([1.0, 2.0])
    with tf.GradientTape() as tape:
        y = hvd.allreduce(x * float(hvd.rank() + 1), op=hvd.Sum)
        loss = tf.reduce_sum(y)
    grad = tape.gradient(loss, x).numpy()
    # d/dx sum_k (k+1) x summed again over ranks: every rank's upstream gradient is 1, and the
    # backward allreduce sums the n ones before the local factor (rank + 1) applies.
    np.testing.assert_allclose(grad, np.full([2], hvd.size() * (hvd.rank() + 1.0)))


@pytest.mark.parametrize("mode", ["eager", "function", "tf1_graph"])
@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_scaled_average_and_sum_gradients_swap_the_factors(hvd, mode, compression):
    """y = post * op(pre * c_r * x) over ranks, every rank's loss summed: the gradient on rank
    r is post * pre * c_r, times n for a Sum (every rank's upstream ones summed)."""
    r, n = hvd.rank(), hvd.size()
    c = r + 1.0
    options = dict(prescale_factor=4.0, postscale_factor=0.5)
    options["compression"] = getattr(hvd.Compression, compression)

    def gradients(x):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            mean = hvd.allreduce(x * c, op=hvd.Average, **options)
            (total,) = hvd.grouped_allreduce([x * c], op=hvd.Sum, **options)
        return mean, total, tape.gradient(mean, x), tape.gradient(total, x)

    if mode == "tf1_graph":
        with tf.Graph().as_default(), tf.compat.v1.Session() as session:
            x = tf.compat.v1.placeholder(tf.float32, [2])
            mean = hvd.allreduce(x * c, op=hvd.Average, **options)
            (total,) = hvd.grouped_allreduce([x * c], op=hvd.Sum, **options)
            grads = tf.gradients(mean, x) + tf.gradients(total, x)
            out = session.run([mean, total, *grads], {x: [1.0, 2.0]})
    else:
        out = [t.numpy() for t in run(mode, gradients, tf.constant([1.0, 2.0]))]
    mean, total, d_mean, d_total = out
    ranks_sum = n * (n + 1) / 2
    np.testing.assert_allclose(mean, [2.0 * ranks_sum / n, 4.0 * ranks_sum / n], rtol=1e-6)
    np.testing.assert_allclose(total, [2.0 * ranks_sum, 4.0 * ranks_sum], rtol=1e-6)
    np.testing.assert_allclose(d_mean, [2.0 * c] * 2, rtol=1e-6)
    np.testing.assert_allclose(d_total, [2.0 * c * n] * 2, rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_broadcast_variables_makes_replicas_identical(hvd, mode):
    tf.random.set_seed(100 + hvd.rank())  # a different initialisation on every rank
    variables = [
        tf.Variable(tf.random.normal([5, 3])),
        tf.Variable(tf.random.normal([7])),
        tf.Variable(tf.constant([hvd.rank()], tf.int64)),
    ]
    root_values = hvd.broadcast_object([v.numpy() for v in variables], root_rank=0)

    def sync():
        hvd.broadcast_variables(variables, root_rank=0)

    run(mode, sync)
    for v, expected in zip(variables, root_values):
        np.testing.assert_array_equal(v.numpy(), expected)
    digests = hvd.allgather_object([v.numpy().tobytes() for v in variables])
    assert all(d == digests[0] for d in digests)


def test_python_object_collectives(hvd):
    r, n = hvd.rank(), hvd.size()
    assert hvd.broadcast_object({"from": r, "data": [r] * 3}, root_rank=n - 1) == {
        "from": n - 1,
        "data": [n - 1] * 3,
    }
    assert hvd.allgather_object(("rank", r)) == [("rank", k) for k in range(n)]


def test_topology_on_one_host(hvd):
    n = hvd.size()
    assert 0 <= hvd.rank() < n and hvd.is_chief() == (hvd.rank() == 0)
    assert hvd.local_size() == n and hvd.local_rank() == hvd.rank()  # one host
    # Horovod's cross ranks: those sharing this local rank, i.e. one per host here.
    assert hvd.cross_size() == 1 and hvd.cross_rank() == 0


@pytest.mark.parametrize("late", ["last", "first"])
def test_join_returns_the_rank_that_arrived_last(hvd, late):
    n = hvd.size()
    straggler = n - 1 if late == "last" else 0
    hvd.barrier()
    if hvd.rank() == straggler:
        time.sleep(0.5)  # far longer than any skew between the others' arrivals
    assert hvd.join() == straggler
    joined = tf.function(hvd.join)  # inside a graph: computed when it runs, not when traced
    joined.get_concrete_function()
    hvd.barrier()
    if hvd.rank() == straggler:
        time.sleep(0.5)
    assert int(joined()) == straggler


@pytest.mark.parametrize("op", ["min", "max"])
def test_min_max_gradient_flows_to_the_rank_holding_the_extreme(hvd, op):
    """y = op over ranks of (pre * x); the job's loss is the sum of every rank's sum(y * w).

    Element 0: rank 0 holds the extreme alone, so it gets the whole gradient
    (pre * post * sum of every rank's w) and the others none. Element 1: every rank holds the
    same value, so they share it equally (as tf.reduce_min shares ties).
    """
    r, n = hvd.rank(), hvd.size()
    sign = 1.0 if op == "min" else -1.0
    x = tf.Variable([sign * r, 5.0])  # rank 0 holds the min (or, negated, the max)
    w = tf.constant([float(r + 1), 2.0 * (r + 1)])
    pre, post = 2.0, 3.0
    reduce_op = hvd.Min if op == "min" else hvd.Max
    with tf.GradientTape() as tape:
        y = hvd.allreduce(x, op=reduce_op, prescale_factor=pre, postscale_factor=post)
        loss = tf.reduce_sum(y * w)
    np.testing.assert_allclose(y.numpy(), [0.0, 30.0])
    grad = tape.gradient(loss, x).numpy()
    total_w = n * (n + 1) / 2  # sum over ranks of (rank + 1)
    expected0 = pre * post * total_w if r == 0 else 0.0
    expected1 = pre * post * 2.0 * total_w / n
    np.testing.assert_allclose(grad, [expected0, expected1], rtol=1e-6)


def test_bad_arguments_raise(hvd):
    with pytest.raises(ValueError, match="root_rank"):
        hvd.broadcast(tf.ones(1), root_rank=hvd.size())
    with pytest.raises(ValueError, match="op must be"):
        hvd.allreduce(tf.ones(1), op="mean")
    with pytest.raises(TypeError, match="cannot reduce bool"):
        hvd.allreduce(tf.constant([True]))
    words = tf.constant(["a", "b"])
    for collective, call in [
        ("broadcast", lambda: hvd.broadcast(words, 0)),
        ("allgather", lambda: hvd.allgather(words)),
        ("alltoall", lambda: hvd.alltoall(tf.fill([hvd.size()], "a"))),
        ("broadcast", lambda: tf.function(lambda: hvd.broadcast(tf.constant("a"), 0))()),
        ("broadcast_variables", lambda: hvd.broadcast_variables([tf.Variable(["a"])], 0)),
    ]:
        with pytest.raises(TypeError, match=f"{collective} cannot send string tensors"):
            call()
    mine = tf.constant([complex(hvd.rank(), 1)], tf.complex64)  # moved as bytes, as before
    expected = [complex(k, 1) for k in range(hvd.size())]
    np.testing.assert_array_equal(hvd.allgather(mine).numpy(), expected)


def test_objects_travel_by_cloudpickle_and_the_root_keeps_its_own(hvd):
    n, r = hvd.size(), hvd.rank()
    root = n - 1

    class Local:  # defined in a function: plain pickle cannot send it
        def __init__(self, rank):
            self.rank = rank

    mine = {"root": root}
    got = hvd.broadcast_object(mine if r == root else None, root_rank=root)
    assert got == {"root": root}
    assert (got is mine) == (r == root)  # the root gets its very object back, as in Horovod
    shift = hvd.broadcast_object((lambda x: x + root) if r == root else None, root_rank=root)
    assert shift(1) == 1 + root
    functions = hvd.allgather_object(lambda x, r=r: x * (r + 1))
    assert [f(2) for f in functions] == [2 * (i + 1) for i in range(n)]
    assert [o.rank for o in hvd.allgather_object(Local(r))] == list(range(n))


def test_an_object_one_rank_cannot_pickle_fails_on_every_rank_and_the_job_goes_on(hvd):
    from syncdp.base.errors import CollectiveError

    n, r = hvd.size(), hvd.rank()
    root = n - 1
    started = time.monotonic()
    # A lock pickles with neither pickle nor cloudpickle.
    with pytest.raises(CollectiveError, match=f"rank {root}: TypeError: cannot pickle"):
        hvd.broadcast_object(threading.Lock() if r == root else None, root_rank=root)
    mine = threading.Lock() if r == 0 else r
    with pytest.raises(CollectiveError, match="rank 0: "):
        hvd.allgather_object(mine)
    assert time.monotonic() - started < 10  # at once, not at a stall timeout
    # The job goes on: the next collectives work on every rank.
    assert hvd.broadcast_object({"from": root} if r == root else None, root_rank=root) == {
        "from": root
    }
    assert hvd.allgather_object(r * 2) == [2 * i for i in range(n)]


def test_broadcast_variables_takes_tf1_ref_variables(hvd):
    """disable_v2_behavior() programs (or use_resource=False) make reference variables, whose
    dtype is float32_ref: still a float to broadcast."""
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        v = tf.compat.v1.Variable([float(hvd.rank() + 1)], use_resource=False)
        assert v.dtype._is_ref_dtype  # TensorFlow names no public check of it
        op = hvd.broadcast_variables([v], root_rank=0)
        session.run(v.initializer)
        session.run(op)
        np.testing.assert_array_equal(session.run(v), [1.0])


def test_collectives_take_the_tf1_references_that_assign_ops_return(hvd):
    """Under disable_v2_behavior() an assign op returns a float32_ref tensor; TensorFlow's ops
    (and Horovod's) read its value. Every collective refused it as a dtype it cannot move."""
    r, n = hvd.rank(), hvd.size()
    a = [q + 2.0 for q in range(n)]  # each rank's value after the assign_add below
    total = sum(a)
    want = {
        "allreduce": lambda x: (hvd.allreduce(x, op=hvd.Sum), [total] * n),
        "grouped": lambda x: (hvd.grouped_allreduce([x], op=hvd.Sum)[0], [total] * n),
        "broadcast": lambda x: (hvd.broadcast(x, root_rank=n - 1), [a[-1]] * n),
        "allgather": lambda x: (hvd.allgather(x), np.repeat(a, n)),
        "alltoall": lambda x: (hvd.alltoall(x), a),  # element r of every rank's
        "reducescatter": lambda x: (hvd.reducescatter(x, op=hvd.Sum), [total]),
    }
    for name, build in want.items():  # a graph each: running one runs those built before
        with tf.Graph().as_default(), tf.compat.v1.Session() as session:
            v = tf.compat.v1.Variable(tf.fill([n], float(r + 1)), use_resource=False)
            session.run(v.initializer)
            ref = v.assign_add(tf.ones([n]))
            assert ref.dtype._is_ref_dtype, name
            collective, expected = build(ref)
            np.testing.assert_array_equal(session.run(collective), expected, err_msg=name)
