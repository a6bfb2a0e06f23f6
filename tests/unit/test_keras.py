"""syncdp.keras in one process: API surface, config and saving, XLA guard, LR callbacks."""

import sys
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import syncdp
import syncdp.keras as hvd
from syncdp.keras import callbacks as cb
from tests.compressors import QuarterCompressor


@pytest.fixture(scope="module", autouse=True)
def _init():
    syncdp.init()


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(2)])


def _xy(n=16):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 3)).astype("float32"), rng.normal(size=(n, 2)).astype("float32")


def test_all_lists_the_exports():
    import syncdp.tensorflow.keras as tfk

    core = set(syncdp.__all__)
    assert set(hvd.__all__) == core | {
        "DistributedOptimizer",
        "PartialDistributedOptimizer",
        "load_model",
        "callbacks",
        "CheckpointCallback",
    }
    for name in hvd.__all__:
        assert getattr(hvd, name) is getattr(tfk, name)
    public = {
        n
        for n in vars(cb)
        if not n.startswith("_")
        and isinstance(getattr(cb, n), type)
        and getattr(cb, n).__module__ == cb.__name__
    }
    assert public == set(cb.__all__)


def test_horovod_module_paths_are_the_same_objects():
    import syncdp.tensorflow.keras as tfk
    from syncdp.tensorflow.keras import callbacks

    assert tfk.DistributedOptimizer is hvd.DistributedOptimizer
    assert tfk.callbacks.MetricAverageCallback is cb.MetricAverageCallback
    assert callbacks.LearningRateWarmupCallback is cb.LearningRateWarmupCallback
    assert tfk.allgather is syncdp.allgather
    # allreduce and reducescatter take Horovod's Keras order, in both Keras modules
    assert tfk.allreduce is hvd.allreduce is not syncdp.allreduce
    assert tfk.reducescatter is hvd.reducescatter is not syncdp.reducescatter
    assert tfk.CheckpointCallback is hvd.CheckpointCallback


def test_checkpoint_callback_lives_in_the_keras_face():
    from syncdp.keras import checkpoint

    assert checkpoint.__all__ == ["CheckpointCallback"]
    assert hvd.CheckpointCallback is checkpoint.CheckpointCallback
    # The core manager stays Keras-free: the callback is not re-exported from it.
    assert not hasattr(syncdp.checkpoint, "CheckpointCallback")


def test_wrapped_optimizer_exposes_learning_rate_and_hyperparameters():
    inner = keras.optimizers.SGD(0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(inner)
    assert isinstance(opt, keras.optimizers.Optimizer)
    assert float(opt.learning_rate.numpy()) == pytest.approx(0.1)
    opt.learning_rate = 0.25
    assert float(inner.learning_rate.numpy()) == pytest.approx(0.25)
    assert opt.momentum == 0.9
    assert opt.iterations is inner.iterations
    with pytest.raises(AttributeError):
        opt._no_such_thing  # noqa: B018


def test_horovods_keras_2_spellings_still_work():
    # Every Horovod Keras program compiles with experimental_run_tf_function=False (Keras 3
    # refuses it) and many set the rate with set_value(model.optimizer.lr, ...).
    model = _model()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    model.compile(optimizer=opt, loss="mse", experimental_run_tf_function=False)
    with pytest.raises(TypeError, match="not_an_argument"):
        model.compile(optimizer=opt, loss="mse", not_an_argument=1)
    tf.keras.backend.set_value(model.optimizer.lr, 0.25)
    assert float(np.asarray(opt.learning_rate)) == 0.25
    assert float(tf.keras.backend.get_value(opt.lr)) == 0.25
    opt.lr = 0.5
    assert float(np.asarray(opt.inner_optimizer.learning_rate)) == 0.5
    plain = keras.optimizers.Adam(0.001)  # Horovod's elastic TF2 example: opt.lr.assign(...)
    plain.lr.assign(0.004)
    assert float(np.asarray(plain.learning_rate)) == pytest.approx(0.004)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(op=syncdp.Max), ValueError, "op must be syncdp.Average or syncdp.Sum"),
        (dict(backward_passes_per_step=0), ValueError, "integer >= 1; got 0"),
        (dict(compression="fp8"), ValueError, r"compress\(\) and decompress\(\); got 'fp8'"),
        (dict(learning_rate=0.1), TypeError, "set learning rate"),
        (
            dict(op=syncdp.Sum, gradient_predivide_factor=2.0),
            ValueError,
            "gradient_predivide_factor not supported with op != Average",
        ),
    ],
)
def test_bad_arguments_say_what_to_do(kwargs, error, match):
    with pytest.raises(error, match=match):
        hvd.DistributedOptimizer(keras.optimizers.SGD(), **kwargs)


def test_two_ways_of_accumulating_gradients_are_refused_together():
    accumulating = keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="both accumulate gradients over several steps"):
        hvd.DistributedOptimizer(accumulating, backward_passes_per_step=2)
    hvd.DistributedOptimizer(accumulating)  # either one alone is fine


def test_rejects_what_is_not_a_keras_3_optimizer():
    with pytest.raises(TypeError, match="Pass an instance such as keras.optimizers.Adam"):
        hvd.DistributedOptimizer("adam")
    with pytest.raises(ValueError, match="already a DistributedOptimizer"):
        hvd.DistributedOptimizer(hvd.DistributedOptimizer(keras.optimizers.SGD()))


def test_config_round_trip():
    opt = hvd.DistributedOptimizer(
        keras.optimizers.Adam(0.003, beta_1=0.8),
        compression=syncdp.Compression.fp16,
        op=syncdp.Sum,
        backward_passes_per_step=3,
        average_aggregated_gradients=False,
    )
    again = hvd.DistributedOptimizer.from_config(opt.get_config())
    assert again.compression is syncdp.Compression.fp16
    assert again.op is syncdp.Sum
    assert again.backward_passes_per_step == 3 and not again.average_aggregated_gradients
    assert isinstance(again.inner_optimizer, keras.optimizers.Adam)
    assert again.inner_optimizer.beta_1 == 0.8
    assert float(again.learning_rate.numpy()) == pytest.approx(0.003)


def test_a_custom_compressor_is_taken_and_saved_by_its_import_path(tmp_path):
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=QuarterCompressor)
    assert opt.compression is QuarterCompressor
    config = opt.get_config()
    assert config["compression"] == "tests.compressors.QuarterCompressor"
    assert hvd.DistributedOptimizer.from_config(config).compression is QuarterCompressor
    model = _model()
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    x, y = _xy()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    assert keras.saving.load_model(path).optimizer.compression is QuarterCompressor


def test_a_saved_compressor_is_found_in_custom_objects_or_named_when_missing():
    config = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)).get_config()
    config["compression"] = "not_a_module.QuarterCompressor"
    objects = {"QuarterCompressor": QuarterCompressor}
    again = hvd.DistributedOptimizer.from_config(config, custom_objects=objects)
    assert again.compression is QuarterCompressor
    with keras.saving.CustomObjectScope(objects):  # how keras.saving.load_model hands them
        assert hvd.DistributedOptimizer.from_config(config).compression is QuarterCompressor
    with pytest.raises(
        ValueError,
        match="'not_a_module.QuarterCompressor' is not a compressor of any module imported",
    ):
        hvd.DistributedOptimizer.from_config(config)
    # A saved file never makes loading import a module.
    assert "this" not in sys.modules
    config["compression"] = "this.QuarterCompressor"
    with pytest.raises(ValueError, match="Import its module before loading"):
        hvd.DistributedOptimizer.from_config(config)
    assert "this" not in sys.modules


def test_a_compressor_no_import_path_reaches_is_saved_as_none_with_a_warning():
    class Local(QuarterCompressor):  # defined in a function: no path imports it
        pass

    for compression in (Local, QuarterCompressor()):  # a local class, an instance
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=compression)
        assert opt.compression is compression
        with pytest.warns(UserWarning, match="loads with Compression.none"):
            config = opt.get_config()
        assert config["compression"] is None
        again = hvd.DistributedOptimizer.from_config(config)
        assert again.compression is syncdp.Compression.none


@pytest.mark.parametrize(
    "loader",
    [keras.saving.load_model, hvd.load_model],
    ids=["keras.saving.load_model", "syncdp.keras.load_model"],
)
def test_saved_model_loads_with_its_optimizer_state(tmp_path, loader):
    x, y = _xy()
    model = _model()
    model.compile(
        optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)),
        loss="mse",
        jit_compile=False,
    )
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = loader(path)
    assert isinstance(loaded.optimizer, hvd.DistributedOptimizer)
    assert isinstance(loaded.optimizer.inner_optimizer, keras.optimizers.Adam)
    assert int(loaded.optimizer.iterations) == 2
    for a, b in zip(model.optimizer.variables, loaded.optimizer.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    loaded.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert int(loaded.optimizer.iterations) == 4


def test_load_model_wraps_a_plain_optimizer(tmp_path):
    x, y = _xy()
    model = _model()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, verbose=0)
    model.save(tmp_path / "plain.keras")
    loaded = hvd.load_model(str(tmp_path / "plain.keras"))
    assert isinstance(loaded.optimizer, hvd.DistributedOptimizer)
    loaded.fit(x, y, verbose=0)


def test_load_model_sets_the_compression_it_is_given_as_horovods_does(tmp_path):
    x, y = _xy()
    model = _model()
    model.compile(
        optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse", jit_compile=False
    )
    model.fit(x, y, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = hvd.load_model(path, compression=hvd.Compression.fp16)
    assert loaded.optimizer.compression is hvd.Compression.fp16
    loaded.fit(x, y, verbose=0)
    assert hvd.load_model(path).optimizer.compression is hvd.Compression.none  # as saved
    # Under mixed precision the DistributedOptimizer sits inside a LossScaleOptimizer.
    scaled = _model()
    scaled.compile(
        optimizer=keras.optimizers.LossScaleOptimizer(
            hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
        ),
        loss="mse",
        jit_compile=False,
    )
    scaled.fit(x, y, verbose=0)
    scaled.save(tmp_path / "scaled.keras")
    loaded = hvd.load_model(str(tmp_path / "scaled.keras"), compression=hvd.Compression.fp16)
    assert loaded.optimizer.inner_optimizer.compression is hvd.Compression.fp16
    with pytest.raises(ValueError, match="compression must be a compressor"):
        hvd.load_model(path, compression="fp16")


def test_callbacks_turn_jit_off_with_a_warning():
    x, y = _xy()
    model = _model()
    model.compile(
        optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse", jit_compile=True
    )
    with pytest.warns(UserWarning, match="turning jit_compile off"):
        model.fit(x, y, verbose=0, callbacks=[cb.BroadcastGlobalVariablesCallback(0)])
    assert model.jit_compile is False


def test_xla_compiled_step_raises_a_clear_error():
    model = _model()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    opt.build(model.trainable_variables)

    @tf.function(jit_compile=True)
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    # A ConfigError; autograph re-raises it from a user's tf.function as a StagingError.
    with pytest.raises(Exception, match="DistributedOptimizer cannot run inside an XLA"):
        step(tf.ones((2, 3)))


def test_plain_keras_model_keeps_jit():
    model = _model()
    model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cb.MetricAverageCallback().set_model(model)
    assert model.jit_compile is True


def test_momentum_correction_scales_sgd_velocity_by_lr_ratio():
    model = _model()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
    model.compile(optimizer=opt, loss="mse")
    opt.build(model.trainable_variables)
    for m in opt.inner_optimizer.momentums:
        m.assign(tf.ones_like(m))
    callback = cb.LearningRateScheduleCallback(0.4, lambda epoch: 0.5**epoch)  # 0.4, then 0.2
    callback.set_model(model)
    callback.on_train_begin()
    callback.on_epoch_begin(0)
    callback.on_train_batch_begin(0)
    assert float(opt.learning_rate.numpy()) == pytest.approx(0.4)
    for m in opt.inner_optimizer.momentums:
        np.testing.assert_allclose(m.numpy(), 4.0)  # 0.4 / 0.1
    callback.on_train_batch_begin(1)  # staircase: no change inside the epoch
    callback.on_epoch_begin(1)
    callback.on_train_batch_begin(0)
    assert float(opt.learning_rate.numpy()) == pytest.approx(0.2)
    for m in opt.inner_optimizer.momentums:
        np.testing.assert_allclose(m.numpy(), 2.0)


def test_schedule_window_and_callable_multiplier():
    model = _model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(1.0)), loss="mse")
    callback = cb.LearningRateScheduleCallback(
        0.3, lambda e: 1.0 / (e + 1), start_epoch=1, end_epoch=3, staircase=False, steps_per_epoch=4
    )
    callback.set_model(model)
    callback.on_train_begin()
    seen = {}
    for epoch in range(4):
        callback.on_epoch_begin(epoch)
        callback.on_train_batch_begin(2)
        seen[epoch] = float(model.optimizer.learning_rate.numpy())
    assert seen[0] == pytest.approx(1.0)  # before start_epoch: untouched
    assert seen[1] == pytest.approx(0.3 / 2.5)
    assert seen[2] == pytest.approx(0.3 / 3.5)
    assert seen[3] == pytest.approx(seen[2])  # from end_epoch on: left as it was


def test_a_constant_multiplier_is_exponential_decay_from_start_epoch_as_in_horovod():
    x, y = _xy()  # 16 samples, batch 8: two batches per epoch
    model = _model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.5)), loss="mse")
    seen = []
    record = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: seen.append(float(model.optimizer.learning_rate.numpy()))
    )
    schedule = cb.LearningRateScheduleCallback(initial_lr=0.1, multiplier=0.1, start_epoch=1)
    model.fit(x, y, batch_size=8, epochs=4, verbose=0, callbacks=[schedule, record])
    assert seen[0] == pytest.approx(0.5)  # before start_epoch: the optimizer's own rate
    assert seen[1] == pytest.approx(0.1)  # 0.1 * 0.1 ** (1 - 1)
    assert seen[2] == pytest.approx(0.1 * 0.1)
    assert seen[3] == pytest.approx(0.1 * 0.1**2)
    assert schedule.staircase is True


def test_a_constant_multiplier_without_staircase_decays_every_batch():
    model = _model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.5)), loss="mse")
    schedule = cb.LearningRateScheduleCallback(
        0.2, 0.5, start_epoch=1, staircase=False, steps_per_epoch=4
    )
    assert schedule.staircase is False  # a number does not force the staircase
    schedule.set_model(model)
    schedule.on_train_begin()
    for epoch in (1, 2):
        schedule.on_epoch_begin(epoch)
        for batch in range(4):
            schedule.on_train_batch_begin(batch)
            exponent = epoch + batch / 4 - 1
            assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(
                0.2 * 0.5**exponent
            )


def test_a_function_that_ignores_the_epoch_is_a_constant_factor():
    x, y = _xy()
    model = _model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.5)), loss="mse")
    seen = []
    record = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: seen.append(float(model.optimizer.learning_rate.numpy()))
    )
    schedule = cb.LearningRateScheduleCallback(0.1, lambda epoch: 0.1, start_epoch=1)
    model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[schedule, record])
    assert seen == pytest.approx([0.5, 0.1 * 0.1, 0.1 * 0.1])


def test_schedule_needs_initial_lr_and_known_steps():
    with pytest.raises(ValueError, match="needs initial_lr"):
        cb.LearningRateWarmupCallback(None)
    callback = cb.LearningRateWarmupCallback(0.1)
    callback.set_params({"epochs": 1, "steps": None})
    with pytest.raises(ValueError, match="Pass steps_per_epoch="):
        callback.on_train_begin()


def test_fp16_compress_is_horovods_and_collectives_cast_only_across_hosts(monkeypatch):
    import tensorflow as tf

    from syncdp.tensorflow import compression

    x = tf.constant([1.0, 2.0 / 3.0])
    for across in (True, False):  # Horovod's contract, whatever the layout
        monkeypatch.setattr(compression, "_across_hosts", lambda a=across: a)
        sent, ctx = compression.Compression.fp16.compress(x)
        assert sent.dtype == tf.float16 and ctx == tf.float32
        back = compression.Compression.fp16.decompress(sent, ctx)
        assert back.dtype == tf.float32 and back.numpy()[1] == np.float32(np.float16(2.0 / 3.0))
    ints = tf.constant([1, 2])
    assert compression.Compression.fp16.compress(ints)[0].dtype == tf.int32
    monkeypatch.setattr(compression, "_across_hosts", lambda: True)
    assert compression.for_transport(compression.Compression.fp16) is compression.FP16Compressor
    monkeypatch.setattr(compression, "_across_hosts", lambda: False)
    assert compression.for_transport(compression.Compression.fp16) is compression.NoneCompressor
    assert compression.for_transport(compression.Compression.none) is compression.NoneCompressor


def test_under_mixed_precision_the_wrapped_optimizers_loss_scale_factor_is_not_applied_twice():
    """Compile wraps the optimizer in a LossScaleOptimizer, which scales the loss itself and
    turns the wrapped optimizer's loss_scale_factor off; through DistributedOptimizer that must
    reach the optimizer that divides the gradients by it. The update equals plain Keras'."""
    x, y = _xy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        weights = []
        for wrap in (lambda opt: opt, hvd.DistributedOptimizer):
            model = _model()
            start = [w.copy() for w in model.get_weights()]
            model.compile(wrap(keras.optimizers.SGD(0.05, loss_scale_factor=8.0)), "mse")
            model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
            weights.append([w - s for w, s in zip(model.get_weights(), start)])
            assert model.optimizer.inner_optimizer.loss_scale_factor is None
    finally:
        keras.mixed_precision.set_global_policy("float32")
    for plain, distributed in zip(*weights):
        assert np.abs(plain).max() > 1e-3  # the steps moved the weights
        np.testing.assert_allclose(distributed, plain, rtol=2e-2, atol=1e-4)
