"""Keras 2 (tf-keras) in one process, beside Keras 3: the wrapper follows the optimizer given,
Keras 2's spellings, configs and saved models, the per-Keras classes, and import hygiene.

Here ``tf.keras`` is Keras 3 (no ``TF_USE_LEGACY_KERAS``): the tests hand tf-keras objects to
syncdp directly, as a program mixing both Kerases does. tests/parallel/test_keras2.py runs a
Keras 2 program through the launcher.
"""

import json
import subprocess
import sys
import textwrap
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

tf_keras = pytest.importorskip(
    "tf_keras", reason="tf-keras is not installed (pip install tf-keras): no Keras 2 to test"
)

import syncdp  # noqa: E402
import syncdp.keras as hvd  # noqa: E402
from syncdp.keras import _face, callbacks, checkpoint, elastic, optimizer, saving  # noqa: E402
from syncdp.tensorflow import keras2_names, sync_batch_norm  # noqa: E402
from syncdp.tensorflow.elastic import TensorFlowKerasState  # noqa: E402
from tests.compressors import QuarterCompressor  # noqa: E402
from tests.launcher import rank_env  # noqa: E402

DistributedK2 = optimizer.for_package(tf_keras)


@pytest.fixture(scope="module", autouse=True)
def _init():
    syncdp.init()


def _model(seed=0):
    tf_keras.utils.set_random_seed(seed)
    return tf_keras.Sequential(
        [tf_keras.Input((3,)), tf_keras.layers.Dense(4), tf_keras.layers.Dense(2)]
    )


def _xy(n=16):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 3)).astype("float32"), rng.normal(size=(n, 2)).astype("float32")


def test_the_wrapper_is_an_optimizer_of_the_wrapped_ones_keras():
    for inner in (tf_keras.optimizers.Adam(0.01), tf_keras.optimizers.legacy.SGD(0.1)):
        opt = hvd.DistributedOptimizer(inner)  # Keras 3's class, given a Keras 2 optimizer
        assert type(opt) is DistributedK2
        assert isinstance(opt, tf_keras.optimizers.Optimizer)
        assert opt.inner_optimizer is inner and optimizer.is_distributed(opt)
        assert tf_keras.optimizers.get(opt) is opt  # what compile() checks
    opt = DistributedK2(keras.optimizers.SGD(0.1))  # and the other way round
    assert type(opt) is hvd.DistributedOptimizer
    with pytest.raises(TypeError, match="Pass an instance such as keras.optimizers.Adam"):
        DistributedK2("adam")
    with pytest.raises(ValueError, match="already a DistributedOptimizer"):
        DistributedK2(DistributedK2(tf_keras.optimizers.SGD()))
    assert opt is not None and hvd.DistributedOptimizer is optimizer.for_package(keras)


def test_keras_2_spellings_of_the_learning_rate():
    optimizer.for_package(tf_keras)  # tf-keras is adapted once syncdp meets it
    assert float(tf_keras.optimizers.Adam(lr=0.02).learning_rate) == pytest.approx(0.02)
    # As in Keras 2, lr= wins over learning_rate=; a plain construction is untouched.
    assert float(tf_keras.optimizers.SGD(learning_rate=0.5, lr=0.03).learning_rate) == (
        pytest.approx(0.03)
    )
    assert float(tf_keras.optimizers.SGD(0.5).learning_rate) == pytest.approx(0.5)
    for inner in (
        tf_keras.optimizers.SGD(lr=0.1, momentum=0.9),
        tf_keras.optimizers.legacy.SGD(lr=0.1, momentum=0.9),
    ):
        opt = hvd.DistributedOptimizer(inner)
        assert float(tf_keras.backend.get_value(opt.lr)) == pytest.approx(0.1)
        tf_keras.backend.set_value(opt.lr, 0.25)
        assert float(tf_keras.backend.get_value(inner.lr)) == pytest.approx(0.25)
        opt.lr = 0.5
        assert float(tf_keras.backend.get_value(inner.learning_rate)) == pytest.approx(0.5)
        opt.learning_rate = 0.125
        assert float(tf_keras.backend.get_value(opt.learning_rate)) == pytest.approx(0.125)
        # The wrapped optimizer's hyperparameters (a variable in the legacy optimizers).
        assert float(tf_keras.backend.get_value(opt.momentum)) == pytest.approx(0.9)


@pytest.mark.parametrize("legacy", [False, True], ids=["adam", "legacy-adam"])
def test_config_round_trip(legacy):
    adam = tf_keras.optimizers.legacy.Adam if legacy else tf_keras.optimizers.Adam
    opt = DistributedK2(
        adam(0.003, beta_1=0.8),
        compression=syncdp.Compression.fp16,
        op=syncdp.Sum,
        backward_passes_per_step=3,
        average_aggregated_gradients=False,
    )
    config = opt.get_config()
    again = type(opt).from_config(config)
    assert again.get_config() == config  # Horovod's test_from_config, config left as it was
    assert again.compression is syncdp.Compression.fp16 and again.op is syncdp.Sum
    assert again.backward_passes_per_step == 3 and not again.average_aggregated_gradients
    assert type(again.inner_optimizer) is adam and again.inner_optimizer.beta_1 == 0.8


@pytest.mark.parametrize("legacy", [False, True], ids=["sgd", "legacy-sgd"])
def test_a_custom_compressor_round_trips_through_the_config(legacy, tmp_path):
    sgd = tf_keras.optimizers.legacy.SGD if legacy else tf_keras.optimizers.SGD
    opt = DistributedK2(sgd(0.1), compression=QuarterCompressor)
    assert opt.compression is QuarterCompressor and opt.average_aggregated_gradients is False
    config = opt.get_config()
    assert config["compression"] == "tests.compressors.QuarterCompressor"
    assert type(opt).from_config(config).compression is QuarterCompressor
    model = _model()
    model.compile(optimizer=opt, loss="mse")
    x, y = _xy()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    assert tf_keras.models.load_model(path).optimizer.compression is QuarterCompressor


@pytest.mark.parametrize("average", [True, False], ids=["averaged", "summed"])
def test_accumulation_with_a_custom_legacy_optimizer(average):
    # Horovod's test_gradient_aggregation: an OptimizerV2 that adds the gradient to the
    # variable, 4 passes per update, an IndexedSlices gradient made dense, in a tf.function.
    class AddGradient(tf_keras.optimizers.legacy.Optimizer):
        def _create_slots(self, var_list):
            pass

        def _resource_apply_dense(self, grad, var, apply_state=None):
            return var.assign_add(grad)

        def get_config(self):
            return super().get_config()

    k = 4
    opt = hvd.DistributedOptimizer(
        AddGradient("add"),
        backward_passes_per_step=k,
        average_aggregated_gradients=average,
        sparse_as_dense=True,
    )
    x, y = tf.Variable([0.0]), tf.Variable([1.0, 2.0])

    def loss():  # d/dx = 1, d/dy = [-1, 0] (a gather: IndexedSlices)
        return x - tf.gather(y, [0])

    @tf.function
    def step():
        opt.apply_gradients(
            opt._compute_gradients(loss, [x, y]), experimental_aggregate_gradients=False
        )

    for i in range(10):
        step()
        updates = (i + 1) // k
        scale = 1 if average else k
        np.testing.assert_allclose(x.numpy(), [updates * scale])
        np.testing.assert_allclose(y.numpy(), [1.0 - updates * scale, 2.0])
        assert int(opt.iterations) == i + 1  # every call counts, as in Horovod
    assert int(opt._agg_helper.counter) == 10 % k


@pytest.mark.parametrize(
    "fmt, wrapped",
    # A plain legacy optimizer's state is not in a .keras file (tf-keras saves none there).
    [
        ("m.h5", True),
        ("saved_model", True),
        ("m.keras", True),
        ("m.h5", False),
        ("saved_model", False),
    ],
    ids=["h5", "saved_model", "keras", "h5-plain", "saved_model-plain"],
)
def test_load_model_brings_back_the_wrapped_optimizer_and_its_state(tmp_path, fmt, wrapped):
    x, y = _xy()
    model = _model()
    inner = tf_keras.optimizers.legacy.Adam(0.01)
    model.compile(optimizer=DistributedK2(inner) if wrapped else inner, loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = str(tmp_path / fmt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tf-keras' note that .h5 is a legacy format
        model.save(path)
    loaded = saving.for_package(tf_keras)(path)
    assert type(loaded.optimizer) is DistributedK2
    assert isinstance(loaded.optimizer.inner_optimizer, tf_keras.optimizers.legacy.Adam)
    # A SavedModel too: tf-keras alone would leave the optimizer's state in the directory.
    assert int(loaded.optimizer.iterations) == 2
    saved = model.optimizer.get_weights() if wrapped else inner.get_weights()
    for a, b in zip(saved, loaded.optimizer.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    loaded.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert int(loaded.optimizer.iterations) == 4


@pytest.mark.parametrize(
    "make",
    [
        lambda: tf_keras.optimizers.SGD(0.1, momentum=0.9),
        lambda: tf_keras.optimizers.legacy.SGD(0.1, momentum=0.9),
        lambda: tf_keras.optimizers.legacy.RMSprop(0.1, momentum=0.9),
    ],
    ids=["sgd", "legacy-sgd", "legacy-rmsprop"],
)
def test_momentum_correction_scales_the_velocity_by_the_rate_ratio(make):
    model = _model()
    opt = DistributedK2(make())
    model.compile(optimizer=opt, loss="mse")
    opt.build(model.trainable_variables)
    buffers = callbacks._momentum_buffers(opt)
    assert len(buffers) == len(model.trainable_variables)
    for b in buffers:
        b.assign(tf.ones_like(b))
    schedule = callbacks.for_package(tf_keras).LearningRateScheduleCallback(0.4, 1.0)
    schedule.set_model(model)
    schedule.on_train_begin()
    schedule.on_epoch_begin(0)
    schedule.on_train_batch_begin(0)
    assert float(tf_keras.backend.get_value(opt.lr)) == pytest.approx(0.4)
    for b in buffers:
        np.testing.assert_allclose(b.numpy(), 4.0)  # 0.4 / 0.1


def test_the_keras_2_schedule_decays_exponentially_with_a_constant_multiplier():
    x, y = _xy()  # 16 samples, batch 8: two batches per epoch
    model = _model()
    model.compile(optimizer=DistributedK2(tf_keras.optimizers.legacy.SGD(0.5)), loss="mse")
    classes = callbacks.for_package(tf_keras)
    seen = []
    record = tf_keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: seen.append(
            float(tf_keras.backend.get_value(model.optimizer.lr))
        )
    )
    schedule = classes.LearningRateScheduleCallback(0.1, multiplier=0.1, start_epoch=1)
    model.fit(x, y, batch_size=8, epochs=4, verbose=0, callbacks=[schedule, record])
    assert seen == pytest.approx([0.5, 0.1, 0.1 * 0.1, 0.1 * 0.1**2])
    smooth = classes.LearningRateScheduleCallback(
        0.2, 0.5, start_epoch=1, staircase=False, steps_per_epoch=4
    )
    smooth.set_model(model)
    smooth.on_train_begin()
    smooth.on_epoch_begin(2)
    smooth.on_train_batch_begin(3)
    lr = float(tf_keras.backend.get_value(model.optimizer.lr))
    assert lr == pytest.approx(0.2 * 0.5 ** (2 + 3 / 4 - 1))


def test_sync_batch_normalization_takes_keras_2_arguments():
    layer_class = sync_batch_norm.for_package(tf_keras)
    assert issubclass(layer_class, tf_keras.layers.BatchNormalization)
    for fused in (True, None):
        with pytest.raises(ValueError, match="fused=True"):
            layer_class(fused=fused)
    layer = layer_class(momentum=0.5, fused=False, renorm=False, virtual_batch_size=None)
    x = np.random.default_rng(1).normal(size=(6, 4)).astype("float32")
    reference = tf_keras.layers.BatchNormalization(momentum=0.5)
    np.testing.assert_allclose(layer(x, training=True), reference(x, training=True), atol=1e-6)
    config = layer.get_config()
    assert layer.fused is False and config["momentum"] == 0.5
    assert type(tf_keras.layers.deserialize(tf_keras.layers.serialize(layer))) is layer_class
    assert layer_class.from_config(config).get_config() == config


def test_a_callback_given_a_model_of_the_other_keras_says_which_face_to_use():
    keras_2 = callbacks.for_package(tf_keras)
    model_3 = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with pytest.raises(TypeError, match=r"syncdp\.keras \(horovod\.keras\)"):
        keras_2.MetricAverageCallback().set_model(model_3)
    with pytest.raises(TypeError, match=r"syncdp\.tensorflow\.keras"):
        callbacks.MetricAverageCallback().set_model(_model())
    for cls in vars(keras_2).values():
        assert issubclass(cls, tf_keras.callbacks.Callback)
        assert cls.__qualname__ == cls.__name__ and cls.__module__ == callbacks.__name__


def test_callbacks_turn_jit_off_on_a_keras_2_model():
    model = _model()
    model.compile(
        optimizer=DistributedK2(tf_keras.optimizers.SGD(0.1)), loss="mse", jit_compile=True
    )
    with pytest.warns(UserWarning, match="turning jit_compile off"):
        callbacks.for_package(tf_keras).BroadcastGlobalVariablesCallback(0).set_model(model)
    assert model.jit_compile is False


def test_the_face_of_a_package():
    names = _face.names(tf_keras, "syncdp_test.keras")
    module = names["callbacks"]
    assert module.__name__ == "syncdp_test.keras.callbacks" and module.__all__ == callbacks.__all__
    for name in callbacks.__all__:
        assert getattr(module, name) is getattr(callbacks.for_package(tf_keras), name)
    assert names["elastic"].KerasState is elastic.KerasState  # one state for both Kerases
    assert issubclass(names["elastic"].CommitStateCallback, tf_keras.callbacks.Callback)
    assert issubclass(names["CheckpointCallback"], tf_keras.callbacks.Callback)
    assert names["CheckpointCallback"] is checkpoint.for_package(tf_keras)
    assert names["DistributedOptimizer"] is DistributedK2
    # Keras 3's face is syncdp.keras's own objects.
    keras_3 = _face.names(keras, "syncdp.keras")
    assert keras_3["callbacks"] is callbacks and keras_3["elastic"] is elastic
    assert keras_3["load_model"] is hvd.load_model and keras_3["DistributedOptimizer"] is (
        hvd.DistributedOptimizer
    )


@pytest.mark.parametrize("legacy", [False, True], ids=["adam", "legacy-adam"])
def test_elastic_state_of_a_plain_keras_2_optimizer(legacy):
    # Horovod's test_elastic_state: the optimizer given as is, never wrapped.
    adam = tf_keras.optimizers.legacy.Adam if legacy else tf_keras.optimizers.Adam
    x, y = _xy()
    model = _model()
    opt = adam(0.01)
    model.compile(optimizer=opt, loss="mse")
    state = TensorFlowKerasState(model, opt, epoch=1)
    state.sync()  # creates the slots first
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    state.commit()
    saved = (
        model.get_weights() + opt.get_weights() if legacy else [v.numpy() for v in opt.variables]
    )
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    state.restore()
    now = model.get_weights() + opt.get_weights() if legacy else [v.numpy() for v in opt.variables]
    assert int(opt.iterations) == 2 and len(now) == len(saved) > 3
    for a, b in zip(saved, now, strict=True):
        np.testing.assert_array_equal(a, b)


IMPORT_HYGIENE = textwrap.dedent(
    """
    import json, sys
    sys.modules["tf_keras"] = None  # as if tf-keras were not installed: importing it fails
    import numpy as np
    import keras
    import syncdp
    import syncdp.keras as hvd
    import syncdp.tensorflow.keras as tfk

    hvd.init()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=tfk.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    x = np.ones((4, 3), "float32")
    model.fit(x, x[:, :2], verbose=0, callbacks=[tfk.callbacks.BroadcastGlobalVariablesCallback(0)])
    print(json.dumps({
        "same_face": tfk.callbacks is hvd.callbacks and tfk.SyncBatchNormalization is (
            hvd.SyncBatchNormalization),
        "tf_keras": repr(sys.modules["tf_keras"]),
        "steps": int(model.optimizer.iterations),
    }))
    """
)


def test_keras_3_alone_never_imports_tf_keras():
    env = rank_env()
    env.pop("TF_USE_LEGACY_KERAS", None)
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_HYGIENE], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out == {"same_face": True, "tf_keras": "None", "steps": 1}


def test_horovods_tensorflow_distributed_optimizer_takes_keras2_optimizers_too():
    import syncdp.tensorflow as hvd_tf

    for opt in (tf_keras.optimizers.SGD(0.1), tf_keras.optimizers.legacy.SGD(0.1)):
        wrapped = hvd_tf.DistributedOptimizer(opt)
        assert isinstance(wrapped, DistributedK2), type(wrapped)
    assert isinstance(
        hvd_tf.DistributedOptimizer(keras.optimizers.SGD(0.1)), hvd.DistributedOptimizer
    )


def test_a_keras_2_model_built_by_its_first_batch_is_broadcast_after_it():
    # Horovod's tensorflow2_keras_mnist.py: a Sequential without an Input, so fit() builds it.
    # Keras 2 raises where Keras 3 lists no weights; the callback warns and broadcasts after the
    # first batch (as Horovod does) instead of failing.
    tf_keras.utils.set_random_seed(0)
    model = tf_keras.Sequential([tf_keras.layers.Dense(2)])
    model.compile(optimizer=DistributedK2(tf_keras.optimizers.SGD(0.1)), loss="mse")
    callback = callbacks.for_package(tf_keras).BroadcastGlobalVariablesCallback(0)
    x = np.ones((4, 3), "float32")
    with pytest.warns(UserWarning, match="no weights before its first step"):
        model.fit(x, x[:, :2], epochs=1, verbose=0, callbacks=[callback])
    assert callback.broadcast_done and len(model.weights) == 2


def test_keras_2_pieces_horovods_tests_use():
    # PartialDistributedGradientTape takes tf-keras layers; _compute_gradients flattens a
    # nested var_list, as Keras 2's own optimizers do.
    import syncdp.tensorflow as hvd_tf

    layer = tf_keras.layers.Dense(2)
    layer.build((None, 3))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(tf.ones((1, 3))))
    tape = hvd_tf.PartialDistributedGradientTape(tape, local_layers=[layer])
    grads = tape.gradient(loss, layer.trainable_variables)
    np.testing.assert_allclose(grads[1].numpy(), [1.0, 1.0])  # one rank: d(sum)/d(bias) = 1
    with pytest.raises(ValueError, match="local layers"):
        hvd_tf.PartialDistributedGradientTape(tf.GradientTape(), local_layers=["not a layer"])
    x, y = tf.Variable([1.0]), tf.Variable([2.0, 3.0])
    opt = DistributedK2(tf_keras.optimizers.legacy.SGD(0.1))
    pairs = opt._compute_gradients(lambda: tf.reduce_sum(x) + tf.reduce_sum(y), [[x], [y]])
    assert [v is w for (_, v), w in zip(pairs, [x, y])] == [True, True]
    assert [g.numpy().tolist() for g, _ in pairs] == [[1.0], [1.0, 1.0]]


def test_keras_2s_variables_call_on_a_keras_3_optimizer_says_what_to_do():
    # Horovod's TF2 examples broadcast opt.variables(): Keras 2's method, Keras 3's list.
    v = tf.Variable([1.0])
    opt = keras.optimizers.Adam(0.01)
    opt.build([v])
    variables = opt.variables
    assert isinstance(variables, list) and len(variables) == 4  # iterations, rate, 2 slots
    assert keras.tree.flatten(variables) == list(variables)  # still a list to Keras' tree
    with pytest.raises(TypeError) as e:
        opt.variables()
    message = str(e.value)
    assert message.startswith("'list' object is not callable")  # Python's words come first
    assert "TF_USE_LEGACY_KERAS=1 (pip install tf-keras)" in message and "\n" not in message
    # Keras 2's optimizers and the wrapper keep their callable variables.
    for k2 in (tf_keras.optimizers.Adam(0.01), tf_keras.optimizers.legacy.Adam(0.01)):
        keras2_names.create_optimizer_variables(k2, [v])
        assert len(k2.variables()) >= 3  # the step count and Adam's 2 slots
    wrapped = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    wrapped.build([v])
    assert wrapped.variables() == wrapped.variables
