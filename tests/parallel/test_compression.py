"""fp16 compression: results within float16's precision of the exact average, dtypes kept."""

import numpy as np
import pytest
import tensorflow as tf

from tests.compressors import QuarterCompressor


@pytest.mark.parametrize("graph", [False, True])
def test_fp16_average_within_tolerance(hvd, graph):
    n, r = hvd.size(), hvd.rank()
    base = np.linspace(-3.0, 3.0, 10_000)
    tensors = [
        tf.constant(base * (r + 1), tf.float32),
        tf.constant(base[:77] + r, tf.float64),
        tf.constant([r, 2 * r], tf.int32),
    ]

    def run(ts):
        return hvd.grouped_allreduce(ts, compression=hvd.Compression.fp16)

    out = tf.function(run)(tensors) if graph else run(tensors)
    assert [o.dtype for o in out] == [tf.float32, tf.float64, tf.int32]
    mean_scale = (n + 1) / 2
    # float16 keeps 11 significant bits: relative error below 2**-10 per rounding.
    np.testing.assert_allclose(out[0].numpy(), base * mean_scale, rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(out[1].numpy(), base[:77] + (n - 1) / 2, rtol=2e-3, atol=2e-3)
    np.testing.assert_array_equal(out[2].numpy(), [(n - 1) // 2, (n - 1)])


def test_fp16_through_the_tape(hvd):
    n, r = hvd.size(), hvd.rank()
    w = tf.Variable(tf.ones([50]))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * float(r + 1))
    tape = hvd.DistributedGradientTape(tape, compression=hvd.Compression.fp16)
    (g,) = tape.gradient(loss, [w])
    assert g.dtype == tf.float32
    np.testing.assert_allclose(g.numpy(), (n + 1) / 2, rtol=1e-3)


def test_fp16_on_one_host_reduces_the_float32_values(hvd):
    # One host: nothing crosses a network, so fp16 reduces float32 itself (faster than
    # converting; see syncdp.tensorflow.compression): the result is the uncompressed one.
    if hvd.cross_size() > 1:
        pytest.skip("the job spans hosts: fp16 sends float16 there")
    x = tf.constant(np.linspace(-1.0, 1.0, 3001) * (hvd.rank() + 1) / 3, tf.float32)

    @tf.function
    def both(t):
        return (
            hvd.allreduce(t, compression=hvd.Compression.fp16, name="c16"),
            hvd.allreduce(t, name="c32"),
        )

    half, full = both(x)
    np.testing.assert_array_equal(half.numpy(), full.numpy())


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_a_custom_compressor_in_the_keras_optimizer(hvd, traced):
    import keras

    import syncdp.keras

    n, r = hvd.size(), hvd.rank()
    keras.utils.set_random_seed(0)  # the same weights on every rank
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    opt = syncdp.keras.DistributedOptimizer(
        keras.optimizers.SGD(1.0), compression=QuarterCompressor
    )
    x = np.random.default_rng(r).normal(size=(4, 3)).astype("float32")  # this rank's own
    before = [w.numpy() for w in model.trainable_variables]
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x) ** 2)
    mine = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]

    def step(grads):
        opt.apply_gradients(zip(grads, model.trainable_variables))

    (tf.function(step) if traced else step)([tf.constant(g) for g in mine])
    everyone = hvd.allgather_object(mine)
    for k, (w, b) in enumerate(zip(model.trainable_variables, before)):
        if n == 1:  # nothing travels between ranks, so nothing is compressed
            expected = mine[k]
        else:  # the average of what travelled: each rank's gradient rounded to quarters
            expected = np.mean([np.round(theirs[k] * 4) / 4 for theirs in everyone], axis=0)
        np.testing.assert_allclose(b - w.numpy(), expected, rtol=0, atol=1e-5)
