"""Keras 2 through tf-keras: tests/parallel/test_keras2.py through the real launcher at np=1, 2
and 3, with ``TF_USE_LEGACY_KERAS=1`` (so ``tf.keras`` is tf-keras in every rank).

One pytest session per rank for the whole module (TensorFlow and tf-keras load once per rank);
``-x`` makes a failing rank exit at once, and the launcher then ends the others.
"""

import importlib.util
import json
import re

import numpy
import pytest

from tests.launcher import check, launch, pytest_on_ranks, python_script

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tf_keras") is None,
    reason="tf-keras is not installed (pip install tf-keras): no Keras 2 to test",
)


@pytest.mark.parametrize("np", [1, 2, 3])
def test_keras2_suite(np):
    result = check(
        pytest_on_ranks(
            np,
            "-W",
            "ignore::UserWarning",  # tf-keras' notes on h5 files and lr=, once per rank
            "tests/parallel/test_keras2.py",
            env={"TF_USE_LEGACY_KERAS": "1"},
            timeout=600,
        )
    )
    for rank in range(np):
        assert f"[{rank}]<stdout>:" in result.stdout
    summaries = [line for line in result.stdout.splitlines() if " passed" in line]
    assert len(summaries) == np, result.stdout[-3000:]
    for line in summaries:  # nothing skipped: tf.keras was tf-keras in every rank
        assert "failed" not in line and "skipped" not in line and "error" not in line, line


GRAPH_MODE_JOB = """
import json
import numpy as np
import tensorflow as tf
tf.compat.v1.disable_eager_execution()
import horovod.tensorflow.keras as hvd

keras = tf.keras
hvd.init()
r, n = hvd.rank(), hvd.size()
tf.compat.v1.keras.backend.set_session(tf.compat.v1.Session())
rng = np.random.default_rng(0)
x = rng.normal(size=(3 * 6, 3)).astype("float32")  # 3 global batches of 6 rows
y = rng.normal(size=(3 * 6, 1)).astype("float32")
mine = np.concatenate([np.arange(s + r * 6 // n, s + (r + 1) * 6 // n) for s in range(0, 18, 6)])
model = keras.Sequential([keras.layers.Dense(1, input_shape=(3,),
                          kernel_initializer=keras.initializers.Constant(r + 1.0))])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.legacy.SGD(0.1)), loss="mse")
model.fit(x[mine], y[mine], batch_size=6 // n, epochs=1, shuffle=False, verbose=0,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
w, b = model.get_weights()
print("RESULT " + json.dumps({"rank": r, "w": w.ravel().tolist(), "b": b.tolist()}), flush=True)
"""


def _run_graph_job(np, tmp_path, job: str) -> list[dict]:
    """Runs ``job`` (a GRAPH_MODE_JOB) under Keras 2 at ``np`` ranks; every rank's RESULT."""
    result = check(
        launch(
            np,
            "python",
            python_script(tmp_path, job),
            env={"TF_USE_LEGACY_KERAS": "1"},
            timeout=180,
        )
    )
    found = [json.loads(m) for m in re.findall(r"RESULT (\{.*\})", result.stdout)]
    assert sorted(f["rank"] for f in found) == list(range(np)), result.stdout[-3000:]
    return found


def _whole_batches():
    """GRAPH_MODE_JOB's data, whole: 3 global batches of 6 rows, and rank 0's initial weights."""
    rng = numpy.random.default_rng(0)
    x = rng.normal(size=(18, 3)).astype("float32")
    y = rng.normal(size=(18, 1)).astype("float32")
    return x, y, numpy.ones((3, 1)), numpy.zeros(1)


def _assert_weights(found: list[dict], w, b) -> None:
    for f in found:
        numpy.testing.assert_allclose(f["w"], w.ravel(), rtol=0, atol=1e-5)
        numpy.testing.assert_allclose(f["b"], b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("np", [1, 2, 3])
def test_keras2_in_a_tf1_graph_broadcasts_and_averages(np, tmp_path):
    # Horovod's old keras_mnist.py: disable_eager_execution(), then fit. Keras 2 trains
    # through the optimizer's get_updates/get_gradients there, and the broadcast must run in
    # Keras' session: before, every rank trained alone from its own weights and exited 0.
    found = _run_graph_job(np, tmp_path, GRAPH_MODE_JOB)
    # One process on the whole batches: mean squared error, rank 0's initial weights.
    x, y, w, b = _whole_batches()
    for s in range(0, 18, 6):
        error = x[s : s + 6] @ w + b - y[s : s + 6]
        w, b = w - 0.1 * 2 * x[s : s + 6].T @ error / 6, b - 0.1 * 2 * error.mean(0)
    _assert_weights(found, w, b)


@pytest.mark.parametrize("np", [1, 2, 3])
def test_keras2_in_a_tf1_graph_warms_up_the_rate_with_momentum_correction(np, tmp_path):
    # Horovod's older Keras examples: LearningRateWarmupCallback in a TF1 graph, with no
    # steps_per_epoch (fit() knows only samples and batch_size there). The rate was read with
    # .numpy() (an AttributeError), and the momentum buffers' correction built ops nothing ran.
    job = (
        GRAPH_MODE_JOB.replace(
            "keras.optimizers.legacy.SGD(0.1)", "keras.optimizers.legacy.SGD(0.01, momentum=0.9)"
        )
        .replace("epochs=1,", "epochs=2,")
        .replace(
            "callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)]",
            "callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), "
            "hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.1 * n, warmup_epochs=2)]",
        )
    )
    found = _run_graph_job(np, tmp_path, job)
    # One process on the whole batches, at Horovod's warmup rates (initial_lr / size *
    # (t (size - 1) / warmup_epochs + 1), t = epoch + (batch + 1) / steps), the velocity
    # rescaled by new_lr / old_lr before each step (Keras 2's SGD: v = 0.9 v - lr g; w += v).
    x, y, w, b = _whole_batches()
    vw, vb, old = numpy.zeros((3, 1)), numpy.zeros(1), 0.01
    for epoch in range(2):
        for batch, s in enumerate(range(0, 18, 6)):
            t = epoch + (batch + 1) / 3
            lr = 0.1 * (t * (np - 1) / 2 + 1)
            vw, vb = vw * lr / old, vb * lr / old
            error = x[s : s + 6] @ w + b - y[s : s + 6]
            vw = 0.9 * vw - lr * 2 * x[s : s + 6].T @ error / 6
            vb = 0.9 * vb - lr * 2 * error.mean(0)
            w, b, old = w + vw, b + vb, lr
    _assert_weights(found, w, b)


@pytest.mark.parametrize("np", [1, 2, 3])
def test_keras2_in_a_tf1_graph_saves_and_loads_the_optimizers_state(np, tmp_path):
    # Horovod's keras_mnist.py resumes from ModelCheckpoint's .h5 through hvd.load_model. In a
    # TF1 graph the loaded optimizer's state was dropped (assigned by ops nothing ran:
    # iterations 0, momentum zeros), and a SavedModel could not be written at all (the
    # wrapper's own step count was never initialized in Keras' session).
    folder = tmp_path / "saved"
    folder.mkdir()
    job = GRAPH_MODE_JOB.replace(
        "keras.optimizers.legacy.SGD(0.1)", "keras.optimizers.legacy.SGD(0.1, momentum=0.9)"
    ).replace(
        "w, b = model.get_weights()",
        f"""state = model.optimizer.get_weights()
if r == 0:
    model.save("{folder}/model.h5")
    model.save("{folder}/model", save_format="tf")
hvd.barrier()
loaded = hvd.load_model("{folder}/model.h5")
again = loaded.optimizer.get_weights()
assert len(again) == len(state) == 3, (len(again), len(state))  # the step count, 2 momenta
assert int(again[0]) == 3, again[0]  # 3 global batches
for got, want in zip(again, state):
    np.testing.assert_array_equal(got, want)
assert tf.io.gfile.exists("{folder}/model/saved_model.pb")
w, b = loaded.get_weights()""",
    )
    found = _run_graph_job(np, tmp_path, job)
    x, y, w, b = _whole_batches()
    vw, vb = numpy.zeros((3, 1)), numpy.zeros(1)
    for s in range(0, 18, 6):
        error = x[s : s + 6] @ w + b - y[s : s + 6]
        vw, vb = 0.9 * vw - 0.1 * 2 * x[s : s + 6].T @ error / 6, 0.9 * vb - 0.1 * 2 * error.mean(0)
        w, b = w + vw, b + vb
    _assert_weights(found, w, b)


def test_keras2_in_a_tf1_graph_says_checkpoint_callback_needs_eager_execution(tmp_path):
    # It said "must run eagerly, not inside tf.function" to a program with no tf.function.
    job = GRAPH_MODE_JOB.replace(
        "callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)]",
        f"callbacks=[syncdp.tensorflow.keras.CheckpointCallback({str(tmp_path / 'ck')!r})]",
    ).replace(
        "import horovod.tensorflow.keras as hvd",
        "import horovod.tensorflow.keras as hvd\nimport syncdp.tensorflow.keras",
    )
    result = launch(
        1, "python", python_script(tmp_path, job), env={"TF_USE_LEGACY_KERAS": "1"}, timeout=180
    )
    assert result.returncode != 0
    assert (
        "CheckpointManager.restore() needs eager execution, which this program turned off"
        in result.stderr
    ), result.stderr[-3000:]


def test_keras2_in_a_tf1_graph_names_a_current_optimizer_it_cannot_train_with(tmp_path):
    # Keras 2 trains in a TF1 graph only with its legacy optimizers; a current one is refused
    # with the fix, not an AttributeError from deep inside Keras.
    job = GRAPH_MODE_JOB.replace("keras.optimizers.legacy.SGD(0.1)", "keras.optimizers.SGD(0.1)")
    result = launch(
        1, "python", python_script(tmp_path, job), env={"TF_USE_LEGACY_KERAS": "1"}, timeout=180
    )
    assert result.returncode != 0
    assert "SGD cannot train in a TF1 graph" in result.stdout + result.stderr, result.stderr[-3000:]
    assert "tf.keras.optimizers.legacy.SGD(...)" in result.stdout + result.stderr
