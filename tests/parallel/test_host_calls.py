"""A traced training step holds a bounded number of host calls, whatever its variables.

Every host call (a ``tf.numpy_function`` node) costs tens of microseconds per step however few
bytes it moves, so the fixed cost of a step is set by how many the step holds. Gradients of one
dtype that fit one bucket must cost one host call in all: the step's count and its agreement
ride in that bucket, and its members cross into it as one packed tensor. This guard counts the
nodes of the traced graph (no timing), so the fixed cost cannot creep back unnoticed.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import syncdp.keras

_HOST_OPS = {"PyFunc", "EagerPyFunc", "PyFuncStateless"}


def _host_calls(concrete) -> int:
    """Host-call nodes in a concrete function's graph and every function it calls."""
    graph_def = concrete.graph.as_graph_def()
    nodes = list(graph_def.node)
    for function in graph_def.library.function:
        nodes += list(function.node_def)
    return sum(1 for node in nodes if node.op in _HOST_OPS)


def _tape_step(hvd, variables):
    opt = keras.optimizers.SGD(0.1)
    opt.build(variables)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * v) for v in variables])
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables))
        return loss

    return step


def _optimizer_step(hvd, variables):
    opt = syncdp.keras.DistributedOptimizer(keras.optimizers.SGD(0.1))
    opt.build(variables)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * v) for v in variables])
        grads = tape.gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables))
        return loss

    return step


@pytest.mark.parametrize("build", [_tape_step, _optimizer_step], ids=["tape", "optimizer"])
def test_host_calls_do_not_grow_with_the_number_of_variables(hvd, build):
    counts = {}
    for n in (3, 60):
        variables = [tf.Variable(tf.fill([5, 4], float(i + 1))) for i in range(n)]
        step = build(hvd, variables)
        counts[n] = _host_calls(step.get_concrete_function())
        step()
        # The step still trains: every gradient 2v is the same on every rank, so the
        # average is 2v and SGD(0.1) leaves 0.8v.
        np.testing.assert_allclose(variables[-1].numpy(), np.full([5, 4], 0.8 * n), rtol=1e-6)
    # One bucket (60 x 80 bytes is far below the first bucket's 1 MiB): one host call, its
    # step and agreement included. Alone, nothing crosses to the host at all.
    expected = 0 if hvd.size() == 1 else 1
    assert counts == {3: expected, 60: expected}


def test_a_small_bucket_and_its_check_are_one_collective(hvd):
    # A bucket that fits the argument check's record rides in it: one collective per step, not
    # a check and then a gather. The reduction is still the average over the ranks.
    from syncdp.job import runtime

    r, n = hvd.rank(), hvd.size()
    variables = [tf.Variable(tf.fill([5, 4], float(i + 1))) for i in range(8)]
    opt = keras.optimizers.SGD(0.1)
    opt.build(variables)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * v) for v in variables]) * float(r + 1)
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables))

    step()
    comm = runtime.communicator()
    before = comm.seq
    step()
    assert comm.seq - before == (0 if n == 1 else 1)
    # Rank r's gradient is 2v(r+1): the average is 2v(n+1)/2 = v(n+1), and two SGD(0.1) steps
    # scale v by (1 - 0.1(n+1)) each.
    factor = (1 - 0.1 * (n + 1)) ** 2
    np.testing.assert_allclose(variables[-1].numpy(), np.full([5, 4], 8 * factor), rtol=1e-5)
