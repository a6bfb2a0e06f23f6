"""Keras 2 (tf-keras) through ``syncdp.tensorflow.keras``, at any number of ranks.

Runs where ``tf.keras`` is tf-keras: tests/integration/test_keras2.py launches this module with
``TF_USE_LEGACY_KERAS=1`` at np=1, 2 and 3 (the plain parallel suite skips it). The program is
written as a Horovod user writes one for TensorFlow 2: ``import syncdp.tensorflow.keras as hvd``
(``horovod.tensorflow.keras``) and ``tf.keras`` for Keras.

Every expectation comes from the mathematics: a rank holds an equal shard of each global batch,
so the average of the shards' mean gradients is the whole batch's mean gradient, and N ranks
must end where one process trained on the whole batch ends (computed here, in this process);
the learning rates come from the warmup formula; the averaged metrics from the ranks' own
values, gathered here; the batch statistics of SyncBatchNormalization from the whole batch.
"""

import contextlib
import os
import shutil
import tempfile

import numpy as np
import pytest
import tensorflow as tf

if not tf.keras.__name__.startswith("tf_keras"):
    pytest.skip(
        "Keras 2 tests: they need tf.keras to be tf-keras (TF_USE_LEGACY_KERAS=1); "
        "tests/integration/test_keras2.py runs them so",
        allow_module_level=True,
    )

import keras as keras3  # noqa: E402 - Keras 3, in the same process

import syncdp.checkpoint  # noqa: E402
import syncdp.keras  # noqa: E402
import syncdp.tensorflow  # noqa: E402
import syncdp.tensorflow.keras as hvd  # noqa: E402

keras = tf.keras
GLOBAL_BATCH = 12  # splits over 1, 2 and 3 ranks
FEATURES, CLASSES = 5, 3


def _local():
    return GLOBAL_BATCH // hvd.size()


def _data(steps, seed=0):
    """``steps`` global batches, the same on every rank."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps * GLOBAL_BATCH, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=steps * GLOBAL_BATCH)
    return x, y


def _mine(x, y):
    """This rank's part of every global batch, in step order."""
    n = _local()
    rows = np.concatenate(
        [
            np.arange(s + hvd.rank() * n, s + (hvd.rank() + 1) * n)
            for s in range(0, len(x), GLOBAL_BATCH)
        ]
    )
    return x[rows], y[rows]


def _model(seed, package=keras):
    package.utils.set_random_seed(seed)
    return package.Sequential(
        [
            package.Input((FEATURES,)),
            package.layers.Dense(8, activation="tanh"),
            package.layers.Dense(CLASSES),
        ]
    )


def _loss(package=keras):
    return package.losses.SparseCategoricalCrossentropy(from_logits=True)


def _fit(model, x, y, batch_size, epochs=2, callbacks=(), **kwargs):
    return model.fit(
        x,
        y,
        batch_size=batch_size,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=list(callbacks),
        **kwargs,
    )


def _assert_identical_across_ranks(values):
    values = [np.asarray(v) for v in values]
    for r, theirs in enumerate(hvd.allgather_object(values)):
        for mine, other in zip(values, theirs, strict=True):
            assert np.array_equal(mine, other), f"rank {hvd.rank()} and rank {r} differ"


def _assert_close(got, want, atol=1e-5):
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=atol)


@pytest.fixture
def shared_dir():
    """A directory every rank names alike (rank 0's temporary one); the ranks share a disk."""
    path = tempfile.mkdtemp(prefix="syncdp-keras2-") if hvd.rank() == 0 else None
    path = hvd.broadcast_object(path, root_rank=0)
    yield path
    hvd.barrier()
    if hvd.rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def test_the_face_serves_tf_keras_and_keras_3_keeps_its_own():
    assert keras.__name__.startswith("tf_keras")
    for name in ("BroadcastGlobalVariablesCallback", "LearningRateWarmupCallback"):
        assert issubclass(getattr(hvd.callbacks, name), keras.callbacks.Callback)
        assert issubclass(getattr(syncdp.keras.callbacks, name), keras3.callbacks.Callback)
    assert issubclass(hvd.callbacks.BestModelCheckpoint, keras.callbacks.ModelCheckpoint)
    assert issubclass(hvd.elastic.CommitStateCallback, keras.callbacks.Callback)
    assert issubclass(hvd.CheckpointCallback, keras.callbacks.Callback)
    assert issubclass(hvd.SyncBatchNormalization, keras.layers.BatchNormalization)
    assert syncdp.tensorflow.SyncBatchNormalization is hvd.SyncBatchNormalization
    assert issubclass(syncdp.keras.SyncBatchNormalization, keras3.layers.BatchNormalization)
    from syncdp.tensorflow.keras import callbacks, elastic

    assert callbacks is hvd.callbacks and elastic is hvd.elastic


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        lambda: keras.optimizers.Adam(0.01),
        lambda: keras.optimizers.legacy.SGD(lr=0.1, momentum=0.9),  # Keras 2's lr= spelling
        lambda: keras.optimizers.legacy.Adam(learning_rate=0.01),
    ],
    ids=["sgd-momentum", "adam", "legacy-sgd-momentum", "legacy-adam"],
)
def test_fit_on_shards_equals_one_process_on_the_whole_batch(make_optimizer):
    x, y = _data(steps=3)
    # Different initial weights on every rank: the broadcast before step 1 must fix them.
    model = _model(seed=100 + hvd.rank())
    model.compile(
        optimizer=hvd.DistributedOptimizer(make_optimizer()),
        loss=_loss(),
        experimental_run_tf_function=False,  # Horovod's documented spelling
    )
    xs, ys = _mine(x, y)
    _fit(model, xs, ys, _local(), callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])

    reference = _model(seed=100)
    reference.compile(optimizer=make_optimizer(), loss=_loss())
    _fit(reference, x, y, GLOBAL_BATCH)

    _assert_close(model.get_weights(), reference.get_weights())
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) == 6
    _assert_identical_across_ranks(model.get_weights() + model.optimizer.get_weights())


@pytest.mark.parametrize(
    "options, lr_factor, atol",
    [
        # The sum of the shards' mean gradients is size times the whole batch's.
        (dict(op=syncdp.Sum), "size", 1e-5),
        # Divided by 2 before the sum and by size / 2 after: the average again.
        (dict(gradient_predivide_factor=2.0), 1, 1e-5),
        # float16 on the wire only between hosts; replicas stay identical either way.
        (dict(compression=syncdp.Compression.fp16), 1, 2e-3),
    ],
    ids=["op-sum", "predivide", "fp16"],
)
def test_reduction_options(options, lr_factor, atol):
    x, y = _data(steps=2, seed=1)
    xs, ys = _mine(x, y)
    model = _model(seed=5)
    model.compile(
        optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), **options), loss=_loss()
    )
    _fit(model, xs, ys, _local(), callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    factor = hvd.size() if lr_factor == "size" else lr_factor
    reference = _model(seed=5)
    reference.compile(optimizer=keras.optimizers.SGD(0.1 * factor), loss=_loss())
    _fit(reference, x, y, GLOBAL_BATCH)
    _assert_close(model.get_weights(), reference.get_weights(), atol=atol)
    _assert_identical_across_ranks(model.get_weights())


def test_sparse_as_dense_embedding_gradients():
    rng = np.random.default_rng(2)
    x = rng.integers(0, 20, size=(2 * GLOBAL_BATCH, 4))
    y = rng.normal(size=(2 * GLOBAL_BATCH, 4, 3)).astype("float32")

    def make(seed):
        keras.utils.set_random_seed(seed)
        return keras.Sequential([keras.Input((4,), dtype="int64"), keras.layers.Embedding(20, 3)])

    model = make(3)
    opt = keras.optimizers.legacy.RMSprop(lr=0.01)
    model.compile(optimizer=hvd.DistributedOptimizer(opt, sparse_as_dense=True), loss="mse")
    xs, ys = _mine(x, y)
    _fit(model, xs, ys, _local(), callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    reference = make(3)
    reference.compile(optimizer=keras.optimizers.legacy.RMSprop(learning_rate=0.01), loss="mse")
    _fit(reference, x, y, GLOBAL_BATCH)
    _assert_close(model.get_weights(), reference.get_weights())


@pytest.mark.parametrize("legacy", [False, True], ids=["adam", "legacy-adam"])
def test_backward_passes_per_step_2_equals_one_step_on_both_batches(legacy):
    adam = keras.optimizers.legacy.Adam if legacy else keras.optimizers.Adam
    x, y = _data(steps=4, seed=3)  # 4 micro-batches of GLOBAL_BATCH rows -> 2 updates
    xs, ys = _mine(x, y)
    model = _model(seed=11)
    # Averaging the passes' sums is what makes 2 passes one step on both batches.
    opt = hvd.DistributedOptimizer(
        adam(0.01), backward_passes_per_step=2, average_aggregated_gradients=True
    )
    model.compile(optimizer=opt, loss=_loss())
    _fit(
        model,
        xs,
        ys,
        _local(),
        epochs=1,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)],
    )
    reference = _model(seed=11)
    reference.compile(optimizer=adam(0.01), loss=_loss())
    _fit(reference, x, y, 2 * GLOBAL_BATCH, epochs=1, callbacks=[_PassesBefore(2)])

    # Horovod counts every pass in iterations, so Adam's bias correction sees the passes.
    assert int(opt.iterations) == int(reference.optimizer.iterations) == 4
    assert int(opt._agg_helper.counter) == 0
    _assert_close(model.get_weights(), reference.get_weights())
    _assert_identical_across_ranks(model.get_weights())


@pytest.mark.parametrize("legacy", [False, True], ids=["sgd", "legacy-sgd"])
def test_by_default_2_passes_apply_the_sum_of_their_averaged_gradients(legacy):
    # Horovod's default (average_aggregated_gradients=False): the update is the sum over the
    # passes of each pass's rank-averaged gradient, all taken at the broadcast weights.
    sgd = keras.optimizers.legacy.SGD if legacy else keras.optimizers.SGD
    lr = 0.1
    x, y = _data(steps=2, seed=6)  # 2 micro-batches of GLOBAL_BATCH rows -> 1 update
    xs, ys = _mine(x, y)
    model = _model(seed=12)
    opt = hvd.DistributedOptimizer(sgd(lr), backward_passes_per_step=2)
    assert opt.average_aggregated_gradients is False
    model.compile(optimizer=opt, loss=_loss())
    _fit(
        model,
        xs,
        ys,
        _local(),
        epochs=1,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)],
    )
    reference = _model(seed=12)
    summed = [tf.zeros_like(v) for v in reference.trainable_variables]
    for i in range(2):
        rows = slice(i * GLOBAL_BATCH, (i + 1) * GLOBAL_BATCH)
        with tf.GradientTape() as tape:
            loss = _loss()(y[rows], reference(x[rows], training=True))
        grads = tape.gradient(loss, reference.trainable_variables)
        summed = [s + g for s, g in zip(summed, grads, strict=True)]
    want = [v.numpy() - lr * g.numpy() for v, g in zip(reference.trainable_variables, summed)]
    _assert_close([v.numpy() for v in model.trainable_variables], want)
    _assert_identical_across_ranks(model.get_weights())


def _overflowing_data():
    """3 global batches for a regression whose first batch overflows in float16 on the last
    rank's rows only (the other ranks' rows do not)."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(3 * GLOBAL_BATCH, FEATURES)).astype("float32")
    y = rng.normal(size=(3 * GLOBAL_BATCH, 1)).astype("float32")
    y[GLOBAL_BATCH - 1] = 1e4
    return x, y


def _regression(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((FEATURES,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)]
    )


@contextlib.contextmanager
def _mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _fit_regression_on_shards(optimizer, x, y, run_eagerly=False):
    """A new regression model, each rank's initial weights its own, trained one epoch on this
    rank's rows of every global batch with rank 0's weights broadcast first."""
    model = _regression(seed=100 + hvd.rank())
    model.compile(optimizer=optimizer, loss="mse", run_eagerly=run_eagerly)
    xs, ys = _mine(x, y)
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
    _fit(model, xs, ys, _local(), epochs=1, callbacks=callbacks)
    return model


@pytest.mark.parametrize(("op", "run_eagerly"), [("average", False), ("sum", False), ("sum", True)])
def test_mixed_precision_overflow_on_one_rank_is_skipped_on_every_rank(op, run_eagerly):
    """Under mixed_float16, tf-keras' compile wraps the DistributedOptimizer in a loss scale,
    which skips a step whose gradients overflow. It must decide alike on every rank: the last
    rank's first batch overflows, and every rank must skip that step, as one process on the
    whole batch does. (With Sum, a second reduction of the reduced gradients would show.)"""
    x, y = _overflowing_data()
    lr = 0.01
    with _mixed_float16():
        if op == "sum":
            opt = hvd.DistributedOptimizer(keras.optimizers.SGD(lr / hvd.size()), op=syncdp.Sum)
        else:
            opt = hvd.DistributedOptimizer(keras.optimizers.SGD(lr))
        model = _fit_regression_on_shards(opt, x, y, run_eagerly=run_eagerly)
        reference = _regression(seed=100)
        reference.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
        _fit(reference, x, y, GLOBAL_BATCH, epochs=1)
    assert isinstance(model.optimizer, keras.mixed_precision.LossScaleOptimizer)
    # The first step was skipped (the scale halved), the other two applied, as in one process.
    scale = float(model.optimizer.loss_scale.numpy())
    assert scale == float(reference.optimizer.loss_scale.numpy()) == 2.0**14
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) == 3
    _assert_close(model.get_weights(), reference.get_weights(), atol=2e-3)
    _assert_identical_across_ranks(model.get_weights())


def test_mixed_precision_overflow_while_accumulating_is_skipped_on_every_rank():
    """With backward_passes_per_step=2 the gradients are accumulated locally: the ranks still
    skip the overflowing first pass together, then apply the sum of the next two passes'
    rank-averaged gradients, taken at the broadcast weights."""
    x, y = _overflowing_data()
    lr = 0.01
    with _mixed_float16():
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(lr), backward_passes_per_step=2)
        model = _fit_regression_on_shards(opt, x, y)
        reference = _regression(seed=100)
        summed = [tf.zeros_like(v) for v in reference.trainable_variables]
        for i in (1, 2):
            rows = slice(i * GLOBAL_BATCH, (i + 1) * GLOBAL_BATCH)
            with tf.GradientTape() as tape:
                out = tf.cast(reference(x[rows], training=True), tf.float32)
                loss = tf.reduce_mean(tf.square(out - y[rows]))
            grads = tape.gradient(loss, reference.trainable_variables)
            summed = [s + tf.cast(g, s.dtype) for s, g in zip(summed, grads, strict=True)]
    want = [v.numpy() - lr * g.numpy() for v, g in zip(reference.trainable_variables, summed)]
    assert float(model.optimizer.loss_scale.numpy()) == 2.0**14
    assert int(model.optimizer.iterations) == 3
    _assert_close([v.numpy() for v in model.trainable_variables], want, atol=2e-3)
    _assert_identical_across_ranks(model.get_weights())


def test_a_mixed_precision_model_saved_to_h5_loads_back_with_its_optimizer(shared_dir):
    """tf-keras' LossScaleOptimizer saves the DistributedOptimizer it wraps by its bare class
    name, which an .h5 file's loader must find (hvd.load_model and tf-keras' own)."""
    path = os.path.join(shared_dir, "mixed.h5")
    with _mixed_float16():
        model = _regression(seed=100)
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
        if hvd.rank() == 0:
            model.save(path)
        hvd.barrier()
        for load in (hvd.load_model, keras.models.load_model):
            loaded = load(path)
            assert isinstance(loaded.optimizer, keras.mixed_precision.LossScaleOptimizer)
            assert type(loaded.optimizer.inner_optimizer).__name__ == "DistributedOptimizer"
            _assert_close(loaded.get_weights(), model.get_weights(), atol=0)
        hvd.barrier()


def test_aggregated_gradients_are_reduced_once_whatever_happens_between():
    # tf-keras' own pattern for custom aggregation: aggregate, transform, then apply with
    # skip_gradients_aggregation=True. And a step whose aggregation was never applied (a loss
    # scale skipped it) must not let the next step's gradients pass unreduced.
    n, r = hvd.size(), hvd.rank()
    v = tf.Variable([0.0])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), op=syncdp.Sum)
    pairs = opt.aggregate_gradients([(tf.constant([float(r + 1)]), v)])
    np.testing.assert_allclose(pairs[0][0].numpy(), [n * (n + 1) / 2])
    clipped = [(tf.clip_by_norm(g, 1e6), w) for g, w in pairs]
    opt.apply_gradients(clipped, skip_gradients_aggregation=True)
    np.testing.assert_allclose(v.numpy(), [-n * (n + 1) / 2])  # reduced once, not n times

    v.assign([0.0])
    for _ in range(3):  # aggregated, never applied; the tensors freed
        opt.aggregate_gradients([(tf.constant([float(r + 1)]), v)])
    opt.apply_gradients([(tf.constant([float(r + 1)]), v)])
    np.testing.assert_allclose(v.numpy(), [-n * (n + 1) / 2])  # reduced, on every rank alike


class _PassesBefore(keras.callbacks.Callback):
    """Sets a one-process reference's iterations to what they are under Horovod when update
    ``batch`` is applied after ``passes`` passes each: every pass before it counted."""

    def __init__(self, passes: int):
        super().__init__()
        self.passes = passes

    def on_train_batch_begin(self, batch, logs=None):
        self.model.optimizer.iterations.assign(self.passes * batch + self.passes - 1)


class _Record(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epoch_logs, self.batch_lrs = [], []

    def on_train_batch_begin(self, batch, logs=None):
        self.batch_lrs.append(float(keras.backend.get_value(self.model.optimizer.lr)))

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_logs.append(dict(logs))


def test_metric_average_is_the_mean_over_ranks():
    x, y = _data(steps=2, seed=4)
    xs, ys = _mine(x, y)
    model = _model(seed=7)
    model.compile(
        optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)),
        loss=_loss(),
        metrics=["accuracy"],
    )
    before, after = _Record(), _Record()
    history = _fit(
        model,
        xs,
        ys,
        _local(),
        validation_data=(xs[: _local()], ys[: _local()]),
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


def test_warmup_then_schedule_follow_the_formulas_batch_by_batch():
    steps, warmup, initial = 3, 2, 0.04
    x, y = _data(steps=steps, seed=5)
    xs, ys = _mine(x, y)
    model = _model(seed=3)
    opt = hvd.DistributedOptimizer(keras.optimizers.legacy.SGD(0.5, momentum=0.9))
    model.compile(optimizer=opt, loss=_loss())
    record = _Record()
    history = _fit(
        model,
        xs,
        ys,
        _local(),
        epochs=warmup + 2,
        callbacks=[
            hvd.callbacks.BroadcastGlobalVariablesCallback(0),
            hvd.callbacks.LearningRateWarmupCallback(initial, warmup_epochs=warmup),
            hvd.callbacks.LearningRateScheduleCallback(
                initial, multiplier=lambda epoch: 0.5**epoch, start_epoch=warmup + 1
            ),
            record,
        ],
    )
    n = hvd.size()
    expected = []
    for epoch in range(warmup + 2):
        for batch in range(steps):
            if epoch < warmup:
                t = epoch + (batch + 1) / steps
                expected.append(initial / n * (t * (n - 1) / warmup + 1))
            elif epoch == warmup:  # between the two windows the rate stays where it was
                expected.append(expected[-1])
            else:  # staircase: set at the first batch of the epoch
                expected.append(initial * 0.5**epoch)
    np.testing.assert_allclose(record.batch_lrs, expected, rtol=1e-6)
    assert record.batch_lrs[warmup * steps - 1] == pytest.approx(initial, rel=1e-6)
    np.testing.assert_allclose(
        history.history["lr"], [expected[(e + 1) * steps - 1] for e in range(warmup + 2)], rtol=1e-6
    )
    _assert_identical_across_ranks(model.get_weights())


def test_sync_batch_normalization_in_a_fit_equals_batch_norm_on_the_whole_batch():
    x, y = _data(steps=2, seed=6)
    xs, ys = _mine(x, y)

    def make(layer):
        keras.utils.set_random_seed(9)
        return keras.Sequential(
            [keras.Input((FEATURES,)), keras.layers.Dense(6), layer, keras.layers.Dense(CLASSES)]
        )

    # Keras 2's own arguments pass through (fused=False is Horovod's spelling).
    sync = hvd.SyncBatchNormalization(momentum=0.5, fused=False, renorm=False)
    model = make(sync)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss=_loss())
    _fit(model, xs, ys, _local(), callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    whole = keras.layers.BatchNormalization(momentum=0.5)
    reference = make(whole)
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss())
    _fit(reference, x, y, GLOBAL_BATCH)

    _assert_close(model.get_weights(), reference.get_weights(), atol=2e-5)
    _assert_close(
        [sync.moving_mean, sync.moving_variance], [whole.moving_mean, whole.moving_variance]
    )
    _assert_identical_across_ranks(model.get_weights())
    with pytest.raises(ValueError, match="fused"):
        hvd.SyncBatchNormalization(fused=True)


def test_sync_batch_normalization_of_images_reduces_across_the_ranks():
    # 4-D inputs: tf-keras picks its fused kernel unless told fused=False, which declared on
    # its base class was never passed; every rank normalized with its own batch's statistics.
    r, n = hvd.rank(), hvd.size()
    whole = np.random.default_rng(4).normal(size=(4 * n, 2, 2, 3)).astype(np.float32) * 3 + 1
    synced = hvd.SyncBatchNormalization(momentum=0.0)
    reference = keras.layers.BatchNormalization(momentum=0.0)
    expected = reference(whole, training=True).numpy()[4 * r : 4 * r + 4]
    out = synced(whole[4 * r : 4 * r + 4], training=True).numpy()
    assert not synced.fused
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(synced.moving_mean.numpy(), whole.mean((0, 1, 2)), rtol=1e-5)


def test_masked_sync_batch_normalization_equals_batch_norm_on_the_whole_masked_batch():
    # Keras 2 weighs rows by the mask's values (tf.nn.weighted_moments): a fractional mask too.
    r, n = hvd.rank(), hvd.size()
    sizes = [2 + q for q in range(n)]
    rng = np.random.default_rng(8)
    whole = (rng.normal(size=(sum(sizes), 5, 3)) * 2 + 1).astype(np.float32)
    mask = (rng.random((sum(sizes), 5)) > 0.3) * rng.choice([0.5, 1.0], (sum(sizes), 5))
    mine = slice(sum(sizes[:r]), sum(sizes[: r + 1]))
    reference = keras.layers.BatchNormalization(momentum=0.5)
    synced = hvd.SyncBatchNormalization(momentum=0.5)
    want = reference(whole, training=True, mask=tf.constant(mask, tf.float32)).numpy()
    got = synced(whole[mine], training=True, mask=tf.constant(mask[mine], tf.float32)).numpy()
    _assert_close([got], [want[mine]], atol=1e-5)
    _assert_close(
        [synced.moving_mean, synced.moving_variance],
        [reference.moving_mean, reference.moving_variance],
    )


def test_partial_distributed_optimizer_keeps_local_layers_local():
    x, y = _data(steps=1, seed=7)
    xs, ys = _mine(x, y)
    model = _model(seed=0)
    opt = hvd.PartialDistributedOptimizer(
        keras.optimizers.legacy.SGD(0.1), local_layers=[model.layers[-1]]
    )
    model.compile(optimizer=opt, loss=_loss())
    _fit(model, xs, ys, _local(), epochs=1)
    # The shared layer follows the whole batch; the local one its own shard's gradient divided
    # by the number of ranks (scale_local_gradients=True, Horovod's default).
    whole, shard = _model(seed=0), _model(seed=0)
    for m, (xx, yy), lr in ((whole, (x, y), 0.1), (shard, (xs, ys), 0.1 / hvd.size())):
        m.compile(optimizer=keras.optimizers.legacy.SGD(lr), loss=_loss())
        _fit(m, xx, yy, len(xx), epochs=1)
    _assert_close(model.layers[0].get_weights(), whole.layers[0].get_weights())
    _assert_close(model.layers[-1].get_weights(), shard.layers[-1].get_weights())


@pytest.mark.parametrize("legacy", [False, True], ids=["adam", "legacy-adam"])
def test_elastic_state_syncs_commits_and_restores_the_optimizer_slots(legacy):
    adam = keras.optimizers.legacy.Adam if legacy else keras.optimizers.Adam
    x, y = _data(steps=1, seed=8)
    xs, ys = _mine(x, y)
    model = _model(seed=40 + hvd.rank())
    model.compile(optimizer=hvd.DistributedOptimizer(adam(0.01)), loss=_loss())
    resets = []
    state = hvd.elastic.KerasState(model, batch=20 + hvd.rank(), epoch=10 + hvd.rank())
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])

    state.sync()  # everyone takes rank 0's weights, slots (created first) and values
    assert (state.batch, state.epoch) == (20, 10)
    _assert_identical_across_ranks(model.get_weights() + model.optimizer.get_weights())
    _fit(model, xs, ys, _local(), epochs=1)
    state.batch, state.epoch = 21, 11
    state.commit()
    committed = model.get_weights() + model.optimizer.get_weights()
    assert int(model.optimizer.iterations) == 1
    assert any(np.any(w != 0) for w in model.optimizer.get_weights()[1:])  # Adam's m and v

    _fit(model, xs, ys, _local(), epochs=1)  # moves weights, slots and the step count on
    state.batch, state.epoch = 99, 99
    state.restore()
    assert (state.batch, state.epoch) == (21, 11)
    assert int(model.optimizer.iterations) == 1
    _assert_close(model.get_weights() + model.optimizer.get_weights(), committed, atol=0)
    state.on_reset()
    assert resets == [hvd.size()]


@pytest.mark.parametrize("legacy", [False, True], ids=["sgd", "legacy-sgd"])
def test_rank_0s_learning_rate_reaches_every_rank(legacy, shared_dir):
    # tf-keras keeps the learning rate outside optimizer.variables: a checkpoint's lowered rate
    # (as ReduceLROnPlateau leaves it), restored by rank 0, and rank 0's rate at an elastic sync
    # or the broadcast callback must reach every rank, or the ranks step at different rates.
    sgd = keras.optimizers.legacy.SGD if legacy else keras.optimizers.SGD
    directory = os.path.join(shared_dir, "lr")

    def new():
        model = _model(seed=80)
        model.compile(optimizer=hvd.DistributedOptimizer(sgd(0.1, momentum=0.9)), loss=_loss())
        return model, syncdp.checkpoint.CheckpointManager(
            directory, model=model, optimizer=model.optimizer
        )

    def rates(model):
        return hvd.allgather_object(float(keras.backend.get_value(model.optimizer.learning_rate)))

    model, manager = new()
    keras.backend.set_value(model.optimizer.learning_rate, 0.001)
    manager.save(1)
    model, manager = new()  # a restarted job
    assert manager.restore() == 1
    assert rates(model) == pytest.approx([0.001] * hvd.size())

    keras.backend.set_value(model.optimizer.learning_rate, 0.01 * (hvd.rank() + 1))
    hvd.elastic.KerasState(model).sync()
    assert rates(model) == pytest.approx([0.01] * hvd.size())

    keras.backend.set_value(model.optimizer.learning_rate, 0.02 * (hvd.rank() + 1))
    x, y = _data(steps=1, seed=14)
    xs, ys = _mine(x, y)
    _fit(model, xs, ys, _local(), callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    assert rates(model) == pytest.approx([0.02] * hvd.size())
    _assert_identical_across_ranks(model.get_weights() + model.optimizer.get_weights())


def test_elastic_callbacks_count_batches_and_epochs_and_commit():
    steps, epochs = 3, 2
    x, y = _data(steps=steps, seed=9)
    xs, ys = _mine(x, y)
    model = _model(seed=1)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss=_loss())

    class Counting(hvd.elastic.KerasState):
        commits = 0

        def commit(self):
            type(self).commits += 1
            super().commit()

    state = Counting(model, batch=0, epoch=0)
    seen = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append((state.epoch, state.batch))
    )
    _fit(
        model,
        xs,
        ys,
        _local(),
        epochs=epochs,
        callbacks=[
            hvd.elastic.UpdateEpochStateCallback(state),
            hvd.elastic.UpdateBatchStateCallback(state),
            hvd.elastic.CommitStateCallback(state, batches_per_commit=2),
            record,
        ],
    )
    assert seen == [(e, b) for e in range(epochs) for b in range(1, steps + 1)]
    assert (state.epoch, state.batch) == (epochs, 0)
    # Every 2 batches of the fit (taken when the next batch begins; the count runs on across
    # epochs), at every epoch's end and again as the next epoch begins or training ends: in
    # epoch 1 after batch 2, at its end and as epoch 2 begins; in epoch 2 after its batch 1
    # (the 2nd since), at its end and as training ends.
    assert Counting.commits == 6
    state.restore()
    assert (state.epoch, state.batch) == (epochs, 0)


def test_checkpoint_callback_resumes_fit_where_it_stopped(shared_dir):
    x, y = _data(steps=2, seed=10)
    xs, ys = _mine(x, y)
    directory = os.path.join(shared_dir, "checkpoints")
    for epochs in (2, 4):  # the second fit (a restarted job) resumes after epoch 2
        model = _model(seed=60 + hvd.rank())  # a fresh job: its own initial weights
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss=_loss())
        callback = hvd.CheckpointCallback(directory)
        history = _fit(model, xs, ys, _local(), epochs=epochs, callbacks=[callback])
    assert callback.initial_epoch == 2 and len(history.history["loss"]) == 2
    reference = _model(seed=60)
    reference.compile(optimizer=keras.optimizers.Adam(0.01), loss=_loss())
    _fit(reference, x, y, GLOBAL_BATCH, epochs=4)
    _assert_close(model.get_weights(), reference.get_weights())
    assert int(model.optimizer.iterations) == 8


@pytest.mark.parametrize("fmt", ["model.h5", "saved_model", "model.keras"])
def test_load_model_resumes_with_the_wrapped_optimizer(fmt, shared_dir):
    x, y = _data(steps=2, seed=11)
    xs, ys = _mine(x, y)
    path = os.path.join(shared_dir, fmt)
    model = _model(seed=70 + hvd.rank())
    model.compile(
        optimizer=hvd.DistributedOptimizer(keras.optimizers.legacy.Adam(0.01)), loss=_loss()
    )
    _fit(model, xs, ys, _local(), callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    if hvd.rank() == 0:
        model.save(path)
    hvd.barrier()

    resumed = hvd.load_model(path)
    assert isinstance(resumed.optimizer, hvd.DistributedOptimizer)
    assert isinstance(resumed.optimizer.inner_optimizer, keras.optimizers.legacy.Adam)
    assert int(resumed.optimizer.iterations) == 4  # Adam's slots and step count came back
    _fit(resumed, xs, ys, _local(), epochs=1)
    reference = _model(seed=70)
    reference.compile(optimizer=keras.optimizers.legacy.Adam(0.01), loss=_loss())
    _fit(reference, x, y, GLOBAL_BATCH, epochs=3)
    _assert_close(resumed.get_weights(), reference.get_weights())
    _assert_identical_across_ranks(resumed.get_weights())


@pytest.mark.parametrize(
    ("inner_name", "name"), [(None, None), ("my_adam", None), (None, "distributed_Adam")]
)
def test_a_model_loaded_on_rank_0_alone_trains_beside_new_ones(inner_name, name, shared_dir):
    # Horovod's resume (keras_imagenet_resnet50.py): rank 0 loads the checkpoint, the other
    # ranks build and compile a new model, and the broadcast callback hands rank 0's state
    # on. The loaded optimizer's collectives must go by the new ones' names, a chosen name
    # (here the same as the default display name) included.
    x, y = _data(steps=2, seed=13)
    xs, ys = _mine(x, y)
    path = os.path.join(shared_dir, "model.h5")

    def adam():
        return keras.optimizers.Adam(0.01, **({"name": inner_name} if inner_name else {}))

    def new_model(seed):
        model = _model(seed=seed)
        model.compile(optimizer=hvd.DistributedOptimizer(adam(), name=name), loss=_loss())
        return model

    model = new_model(seed=71)
    _fit(model, xs, ys, _local(), callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    if hvd.rank() == 0:
        model.save(path)
    hvd.barrier()

    resumed = hvd.load_model(path) if hvd.rank() == 0 else new_model(seed=300 + hvd.rank())
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
    _fit(resumed, xs, ys, _local(), epochs=3, initial_epoch=2, callbacks=callbacks)
    reference = _model(seed=71)
    reference.compile(optimizer=adam(), loss=_loss())
    _fit(reference, x, y, GLOBAL_BATCH, epochs=3)
    _assert_close(resumed.get_weights(), reference.get_weights())
    _assert_identical_across_ranks(resumed.get_weights())


def test_best_model_checkpoint_on_rank_0_loads_with_the_wrapped_optimizer(shared_dir):
    x, y = _data(steps=2, seed=12)
    xs, ys = _mine(x, y)
    path = os.path.join(shared_dir, "best.h5")
    model = _model(seed=2)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss=_loss())
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
    ]
    if hvd.rank() == 0:
        callbacks.append(hvd.callbacks.BestModelCheckpoint(monitor="loss", filepath=path))
    history = _fit(model, xs, ys, _local(), epochs=3, callbacks=callbacks)
    hvd.barrier()
    best = hvd.load_model(path)
    assert isinstance(best.optimizer, hvd.DistributedOptimizer)
    # The saved model is the one after the epoch with the lowest (averaged) loss.
    epoch = int(np.argmin(history.history["loss"]))
    assert int(best.optimizer.iterations) == 2 * (epoch + 1)


def test_keras_3_in_the_same_process():
    # Horovod's test_keras.py uses `import keras` (Keras 3) where test_tensorflow2_keras.py
    # uses tf.keras: both run in one process, each with its own Keras' classes.
    x, y = _data(steps=2, seed=13)
    xs, ys = _mine(x, y)
    model = _model(seed=80 + hvd.rank(), package=keras3)
    opt = hvd.DistributedOptimizer(keras3.optimizers.SGD(0.1, momentum=0.9))  # tf.keras' face
    assert isinstance(opt, keras3.optimizers.Optimizer) and isinstance(
        opt, syncdp.keras.DistributedOptimizer
    )
    model.compile(optimizer=opt, loss=_loss(keras3), jit_compile=False)
    _fit(
        model,
        xs,
        ys,
        _local(),
        callbacks=[syncdp.keras.callbacks.BroadcastGlobalVariablesCallback(0)],
    )
    reference = _model(seed=80, package=keras3)
    reference.compile(optimizer=keras3.optimizers.SGD(0.1, momentum=0.9), loss=_loss(keras3))
    _fit(reference, x, y, GLOBAL_BATCH)
    _assert_close(model.get_weights(), reference.get_weights())

    # A callback of one Keras given to the other's model says which face to use.
    tf_keras_model = _model(seed=0)
    tf_keras_model.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss())
    with pytest.raises(TypeError, match="syncdp.tensorflow.keras"):
        _fit(
            tf_keras_model,
            xs,
            ys,
            _local(),
            callbacks=[syncdp.keras.callbacks.MetricAverageCallback()],
        )


@pytest.mark.parametrize("legacy", [False, True], ids=["sgd", "legacy-sgd"])
def test_settings_set_on_the_distributed_optimizer_reach_the_update(legacy):
    """As tests/parallel/test_keras_fit.py's test of the same name, for Keras 2's optimizers."""
    from tests.parallel.test_keras_fit import _settings_set_on_the_wrapper_reach_the_update

    optimizers = keras.optimizers.legacy if legacy else keras.optimizers
    settings = [("momentum", 0.0), ("nesterov", True), ("clipnorm", 0.5)]
    if not legacy:  # the legacy SGD has no weight decay
        settings.append(("weight_decay", 0.1))
    _settings_set_on_the_wrapper_reach_the_update(
        lambda: optimizers.SGD(0.1, momentum=0.9), hvd.DistributedOptimizer, settings
    )


def test_the_distributed_optimizer_reads_the_wrapped_optimizers_clipping_and_decay():
    """As tests/parallel/test_keras_fit.py's test of the same name, for Keras 2's optimizers."""
    opt = hvd.DistributedOptimizer(keras.optimizers.AdamW(0.05, weight_decay=0.4, clipnorm=0.7))
    assert (opt.weight_decay, opt.clipnorm) == (0.4, 0.7)
    opt.weight_decay = opt.weight_decay * 0.5
    assert opt.weight_decay == opt.inner_optimizer.weight_decay == 0.2
    legacy = hvd.DistributedOptimizer(keras.optimizers.legacy.SGD(0.1, clipnorm=0.7))
    assert legacy.clipnorm == 0.7
    ema = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.5))
    assert (ema.use_ema, ema.ema_momentum) == (True, 0.5)
    ema.ema_momentum = 0.9
    assert ema.inner_optimizer.ema_momentum == 0.9


def test_errors_raised_in_a_layer_keep_their_class_and_message():
    """As tests/parallel/test_keras_fit.py's test of the same name, in a Keras 2 layer."""
    from tests.parallel.test_keras_fit import _errors_raised_in_a_layer_keep_their_class_and_message

    _errors_raised_in_a_layer_keep_their_class_and_message(keras)
