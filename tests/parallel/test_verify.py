"""verify_synchronized and step agreement, at any number of ranks.

A deliberately perturbed rank (the last one) must be named on every rank, eagerly and inside
tf.function; ranks at different training steps must be named before any gradient is averaged.
"""

import dataclasses
import re

import numpy as np
import pytest
import tensorflow as tf

from syncdp.job import runtime
from syncdp.tensorflow import tape


def _variables():
    return [tf.Variable(tf.ones([3, 2]), name="kernel"), tf.Variable(tf.zeros([2]), name="bias")]


def test_identical_replicas_pass(hvd):
    variables = _variables()
    assert hvd.verify_synchronized(variables) == 2
    assert int(tf.function(lambda: hvd.verify_synchronized(variables))()) == 2


_NEEDS_TWO = "a replica can only differ from another one with 2 or more ranks"


@pytest.mark.parametrize("in_function", [False, True])
def test_a_perturbed_rank_is_named(hvd, in_function):
    if hvd.size() == 1:
        pytest.skip(_NEEDS_TWO)
    kernel, bias = _variables()
    last = hvd.size() - 1
    if hvd.size() > 1 and hvd.rank() == last:
        bias.assign([0.0, np.float32(1e-30)])  # one value, barely different
    call = (
        tf.function(lambda: hvd.verify_synchronized([kernel, bias]))
        if in_function
        else lambda: hvd.verify_synchronized([kernel, bias])
    )
    error = tf.errors.OpError if in_function else hvd.VerificationError
    with pytest.raises(error) as raised:
        call()
    text = str(raised.value)
    assert "1 of 2 variables" in text
    assert re.search(rf"bias\S*: rank {last} differ from rank", text), text
    assert "kernel" not in text


def _train(hvd, skip_rank: int, in_function: bool):
    """Two steps; ``skip_rank`` skips the first update, then both pass the optimizer's step."""
    w = tf.Variable(tf.ones([4]))
    opt = tf.keras.optimizers.SGD(0.1)
    opt.build([w])

    def step(apply):
        with tf.GradientTape() as t:
            loss = tf.reduce_sum(w * w)
        grads = hvd.DistributedGradientTape(t, step=opt.iterations).gradient(loss, [w])
        if apply:
            opt.apply_gradients(zip(grads, [w]))

    run = tf.function(step) if in_function else step
    run(True)  # step 0 on every rank: they agree
    # Rank skip_rank's update of step 1 is skipped (e.g. a rank-dependent NaN check), so its
    # optimizer is a step behind at the next reduction.
    run(hvd.rank() != skip_rank)
    run(True)


@pytest.mark.parametrize("in_function", [False, True])
def test_ranks_at_different_steps_are_named(hvd, in_function):
    if hvd.size() == 1:
        pytest.skip("ranks can only disagree on the step with 2 or more ranks")
    last = hvd.size() - 1
    error = tf.errors.OpError if in_function else hvd.StepMismatchError
    with pytest.raises(error) as raised:
        _train(hvd, skip_rank=last, in_function=in_function)
    text = str(raised.value)
    assert f"rank {last} is at step 1" in text and "at step 2" in text
    hvd.barrier()


def test_verify_every_k_steps_catches_a_perturbed_rank(hvd, monkeypatch):
    if hvd.size() == 1:
        pytest.skip(_NEEDS_TWO)
    config = runtime.get_config()
    monkeypatch.setattr(runtime._state, "config", dataclasses.replace(config, verify_every=3))
    monkeypatch.setattr(tape, "_counters", {})  # this test's reductions count from 0
    w = tf.Variable(tf.ones([4]), name="w")

    @tf.function
    def gradient():
        with tf.GradientTape() as t:
            loss = tf.reduce_sum(w * w)
        return hvd.DistributedGradientTape(t).gradient(loss, [w])

    gradient()
    gradient()
    if hvd.rank() == hvd.size() - 1:
        w.assign_add([0.0, 0.0, 0.0, 1e-3])
    with pytest.raises(tf.errors.OpError, match=rf"w\S*: rank {hvd.size() - 1} differ"):
        gradient()  # the third reduction checks
    assert int(tape._step_counter().numpy()) == 3


def test_verify_every_runs_in_the_ordered_chain_of_collectives(hvd, monkeypatch):
    """The periodic check is a collective: it must run at a fixed place among the buckets on
    every rank, i.e. chained after the last gradient bucket, not beside the chain."""
    if hvd.size() == 1:
        pytest.skip(_NEEDS_TWO)
    config = runtime.get_config()
    monkeypatch.setattr(runtime._state, "config", dataclasses.replace(config, verify_every=1))
    w = tf.Variable(tf.ones([4]), name="w")
    v = tf.Variable(tf.ones([3], tf.float64), name="v")  # a second dtype: a second bucket

    @tf.function
    def gradient():
        with tf.GradientTape() as t:
            loss = tf.reduce_sum(w * w) + tf.cast(tf.reduce_sum(v * v), tf.float32)
        return hvd.DistributedGradientTape(t).gradient(loss, [w, v])

    graph = gradient.get_concrete_function().graph
    host_ops = [op for op in graph.get_operations() if op.type == "PyFunc"]
    buckets = [op for op in host_ops if "bucket" in op.name]
    checks = [op for op in host_ops if "verify_every" in op.name]
    assert len(buckets) == 2 and len(checks) == 1
    assert buckets[0] in buckets[1].control_inputs
    assert buckets[1] in checks[0].control_inputs
    np.testing.assert_allclose(gradient()[0].numpy(), np.full([4], 2.0))


def test_verify_every_in_a_process_set_checks_its_ranks_only(hvd, monkeypatch):
    # Ranks outside the set keep their gradients and never reach the check: it runs among
    # the set's ranks (on the job's communicator it waited for the others until the stall
    # timeout).
    if hvd.size() < 3:
        pytest.skip("needs a set of 2 ranks beside a rank outside it")
    config = runtime.get_config()
    monkeypatch.setattr(runtime._state, "config", dataclasses.replace(config, verify_every=1))
    ps = hvd.add_process_set([0, 1])
    try:
        w = tf.Variable(tf.ones([2]), name="w")
        with tf.GradientTape() as t:
            loss = tf.reduce_sum(w * w)
        (grad,) = hvd.DistributedGradientTape(t, process_set=ps).gradient(loss, [w])
        np.testing.assert_allclose(grad.numpy(), [2.0, 2.0])
        if ps.included():
            w.assign_add([0.0, 1e-3] if hvd.rank() == 1 else [0.0, 0.0])
            with tf.GradientTape() as t:
                loss = tf.reduce_sum(w * w)
            with pytest.raises(hvd.VerificationError, match=r"w\S*: rank 1 differ"):
                hvd.DistributedGradientTape(t, process_set=ps).gradient(loss, [w])
    finally:
        hvd.remove_process_set(ps)
