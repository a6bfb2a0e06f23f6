"""``iterations`` under ``backward_passes_per_step``, as Horovod defines it.

Horovod's ``test_gradient_aggregation`` (test_tensorflow2_keras.py) asserts that after the
``n``-th ``apply_gradients`` call ``optimizer.iterations == n``, whether that call applied an
update or only added to the sums, and that ``_agg_helper.counter == n % k``. Checked here for
Keras 3, Keras 2 (tf-keras) and Keras 2's legacy optimizers, eagerly, in a ``tf.function``, in
``fit``, and through the elastic state's commit and restore. One process: the count does not
depend on the number of ranks (tests/parallel/test_keras_fit.py checks the values at np=2, 3).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import syncdp
import syncdp.keras as hvd
from syncdp.keras import optimizer as optimizers
from syncdp.tensorflow.elastic import TensorFlowKerasState

tf_keras = pytest.importorskip("tf_keras", reason="tf-keras is not installed: no Keras 2")

KERASES = {
    "keras3": lambda: (keras, keras.optimizers.SGD),
    "keras2": lambda: (tf_keras, tf_keras.optimizers.SGD),
    "keras2-legacy": lambda: (tf_keras, tf_keras.optimizers.legacy.SGD),
}


@pytest.fixture(scope="module", autouse=True)
def _init():
    syncdp.init()


@pytest.fixture(params=sorted(KERASES))
def kind(request):
    return KERASES[request.param]()


def _wrapped(sgd, k, average=True):
    # SGD with learning rate -1 adds the gradient to the variable: the updates are readable.
    inner = sgd(-1.0)
    return optimizers.for_package(_package_of(inner))(
        inner,
        backward_passes_per_step=k,
        average_aggregated_gradients=average,
        sparse_as_dense=True,
    )


def _package_of(opt):
    return tf_keras if type(opt).__module__.startswith("tf_keras") else keras


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("average", [True, False], ids=["average", "sum"])
def test_every_call_counts_as_in_horovods_test_gradient_aggregation(kind, traced, average):
    _, sgd = kind
    k = 4
    opt = _wrapped(sgd, k, average)
    x, y = tf.Variable([0.0]), tf.Variable([1.0, 2.0])

    def step():
        with tf.GradientTape() as tape:
            loss = x - tf.gather(y, [0])  # d/dx = 1, d/dy = [-1, 0] (IndexedSlices)
        grads = tape.gradient(loss, [x, y])
        opt.apply_gradients(zip(grads, [x, y]))

    step = tf.function(step) if traced else step
    for n in range(1, 11):
        step()
        updates = n // k
        per_update = 1.0 if average else float(k)
        np.testing.assert_allclose(x.numpy(), [updates * per_update])
        np.testing.assert_allclose(y.numpy(), [1.0 - updates * per_update, 2.0])
        assert int(opt.iterations) == n
        assert int(opt._agg_helper.counter) == n % k


def test_a_schedule_keyed_to_iterations_moves_per_pass(kind):
    package, sgd = kind
    # Keras evaluates the schedule at the iterations of the update: with 2 passes per update,
    # the updates happen at iterations 1 and 3 (0-based), as under Horovod.
    schedule = package.optimizers.schedules.PiecewiseConstantDecay([0, 1, 2], [-1, -2, -4, -8])
    inner = sgd(schedule)
    opt = optimizers.for_package(package)(inner, backward_passes_per_step=2)
    w = tf.Variable([0.0])
    for _ in range(4):
        with tf.GradientTape() as tape:
            loss = 1.0 * w
        opt.apply_gradients([(tape.gradient(loss, w), w)])
    # Each update applies the sum of its 2 passes' gradients (2), update 1 at iterations 1
    # (rate -2), update 2 at iterations 3 (rate -8): w = 2 * 2 + 2 * 8.
    np.testing.assert_allclose(w.numpy(), [20.0])
    assert int(opt.iterations) == 4


def test_by_default_an_update_applies_the_sum_of_the_passes_gradients(kind):
    package, sgd = kind
    k = 3
    opt = optimizers.for_package(package)(sgd(-1.0), backward_passes_per_step=k)
    assert opt.average_aggregated_gradients is False  # Horovod's default
    w = tf.Variable([0.0])
    for scale in (1.0, 2.0, 4.0):  # gradients 1, 2 and 4
        opt.apply_gradients([(tf.constant([scale]), w)])
    np.testing.assert_allclose(w.numpy(), [7.0])  # their sum; averaged it would be 7 / 3


def test_fit_counts_every_batch(kind):
    package, sgd = kind
    package.utils.set_random_seed(0)
    model = package.Sequential([package.Input((3,)), package.layers.Dense(2)])
    opt = optimizers.for_package(package)(sgd(0.1), backward_passes_per_step=2)
    model.compile(optimizer=opt, loss="mse")
    x = np.ones((10, 3), "float32")
    model.fit(x, np.zeros((10, 2), "float32"), batch_size=2, epochs=1, verbose=0)
    assert int(model.optimizer.iterations) == 5
    assert int(opt._agg_helper.counter) == 1


def test_the_elastic_state_keeps_the_count_and_the_sums(kind):
    package, sgd = kind
    model = package.Sequential([package.Input((1,)), package.layers.Dense(1, use_bias=False)])
    model.layers[0].kernel.assign([[0.0]])
    opt = _wrapped(sgd, 2)

    def passes(n):
        for _ in range(n):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(model(tf.ones((1, 1))))  # d/dw = 1
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

    state = TensorFlowKerasState(model, opt, batch=0)
    passes(3)  # one update, one pass summed
    state.commit()
    assert int(opt.iterations) == 3 and int(opt._agg_helper.counter) == 1
    passes(2)
    assert int(opt.iterations) == 5
    state.restore()
    assert int(opt.iterations) == 3 and int(opt._agg_helper.counter) == 1
    np.testing.assert_allclose(model.layers[0].kernel.numpy(), [[1.0]])
    passes(1)  # completes the pass summed before the commit
    assert int(opt.iterations) == 4 and int(opt._agg_helper.counter) == 0
    np.testing.assert_allclose(model.layers[0].kernel.numpy(), [[2.0]])


def test_without_aggregation_iterations_counts_updates():
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    w = tf.Variable([1.0])
    for _ in range(3):
        opt.apply_gradients([(tf.constant([1.0]), w)])
    assert int(opt.iterations) == 3 and opt._agg_helper is None
