"""Horovod's elastic TF2 pattern through the real launcher in elastic mode.

The program below is written the way Horovod's elastic TensorFlow 2 example is: a
``tf.function`` step with an ``allreduce`` switch, called once without syncdp (a local step
that makes Adam's slots), then under ``hvd.elastic.run`` with the DistributedGradientTape, so
the step is traced a second time with syncdp in it. Every rank commits after each step; the
data is a fixed sequence of global batches split over the ranks of the moment. So with or
without a lost rank, the weights must equal one process's result: rank 0's local step, then one
step per global batch, each applied exactly once.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.launcher import launch

PROGRAM = """
import json, os, signal, sys

import keras
import numpy as np
import tensorflow as tf

import syncdp.tensorflow as hvd
from syncdp.membership import membership

GLOBAL_BATCH, STEPS = 6, 5
kill_at = int(sys.argv[1])  # the step before which the process labelled 1 dies; -1: never


def global_batch(step):
    rng = np.random.default_rng(step)
    x = rng.normal(size=(GLOBAL_BATCH, 3)).astype("float32")
    return x, np.argmax(x @ np.array([[1.0, -2.0], [0.5, 0.0], [-1.0, 3.0]], "float32"), axis=1)


def my_part(batch, rank, size):
    n = GLOBAL_BATCH // size
    return batch[0][rank * n : (rank + 1) * n], batch[1][rank * n : (rank + 1) * n]


def make_model(seed):
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((3,)), keras.layers.Dense(8, "relu"), keras.layers.Dense(2)]
    return keras.Sequential(layers)


loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
hvd.init()
first_size = hvd.size()
model, opt = make_model(hvd.rank()), keras.optimizers.Adam(0.01)


@tf.function
def training_step(images, labels, allreduce=True):
    with tf.GradientTape() as tape:
        loss = loss_fn(labels, model(images, training=True))
    if allreduce:
        tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss


# One local step makes the optimizer's slots; run() then gives every rank rank 0's state.
training_step(*my_part(global_batch(0), hvd.rank(), hvd.size()), allreduce=False)
state = hvd.elastic.TensorFlowKerasState(model, opt, step=1, first_size=first_size)


@hvd.elastic.run
def train(state):
    while state.step <= STEPS:
        if state.step == kill_at and membership.me().label == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        training_step(*my_part(global_batch(state.step), hvd.rank(), hvd.size()))
        state.step += 1
        state.commit()


train(state)

reference, reference_opt = make_model(0), keras.optimizers.Adam(0.01)
batches = [my_part(global_batch(0), 0, state.first_size)]
batches += [global_batch(s) for s in range(1, STEPS + 1)]
for x, y in batches:
    with tf.GradientTape() as tape:
        loss = loss_fn(y, reference(x, training=True))
    grads = tape.gradient(loss, reference.trainable_variables)
    reference_opt.apply_gradients(zip(grads, reference.trainable_variables))
mine = [w.numpy() for w in model.weights + list(opt.variables)]
result = {
    "rank": hvd.rank(),
    "size": hvd.size(),
    "label": membership.me().label,
    "steps": int(opt.iterations),
    "error": max(
        float(np.abs(a.numpy() - b.numpy()).max())
        for a, b in zip(model.weights, reference.weights)
    ),
    "state": [a.tolist() for a in mine],
}
print("RESULT " + json.dumps(result), flush=True)
"""


@pytest.mark.parametrize("kill_at", [-1, 3], ids=["no-failure", "rank-1-lost-at-step-3"])
def test_elastic_tf2_pattern_traces_the_step_without_then_with_syncdp(tmp_path, kill_at):
    program = tmp_path / "elastic_tf2_pattern.py"
    program.write_text(PROGRAM)
    result = launch(
        2, "python", str(program), str(kill_at), launcher_args=("--min-np", "2"), timeout=300
    )
    out = f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-6000:]}"
    assert result.returncode == 0, out
    results = [json.loads(m) for m in re.findall(r"<stdout>:RESULT (\{.*\})", result.stdout)]
    assert sorted(r["rank"] for r in results) == [0, 1], out
    for r in results:
        assert r["size"] == 2 and r["steps"] == 1 + 5, out  # the local step, then 5 together
        assert r["error"] < 1e-5, out
        assert r["state"] == results[0]["state"], out  # bit-identical replicas
    assert "singleton" not in result.stderr, out
    if kill_at >= 0:
        assert {r["label"] for r in results} != {0, 1}, out  # rank 1 is a replacement
        assert "1 membership change(s)" in result.stderr, out


# Horovod's elastic Keras example (tensorflow2_keras_mnist_elastic.py), its structure kept: a
# compile with Horovod's experimental_run_tf_function=False, a one-step fit before the state
# exists, a reset callback that sets the learning rate through optimizer.lr and fits one step
# (before run() syncs the state: the ranks' optimizer steps differ there by design), and the
# epoch, batch and commit callbacks. Small synthetic data instead of MNIST.
KERAS_PROGRAM = """
import json, os, signal, sys

import keras
import numpy as np
import tensorflow as tf

import syncdp.tensorflow.keras as hvd
from syncdp.membership import membership

EPOCHS, STEPS = 3, 6
kill_at = int(sys.argv[1])  # the global batch (epoch * STEPS + batch) at which a label dies
victim = int(sys.argv[2])  # that label
dies_in_reset = int(sys.argv[3])  # a label that dies in the first reset callback; -1: none
commit_every = int(sys.argv[4]) if len(sys.argv) > 4 else 1  # batches_per_commit

hvd.init()
rng = np.random.default_rng(hvd.rank())
x = rng.normal(size=(256, 4)).astype("float32")
y = (x @ np.array([1.0, -2.0, 0.5, 3.0], "float32") > 0).astype("int64")
dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(8)

keras.utils.set_random_seed(hvd.rank())
model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(8, "relu"),
                             tf.keras.layers.Dense(2, activation="softmax")])
opt = hvd.DistributedOptimizer(tf.optimizers.Adam(0.001 * hvd.size()),
                               backward_passes_per_step=1, average_aggregated_gradients=True)
model.compile(loss=tf.losses.SparseCategoricalCrossentropy(), optimizer=opt,
              metrics=["accuracy"], experimental_run_tf_function=False)
model.fit(dataset, steps_per_epoch=1, epochs=1, callbacks=None, verbose=0)

state = hvd.elastic.KerasState(model, batch=0, epoch=0)
resets = []


def on_state_reset():
    commits.clear()
    if membership.me().label == dies_in_reset:
        os.kill(os.getpid(), signal.SIGKILL)
    tf.keras.backend.set_value(state.model.optimizer.lr, 0.001 * hvd.size())
    state.model.fit(dataset, steps_per_epoch=1, epochs=1, callbacks=None, verbose=0)
    resets.append(hvd.size())


state.register_reset_callbacks([on_state_reset])
commits = []  # the optimizer's step at each commit since this rank's last reset
_commit = state.commit


def commit():
    commits.append(int(model.optimizer.iterations))
    _commit()


state.commit = commit


class Kill(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if state.epoch * STEPS + state.batch == kill_at and membership.me().label == victim:
            os.kill(os.getpid(), signal.SIGKILL)


callbacks = [
    hvd.elastic.UpdateEpochStateCallback(state),
    hvd.elastic.UpdateBatchStateCallback(state),
    hvd.elastic.CommitStateCallback(state, batches_per_commit=commit_every),
    Kill(),
]


@hvd.elastic.run
def train(state):
    state.model.fit(dataset, steps_per_epoch=STEPS, epochs=EPOCHS - state.epoch,
                    callbacks=callbacks, verbose=0)


train(state)
result = {
    "rank": hvd.rank(),
    "label": membership.me().label,
    "size": hvd.size(),
    "resets": resets,
    "commits": commits,
    "iterations": int(model.optimizer.iterations),
    "epoch": state.epoch,
    "lr": float(np.asarray(model.optimizer.learning_rate)),
    "weights": [w.numpy().tolist() for w in model.weights],
}
print("RESULT " + json.dumps(result), flush=True)
"""


@pytest.mark.parametrize("kill_at", [-1, 8], ids=["no-failure", "rank-1-lost-in-epoch-2"])
def test_horovods_elastic_keras_example_recovers_after_the_import_swap(tmp_path, kill_at):
    program = tmp_path / "elastic_keras_example.py"
    program.write_text(KERAS_PROGRAM)
    args = (str(program), str(kill_at), "1", "-1")
    result = launch(2, "python", *args, launcher_args=("--min-np", "2"), timeout=300)
    out = f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-6000:]}"
    assert result.returncode == 0, out
    results = [json.loads(m) for m in re.findall(r"<stdout>:RESULT (\{.*\})", result.stdout)]
    assert sorted(r["rank"] for r in results) == [0, 1], out
    # Updates: the first one-step fit, 3 epochs of 6 batches, and after a loss one step in the
    # reset callback plus, again, the batches of the interrupted epoch committed before it
    # (the resumed fit runs that epoch in full, as Horovod's did: see UpdateBatchStateCallback).
    # The kill comes as global batch 8 (epoch 1, batch 2) begins: 2 batches were committed.
    extra = 1 + 2 if kill_at >= 0 else 0
    for r in results:
        assert r["size"] == 2 and r["epoch"] == 3, out
        assert r["iterations"] == 1 + 3 * 6 + extra, out
        assert abs(r["lr"] - 0.002) < 1e-9, out
        assert r["weights"] == results[0]["weights"], out  # bit-identical replicas
    if kill_at >= 0:
        assert {r["label"] for r in results} == {0, 2}, out  # rank 1 is a replacement
        assert [r["resets"] for r in results if r["label"] == 0] == [[2]], out
        assert "1 membership change(s)" in result.stderr, out


def test_commits_every_few_batches_stay_in_step_when_a_spare_takes_a_lost_place(tmp_path):
    # batches_per_commit=4 and a warm spare, whose commits are collectives (they hand the
    # spares the job's state). Label 1 dies at global batch 8 (epoch 1, batch 2): the
    # survivors had counted 2 batches since their last commit, the spare none. Each fit counts
    # from 0 on every rank, as Horovod's callback does, so all commit at the same batches.
    program = tmp_path / "elastic_keras_example.py"
    program.write_text(KERAS_PROGRAM)
    flags = ("--min-np", "2", "--spares", "1")
    args = (str(program), "8", "1", "-1", "4")
    result = launch(2, "python", *args, launcher_args=flags, timeout=300)
    out = f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-6000:]}"
    assert result.returncode == 0, out
    results = [json.loads(m) for m in re.findall(r"<stdout>:RESULT (\{.*\})", result.stdout)]
    assert sorted(r["rank"] for r in results) == [0, 1] and len(results) == 2, out
    assert 1 not in {r["label"] for r in results}, out  # the spare took label 1's place
    # The first one-step fit, then a commit after every 4th batch of the fit (taken as the
    # next batch begins; the count runs on across epochs, as Horovod's), at an epoch's end and
    # again as the next epoch begins or the fit ends: steps 5, 7, 7 and 9 (epoch 1, batch 2)
    # before the loss. The resumed fit, after the reset callback's step (10), runs epochs 1
    # (in full: a Keras epoch cannot be shortened) and 2: 12 more steps.
    for r in results:
        assert r["size"] == 2 and r["epoch"] == 3, out
        assert r["iterations"] == 9 + 1 + 2 * 6, out
        assert r["weights"] == results[0]["weights"], out
        assert r["commits"] == [14, 16, 16, 18, 22, 22], out
    assert "1 membership change(s)" in result.stderr, out


def test_a_rank_lost_while_the_reset_callbacks_train_is_one_more_recovery(tmp_path):
    # np=3 and no free slot (the discovery script lists 1): label 2 dies at global batch 8;
    # in the recovery, label 1 dies inside the reset callback, while label 0's callback trains
    # a step with it. That collective fails on label 0, which recovers again and finishes
    # alone.
    program = tmp_path / "elastic_keras_example.py"
    program.write_text(KERAS_PROGRAM)
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:1\n")
    script.chmod(0o755)
    flags = ("--min-np", "1", "--host-discovery-script", str(script))
    result = launch(3, "python", str(program), "8", "2", "1", launcher_args=flags, timeout=300)
    out = f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-6000:]}"
    assert result.returncode == 0, out
    results = [json.loads(m) for m in re.findall(r"<stdout>:RESULT (\{.*\})", result.stdout)]
    assert [(r["label"], r["size"]) for r in results] == [(0, 1)], out
    (r,) = results
    # As above: the committed updates are kept, the failed callback's step is undone by the
    # restore, and the second callback's step counts once.
    assert r["iterations"] == 1 + 3 * 6 + 1 + 2 and r["epoch"] == 3, out
    assert r["resets"] == [1], out
    assert "2 membership change(s)" in result.stderr, out


def test_a_replacement_that_meets_a_second_loss_before_its_run_is_replaced_too(tmp_path):
    # np=3, replacements allowed: label 2 dies at global batch 8 and label 3 replaces it. Label 3
    # fits its first step (before elastic.run) paired with the survivors' reset callback, in
    # which label 1 dies. Label 3's collective fails outside elastic.run: it ends as one more
    # lost rank (the job is not ended), and labels 4 and 5 take the two places.
    program = tmp_path / "elastic_keras_example.py"
    program.write_text(KERAS_PROGRAM)
    flags = ("--min-np", "1")
    result = launch(3, "python", str(program), "8", "2", "1", launcher_args=flags, timeout=300)
    out = f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-6000:]}"
    assert result.returncode == 0, out
    results = [json.loads(m) for m in re.findall(r"<stdout>:RESULT (\{.*\})", result.stdout)]
    assert sorted(r["label"] for r in results) == [0, 4, 5], out
    for r in results:
        assert r["size"] == 3 and r["epoch"] == 3, out
        assert r["iterations"] == 1 + 3 * 6 + 1 + 2, out
        assert r["weights"] == results[0]["weights"], out
    assert "a rank of the job was lost outside elastic.run" in result.stderr, out
    assert "2 membership change(s)" in result.stderr, out
