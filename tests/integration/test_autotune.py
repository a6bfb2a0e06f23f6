"""``syncdp-run --autotune``: the search runs, logs, settles, and never changes the arithmetic.

The job trains a 7 MiB MLP (so the tuned fusion thresholds give different buckets and the traced
step really switches plans) with full-batch SGD, each rank on its share of the batch, while the
tuner moves between choices every two steps. The result must equal one process training on the
whole batch (plans only regroup tensors; every element is still the same sum), and the CSV log
must show the warmup, the samples and a choice that is the fastest sample.
"""

import csv
import math

import pytest

from syncdp import engine
from syncdp.watch import timeline
from tests.launcher import check, launch, python_script

MiB = 1 << 20
# The job's model: its trainable variables' sizes, in order.
SHAPES = [(256, 1024), (1024,), (1024, 1024), (1024,), (1024, 512), (512,), (512, 10), (10,)]

JOB = """
import sys
import numpy as np
import tensorflow as tf
import syncdp.tensorflow as hvd

mode = sys.argv[1]
hvd.init()
STEPS, BATCH = 60, 24


def build():
    return tf.keras.Sequential([
        tf.keras.Input((256,)),
        tf.keras.layers.Dense(1024, activation="tanh"),
        tf.keras.layers.Dense(1024, activation="tanh"),
        tf.keras.layers.Dense(512, activation="tanh"),
        tf.keras.layers.Dense(10),
    ])


data = np.random.default_rng(1)
x = tf.constant(data.normal(size=(BATCH, 256)), tf.float32)
y = tf.constant(data.integers(0, 10, size=BATCH), tf.int32)
start = hvd.broadcast_object(build().get_weights(), root_rank=0)


lossf = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

# The reference: one process, the whole batch, no syncdp.
ref = build()
ref.set_weights(start)
ref_opt = tf.keras.optimizers.SGD(0.05)
if mode == "keras":
    ref.compile(optimizer=ref_opt, loss=lossf)
    ref.fit(x, y, batch_size=BATCH, epochs=STEPS, shuffle=False, verbose=0)
else:
    for _ in range(STEPS):
        with tf.GradientTape() as tape:
            loss = lossf(y, ref(x))
        ref_opt.apply_gradients(zip(tape.gradient(loss, ref.trainable_variables),
                                    ref.trainable_variables))

model = build()
model.set_weights(start)
mine = slice(hvd.rank() * BATCH // hvd.size(), (hvd.rank() + 1) * BATCH // hvd.size())
xs, ys = x[mine], y[mine]
opt = tf.keras.optimizers.SGD(0.05)

if mode == "keras":
    model.compile(optimizer=hvd.DistributedOptimizer(opt), loss=lossf)
    model.fit(xs, ys, batch_size=BATCH // hvd.size(), epochs=STEPS, shuffle=False, verbose=0)
else:
    def step():
        with tf.GradientTape() as tape:
            loss = lossf(ys, model(xs))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    if mode == "function":
        step = tf.function(step)
    for _ in range(STEPS):
        step()

for a, b in zip(model.variables, ref.variables):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=2e-4, atol=2e-6)
print("matches one process", flush=True)
"""


def _buckets_per_step(trace):
    """Rank 0's gradient buckets, one list of bucket indices per step, in order."""
    steps = []
    for event in timeline.load(str(trace))[0]:
        if event.get("ph") != "X" or ".bucket" not in event["name"]:
            continue
        if event["args"]["bucket"] == 0:
            steps.append([])
        steps[-1].append(event["args"]["bucket"])
    return steps


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize(
    ("np", "mode"), [(2, "function"), (3, "function"), (2, "eager"), (2, "keras")]
)
def test_autotune_searches_settles_and_matches_one_process(np, mode, tmp_path):
    log = tmp_path / "tune.csv"
    trace = tmp_path / "trace.json"
    result = check(
        launch(
            np,
            "python",
            python_script(tmp_path, JOB),
            mode,
            launcher_args=(
                "--autotune",
                "--autotune-warmup-samples",
                "1",
                "--autotune-steps-per-sample",
                "2",
                "--autotune-log-file",
                str(log),
                "--timeline-filename",
                str(trace),
            ),
            timeout=240,
        )
    )
    assert result.stdout.count("matches one process") == np, result.stdout
    rows = _rows(log)
    kinds = [r["kind"] for r in rows]
    assert kinds[0] == "warmup" and kinds[1] == "sample" and kinds[-1] == "chosen", kinds
    assert kinds.count("warmup") == 1 and kinds.count("chosen") == 1
    samples = [r for r in rows if r["kind"] == "sample"]
    assert len(samples) <= 20
    # For 7 MiB of gradients a 2 MiB cap gives other buckets than 8, 25 or 64 MiB: the traced
    # step ran both plans.
    caps = {r["fusion_threshold_mb"] for r in samples}
    assert "2" in caps and caps & {"8", "25", "64"}, rows
    chosen = rows[-1]
    fastest = min(float(r["step_ms"]) for r in samples)
    assert float(chosen["step_ms"]) == fastest, rows
    assert "syncdp: autotune chose fusion threshold " in result.stderr, result.stderr[-3000:]
    # The traced step switched plans while searching, and runs the chosen one once settled.
    specs = [engine.TensorSpec(4 * int(math.prod(s)), "float32") for s in SHAPES]
    first, cap = (int(float(chosen[k]) * MiB) for k in ("first_bucket_mb", "fusion_threshold_mb"))
    planned = engine.plan(specs, first_bytes=first, cap_bytes=cap, reverse=True)
    steps = _buckets_per_step(trace)
    assert steps[-1] == list(range(len(planned))), (steps[-1], planned)
    assert len({len(s) for s in steps}) > 1, "every step ran the same number of buckets"


SHORT = """
import tensorflow as tf
import syncdp.tensorflow as hvd

hvd.init()
w = tf.Variable(tf.ones([1000]))


@tf.function
def step():
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * w)
    (g,) = hvd.DistributedGradientTape(tape).gradient(loss, [w])
    w.assign_sub(0.01 * g)


for _ in range(8):
    step()
"""


def test_a_job_shorter_than_the_search_says_so(tmp_path):
    result = check(
        launch(
            2,
            "python",
            python_script(tmp_path, SHORT),
            launcher_args=("--autotune", "--autotune-steps-per-sample", "2"),
            timeout=120,
        )
    )
    # 8 steps: 7 step times, 3 warmup samples of 2, then the job ends.
    assert (
        "syncdp: autotune did not finish: the job ended after 0 of up to 20 samples "
        "(plus 3 warmup)" in result.stderr
    ), result.stderr[-2000:]
    assert "autotune chose" not in result.stderr


TF1_GRAPH = """
import numpy as np
import tensorflow as tf
import syncdp.tensorflow as hvd

tf.compat.v1.disable_eager_execution()
hvd.init()
w = tf.compat.v1.get_variable("w", initializer=np.ones((4, 1), np.float32))
loss = tf.reduce_sum(tf.matmul(tf.ones((2, 4)), w))
opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
train = opt.minimize(loss)
with tf.compat.v1.Session() as sess:
    sess.run(tf.compat.v1.global_variables_initializer())
    for _ in range(3):
        sess.run(train)
    print("w", [round(float(v), 5) for v in sess.run(w).ravel()], flush=True)
"""


@pytest.mark.parametrize("np_", [2, 3])  # one rank runs no reduction, so it has nothing to say
def test_a_tf1_graph_with_autotune_on_is_told_it_is_not_tuned(tmp_path, np_):
    log = tmp_path / "tune.csv"
    # An earlier job's log, with its choice: this job takes no sample, so no log is left
    # (Horovod empties the file at init), rather than a choice this job never made.
    log.write_text("sample,kind,fusion_threshold_mb\n0,chosen,64\n")
    result = check(
        launch(
            np_,
            "python",
            python_script(tmp_path, TF1_GRAPH),
            launcher_args=("--autotune", "--autotune-log-file", str(log)),
            timeout=120,
        )
    )
    note = "syncdp: --autotune does not tune gradient reductions in a TF1 graph"
    assert result.stderr.count(note) == 1, result.stderr[-2000:]
    # Every rank's gradient is the same (2 per weight): 3 steps of 0.1 * 2 from 1.
    assert result.stdout.count("w [0.4, 0.4, 0.4, 0.4]") == np_, result.stdout
    assert not log.exists()
