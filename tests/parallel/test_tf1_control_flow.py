"""Collectives inside TF1 control flow (``tf.compat.v1.disable_v2_behavior()`` programs), and
inside control flow v2 and ``tf.function`` in a TF1 graph.

With control flow v1, ``tf.cond`` and ``tf.while_loop`` are Switch/Merge/Enter/Exit nodes in the
one graph a Session runs, and syncdp's chain of collectives (each waits for the one built before
it) crosses them: a collective in a cond branch not taken must not stop the ones after it (the
training step was skipped without an error), and a collective after a while loop that holds
collectives must not be refused for depending on an op in the loop's frame. The expected weights
are full-batch gradient descent computed in NumPy.
"""

import contextlib
import time

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.ops import control_flow_util

D, B, LR = 4, 2, 0.1


@contextlib.contextmanager
def tf1_control_flow(version=1):
    """A TF1 graph built with control flow v1, as under ``disable_v2_behavior()``, or v2 (as
    after ``disable_eager_execution()`` alone)."""
    saved = control_flow_util.ENABLE_CONTROL_FLOW_V2
    if version == 1:
        tf.compat.v1.disable_control_flow_v2()
    else:
        tf.compat.v1.enable_control_flow_v2()
    try:
        with tf.Graph().as_default():
            yield
    finally:
        control_flow_util.ENABLE_CONTROL_FLOW_V2 = saved


def problem(n):
    rng = np.random.RandomState(0)
    x = rng.randn(n * B, D).astype(np.float32)
    y = rng.randn(n * B, 1).astype(np.float32)
    return x, y, rng.randn(D, 1).astype(np.float32)


def descend(x, y, w0, steps):
    """Full-batch gradient descent on the mean squared error, in float64."""
    w = w0.astype(np.float64)
    for _ in range(steps):
        w = w - LR * 2 * x.T @ (x @ w - y) / len(x)
    return w


def rank_loss(hvd, x, y, w):
    r = hvd.rank()
    xs, ys = tf.constant(x[r * B : (r + 1) * B]), tf.constant(y[r * B : (r + 1) * B])
    return tf.reduce_mean(tf.square(tf.matmul(xs, w) - ys))


@pytest.mark.parametrize("fetch_the_cond", [False, True])
def test_a_collective_in_a_cond_branch_not_taken_stops_nothing(hvd, fetch_the_cond):
    steps = 4
    x, y, w0 = problem(hvd.size())
    with tf1_control_flow():
        w = tf.compat.v1.get_variable("w", initializer=w0)
        step = tf.compat.v1.train.get_or_create_global_step()
        loss = rank_loss(hvd, x, y, w)
        # Every other step the logged loss is averaged over the ranks: the branch holding that
        # allreduce is not taken on odd steps.
        logged = tf.compat.v1.cond(tf.equal(step % 2, 0), lambda: hvd.allreduce(loss), lambda: loss)
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LR))
        train = opt.minimize(loss, global_step=step)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for _ in range(steps):
                sess.run([train, logged] if fetch_the_cond else train)
            got_w, got_step = sess.run([w, step])
    assert got_step == steps
    np.testing.assert_allclose(got_w, descend(x, y, w0, steps), rtol=1e-5, atol=1e-6)


def test_a_collective_after_a_while_loop_of_training_steps(hvd):
    steps = 3
    x, y, w0 = problem(hvd.size())
    expected_w = descend(x, y, w0, steps)
    with tf1_control_flow():
        w = tf.compat.v1.get_variable("w", initializer=w0)
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LR))

        def body(i):
            with tf.control_dependencies([opt.minimize(rank_loss(hvd, x, y, w))]):
                return i + 1

        loop = tf.compat.v1.while_loop(lambda i: i < steps, body, [tf.constant(0)])
        with tf.control_dependencies([loop]):
            final = rank_loss(hvd, x, y, w)
        mean_final = hvd.allreduce(final)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            got = sess.run(mean_final)
            got_w = sess.run(w)
    np.testing.assert_allclose(got_w, expected_w, rtol=1e-5, atol=1e-6)
    # The mean of the ranks' losses is the loss over the whole batch.
    assert got == pytest.approx(float(np.mean((x @ expected_w - y) ** 2)), rel=1e-5)


@pytest.mark.parametrize("construct", ["cond", "while_loop", "tf.function"])
def test_a_collective_in_control_flow_v2_keeps_its_place_in_a_tf1_graph(hvd, construct):
    # Control flow v2 in a TF1 graph (TF2's default after disable_eager_execution() alone)
    # builds each branch, loop body or tf.function as a function graph called by one op.
    # Rank 0's input to the first collective comes late and so does the last rank's to the
    # second: without an order between them, the ranks would pair the two crosswise.
    r, n = hvd.rank(), hvd.size()

    def late_on(rank):
        def pass_through(v):
            if r == rank:
                time.sleep(0.3)
            return v

        return pass_through

    def allreduce(v):
        return hvd.allreduce(v)

    with tf1_control_flow(version=2):
        first_in = tf.numpy_function(late_on(0), [tf.constant([1.0 + r])], tf.float32)
        second_in = tf.numpy_function(late_on(n - 1), [tf.constant([100.0 + r])], tf.float32)
        first_in.set_shape([1])
        second_in.set_shape([1])
        take = tf.compat.v1.placeholder(tf.bool, [])
        if construct == "cond":
            first = tf.compat.v1.cond(take, lambda: allreduce(first_in), lambda: first_in)
        elif construct == "while_loop":
            body = lambda i, v: (i + 1, allreduce(v))  # noqa: E731
            _, first = tf.compat.v1.while_loop(lambda i, v: i < 1, body, [0, first_in])
        else:
            first = tf.function(allreduce, autograph=False)(first_in)
        second = hvd.allreduce(second_in)
        config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=2)
        with tf.compat.v1.Session(config=config) as sess:
            for _ in range(2):
                got_first, got_second = sess.run([first, second], feed_dict={take: True})
                # the means over the ranks of 1 + r and of 100 + r
                np.testing.assert_allclose(got_first, [1 + (n - 1) / 2], rtol=1e-6)
                np.testing.assert_allclose(got_second, [100 + (n - 1) / 2], rtol=1e-6)
