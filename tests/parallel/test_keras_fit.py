"""model.fit with syncdp.keras at any number of ranks equals one process on the whole batch.

Every expectation is computed here from the mathematics: the reference is a fresh model,
initialized from rank 0's seed, trained by plain Keras in this process on the whole global
batch; the learning rates come from the warmup formula; the averaged metrics from the ranks'
own values gathered here.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import syncdp.keras as hvd

GLOBAL_BATCH = 24
FEATURES, CLASSES = 5, 3


def _local_batch():
    if GLOBAL_BATCH % hvd.size():
        pytest.skip(f"the global batch of {GLOBAL_BATCH} does not split over {hvd.size()} ranks")
    return GLOBAL_BATCH // hvd.size()


def _data(steps, seed=0):
    """The global data: ``steps`` global batches, the same on every rank."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps * GLOBAL_BATCH, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=steps * GLOBAL_BATCH)
    return x, y


def _my_rows(x, y, local):
    """This rank's part of every global batch, in step order."""
    rows = np.concatenate(
        [
            np.arange(s + hvd.rank() * local, s + (hvd.rank() + 1) * local)
            for s in range(0, len(x), GLOBAL_BATCH)
        ]
    )
    return x[rows], y[rows]


def _model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(CLASSES),
        ]
    )


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _assert_identical_across_ranks(values):
    values = [np.asarray(v) for v in values]
    everyone = hvd.allgather_object(values)
    for r, theirs in enumerate(everyone):
        for mine, other in zip(values, theirs, strict=True):
            assert np.array_equal(mine, other), f"rank {hvd.rank()} and rank {r} differ"


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        lambda: keras.optimizers.Adam(0.01),
    ],
    ids=["sgd-momentum", "adam"],
)
def test_fit_on_half_batches_equals_one_process_on_whole_batch(make_optimizer):
    local = _local_batch()
    x, y = _data(steps=4)
    # Different initial weights on every rank: the broadcast before step 1 must fix them.
    model = _model(seed=100 + hvd.rank())
    model.compile(
        optimizer=hvd.DistributedOptimizer(make_optimizer()), loss=_loss(), jit_compile=False
    )
    xs, ys = _my_rows(x, y, local)
    model.fit(
        xs,
        ys,
        batch_size=local,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)],
    )

    reference = _model(seed=100)
    reference.compile(optimizer=make_optimizer(), loss=_loss(), jit_compile=False)
    reference.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)

    for got, want in zip(model.weights, reference.weights, strict=True):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0, atol=1e-5)
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) == 8
    _assert_identical_across_ranks(
        [w.numpy() for w in model.weights] + [v.numpy() for v in model.optimizer.variables]
    )


class _Record(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epoch_logs, self.batch_lrs = [], []

    def on_train_batch_begin(self, batch, logs=None):
        self.batch_lrs.append(float(self.model.optimizer.learning_rate.numpy()))

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_logs.append(dict(logs))


def test_metric_average_is_the_mean_over_ranks():
    local = _local_batch()
    x, y = _data(steps=3, seed=1)
    xs, ys = _my_rows(x, y, local)
    model = _model(seed=7)
    model.compile(
        optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)),
        loss=_loss(),
        metrics=["accuracy"],
        jit_compile=False,
    )
    before, after = _Record(), _Record()
    history = model.fit(
        xs,
        ys,
        batch_size=local,
        epochs=2,
        shuffle=False,
        verbose=0,
        validation_data=(xs[:local], ys[:local]),
        callbacks=[
            hvd.callbacks.BroadcastGlobalVariablesCallback(0),
            before,
            hvd.callbacks.MetricAverageCallback(),
            after,
        ],
    )
    everyone = hvd.allgather_object(before.epoch_logs)
    for epoch, logs in enumerate(after.epoch_logs):
        assert set(logs) == {"loss", "accuracy", "val_loss", "val_accuracy"}
        for name, value in logs.items():
            expected = sum(theirs[epoch][name] for theirs in everyone) / hvd.size()
            assert value == pytest.approx(expected, rel=1e-12, abs=1e-12)
            assert history.history[name][epoch] == value
    _assert_identical_across_ranks([[logs[k] for k in sorted(logs)] for logs in after.epoch_logs])


def test_metric_average_averages_a_metric_of_several_numbers_element_by_element():
    # Precision with two thresholds logs two numbers; Horovod's allreduce averages each.
    x = np.random.default_rng(hvd.rank()).random((16, 3)).astype("float32")
    y = (np.random.default_rng(10 + hvd.rank()).random((16, 1)) < 0.2 + 0.2 * hvd.rank()).astype(
        "float32"
    )
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(1, activation="sigmoid", kernel_initializer="ones")]
    )
    model.compile(
        optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.0)),
        loss="binary_crossentropy",
        metrics=[keras.metrics.Precision(thresholds=[0.8, 0.9], name="prec")],
        jit_compile=False,
    )
    before, after = _Record(), _Record()
    callbacks = [before, hvd.callbacks.MetricAverageCallback(), after]
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=callbacks)
    everyone = hvd.allgather_object(before.epoch_logs)
    mine = np.asarray(before.epoch_logs[0]["prec"])
    assert mine.shape == (2,)
    expected = np.mean([np.asarray(t[0]["prec"], np.float64) for t in everyone], axis=0)
    np.testing.assert_allclose(after.epoch_logs[0]["prec"], expected, rtol=1e-12)
    assert after.epoch_logs[0]["loss"] == pytest.approx(
        np.mean([theirs[0]["loss"] for theirs in everyone]), rel=1e-12
    )


def test_warmup_learning_rate_follows_the_formula_step_by_step():
    local = _local_batch()
    steps, warmup, initial = 3, 2, 0.04
    x, y = _data(steps=steps, seed=2)
    xs, ys = _my_rows(x, y, local)
    model = _model(seed=3)
    model.compile(
        optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.5, momentum=0.9)),
        loss=_loss(),
        jit_compile=False,
    )
    record = _Record()
    history = model.fit(
        xs,
        ys,
        batch_size=local,
        epochs=warmup + 1,
        shuffle=False,
        verbose=0,
        callbacks=[
            hvd.callbacks.BroadcastGlobalVariablesCallback(0),
            hvd.callbacks.LearningRateWarmupCallback(initial, warmup_epochs=warmup),
            record,
        ],
    )
    n = hvd.size()
    expected = []
    for epoch in range(warmup + 1):
        for batch in range(steps):
            if epoch < warmup:
                t = epoch + (batch + 1) / steps
                expected.append(initial / n * (t * (n - 1) / warmup + 1))
            else:  # after the warmup the rate stays where the warmup ended
                expected.append(expected[-1])
    np.testing.assert_allclose(record.batch_lrs, expected, rtol=1e-6)
    assert record.batch_lrs[warmup * steps - 1] == pytest.approx(initial, rel=1e-6)
    np.testing.assert_allclose(
        history.history["lr"], [expected[(e + 1) * steps - 1] for e in range(warmup + 1)], rtol=1e-6
    )


def test_backward_passes_per_step_2_equals_one_step_on_both_batches():
    local = _local_batch()
    x, y = _data(steps=4, seed=3)  # 4 micro-batches of GLOBAL_BATCH rows -> 2 updates
    xs, ys = _my_rows(x, y, local)
    model = _model(seed=11)
    # Averaging the passes' sums is what makes 2 passes one step on both batches.
    opt = hvd.DistributedOptimizer(
        keras.optimizers.Adam(0.01), backward_passes_per_step=2, average_aggregated_gradients=True
    )
    model.compile(optimizer=opt, loss=_loss(), jit_compile=False)
    model.fit(
        xs,
        ys,
        batch_size=local,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)],
    )

    reference = _model(seed=11)
    reference.compile(optimizer=keras.optimizers.Adam(0.01), loss=_loss(), jit_compile=False)
    reference.fit(
        x,
        y,
        batch_size=2 * GLOBAL_BATCH,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[_PassesBefore(2)],
    )

    # Horovod counts every pass in iterations, so Adam's bias correction sees the passes.
    assert int(opt.iterations) == int(reference.optimizer.iterations) == 4
    for got, want in zip(model.weights, reference.weights, strict=True):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0, atol=1e-5)
    _assert_identical_across_ranks([w.numpy() for w in model.weights])


class _PassesBefore(keras.callbacks.Callback):
    """Sets a one-process reference's iterations to what they are under Horovod when update
    ``batch`` is applied after ``passes`` passes each: every pass before it counted."""

    def __init__(self, passes: int):
        super().__init__()
        self.passes = passes

    def on_train_batch_begin(self, batch, logs=None):
        self.model.optimizer.iterations.assign(self.passes * batch + self.passes - 1)


def _custom_loop(model, opt, xs, ys, local: int, passes: int, traced: bool) -> None:
    """``passes`` steps of a custom loop, one per ``local`` rows of this rank's ``xs``: the
    gradients of a plain tape go to ``opt.apply_gradients`` (eager, or in a ``tf.function``)."""
    loss_fn = _loss()

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    step = tf.function(step) if traced else step
    for i in range(passes):
        step(xs[i * local : (i + 1) * local], ys[i * local : (i + 1) * local])


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_custom_loop_apply_gradients_with_accumulation(traced):
    local = _local_batch()
    x, y = _data(steps=2, seed=4)
    xs, ys = _my_rows(x, y, local)
    model = _model(seed=5)
    opt = hvd.DistributedOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.5),
        backward_passes_per_step=2,
        average_aggregated_gradients=True,
    )
    opt.build(model.trainable_variables)
    hvd.broadcast_variables(model.weights, root_rank=0)
    loss_fn = _loss()
    _custom_loop(model, opt, xs, ys, local, passes=2, traced=traced)

    reference = _model(seed=5)
    ref_opt = keras.optimizers.SGD(0.1, momentum=0.5)
    with tf.GradientTape() as tape:
        loss = loss_fn(y, reference(x, training=True))
    grads = tape.gradient(loss, reference.trainable_variables)
    ref_opt.apply_gradients(zip(grads, reference.trainable_variables, strict=True))

    assert int(opt.iterations) == 2  # both passes, as Horovod counts them
    for got, want in zip(model.weights, reference.weights, strict=True):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_by_default_k_passes_apply_the_sum_of_their_averaged_gradients(traced):
    # Horovod's default (average_aggregated_gradients=False): one update with the sum over
    # the passes of each pass's gradient averaged over the ranks, all taken at the same weights.
    passes, lr = 3, 0.1
    local = _local_batch()
    x, y = _data(steps=passes, seed=8)
    xs, ys = _my_rows(x, y, local)
    model = _model(seed=9)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(lr), backward_passes_per_step=passes)
    assert opt.average_aggregated_gradients is False
    opt.build(model.trainable_variables)
    hvd.broadcast_variables(model.weights, root_rank=0)
    loss_fn = _loss()
    _custom_loop(model, opt, xs, ys, local, passes=passes, traced=traced)

    # The ranks' average of equal shards' mean gradients is the global batch's mean gradient.
    reference = _model(seed=9)
    summed = [tf.zeros_like(v) for v in reference.trainable_variables]
    for i in range(passes):
        rows = slice(i * GLOBAL_BATCH, (i + 1) * GLOBAL_BATCH)
        with tf.GradientTape() as tape:
            loss = loss_fn(y[rows], reference(x[rows], training=True))
        grads = tape.gradient(loss, reference.trainable_variables)
        summed = [s + g for s, g in zip(summed, grads, strict=True)]
    assert int(opt.iterations) == passes
    for got, start, total in zip(model.trainable_variables, reference.trainable_variables, summed):
        np.testing.assert_allclose(
            got.numpy(), start.numpy() - lr * total.numpy(), rtol=0, atol=1e-5
        )
    _assert_identical_across_ranks([w.numpy() for w in model.weights])


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_a_gradient_from_early_in_the_window_counts_when_the_last_pass_gives_none(traced):
    # Rank r's loss is x * w1 * w2 on the first pass and x * w1 on the second (x = r + 1), at
    # w1 = w2 = 1: w1 gets x on each pass, w2 gets x on the first and None on the second. One
    # update with the sum over the passes of the ranks' average: w1 by mean(2x) = n + 1, w2 by
    # mean(x) = (n + 1) / 2.
    n = hvd.size()
    w1, w2 = tf.Variable([1.0]), tf.Variable([1.0])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2)
    opt.build([w1, w2])
    x = float(hvd.rank() + 1)

    def step(use_w2):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(x * w1 * (w2 if use_w2 else 1.0))
        opt.apply(tape.gradient(loss, [w1, w2]), [w1, w2])

    step = tf.function(step) if traced else step
    step(True)
    step(False)
    np.testing.assert_allclose(w1.numpy(), [1.0 - (n + 1)], rtol=0, atol=1e-6)
    np.testing.assert_allclose(w2.numpy(), [1.0 - (n + 1) / 2], rtol=0, atol=1e-6)
    _assert_identical_across_ranks([w1.numpy(), w2.numpy()])


@pytest.mark.parametrize("loss_scale", [False, True], ids=["plain", "LossScaleOptimizer"])
def test_a_checkpoint_saved_partway_through_accumulation_resumes_the_window(
    hvd, tmp_path, loss_scale
):
    # backward_passes_per_step=2: a pass, a CheckpointManager save, the second pass and the
    # update; then a fresh model and optimizer restored from that checkpoint take the second
    # pass again. Both must make the one update of the two passes' averaged gradients: the
    # checkpoint holds what every rank accumulated, not rank 0's own gradients alone.
    from syncdp.checkpoint import CheckpointManager

    lr, local = 0.1, _local_batch()
    x, y = _data(steps=2, seed=12)
    xs, ys = _my_rows(x, y, local)
    directory = hvd.broadcast_object(str(tmp_path / "ck"))  # rank 0's, on this one host

    def fresh():
        model = _model(seed=13)
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(lr), backward_passes_per_step=2)
        if loss_scale:  # mixed precision wraps it: the manager finds it inside (scale 1 here)
            opt = keras.optimizers.LossScaleOptimizer(opt, initial_scale=1.0)
        opt.build(model.trainable_variables)
        hvd.broadcast_variables(model.weights, root_rank=0)
        return model, opt, CheckpointManager(directory, model=model, optimizer=opt)

    model, opt, manager = fresh()
    _custom_loop(model, opt, xs, ys, local, passes=1, traced=False)
    manager.save(1)
    _custom_loop(model, opt, xs[local:], ys[local:], local, passes=1, traced=False)
    uninterrupted = [w.numpy() for w in model.trainable_variables]
    model, opt, manager = fresh()
    assert manager.restore() == 1
    _custom_loop(model, opt, xs[local:], ys[local:], local, passes=1, traced=False)
    resumed = [w.numpy() for w in model.trainable_variables]

    reference = _model(seed=13)
    loss_fn = _loss()
    total = [tf.zeros_like(v) for v in reference.trainable_variables]
    for i in range(2):
        rows = slice(i * GLOBAL_BATCH, (i + 1) * GLOBAL_BATCH)
        with tf.GradientTape() as tape:
            loss = loss_fn(y[rows], reference(x[rows], training=True))
        grads = tape.gradient(loss, reference.trainable_variables)
        total = [t + g for t, g in zip(total, grads, strict=True)]
    for start, t, a, b in zip(reference.trainable_variables, total, uninterrupted, resumed):
        expected = start.numpy() - lr * t.numpy()
        np.testing.assert_allclose(a, expected, rtol=0, atol=1e-5)
        np.testing.assert_allclose(b, expected, rtol=0, atol=1e-5)
    _assert_identical_across_ranks(resumed)


def test_checkpoint_metadata_a_restore_would_not_take_is_refused_before_writing(tmp_path):
    # Metadata that is not a JSON dict is refused before anything is written or pruned (a
    # restore would call its checkpoint damaged, after pruning deleted the good one).
    from syncdp.base.errors import CheckpointError
    from syncdp.checkpoint import CheckpointManager, list_checkpoints

    directory = hvd.broadcast_object(str(tmp_path), root_rank=0)  # rank 0 writes and reads
    v = tf.Variable([1.0, 2.0])
    manager = CheckpointManager(directory, v=v, max_to_keep=1)
    manager.save(1, metadata={"epoch": 1})
    v.assign([5.0, 6.0])
    for bad in ([("epoch", 2)], {"epoch": object()}):
        with pytest.raises(CheckpointError, match="refused its metadata"):
            manager.save(2, metadata=bad)
    # Keys JSON turns into strings: the restore would give {"1": ...}, not {1: ...}.
    for bad in ({1: "one"}, {"epochs": [{2: "two"}]}):
        with pytest.raises(CheckpointError, match="its keys must be strings"):
            manager.save(2, metadata=bad)
    if hvd.rank() == 0:
        assert [step for step, _ in list_checkpoints(directory)] == [1]
    resumed = CheckpointManager(directory, v=v, max_to_keep=1)
    assert resumed.restore() == 1
    assert resumed.metadata == {"epoch": 1}
    assert v.numpy().tolist() == [1.0, 2.0]


def _dense_model(widths):
    return keras.Sequential([keras.Input((FEATURES,))] + [keras.layers.Dense(w) for w in widths])


def test_a_checkpoint_restores_only_into_the_model_it_was_saved_from(tmp_path):
    # A checkpoint of a bigger (or smaller) model is refused on every rank, where TensorFlow's
    # own matching would restore the layers both share and drop the rest without a word; a
    # training checkpoint still restores into the model alone (no optimizer), for evaluation.
    from syncdp.base.errors import CheckpointError
    from syncdp.checkpoint import CheckpointManager

    directory = hvd.broadcast_object(str(tmp_path), root_rank=0)  # rank 0 writes and reads
    saved = _dense_model([4, 3])
    optimizer = keras.optimizers.Adam()
    CheckpointManager(directory, model=saved, optimizer=optimizer).save(7)
    refusals = {
        (4,): "model has 2 variables here, 4 in the checkpoint",
        (4, 3, 2): "model has 6 variables here, 4 in the checkpoint",
        (4, 2): r"model's variable 2 has shape \(4, 2\) .* here, shape \(4, 3\)",
    }
    for widths, words in refusals.items():
        other = _dense_model(widths)
        before = [w.numpy() for w in other.weights]
        with pytest.raises(CheckpointError, match=words):
            CheckpointManager(directory, model=other).restore()
        if hvd.rank() == 0:  # refused before anything was read
            for b, w in zip(before, other.weights, strict=True):
                np.testing.assert_array_equal(b, w.numpy())
    same = _dense_model([4, 3])
    assert CheckpointManager(directory, model=same).restore() == 7
    rank_0s = hvd.broadcast_object([w.numpy() for w in saved.weights], root_rank=0)
    for a, b in zip(rank_0s, same.weights, strict=True):
        np.testing.assert_array_equal(a, b.numpy())


def test_fp16_compression_keeps_replicas_identical():
    local = _local_batch()
    x, y = _data(steps=2, seed=5)
    xs, ys = _my_rows(x, y, local)
    model = _model(seed=20 + hvd.rank())
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=hvd.Compression.fp16)
    model.compile(optimizer=opt, loss=_loss(), jit_compile=False)
    model.fit(
        xs,
        ys,
        batch_size=local,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)],
    )
    _assert_identical_across_ranks([w.numpy() for w in model.weights])


def _fit_my_rows(model, x, y, local):
    """One epoch of ``model.fit`` on this rank's rows of the global batches, rank 0's weights
    broadcast first."""
    xs, ys = _my_rows(x, y, local)
    model.fit(
        xs,
        ys,
        batch_size=local,
        shuffle=False,
        verbose=0,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)],
    )


@pytest.mark.parametrize("wrapping", ["compile-adds-the-loss-scale", "loss-scale-given"])
def test_mixed_precision_overflow_on_one_rank_is_skipped_on_every_rank(wrapping):
    """Under mixed_float16 a loss scale skips a step whose gradients overflow. It must decide
    alike on every rank: the last rank's first batch overflows, the others' do not, and every
    rank must skip that step, as one process on the whole batch (which overflows too) does."""
    local = _local_batch()
    rng = np.random.default_rng(3)
    x = rng.normal(size=(3 * GLOBAL_BATCH, FEATURES)).astype("float32")
    y = rng.normal(size=(3 * GLOBAL_BATCH, 1)).astype("float32")
    y[GLOBAL_BATCH - 1] = 1e4  # in the first global batch, on the last rank only

    def model(seed):
        keras.utils.set_random_seed(seed)
        return keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(8, activation="tanh"),
                keras.layers.Dense(1),
            ]
        )

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        distributed = model(seed=100 + hvd.rank())
        sgd = keras.optimizers.SGD(0.01)
        if wrapping == "loss-scale-given":
            opt = hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(sgd))
        else:
            opt = hvd.DistributedOptimizer(sgd)  # compile wraps it in a LossScaleOptimizer
        distributed.compile(optimizer=opt, loss="mse", jit_compile=False)
        _fit_my_rows(distributed, x, y, local)
        reference = model(seed=100)
        reference.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=False)
        reference.fit(x, y, batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    # One loss scale, around the DistributedOptimizer: the gradients are unscaled once.
    assert isinstance(distributed.optimizer, keras.optimizers.LossScaleOptimizer)
    assert isinstance(distributed.optimizer.inner_optimizer, hvd.DistributedOptimizer)
    assert not isinstance(
        distributed.optimizer.inner_optimizer.inner_optimizer, keras.optimizers.LossScaleOptimizer
    )
    # The first step was skipped (the scale halved), the other two applied, as in one process.
    scale = float(distributed.optimizer.dynamic_scale.numpy())
    assert scale == float(reference.optimizer.dynamic_scale.numpy()) == 2.0**14
    for got, want in zip(distributed.weights, reference.weights, strict=True):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0, atol=2e-3)
    _assert_identical_across_ranks([w.numpy() for w in distributed.weights])


def test_an_optimizer_made_on_one_rank_only_leaves_the_collectives_alike():
    """Keras 3 numbers optimizers' names per process (sgd, sgd_1, ...): an evaluation copy made
    on rank 0 alone must not give rank 0's DistributedOptimizer other collectives' names."""
    local = _local_batch()
    x, y = _data(steps=2)
    if hvd.rank() == 0:
        side = _model(seed=1)
        side.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss())
    model = _model(seed=100 + hvd.rank())
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss=_loss())
    _fit_my_rows(model, x, y, local)
    reference = _model(seed=100)
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss())
    reference.fit(x, y, batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)
    for got, want in zip(model.weights, reference.weights, strict=True):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0, atol=1e-5)


def _settings_set_on_the_wrapper_reach_the_update(make_sgd, optimizer_class, settings):
    """Sets each setting on a DistributedOptimizer after construction, applies rank-dependent
    gradients three times, and compares with the plain optimizer, given the same settings,
    applying the ranks' mean gradient (rank r's gradient is (r + 1) g: the mean (n + 1) g / 2)."""
    g = np.array([1.0, 3.0], np.float32)
    mean = (hvd.size() + 1) / 2.0 * g
    for name, value in settings:

        def trained(distributed, name=name, value=value):
            v = tf.Variable([1.0, -2.0])
            opt = make_sgd()
            opt = optimizer_class(opt) if distributed else opt
            setattr(opt, name, value)
            grad = (hvd.rank() + 1.0) * g if distributed else mean
            for _ in range(3):
                opt.apply_gradients([(tf.constant(grad), v)])
            return v.numpy(), getattr(opt, name)

        (got, read_back), (expected, _) = trained(True), trained(False)
        np.testing.assert_allclose(got, expected, rtol=1e-6, err_msg=name)
        assert read_back == value, (name, read_back)


def test_settings_set_on_the_distributed_optimizer_reach_the_update():
    _settings_set_on_the_wrapper_reach_the_update(
        lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        hvd.DistributedOptimizer,
        [("momentum", 0.0), ("nesterov", True), ("clipnorm", 0.5), ("weight_decay", 0.1)],
    )


def test_the_distributed_optimizer_reads_the_wrapped_optimizers_clipping_and_decay():
    """Read, then set from what was read (a decay cut between two phases): the wrapped
    optimizer's values, not the Keras base class's defaults on the wrapper."""
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, clipnorm=0.7, weight_decay=0.4))
    assert (opt.clipnorm, opt.weight_decay) == (0.7, 0.4)
    opt.weight_decay = opt.weight_decay * 0.5
    assert opt.weight_decay == opt.inner_optimizer.weight_decay == 0.2
    for clipping in (dict(clipvalue=2.0), dict(global_clipnorm=3.0)):  # one at a time
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, **clipping))
        assert {name: getattr(opt, name) for name in clipping} == clipping


def test_an_ema_of_the_wrapped_optimizer_is_kept_and_read_through_the_wrapper():
    """use_ema=True on the wrapped optimizer: fit ends with the weights' moving average, as the
    plain optimizer on the global batches ends; the wrapper reads the wrapped optimizer's EMA
    settings and keeps no EMA of its own."""

    def sgd():
        return keras.optimizers.SGD(0.1, momentum=0.5, use_ema=True, ema_momentum=0.5)

    local = _local_batch()
    x, y = _data(steps=3)
    model = _model(seed=100 + hvd.rank())
    opt = hvd.DistributedOptimizer(sgd())
    assert (opt.use_ema, opt.ema_momentum, opt.ema_overwrite_frequency) == (True, 0.5, None)
    model.compile(optimizer=opt, loss=_loss())
    _fit_my_rows(model, x, y, local)
    assert "_model_variables_moving_average" not in vars(opt)
    reference = _model(seed=100)
    reference.compile(optimizer=sgd(), loss=_loss())
    reference.fit(x, y, batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)
    for got, want in zip(model.weights, reference.weights, strict=True):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0, atol=1e-5)
    opt.ema_momentum = 0.9
    assert opt.ema_momentum == opt.inner_optimizer.ema_momentum == 0.9


def test_gradient_accumulation_set_beside_backward_passes_is_refused_clearly():
    """Two accumulations at once are refused when set after construction too, as the
    constructor refuses them, before any step runs."""
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2)
    assert opt.gradient_accumulation_steps is None
    with pytest.raises(ValueError, match="both accumulate gradients"):
        opt.gradient_accumulation_steps = 3
    assert opt.inner_optimizer.gradient_accumulation_steps is None
    single = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    single.gradient_accumulation_steps = 3
    assert single.inner_optimizer.gradient_accumulation_steps == 3


def test_variables_excluded_from_weight_decay_through_the_distributed_optimizer():
    """exclude_from_weight_decay() called on the wrapper reaches the optimizer that decays:
    with zero gradients and a rate of 1, SGD's decay of 0.5 halves only the kernel."""
    bias, kernel = tf.Variable([1.0], name="bias"), tf.Variable([1.0], name="kernel")
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0, weight_decay=0.5))
    opt.exclude_from_weight_decay(var_names=["bias"])
    opt.apply_gradients([(tf.zeros([1]), bias), (tf.zeros([1]), kernel)])
    np.testing.assert_allclose([bias.numpy()[0], kernel.numpy()[0]], [1.0, 0.5])


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_a_distributed_tapes_gradients_are_not_reduced_again_by_the_optimizer(traced):
    """A program that wraps both the tape and the optimizer (harmless in Horovod, whose Keras
    optimizer applies the gradients it is given) reduces once: with Sum, rank r's gradient
    r + 1 sums to n (n + 1) / 2, not n times that."""
    n, r = hvd.size(), hvd.rank()
    v = tf.Variable([1.0])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), op=hvd.Sum)

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(v) * (r + 1.0)
        grads = hvd.DistributedGradientTape(tape, op=hvd.Sum).gradient(loss, [v])
        opt.apply_gradients(zip(grads, [v]))

    step = tf.function(step) if traced else step
    for k in range(1, 3):
        step()
        np.testing.assert_allclose(v.numpy(), [1.0 - k * n * (n + 1) / 2])


def _errors_raised_in_a_layer_keep_their_class_and_message(package):
    """A syncdp error raised in a layer's call() reaches the program as itself: Keras makes it
    again, its context added, from TensorFlow's arguments (node_def, op, message, code)."""
    import syncdp.tensorflow as stf
    from syncdp.tensorflow.collectives import NotInProcessSetError
    from syncdp.tensorflow.graph import MismatchError

    class Collective(package.layers.Layer):
        def __init__(self, fn):
            super().__init__()
            self.fn = fn

        def call(self, x):
            return self.fn(x)

    if hvd.size() > 1:  # trailing dimensions that differ between the ranks
        with pytest.raises(MismatchError, match="ranks passed different") as raised:
            Collective(stf.allgather)(tf.ones([2, 3 + hvd.rank()]))
        assert isinstance(raised.value, tf.errors.FailedPreconditionError)
        assert "Exception encountered when calling" in str(raised.value)
        only_rank_0 = stf.add_process_set([0])
        try:
            if hvd.rank() > 0:
                with pytest.raises(NotInProcessSetError, match="is not in") as raised:
                    Collective(lambda x: stf.allreduce(x, process_set=only_rank_0))(tf.ones([2]))
                assert isinstance(raised.value, tf.errors.InvalidArgumentError)
                assert "Exception encountered when calling" in str(raised.value)
        finally:
            stf.remove_process_set(only_rank_0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="splits") as raised:
        Collective(lambda x: stf.alltoall(x, splits=[-1] * hvd.size()))(tf.ones([2]))
    assert isinstance(raised.value, ValueError)


def test_errors_raised_in_a_layer_keep_their_class_and_message():
    _errors_raised_in_a_layer_keep_their_class_and_message(keras)
