"""Horovod's names in ``hvd.elastic``: object broadcasts and ``run_fn``, at any number of ranks."""

import syncdp.tensorflow as hvd


def test_broadcast_object_gives_every_rank_the_roots_object():
    root = hvd.size() - 1
    mine = {"rank": hvd.rank(), "ranks": list(range(hvd.rank() + 1)), "name": f"r{hvd.rank()}"}
    got = hvd.elastic.broadcast_object(mine, root_rank=root)
    assert got == {"rank": root, "ranks": list(range(root + 1)), "name": f"r{root}"}


def test_broadcast_object_fn_returns_a_broadcast_from_its_root():
    bcast = hvd.elastic.broadcast_object_fn(root_rank=0, name="test.fn")
    assert bcast(("epoch", 10 + hvd.rank())) == ("epoch", 10)
    assert bcast([hvd.rank()] * 2) == [0, 0]  # the function can be called again


def test_run_fn_syncs_the_state_from_rank_0_and_runs_without_a_reset():
    resets = []
    state = hvd.elastic.ObjectState(epoch=hvd.rank(), seen=[hvd.rank()])

    def train(state, extra):
        return state.epoch, state.seen, extra

    train = hvd.elastic.run_fn(train, lambda: resets.append(hvd.rank()))
    assert train(state, extra=hvd.rank()) == (0, [0], hvd.rank())
    assert resets == []  # no membership change: nothing to reset


def test_a_commit_partway_through_a_window_keeps_every_ranks_gradients_through_a_reset():
    # backward_passes_per_step=2, committed after the first pass: a reset restores the commit
    # and gives every rank rank 0's state. The window's first pass must still count every
    # rank's gradient (before, every rank resumed with rank 0's alone).
    import keras
    import numpy as np
    import tensorflow as tf

    r, n = hvd.rank(), hvd.size()
    model = keras.Sequential(
        [keras.Input((2,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")]
    )
    opt = hvd.DistributedOptimizer(
        keras.optimizers.SGD(1.0), backward_passes_per_step=2, average_aggregated_gradients=True
    )

    def gradient(rank, p):
        return np.array([[rank + 1.0 + 3 * p], [10.0 * (p + 1) * (rank + 1)]], np.float32)

    def one_pass(p):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model.trainable_variables[0] * gradient(r, p))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    state = hvd.elastic.TensorFlowKerasState(model, opt, batch=0)
    one_pass(0)
    state.batch = 1
    state.commit()
    state.restore()  # what elastic.run does after a reset
    state.sync()
    one_pass(1)
    expected = -np.mean([gradient(q, p) for q in range(n) for p in range(2)], axis=0)
    np.testing.assert_allclose(model.trainable_variables[0].numpy(), expected, rtol=1e-6)
