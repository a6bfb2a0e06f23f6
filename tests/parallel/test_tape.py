"""N ranks on 1/N of each batch reach the weights of one process on the whole batch."""

import keras
import numpy as np
import pytest
import tensorflow as tf

GLOBAL_BATCH = 24  # splits evenly over 1, 2, 3 and 4 ranks
STEPS = 10


def make_model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input([6]), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)]
    )


def data(step):
    rng = np.random.default_rng(step)
    x = rng.normal(size=[GLOBAL_BATCH, 6]).astype(np.float32)
    y = rng.integers(0, 3, size=[GLOBAL_BATCH])
    return x, y


def train(model, optimizer, tape_wrapper, shard):
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape_wrapper(tape).gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    for s in range(STEPS):
        x, y = data(s)
        step(*shard(x, y))


def test_distributed_tape_matches_single_process(hvd):
    r, n = hvd.rank(), hvd.size()
    model = make_model(seed=r)  # different initial weights on every rank
    optimizer = keras.optimizers.Adam(0.01)
    optimizer.build(model.trainable_variables)
    hvd.broadcast_variables(model.variables + optimizer.variables, root_rank=0)

    reference = make_model(seed=0)
    reference.set_weights(model.get_weights())
    ref_optimizer = keras.optimizers.Adam(0.01)

    per_rank = GLOBAL_BATCH // n
    train(
        model,
        optimizer,
        hvd.DistributedGradientTape,
        lambda x, y: (x[r * per_rank : (r + 1) * per_rank], y[r * per_rank : (r + 1) * per_rank]),
    )
    train(reference, ref_optimizer, lambda tape: tape, lambda x, y: (x, y))

    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    everyone = hvd.allgather_object([w.tobytes() for w in model.get_weights()])
    assert all(weights == everyone[0] for weights in everyone), "replicas differ"


def test_tape_as_context_manager_and_sum(hvd):
    x = tf.Variable([1.0, 1.0])
    with hvd.DistributedGradientTape(tf.GradientTape(), op=hvd.Sum) as tape:
        loss = tf.reduce_sum(x * float(hvd.rank() + 1))
    grad = tape.gradient(loss, x)
    n = hvd.size()
    np.testing.assert_allclose(grad.numpy(), np.full([2], n * (n + 1) / 2))


def test_fp16_compression_and_unconnected_gradients(hvd):
    a, b = tf.Variable(tf.fill([4], 1.0)), tf.Variable(2.0)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(a * (hvd.rank() + 1.0) / 3.0)
    tape = hvd.DistributedGradientTape(tape, compression=hvd.Compression.fp16)
    grad_a, grad_b = tape.gradient(loss, [a, b])
    assert grad_b is None and grad_a.dtype == tf.float32
    n = hvd.size()
    expected = (n + 1) / 2 / 3.0
    np.testing.assert_allclose(grad_a.numpy(), np.full([4], expected), rtol=1e-3)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_min_max_and_product_reduce_each_gradient_element_as_horovods_tape_does(hvd, mode):
    """Rank r's gradients are (r + 1) c: each element is reduced over the ranks' values
    (elementwise min, max, product), for every variable, two steps running (no step check
    stands in the way)."""
    n, r = hvd.size(), hvd.rank()
    a, b = tf.Variable([1.0, -2.0]), tf.Variable(3.0)
    ranks = np.arange(1.0, n + 1).reshape([n] + [1])
    expected = {
        hvd.Min: lambda c: np.min(ranks * c, axis=0).reshape(np.shape(c)),
        hvd.Max: lambda c: np.max(ranks * c, axis=0).reshape(np.shape(c)),
        hvd.Product: lambda c: np.prod(ranks * c, axis=0).reshape(np.shape(c)),
    }

    def gradients(op):
        with tf.GradientTape() as tape:
            loss = (r + 1.0) * (tf.reduce_sum(a * a) + b * b)  # d/da = 2 (r + 1) a
        return hvd.DistributedGradientTape(tape, op=op).gradient(loss, [a, b])

    for op, of in expected.items():
        run = gradients if mode == "eager" else tf.function(lambda op=op: gradients(op))
        for _ in range(2):
            grad_a, grad_b = run(op) if mode == "eager" else run()
            np.testing.assert_allclose(grad_a.numpy(), of(np.array([2.0, -4.0])), rtol=1e-6)
            np.testing.assert_allclose(grad_b.numpy(), of(6.0), rtol=1e-6)


def test_gradient_takes_horovods_arguments_and_tensorflows_unconnected_gradients(hvd):
    # Horovod: gradient(target, sources, output_gradients, use_generic_names); tf.GradientTape:
    # gradient(target, sources, output_gradients, unconnected_gradients).
    n, r = hvd.size(), hvd.rank()
    a, b = tf.Variable(tf.fill([2], 1.0)), tf.Variable(2.0)
    zero = tf.UnconnectedGradients.ZERO
    calls = [  # (how gradient() is called, the unconnected b's gradient)
        (lambda tape, loss: tape.gradient(loss, [a, b], None, True), None),
        (lambda tape, loss: tape.gradient(loss, [a, b], None, zero), 0.0),
        (lambda tape, loss: tape.gradient(loss, [a, b], unconnected_gradients=zero), 0.0),
    ]
    for call, expected_b in calls:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(a * (r + 1.0))
        grad_a, grad_b = call(hvd.DistributedGradientTape(tape), loss)
        np.testing.assert_allclose(grad_a.numpy(), [(n + 1) / 2] * 2)
        assert (grad_b if grad_b is None else grad_b.numpy()) == expected_b


def test_a_variable_unused_on_some_ranks_is_named_and_zero_gradients_average_it(hvd):
    # The even ranks use b, the odd ones do not: the odd ranks have no gradient for it.
    n, r = hvd.size(), hvd.rank()
    a, b = tf.Variable([1.0, 2.0]), tf.Variable([3.0], name="b")

    def grads(**kwargs):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(a * a) + (tf.reduce_sum(b * b) if r % 2 == 0 else 0.0)
        return hvd.DistributedGradientTape(tape).gradient(loss, [a, b], **kwargs)

    if n > 1:
        with pytest.raises(hvd.MismatchError) as info:
            grads()
        message = str(info.value)
        assert "ranks passed different shapes, no_gradient (" in message, message
        assert "rank 1: shapes=((2,),), no_gradient=b:0" in message, message
        assert "unconnected_gradients=tf.UnconnectedGradients.ZERO" in message
    grad_a, grad_b = grads(unconnected_gradients=tf.UnconnectedGradients.ZERO)
    users = len(range(0, n, 2))
    np.testing.assert_allclose(grad_a.numpy(), [2.0, 4.0])
    np.testing.assert_allclose(grad_b.numpy(), [6.0 * users / n], rtol=1e-6)


@pytest.mark.parametrize("unused", ["one of two", "the only one"])
def test_adasum_refuses_gradients_that_differ_between_ranks_as_the_others_do(hvd, unused):
    """Adasum reduces tensor by tensor: where rank 0 alone had a gradient for v, its reduction
    of v met the others' next one (of w, the same shape), and the replicas diverged silently
    from then on. Now every rank raises, naming the variable, and the job goes on."""
    n, r = hvd.size(), hvd.rank()
    if n == 1:
        pytest.skip("one rank cannot differ from another")
    w, v = tf.Variable([1.0, 2.0], name="w"), tf.Variable([3.0, 4.0], name="v")
    x = tf.constant([1.0, 0.0]) if r % 2 == 0 else tf.constant([0.0, 1.0])
    sources = [w, v] if unused == "one of two" else [v]

    def grads(use_v: bool):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * x) + (tf.reduce_sum(v * v) if use_v else 0.0)
        return hvd.DistributedGradientTape(tape, op=hvd.Adasum).gradient(loss, sources)

    with pytest.raises(hvd.MismatchError, match="no_gradient"):
        grads(use_v=r == 0)
    # The job goes on: the next reduction pairs right. Ranks 0 and 1's [1, 0] and [0, 1] are
    # orthogonal: summed, [1, 1]; at np=3 that meets rank 2's [1, 0] (a.b = 1, |a|^2 = 2,
    # |b|^2 = 1): (1 - 1/4) [1, 1] + (1 - 1/2) [1, 0] = [1.25, 0.75].
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * x)
    (grad_w,) = hvd.DistributedGradientTape(tape, op=hvd.Adasum).gradient(loss, [w])
    expected = [1.0, 1.0] if n == 2 else [1.25, 0.75]
    np.testing.assert_allclose(grad_w.numpy(), expected, rtol=1e-6)


@pytest.mark.parametrize("where", ["eager", "function", "function under an eager tape"])
def test_a_tape_differentiates_through_the_averaged_gradient(hvd, where):
    """A penalty on the averaged gradient (loss + sum(g^2), g the tape's average): an outer
    tape differentiates through the reduction, as through Horovod's allreduce op, whose
    gradient is the same average of the outputs' gradients. The reduction was a host call no
    tape saw: the penalty's term was silently left out.

    Rank r: l = c sum(w^3), c = r + 1, so g = 3 mean(c) w^2 and, through the average (dy = 2g
    on every rank) and this rank's 3 c w^2, d(l + sum(g^2))/dw = 3 c w^2 + 36 c mean(c) w^3.
    """
    n, r = hvd.size(), hvd.rank()
    c, mean_c = r + 1.0, (n + 1) / 2
    w = tf.Variable([1.0, 2.0])

    def loss_and_average():
        with tf.GradientTape() as inner:
            loss = c * tf.reduce_sum(w**3)
        (g,) = hvd.DistributedGradientTape(inner, gradient_predivide_factor=2.0).gradient(loss, [w])
        return loss, g

    def penalized(part):
        with tf.GradientTape() as outer:
            loss, g = part()
            total = loss + tf.reduce_sum(g * g)
        return g, outer.gradient(total, w)

    if where == "eager":
        g, d = penalized(loss_and_average)
    elif where == "function":
        g, d = tf.function(lambda: penalized(loss_and_average))()
    else:  # the outer tape differentiates the traced function's graph
        g, d = penalized(tf.function(loss_and_average))
    x = np.array([1.0, 2.0])
    np.testing.assert_allclose(g.numpy(), 3 * mean_c * x**2, rtol=1e-6)
    np.testing.assert_allclose(d.numpy(), 3 * c * x**2 + 36 * c * mean_c * x**3, rtol=1e-6)


def test_a_traced_reduction_saves_as_a_saved_model(hvd, tmp_path):
    # Saving traces every registered gradient with no op: the reduction's gradient must give
    # none there rather than fail the save. (A predivide makes the host call at np=1 too.)
    class Step(tf.Module):
        def __init__(self):
            self.w = tf.Variable([1.0, 2.0])

        @tf.function(input_signature=[tf.TensorSpec([], tf.float32)])
        def gradient(self, c):
            with tf.GradientTape() as tape:
                loss = c * tf.reduce_sum(self.w**2)
            tape = hvd.DistributedGradientTape(tape, gradient_predivide_factor=2.0)
            return tape.gradient(loss, [self.w])[0]

    step = Step()
    mean_c = (hvd.size() + 1) / 2
    g = step.gradient(tf.constant(hvd.rank() + 1.0))
    np.testing.assert_allclose(g.numpy(), [2 * mean_c, 4 * mean_c], rtol=1e-6)
    tf.saved_model.save(step, str(tmp_path / f"rank{hvd.rank()}"))
    assert (tmp_path / f"rank{hvd.rank()}" / "saved_model.pb").exists()


def test_resnet50_gradient_list_is_averaged_exactly(hvd):
    """ResNet-50's 214 trainable variables (~100 MB): the tape returns the exact average.

    The loss is sum(v * c) over variables, so each gradient is the constant c this rank chose:
    (rank + 1) * (index % 5 + 1), small integers, whose average over ranks is exact in float32.
    """
    r, n = hvd.rank(), hvd.size()
    shapes = [tuple(v.shape) for v in keras.applications.ResNet50(weights=None).trainable_variables]
    variables = [tf.Variable(tf.zeros(s)) for s in shapes]
    coefficients = [tf.fill(s, float((r + 1) * (i % 5 + 1))) for i, s in enumerate(shapes)]

    @tf.function
    def gradients():
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * c) for v, c in zip(variables, coefficients)])
        return hvd.DistributedGradientTape(tape).gradient(loss, variables)

    mean_rank_plus_one = (n + 1) / 2  # average of 1, 2, ..., n
    for _ in range(2):  # the second step reuses the first step's fused buffers
        grads = gradients()
        assert len(grads) == len(shapes) == 214
        for i, (g, s) in enumerate(zip(grads, shapes)):
            assert tuple(g.shape) == s
            np.testing.assert_array_equal(g.numpy(), np.full(s, mean_rank_plus_one * (i % 5 + 1)))


def test_the_distributed_tape_is_a_gradient_tape_that_records_on_the_wrapped_one(hvd):
    # Horovod's DistributedGradientTape is a subclass of the tape's class; code that checks
    # isinstance(tape, tf.GradientTape) must take it.
    n, r = hvd.size(), hvd.rank()
    x = tf.constant([1.0, 2.0])
    inner = tf.GradientTape(persistent=True)
    tape = hvd.DistributedGradientTape(inner)
    assert isinstance(tape, tf.GradientTape)
    with tape:
        tape.watch(x)
        y = x * x * (r + 1.0)
        with tape.stop_recording():
            ignored = x * 3.0
    assert tape._persistent and tape.watched_variables() == inner.watched_variables() == ()
    # The wrapped tape's own methods, on this rank's recording: d(y)/dx = 2x(r+1), unreduced.
    np.testing.assert_allclose(tape.jacobian(y, x).numpy(), np.diag([2.0, 4.0]) * (r + 1))
    assert inner.gradient(ignored, x) is None
    # gradient(), reduced: the mean over ranks of 2x(r+1); persistent, so twice.
    for _ in range(2):
        np.testing.assert_allclose(tape.gradient(y, x).numpy(), [n + 1.0, 2.0 * (n + 1)])
    with tape:
        tape.reset()  # forgets y: only z is recorded
        tape.watch(x)
        z = tf.reduce_sum(x) * (r + 1.0)
    np.testing.assert_allclose(tape.gradient(z, x).numpy(), [(n + 1) / 2] * 2)


def test_a_set_that_reuses_a_removed_sets_id_counts_its_tape_steps_from_zero(hvd):
    # Set C reduces two steps on its ranks, is removed, and D gets C's id: the tape's step
    # check counted D's first step on from C's on C's ranks alone (a false StepMismatchError).
    r, n = hvd.rank(), hvd.size()
    if n < 3:
        pytest.skip("needs three ranks: two sets that share one")
    w = tf.Variable([1.0])

    def tape_step(ps):
        with tf.GradientTape() as t:
            loss = tf.reduce_sum(w) * (r + 1.0)
        return hvd.DistributedGradientTape(t, process_set=ps).gradient(loss, [w])[0]

    first, second = [0, 1], [1, 2]
    c = hvd.add_process_set(first)
    if c.included():
        for _ in range(2):
            assert float(tape_step(c)[0]) == pytest.approx(np.mean([q + 1.0 for q in first]))
    c_id = c.process_set_id
    assert hvd.remove_process_set(c)
    d = hvd.add_process_set(second)
    try:
        assert d.process_set_id == c_id
        if d.included():
            assert float(tape_step(d)[0]) == pytest.approx(np.mean([q + 1.0 for q in second]))
    finally:
        assert hvd.remove_process_set(d)


def test_fusion_groups_are_checked_as_horovod_checks_them(hvd):
    """groups (num_groups) must be a positive integer or a list of lists of variables: the
    tape and both optimizers refuse anything else, as Horovod's do."""
    a = tf.Variable(1.0)
    tape = tf.GradientTape()
    wrappers = {
        "tape": lambda **kw: hvd.DistributedGradientTape(tape, **kw),
        "keras": lambda **kw: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), **kw),
        "tf1": lambda **kw: hvd.DistributedOptimizer(
            tf.compat.v1.train.GradientDescentOptimizer(0.1), **kw
        ),
    }
    for name, wrap in wrappers.items():
        for bad in (dict(groups=0), dict(groups=-1), dict(groups=1.5), dict(num_groups=-2)):
            with pytest.raises(ValueError, match="groups should be a positive integer"):
                wrap(**bad)
                pytest.fail(f"{name} took {bad}")
        for good in (dict(groups=2), dict(groups=[[a]]), dict(num_groups=3), dict()):
            wrap(**good)
