"""syncdp makes no variable inside a user's traced function.

Horovod's elastic TF2 example traces its step once without syncdp (a local step that makes the
optimizer's slots), then again with the DistributedGradientTape; ``tf.function`` refuses
variables made after its first trace, so syncdp's own state (the step count, the gradient
accumulators) must not be made there. Each pattern runs both ways round, eagerly, traced and
in ``model.fit``, with a broadcast and with an elastic state (and elastic mode on), and the
weights are checked against one process trained on the whole global batch: N ranks on 1/N of
each batch take the steps one process takes on all of it. Ranks end bit-identical.
"""

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

import syncdp.keras as hvd_keras
import syncdp.tensorflow as hvd
from syncdp.job import runtime
from syncdp.tensorflow import tape

GLOBAL_BATCH = 6
FEATURES, OUTPUTS = 3, 2


def _local_batch() -> int:
    if GLOBAL_BATCH % hvd.size():
        pytest.skip(f"the global batch of {GLOBAL_BATCH} does not split over {hvd.size()} ranks")
    return GLOBAL_BATCH // hvd.size()


def _batches(count: int, seed: int):
    """``count`` global batches, the same on every rank."""
    rng = np.random.default_rng(seed)
    return [
        (
            rng.normal(size=(GLOBAL_BATCH, FEATURES)).astype("float32"),
            rng.normal(size=(GLOBAL_BATCH, OUTPUTS)).astype("float32"),
        )
        for _ in range(count)
    ]


def _slice(batch, rank: int, local: int):
    x, y = batch
    return x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]


def _joined(batches):
    """One batch of several (a step on it equals their accumulated average)."""
    return np.concatenate([b[0] for b in batches]), np.concatenate([b[1] for b in batches])


def _model(seed: int):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(4, activation="tanh"),
            keras.layers.Dense(OUTPUTS),
        ]
    )


def _sgd():
    return keras.optimizers.SGD(0.1, momentum=0.9)  # momentum: slots made by the first step


def _loss(model, x, y):
    return tf.reduce_mean(tf.square(model(x, training=True) - y))


def _reference(seed: int, batches):
    """One process: the model of rank 0's seed, one eager step per batch."""
    model, opt = _model(seed), _sgd()
    for x, y in batches:
        with tf.GradientTape() as tape:
            loss = _loss(model, x, y)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    return model, opt


def _check(model, opt, reference, *, iterations=None):
    """``iterations``: the count expected, where it is not the reference's number of updates
    (with ``backward_passes_per_step``, Horovod counts every pass)."""
    want_model, want_opt = reference
    for got, want in zip(model.weights, want_model.weights, strict=True):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0, atol=1e-5)
    want_iterations = int(want_opt.iterations) if iterations is None else iterations
    assert int(opt.iterations) == want_iterations
    mine = [np.asarray(v) for v in model.weights + list(opt.variables)]
    for r, theirs in enumerate(hvd.allgather_object(mine)):
        for a, b in zip(mine, theirs, strict=True):
            assert np.array_equal(a, b), f"rank {hvd.rank()} and rank {r} differ"


@pytest.fixture(autouse=True)
def first_reduction(monkeypatch):
    """Each test reduces as a program's first reduction: syncdp has no step count yet."""
    monkeypatch.setattr(tape, "_counters", {})


@pytest.fixture(params=[False, True], ids=["broadcast", "elastic"])
def elastic(request, monkeypatch):
    """Elastic mode on (a traced step keeps the step region even at one rank) or off."""
    if request.param:
        config = dataclasses.replace(runtime.get_config(), elastic=True)
        monkeypatch.setattr(runtime._state, "config", config)
    return request.param


def _train(step, model, opt, batches, *, elastic: bool) -> None:
    """``step(x, y)`` on each batch, after every rank takes rank 0's model and optimizer: by a
    broadcast, or by an elastic state's ``run`` (which syncs it first and commits each step)."""
    if not elastic:
        hvd.broadcast_variables(model.weights + list(opt.variables), root_rank=0)
        for x, y in batches:
            step(x, y)
        return
    state = hvd.elastic.TensorFlowKerasState(model, opt, done=0)

    @hvd.elastic.run
    def train(state):
        while state.done < len(batches):
            step(*batches[state.done])
            state.done += 1
            state.commit()

    train(state)
    assert state.done == len(batches)


@pytest.mark.parametrize(
    "syncdp_first", [False, True], ids=["without-then-with", "with-then-without"]
)
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_tape_step_without_and_with_syncdp(syncdp_first, traced, elastic):
    local = _local_batch()
    batches = _batches(3, seed=1)
    model, opt = _model(10 + hvd.rank()), _sgd()

    def step(x, y, allreduce=True):  # Horovod's elastic TF2 example's step
        with tf.GradientTape() as tape:
            loss = _loss(model, x, y)
        if allreduce:
            tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    step = tf.function(step) if traced else step
    mine = [_slice(b, hvd.rank(), local) for b in batches]
    if syncdp_first:
        _train(step, model, opt, mine[:2], elastic=elastic)
        step(*batches[2], allreduce=False)  # the whole batch on every rank: still replicas
        want = _reference(10, batches)
    else:
        step(*mine[0], allreduce=False)  # makes the slots; rank 0's result is synced next
        _train(step, model, opt, mine[1:], elastic=elastic)
        want = _reference(10, [_slice(batches[0], 0, local), *batches[1:]])
    _check(model, opt, want)


@pytest.mark.parametrize(
    ("passes", "elastic"),
    [(1, False), (4, False), (4, True)],
    ids=["1-broadcast", "4-broadcast", "4-elastic"],
    indirect=["elastic"],
)
@pytest.mark.parametrize(
    "syncdp_first", [False, True], ids=["without-then-with", "with-then-without"]
)
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_distributed_optimizer_step_without_and_with_syncdp(passes, syncdp_first, traced, elastic):
    local = _local_batch()
    batches = _batches(passes + 1, seed=2)
    model, inner = _model(20 + hvd.rank()), _sgd()
    opt = hvd.DistributedOptimizer(
        inner, backward_passes_per_step=passes, average_aggregated_gradients=True
    )

    def step(x, y, allreduce=True):
        with tf.GradientTape() as tape:
            loss = _loss(model, x, y)
        grads = tape.gradient(loss, model.trainable_variables)
        (opt if allreduce else inner).apply_gradients(zip(grads, model.trainable_variables))

    step = tf.function(step) if traced else step
    mine = [_slice(b, hvd.rank(), local) for b in batches]
    if syncdp_first:
        _train(step, model, opt, mine[:passes], elastic=elastic)
        step(*batches[passes], allreduce=False)
        want = _reference(20, [_joined(batches[:passes]), batches[passes]])
    else:
        # The optimizer it wraps makes its slots first; the accumulators come in a later trace.
        step(*mine[0], allreduce=False)
        _train(step, model, opt, mine[1:], elastic=elastic)
        want = _reference(20, [_slice(batches[0], 0, local), _joined(batches[1:])])
    _check(model, inner, want, iterations=1 + passes)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_aggregation_helper_first_used_after_a_step_without_syncdp(traced):
    passes = 4
    local = _local_batch()
    batches = _batches(passes + 1, seed=5)
    model, opt = _model(50 + hvd.rank()), _sgd()
    helper = hvd.LocalGradientAggregationHelper(passes, average_aggregated_gradients=True)

    def step(x, y, allreduce=True):
        with tf.GradientTape() as tape:
            loss = _loss(model, x, y)
        grads = tape.gradient(loss, model.trainable_variables)
        if not allreduce:
            return opt.apply_gradients(zip(grads, model.trainable_variables))
        grads = helper.compute_gradients(grads, model.trainable_variables)
        return helper.apply_gradients(
            lambda: opt.apply_gradients(zip(grads, model.trainable_variables)), opt
        )

    step = tf.function(step) if traced else step
    mine = [_slice(b, hvd.rank(), local) for b in batches]
    step(*mine[0], allreduce=False)  # the helper's sums come in a later trace
    _train(step, model, opt, mine[1:], elastic=False)

    want_model, _ = _reference(50, [_slice(batches[0], 0, local), _joined(batches[1:])])
    for got, want in zip(model.weights, want_model.weights, strict=True):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0, atol=1e-5)
    assert int(opt.iterations) == 1 + passes  # Horovod's helper counts every pass
    assert int(helper.counter) == 0


def _two_weight_window(traced):
    """A helper of two passes per window and its step on rank r (x = r + 1): ``step(True)``
    gives w1 and w2 the gradient x each, ``step(False)`` gives w1 x and w2 None."""
    w1, w2 = tf.Variable([1.0]), tf.Variable([1.0])
    helper = hvd.LocalGradientAggregationHelper(2)
    x = float(hvd.rank() + 1)

    def step(use_w2):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(x * w1 * (w2 if use_w2 else 1.0))
        return helper.compute_gradients(tape.gradient(loss, [w1, w2]), [w1, w2])

    return helper, tf.function(step) if traced else step


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_aggregation_helper_keeps_a_sum_the_last_pass_gave_nothing_to(traced):
    # Rank r (x = r + 1): w1 gets x on both passes, w2 gets x on the first and None on the
    # second. The window's reduction: w1 mean(2x) = n + 1, w2 mean(x) = (n + 1) / 2.
    n = hvd.size()
    helper, step = _two_weight_window(traced)
    step(True)
    reduced = step(False)
    np.testing.assert_allclose(reduced[0].numpy(), [n + 1.0], rtol=0, atol=1e-6)
    assert reduced[1] is not None, "the first pass's gradient of w2 was dropped"
    np.testing.assert_allclose(reduced[1].numpy(), [(n + 1) / 2], rtol=0, atol=1e-6)
    assert int(helper.counter) == 0


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_aggregation_helper_clears_a_sum_a_later_trace_made(traced):
    # Rank r (x = r + 1): the step without w2 is traced first, so w2's sum is made in a later
    # trace; a window the first trace closes must still clear it. The last window (two passes
    # with w2) reduces w2 to mean(2x) = n + 1, not more.
    n = hvd.size()
    helper, step = _two_weight_window(traced)
    for use_w2 in (False, True, True, False, True):
        step(use_w2)
    reduced = step(True)
    np.testing.assert_allclose(reduced[0].numpy(), [n + 1.0], rtol=0, atol=1e-6)
    np.testing.assert_allclose(reduced[1].numpy(), [n + 1.0], rtol=0, atol=1e-6)
    assert int(helper.counter) == 0


@pytest.mark.parametrize(
    ("passes", "elastic"),
    [(1, False), (4, True)],
    ids=["1-broadcast", "4-elastic"],
    indirect=["elastic"],
)
@pytest.mark.parametrize(
    "syncdp_first", [False, True], ids=["without-then-with", "with-then-without"]
)
def test_fit_without_and_with_distributed_optimizer(passes, syncdp_first, elastic):
    local = _local_batch()
    batches = _batches(passes + 1, seed=3)
    model, inner = _model(30 + hvd.rank()), _sgd()
    mine = [_slice(b, hvd.rank(), local) for b in batches]

    def fit(batch_list, batch_size, callbacks=()):
        x, y = _joined(batch_list)
        model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0, callbacks=list(callbacks))

    def fit_plain(batch_list, batch_size):
        model.compile(optimizer=inner, loss="mse", jit_compile=False)
        fit(batch_list, batch_size)

    def fit_distributed(batch_list):
        opt = hvd_keras.DistributedOptimizer(
            inner, backward_passes_per_step=passes, average_aggregated_gradients=True
        )
        model.compile(optimizer=opt, loss="mse", jit_compile=False)
        if not elastic:
            fit(batch_list, local, [hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)])
            return
        state = hvd_keras.elastic.KerasState(model, opt, epoch=0, batch=0)
        callbacks = [
            hvd_keras.elastic.CommitStateCallback(state),
            hvd_keras.elastic.UpdateBatchStateCallback(state),
            hvd_keras.elastic.UpdateEpochStateCallback(state),
        ]

        @hvd_keras.elastic.run
        def train(state):
            fit(batch_list, local, callbacks)

        train(state)
        assert state.epoch == 1

    if syncdp_first:
        fit_distributed(mine[:passes])
        fit_plain([batches[passes]], GLOBAL_BATCH)
        want = _reference(30, [_joined(batches[:passes]), batches[passes]])
    else:
        fit_plain([mine[0]], local)  # makes the slots; rank 0's result is synced next
        fit_distributed(mine[1:])
        want = _reference(30, [_slice(batches[0], 0, local), _joined(batches[1:])])
    _check(model, inner, want, iterations=1 + passes)


class _Towers(keras.Model):
    """Two towers placed on their own devices (both the CPU here), summed: model parallelism
    inside each rank, data parallelism across ranks."""

    def __init__(self):
        super().__init__(name="towers")
        with tf.device("/cpu:0"):
            self.first = keras.layers.Dense(OUTPUTS, activation="tanh")
        with tf.device("/cpu:0"):
            self.second = keras.layers.Dense(OUTPUTS)

    def call(self, x):
        with tf.device("/cpu:0"):
            a = self.first(x)
        with tf.device("/cpu:0"):
            b = self.second(x)
        return a + b


def _towers(seed: int):
    keras.utils.set_random_seed(seed)
    model = _Towers()
    model(tf.zeros([1, FEATURES]))
    return model


def test_model_parallel_towers_in_a_step_traced_twice():
    local = _local_batch()
    batches = _batches(2, seed=4)
    model, opt = _towers(40 + hvd.rank()), _sgd()
    hvd.broadcast_variables(model.weights, root_rank=0)

    def loss_of(model, x, y, weight):
        return weight * tf.reduce_mean(tf.square(model(x) - y))

    @tf.function
    def step(x, y, weight):
        with tf.GradientTape() as tape:
            loss = loss_of(model, x, y, weight)
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    weights = [1.0, 0.5]  # a Python number: the second step is a second trace
    for batch, weight in zip(batches, weights, strict=True):
        step(*_slice(batch, hvd.rank(), local), weight)

    ref_model, ref_opt = _towers(40), _sgd()
    for (x, y), weight in zip(batches, weights, strict=True):
        with tf.GradientTape() as tape:
            loss = loss_of(ref_model, x, y, weight)
        grads = tape.gradient(loss, ref_model.trainable_variables)
        ref_opt.apply_gradients(zip(grads, ref_model.trainable_variables))
    _check(model, opt, (ref_model, ref_opt))


def test_a_step_traced_into_two_graphs():
    """The step count belongs to no graph: one graph's tensor would be out of scope in the
    next (Horovod's test classes build each test in a graph of its own)."""

    def gradient(w):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * w) * tf.cast(hvd.rank() + 1, tf.float32)
        return hvd.DistributedGradientTape(tape).gradient(loss, [w])[0]

    for _ in range(2):
        with tf.Graph().as_default() as g:
            w = tf.Variable([1.0, 2.0])
            out = tf.function(gradient)(w)
            with tf.compat.v1.Session(graph=g) as session:
                session.run(w.initializer)
                got = session.run(out)
        mean_factor = (hvd.size() + 1) / 2  # the ranks' (rank + 1), averaged
        np.testing.assert_allclose(got, [2.0 * mean_factor, 4.0 * mean_factor], rtol=1e-6)
