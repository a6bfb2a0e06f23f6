"""Horovod programs run unchanged: ``import horovod...``, launched by ``horovodrun``, under Keras 3
and under Keras 2 (tf-keras with ``TF_USE_LEGACY_KERAS=1``), at np=1, 2 and 3.

The program is written as a Horovod user writes one: ``horovod.tensorflow`` for the custom loop,
``horovod.tensorflow.keras`` for ``fit``, ``tf.keras`` for Keras (which is Keras 2 when
``TF_USE_LEGACY_KERAS=1``). Every rank trains on its shard of a fixed global batch; each result
is compared, on every rank, with one process that trains the same model on the whole batch
(the mathematics of synchronous data parallelism with equal shards: the average of the shards'
mean gradients is the whole batch's mean gradient):

- ``hvd.init(comm, process_sets=[ProcessSet(split)])`` with ``COMM_WORLD`` split by colour,
  made before ``init()``: each rank's set is its colour's ranks, its sum is over them, and every
  rank registers both colours;

- custom loop: ``DistributedGradientTape`` after ``broadcast_variables`` from rank 0 (each rank
  starts from different weights);
- ``fit`` with ``DistributedOptimizer``, ``BroadcastGlobalVariablesCallback`` and
  ``MetricAverageCallback``: the weights, and the loss every rank logs (the average of the shard
  losses, which is the whole batch's loss);
- ``SyncBatchNormalization`` against ``BatchNormalization`` on the whole batch: the outputs and
  the moving statistics;
- ``PartialDistributedOptimizer``: the shared layer follows the whole batch, the local layer its
  own shard's gradient divided by the number of ranks (Horovod's ``scale_local_gradients``);
- checkpoint and resume: 2 epochs with Adam, rank 0 saves (``.keras`` for Keras 3, ``.h5`` for
  Keras 2), every rank resumes with ``hvd.load_model`` and trains a third epoch: equal to 3
  epochs in one go (Adam's slots and step count come back with the wrapped optimizer);
- Keras 2 only: a ``tf.keras.optimizers.legacy`` optimizer built with ``lr=``, and
  ``optimizer.lr`` read and set through ``tf.keras.backend.set_value``.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.launcher import check, launch, python_script

PROGRAM = r"""
import json, os, sys

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd_tf
import horovod.tensorflow.keras as hvd

keras = tf.keras
KERAS2 = os.environ.get("TF_USE_LEGACY_KERAS") == "1"
assert KERAS2 == keras.__name__.startswith("tf_keras"), keras.__name__
workdir = sys.argv[1]

# A process set from a communicator split by colour, made before init (Horovod's "static
# process sets from MPI communicators"): the even ranks' set on even ranks, the odd on odd.
from mpi4py import MPI

world = MPI.COMM_WORLD
split = hvd.ProcessSet(world.Split(color=world.rank % 2, key=world.rank))
hvd.init(world, process_sets=[split])
rank, size = hvd.rank(), hvd.size()
G = 12
n = G // size
rng = np.random.default_rng(0)
X = rng.normal(size=(G, 4)).astype("float32")
Y = (X @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32") + 0.1).astype("float32")
mine = slice(rank * n, (rank + 1) * n)
out = {"keras": keras.__name__, "size": size, "rank": rank}
out["split_ranks"] = split.ranks
total = hvd_tf.allreduce(tf.constant([rank + 1.0]), op=hvd_tf.Sum, process_set=split)
out["split_sum"] = float(total.numpy()[0])
out["sets"] = hvd_tf.get_process_set_ids_and_ranks()


def make(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)]
    )


def diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b))


def barrier():
    hvd_tf.allreduce(tf.constant(0.0), name="barrier")


# Custom loop: DistributedGradientTape.
model, ref = make(rank), make(0)
opt, ref_opt = keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.1)
hvd_tf.broadcast_variables(model.variables, root_rank=0)


@tf.function
def step(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x) - y) ** 2)
    tape = hvd_tf.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))


for _ in range(3):
    step(X[mine], Y[mine])
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((ref(X) - Y) ** 2)
    grads = tape.gradient(loss, ref.trainable_variables)
    ref_opt.apply_gradients(zip(grads, ref.trainable_variables))
out["custom_loop"] = diff(model.get_weights(), ref.get_weights())

# fit: DistributedOptimizer, broadcast and metric averaging.
model, ref = make(rank), make(0)
opt = hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.1))
model.compile(optimizer=opt, loss="mse")
callbacks = [
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    hvd.callbacks.MetricAverageCallback(),
]
history = model.fit(
    X[mine], Y[mine], batch_size=n, epochs=3, shuffle=False, verbose=0, callbacks=callbacks
)
ref.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1), loss="mse")
ref_history = ref.fit(X, Y, batch_size=G, epochs=3, shuffle=False, verbose=0)
out["fit"] = diff(model.get_weights(), ref.get_weights())
out["fit_loss"] = diff(history.history["loss"], ref_history.history["loss"])

# SyncBatchNormalization against BatchNormalization on the whole batch.
extra = {"fused": False} if KERAS2 else {}
bn = hvd_tf.SyncBatchNormalization(momentum=0.5, **extra)
ref_bn = keras.layers.BatchNormalization(momentum=0.5)
y_bn, ref_y = bn(X[mine], training=True), ref_bn(X, training=True)
out["syncbn_output"] = diff(y_bn, ref_y[mine])
out["syncbn_moving"] = diff(
    [bn.moving_mean, bn.moving_variance], [ref_bn.moving_mean, ref_bn.moving_variance]
)

# PartialDistributedOptimizer: the last layer keeps its gradients local.
model = make(0)
opt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=[model.layers[-1]])
model.compile(optimizer=opt, loss="mse")
model.fit(X[mine], Y[mine], batch_size=n, epochs=1, shuffle=False, verbose=0)
whole, shard = make(0), make(0)
# Horovod scales local gradients by 1 / size (scale_local_gradients=True).
for m, (x, y), lr in ((whole, (X, Y), 0.1), (shard, (X[mine], Y[mine]), 0.1 / size)):
    m.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
    m.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
out["partial_shared"] = diff(model.layers[0].get_weights(), whole.layers[0].get_weights())
out["partial_local"] = diff(model.layers[-1].get_weights(), shard.layers[-1].get_weights())

# Checkpoint and resume with the wrapped optimizer.
path = os.path.join(workdir, "model.h5" if KERAS2 else "model.keras")
model = make(rank)
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
model.fit(X[mine], Y[mine], batch_size=n, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
if rank == 0:
    model.save(path)
barrier()
resumed = hvd.load_model(path)
resumed.fit(X[mine], Y[mine], batch_size=n, epochs=1, shuffle=False, verbose=0)
ref = make(0)
ref.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
ref.fit(X, Y, batch_size=G, epochs=3, shuffle=False, verbose=0)
out["resume"] = diff(resumed.get_weights(), ref.get_weights())
out["resumed_steps"] = int(resumed.optimizer.iterations.numpy())

if KERAS2:  # the legacy optimizers, lr= and optimizer.lr
    model, ref = make(0), make(0)
    opt = hvd.DistributedOptimizer(keras.optimizers.legacy.SGD(lr=0.2))
    model.compile(optimizer=opt, loss="mse")
    keras.backend.set_value(model.optimizer.lr, 0.1)
    out["lr"] = float(keras.backend.get_value(model.optimizer.lr))
    model.fit(X[mine], Y[mine], batch_size=n, epochs=2, shuffle=False, verbose=0)
    ref.compile(optimizer=keras.optimizers.legacy.SGD(learning_rate=0.1), loss="mse")
    ref.fit(X, Y, batch_size=G, epochs=2, shuffle=False, verbose=0)
    out["legacy"] = diff(model.get_weights(), ref.get_weights())

print("RESULT", json.dumps(out), flush=True)
"""

HAS_TF_KERAS = importlib.util.find_spec("tf_keras") is not None

# Runs a test under Keras 3 and, where tf-keras is installed, under Keras 2 (keras2=True).
UNDER_BOTH_KERASES = pytest.mark.parametrize(
    "keras2",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.skipif(not HAS_TF_KERAS, reason="tf-keras is not installed"),
        ),
    ],
    ids=["keras3", "keras2"],
)


@pytest.mark.parametrize("np", [1, 2, 3])
@UNDER_BOTH_KERASES
def test_a_horovod_program_runs_unchanged_under_horovodrun(tmp_path, np, keras2):
    env = {"TF_USE_LEGACY_KERAS": "1"} if keras2 else {"TF_USE_LEGACY_KERAS": "0"}
    script = python_script(tmp_path, PROGRAM)
    result = check(
        launch(np, "python", script, str(tmp_path), env=env, timeout=300, launcher="horovodrun")
    )
    lines = [line for line in result.stdout.splitlines() if "RESULT " in line]
    assert len(lines) == np, result.stdout[-3000:]
    for line in lines:
        out = json.loads(line.split("RESULT ", 1)[1])
        assert out["size"] == np
        assert out["keras"].startswith("tf_keras" if keras2 else "keras")
        mine = list(range(out["rank"] % 2, np, 2))  # the ranks of this rank's colour
        assert out["split_ranks"] == mine and out["split_sum"] == sum(q + 1 for q in mine)
        # Both colours registered on every rank, even first (JSON keys are strings).
        evens, odds = list(range(0, np, 2)), list(range(1, np, 2))
        expected = {"0": list(range(np))} | ({"1": evens, "2": odds} if np > 1 else {})
        assert out["sets"] == expected, out["sets"]
        for key in ("custom_loop", "fit", "fit_loss", "syncbn_output", "syncbn_moving"):
            assert out[key] < 2e-5, (key, out)
        assert out["partial_shared"] < 2e-5 and out["partial_local"] < 2e-5, out
        assert out["resume"] < 2e-5 and out["resumed_steps"] == 3, out
        if keras2:
            assert abs(out["lr"] - 0.1) < 1e-7 and out["legacy"] < 2e-5, out


# Horovod's elastic Keras example (tensorflow2_keras_mnist_elastic.py) as its users write it:
# horovod's import names, tf.keras (Keras 2 under TF_USE_LEGACY_KERAS=1), compile with
# experimental_run_tf_function=False, a one-step fit before the state exists, a reset callback
# that sets optimizer.lr and fits one step, the epoch, batch and commit callbacks. Small
# synthetic data instead of MNIST; rank 1 kills itself once as global batch 8 begins (a marker
# file keeps its replacement alive).
ELASTIC_PROGRAM = r"""
import json, os, signal, sys

import numpy as np
import tensorflow as tf

import horovod.tensorflow.keras as hvd

EPOCHS, STEPS = 3, 6
marker = sys.argv[1]

hvd.init()
rng = np.random.default_rng(hvd.rank())
x = rng.normal(size=(256, 4)).astype("float32")
y = (x @ np.array([1.0, -2.0, 0.5, 3.0], "float32") > 0).astype("int64")
dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(8)

tf.keras.utils.set_random_seed(hvd.rank())
model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(8, "relu"),
                             tf.keras.layers.Dense(2, activation="softmax")])
opt = hvd.DistributedOptimizer(tf.keras.optimizers.Adam(0.001 * hvd.size()))
model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(), optimizer=opt,
              metrics=["accuracy"], experimental_run_tf_function=False)
model.fit(dataset, steps_per_epoch=1, epochs=1, callbacks=None, verbose=0)

state = hvd.elastic.KerasState(model, batch=0, epoch=0)
resets = []


def on_state_reset():
    tf.keras.backend.set_value(state.model.optimizer.lr, 0.001 * hvd.size())
    state.model.fit(dataset, steps_per_epoch=1, epochs=1, callbacks=None, verbose=0)
    resets.append(hvd.size())


state.register_reset_callbacks([on_state_reset])


class Kill(tf.keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if state.epoch * STEPS + state.batch == 8 and hvd.rank() == 1:
            if not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)


callbacks = [
    hvd.elastic.UpdateEpochStateCallback(state),
    hvd.elastic.UpdateBatchStateCallback(state),
    hvd.elastic.CommitStateCallback(state),
    Kill(),
]


@hvd.elastic.run
def train(state):
    state.model.fit(dataset, steps_per_epoch=STEPS, epochs=EPOCHS - state.epoch,
                    callbacks=callbacks, verbose=0)


train(state)
result = {
    "rank": hvd.rank(),
    "size": hvd.size(),
    "resets": resets,
    "iterations": int(model.optimizer.iterations.numpy()),
    "epoch": state.epoch,
    "lr": float(tf.keras.backend.get_value(model.optimizer.lr)),
    "weights": [w.tolist() for w in model.get_weights()],
}
print("RESULT " + json.dumps(result), flush=True)
"""


@UNDER_BOTH_KERASES
def test_horovods_elastic_keras_example_survives_a_kill_under_horovodrun(tmp_path, keras2):
    env = {"TF_USE_LEGACY_KERAS": "1" if keras2 else "0"}
    script = python_script(tmp_path, ELASTIC_PROGRAM)
    result = launch(
        2,
        "python",
        script,
        str(tmp_path / "killed"),
        env=env,
        launcher_args=("--min-np", "2"),
        timeout=300,
        launcher="horovodrun",
    )
    out = f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-6000:]}"
    assert result.returncode == 0, out
    assert (tmp_path / "killed").exists(), out
    results = [
        json.loads(line.split("RESULT ", 1)[1])
        for line in result.stdout.splitlines()
        if "RESULT " in line
    ]
    assert sorted(r["rank"] for r in results) == [0, 1], out
    # Updates: the first one-step fit, 3 epochs of 6 batches, the reset callback's step, and the
    # 2 batches of the interrupted epoch committed before the kill (the resumed fit runs that
    # epoch in full, as Horovod's does).
    for r in results:
        assert r["size"] == 2 and r["epoch"] == 3, out
        assert r["iterations"] == 1 + 3 * 6 + 1 + 2, out
        assert abs(r["lr"] - 0.002) < 1e-9, out
        assert r["weights"] == results[0]["weights"], out  # bit-identical replicas
    assert [r["resets"] for r in results if r["rank"] == 0] == [[2]], out
    assert "1 membership change(s)" in result.stderr, out


# Horovod's tensorflow2_mnist.py step as its users write it: tf.keras, DistributedGradientTape,
# and on the first batch a broadcast of opt.variables(), Keras 2's method (a list in Keras 3).
MNIST_STEP_PROGRAM = r"""
import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd

hvd.init()
rng = np.random.default_rng(hvd.rank())
images = rng.normal(size=(16, 4)).astype("float32")
labels = rng.integers(0, 2, size=(16,)).astype("int64")
model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2)])
loss = tf.losses.SparseCategoricalCrossentropy(from_logits=True)
opt = tf.optimizers.Adam(0.001 * hvd.size())


@tf.function
def training_step(images, labels, first_batch):
    with tf.GradientTape() as tape:
        loss_value = loss(labels, model(images, training=True))
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss_value, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables(), root_rank=0)
    return loss_value


for batch in range(3):
    training_step(images, labels, batch == 0)
print("DONE", hvd.rank(), flush=True)
"""


@UNDER_BOTH_KERASES
def test_horovods_tf2_example_says_to_run_under_keras_2_where_keras_3_fails(tmp_path, keras2):
    env = {"TF_USE_LEGACY_KERAS": "1" if keras2 else "0"}
    script = python_script(tmp_path, MNIST_STEP_PROGRAM)
    result = launch(2, "python", script, env=env, timeout=300, launcher="horovodrun")
    out = f"--- stdout ---\n{result.stdout[-3000:]}\n--- stderr ---\n{result.stderr[-4000:]}"
    if keras2:
        assert result.returncode == 0 and result.stdout.count("DONE") == 2, out
        return
    assert result.returncode != 0, out
    (last,) = [line for line in result.stderr.splitlines() if "first failure: rank" in line]
    # The launcher's line carries the error's own message, which says what to do.
    assert "failed with TypeError: 'list' object is not callable: optimizer.variables" in last
    assert "run it under Keras 2 with TF_USE_LEGACY_KERAS=1 (pip install tf-keras)" in last
