"""A graph that held syncdp's collectives is freed once the program drops it.

syncdp remembers, per graph being built, the last collective made in it (the next one waits for
it). That memory must not keep the graph alive: a program that builds and drops graphs (a TF1
loop making a graph per evaluation, a ``tf.function`` retraced for new shapes) would otherwise
keep every one. An Average or Sum of floats, differentiated, must not keep it either: its
gradient is kept with the graph. (Min, Max, Product and Adasum are differentiable through
``tf.custom_gradient``, whose registry TensorFlow itself keeps forever: plain TensorFlow leaks
such a graph too.)
"""

import gc
import weakref

import numpy as np
import tensorflow as tf

import syncdp.tensorflow as hvd


def _expected_sum():
    return np.full(3, sum(range(1, hvd.size() + 1)), np.int32)


def _collectives(value):
    total = hvd.allreduce(value, op=hvd.Sum, name="lifetime.sum")
    root = hvd.broadcast(value, root_rank=hvd.size() - 1, name="lifetime.root")
    return total, root


def _traced_and_dropped():
    @tf.function
    def step(x):
        return _collectives(x)

    mine = tf.fill([3], hvd.rank() + 1)
    concrete = step.get_concrete_function(mine)
    total, root = concrete(mine)
    np.testing.assert_array_equal(total.numpy(), _expected_sum())
    np.testing.assert_array_equal(root.numpy(), np.full(3, hvd.size(), np.int32))
    return weakref.ref(concrete.graph)


def _tf1_graph_run_and_dropped():
    graph = tf.Graph()
    with graph.as_default():
        total, root = _collectives(tf.fill([3], hvd.rank() + 1))
        total_again, _ = _collectives(tf.fill([3], hvd.rank() + 1))
        with tf.compat.v1.Session() as session:
            values = session.run([total, root, total_again])
    np.testing.assert_array_equal(values[0], _expected_sum())
    np.testing.assert_array_equal(values[1], np.full(3, hvd.size(), np.int32))
    np.testing.assert_array_equal(values[2], _expected_sum())
    return weakref.ref(graph)


def test_a_traced_function_graph_is_freed_when_dropped():
    graph = _traced_and_dropped()
    gc.collect()
    assert graph() is None, "the function's graph outlived the function"


def test_a_tf1_graph_is_freed_when_dropped():
    graph = _tf1_graph_run_and_dropped()
    gc.collect()
    assert graph() is None, "the TF1 graph outlived the program's last reference to it"


def _float_step_traced_and_dropped():
    """A traced step that averages and sums floats and is differentiated through them."""
    r, n = hvd.rank(), hvd.size()

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            mean = hvd.allreduce(x * (r + 1.0), op=hvd.Average, prescale_factor=2.0)
            total, double = hvd.grouped_allreduce([x, 2.0 * x], op=hvd.Sum)
            loss = tf.reduce_sum(mean) + tf.reduce_sum(total) + tf.reduce_sum(double)
        return mean, total, tape.gradient(loss, x)

    x = tf.ones([3])
    concrete = step.get_concrete_function(x)
    mean, total, grad = concrete(x)
    ranks_sum = n * (n + 1) / 2
    np.testing.assert_allclose(mean.numpy(), np.full(3, 2.0 * ranks_sum / n), rtol=1e-6)
    np.testing.assert_allclose(total.numpy(), np.full(3, float(n)))
    # every rank's loss is summed over ranks: mean's term gives 2 (r + 1) (the n ranks' ones,
    # averaged), total's n and double's 2 n
    np.testing.assert_allclose(grad.numpy(), np.full(3, 2.0 * (r + 1) + 3.0 * n), rtol=1e-6)
    return weakref.ref(concrete.graph)


def test_a_differentiated_float_average_and_sum_do_not_keep_their_graph():
    graph = _float_step_traced_and_dropped()
    gc.collect()
    assert graph() is None, "the function's graph outlived the function"
