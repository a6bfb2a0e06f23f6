"""Crash and resume through CheckpointManager and CheckpointCallback, end to end at np=2;
restore failures raised, and damaged checkpoints reported, on every rank.

Expected values come from an uninterrupted run of the same training, done in the same job
after the resumed one (same initial weights, same per-step data), never from stored outputs.
"""

from __future__ import annotations

import os
import re

import pytest

from tests.launcher import check, launch, python_script

TRAIN = r"""
import os, signal, sys
import numpy as np
import tensorflow as tf
import keras
import syncdp
from syncdp.checkpoint import CheckpointManager

syncdp.init()
rank = syncdp.rank()
directory = os.environ["CKPT_DIR"]
crash_at = int(os.environ.get("CRASH_STEP", -1))
interrupt_at = int(os.environ.get("INTERRUPT_SAVE", -1))
TOTAL, EVERY = 40, 10

if interrupt_at >= 0 and rank == 0:
    # Rank 0 dies inside save(interrupt_at): every file written and flushed, not yet renamed.
    real_rename = os.rename
    def rename(src, dst):
        if os.path.basename(dst) == f"ckpt-{interrupt_at:08d}":
            print("KILLED MID-SAVE", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return real_rename(src, dst)
    os.rename = rename

def build():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(1)])
    rng = np.random.default_rng(7)  # the same initial weights in every launch
    for v in model.weights:
        v.assign(rng.normal(size=v.shape).astype("float32") * 0.5)
    return model, keras.optimizers.Adam(0.01)

def trainer(model, opt):
    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        tape = syncdp.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    return step

def batch(i):
    rng = np.random.default_rng(1000 * i + rank)  # each rank its own data, fixed per step
    x = rng.normal(size=(8, 4)).astype("float32")
    return x, np.sin(x.sum(axis=1, keepdims=True))

model, opt = build()
manager = CheckpointManager(directory, max_to_keep=3, model=model, optimizer=opt)
start = manager.restore()
print("RESTORED", start, flush=True)
step = trainer(model, opt)
for i in range(start, TOTAL):
    if i == crash_at and rank == 1:
        raise RuntimeError(f"rank 1 crashes at step {i}")
    step(*batch(i))
    if (i + 1) % EVERY == 0:
        manager.save(i + 1)

ref, ref_opt = build()
ref_opt.build(ref.trainable_variables)
syncdp.broadcast_variables(ref.variables + ref_opt.variables)
ref_step = trainer(ref, ref_opt)
for i in range(TOTAL):
    ref_step(*batch(i))
diff = max(float(np.max(np.abs(a.numpy() - b.numpy())))
           for a, b in zip(model.variables + opt.variables, ref.variables + ref_opt.variables))
syncdp.verify_synchronized(model.variables + opt.variables)
print(f"ITERATIONS {int(opt.iterations.numpy())} MAXDIFF {diff:.3e}", flush=True)
"""

FIT = r"""
import os
import numpy as np
import keras
import syncdp
from syncdp.keras import CheckpointCallback

syncdp.init()
crash_epoch = int(os.environ.get("CRASH_EPOCH", -1))

def build():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model

class Crash(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == crash_epoch and syncdp.rank() == 1:
            raise RuntimeError(f"rank 1 crashes at epoch {epoch}")

rng = np.random.default_rng(0)
x = rng.normal(size=(64, 4)).astype("float32")
y = np.sin(x.sum(axis=1, keepdims=True))
model = build()
ckpt = CheckpointCallback(os.environ["CKPT_DIR"], save_freq="epoch")
model.fit(x, y, batch_size=16, epochs=5, shuffle=False, verbose=0, callbacks=[ckpt, Crash()])
print("INITIAL_EPOCH", ckpt.initial_epoch, flush=True)
ref = build()
ref.fit(x, y, batch_size=16, epochs=5, shuffle=False, verbose=0)
diff = max(float(np.max(np.abs(a.numpy() - b.numpy())))
           for a, b in zip(model.variables, ref.variables))
print(f"ITERATIONS {int(model.optimizer.iterations.numpy())} MAXDIFF {diff:.3e}", flush=True)
"""


UNREADABLE = r"""
import builtins, errno, os, shutil, sys
import tensorflow as tf
import syncdp
from syncdp.checkpoint import CheckpointManager
from syncdp.base.errors import CheckpointError

syncdp.init()
rank = syncdp.rank()
v = tf.Variable([1.0, 2.0, 3.0])
manager = CheckpointManager(os.environ["CKPT_DIR"], v=v)
manager.save(5)
v.assign([7.0, 8.0, 9.0])
newest = manager.save(7)  # rank 0's path, None elsewhere
data = newest and os.path.join(newest, "ckpt.data-00000-of-00001")
v.assign([float(rank)] * 3)

def restore(case):
    try:
        step = manager.restore()
    except CheckpointError as e:
        print(f"CAUGHT {case} rank {rank}: {e}", flush=True)
    else:
        print(f"RESTORED {case} rank {rank} step {step} v {v.numpy().tolist()}", flush=True)

# 1. The disk fails on rank 0 while it reads the newest checkpoint.
real_open = builtins.open
def failing_open(file, *args, **kwargs):
    if file == data:
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    return real_open(file, *args, **kwargs)
builtins.open = failing_open
restore("eio")
builtins.open = real_open

# 2. A directory where the data file should be (as root, chmod 000 would not stop a read).
if rank == 0:
    os.remove(data)
    os.mkdir(data)
restore("eisdir")

# 3. What the error says to do: move the unreadable checkpoint away; the previous one is used.
if rank == 0:
    shutil.move(newest, os.environ["CKPT_DIR"] + "-unreadable")
restore("moved")
"""


@pytest.mark.parametrize("np_", [1, 2], ids=["np1", "np2"])
def test_an_unreadable_checkpoint_raises_on_every_rank(tmp_path, np_):
    script = python_script(tmp_path, UNREADABLE)
    directory = tmp_path / "ckpt"
    data = directory / "ckpt-00000007" / "ckpt.data-00000-of-00001"
    done = check(launch(np_, "python", script, env={"CKPT_DIR": str(directory)}, timeout=180))
    out = done.stdout
    for rank in range(np_):
        prefix = f"[{rank}]<stdout>:"
        for case, cause in (("eio", "Input/output error"), ("eisdir", "Is a directory")):
            line = f"{prefix}CAUGHT {case} rank {rank}: Rank 0 could not read {data} "
            assert line in out, out[-3000:] + done.stderr[-3000:]
            assert f"to restore from {directory}: {cause}." in out
        # Every rank holds what rank 0 saved at step 5, not a fallback taken silently earlier.
        assert f"{prefix}RESTORED moved rank {rank} step 5 v [1.0, 2.0, 3.0]" in out, out[-3000:]
    assert "RESTORED eio" not in out and "RESTORED eisdir" not in out


DAMAGED = r"""
import os
import numpy as np
import tensorflow as tf
import keras
import syncdp
from syncdp.checkpoint import MANIFEST, CheckpointManager, list_checkpoints
from syncdp.base.errors import CheckpointError
from syncdp.keras import CheckpointCallback

syncdp.init()
rank = syncdp.rank()
root = os.environ["CKPT_DIR"]

def flip(checkpoint):  # rank 0 alone touches the directory
    with open(os.path.join(checkpoint, "ckpt.data-00000-of-00001"), "r+b") as f:
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0xFF]))

def restore(case, call):
    try:
        step = call()
    except CheckpointError as e:
        print(f"CAUGHT {case} rank {rank}: {e}", flush=True)
    else:
        print(f"RESTORED {case} rank {rank} step {step} v {v.numpy().tolist()}", flush=True)

# 1. An intact step 1 and a damaged newest step 3, restored with max_to_keep=1.
directory = os.path.join(root, "manager")
v = tf.Variable([0.0, 0.0, 0.0])
writer = CheckpointManager(directory, max_to_keep=None, v=v)
for step in (1, 3):
    v.assign([float(step)] * 3)
    writer.save(step)
if rank == 0:
    flip(os.path.join(directory, "ckpt-00000003"))
v.assign([-1.0 - rank] * 3)  # different on every rank: each must get rank 0's step 1
manager = CheckpointManager(directory, max_to_keep=1, v=v)
restore("damaged", manager.restore)
v.assign([2.0] * 3)
manager.save(2)
if rank == 0:
    print("LEFT", sorted(os.listdir(directory)), flush=True)

# 2. The only checkpoint damaged: an error on every rank, then a fresh start when asked for.
if rank == 0:
    os.remove(os.path.join(directory, "ckpt-00000002", MANIFEST))
v.assign([10.0 + rank] * 3)
restore("none-intact", manager.restore)
restore("fresh", lambda: manager.restore(allow_fresh=True))

# 3. model.fit: epoch 3's checkpoint damaged resumes at epoch 2; all damaged raises.
class Probe(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.begin = [w.numpy() for w in self.model.weights]
        self.step = int(self.model.optimizer.iterations.numpy())
        self.epochs = {}
    def on_epoch_end(self, epoch, logs=None):
        self.epochs[epoch] = [w.numpy() for w in self.model.weights]

def fit(epochs=3):
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=False)
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    callback, probe = CheckpointCallback(os.path.join(root, "fit"), max_to_keep=3), Probe()
    model.fit(x, x.sum(axis=1, keepdims=True), batch_size=16, epochs=epochs, shuffle=False,
              verbose=0, callbacks=[callback, probe])
    return callback, probe

_, first = fit()  # checkpoints of steps 2, 4, 6 (2 batches an epoch)
if rank == 0:
    flip(os.path.join(root, "fit", "ckpt-00000006"))
callback, probe = fit()
same = all(np.array_equal(a, b) for a, b in zip(probe.begin, first.epochs[1]))
print(f"KERAS resumed rank {rank} at epoch {callback.initial_epoch} step {probe.step} "
      f"with epoch 2's weights {same}", flush=True)
if rank == 0:
    for _, path in list_checkpoints(os.path.join(root, "fit")):
        flip(path)
try:
    fit()
except CheckpointError as e:
    print(f"KERAS CAUGHT rank {rank}: {e}", flush=True)
"""


@pytest.mark.parametrize("np_", [2, 3], ids=["np2", "np3"])
def test_damaged_checkpoints_are_reported_and_raised_on_every_rank(tmp_path, np_):
    script = python_script(tmp_path, DAMAGED)
    directory = tmp_path / "ckpt" / "manager"
    fit = tmp_path / "ckpt" / "fit"
    env = {"CKPT_DIR": str(tmp_path / "ckpt")}
    done = check(launch(np_, "python", script, env=env, timeout=300))
    out, err = done.stdout, done.stderr
    seen = out[-3000:] + err[-3000:]
    data = "ckpt.data-00000-of-00001"
    for rank in range(np_):
        say, warn = f"[{rank}]<stdout>:", f"[{rank}]<stderr>:syncdp: warning: checkpoint "
        # 1. Every rank warns, and holds rank 0's step 1.
        line = (
            f"{warn}{directory}/ckpt-00000003 is damaged ({directory}/ckpt-00000003/{data} does "
            f"not match its SHA-256 in syncdp-checkpoint.json); rank 0 moved it to "
            f"{directory}/ckpt-00000003.damaged, kept for inspection"
        )
        assert line in err, seen
        assert f"{say}RESTORED damaged rank {rank} step 1 v [1.0, 1.0, 1.0]\n" in out, seen
        # 2. Every rank raises, naming the checkpoint and its damage; then starts fresh.
        caught = (
            f"{say}CAUGHT none-intact rank {rank}: restore() resumes only from an intact "
            f"checkpoint, and the only checkpoint (ckpt-00000002) in {directory} is damaged: "
            f"{directory}/ckpt-00000002 has no syncdp-checkpoint.json. Nothing was moved or "
            "deleted."
        )
        assert caught in out, seen
        assert f"{warn}{directory}/ckpt-00000002 is damaged (" in err, seen
        assert f"{say}RESTORED fresh rank {rank} step 0 v [10.0, 10.0, 10.0]\n" in out, seen
        # 3. model.fit resumes at epoch 2 with what step 4 holds, or raises on every rank.
        assert (
            f"{say}KERAS resumed rank {rank} at epoch 2 step 4 with epoch 2's weights True" in out
        )
        assert f"{warn}{fit}/ckpt-00000006 is damaged (" in err, seen
        assert f"{say}KERAS CAUGHT rank {rank}: restore() resumes only from an intact " in out
    assert "[0]<stdout>:LEFT ['ckpt-00000002', 'ckpt-00000003.damaged']\n" in out, seen
    assert "RESTORED none-intact" not in out
    assert sorted(os.listdir(directory)) == ["ckpt-00000002.damaged", "ckpt-00000003.damaged"]
    assert sorted(os.listdir(fit)) == [
        "ckpt-00000002",
        "ckpt-00000004",
        "ckpt-00000006",
        "ckpt-00000006.damaged",
    ]


def _rank0(result, word: str) -> str:
    match = re.search(rf"\[0\]<stdout>:{word} (.*)", result.stdout)
    assert match, result.stdout[-3000:] + result.stderr[-3000:]
    return match.group(1)


def test_crash_resume_and_interrupted_save_match_an_uninterrupted_run(tmp_path):
    script = python_script(tmp_path, TRAIN)
    directory = tmp_path / "ckpt"
    env = {"CKPT_DIR": str(directory)}

    # 1. Rank 1 crashes at step 25, after the checkpoints of steps 10 and 20.
    crashed = launch(2, "python", script, env={**env, "CRASH_STEP": "25"}, timeout=300)
    assert crashed.returncode != 0
    assert _rank0(crashed, "RESTORED") == "0"
    last = crashed.stderr.strip().splitlines()[-1]
    assert "first failure: rank 1 " in last, last  # the launcher names the rank first
    assert "failed with RuntimeError: rank 1 crashes at step 25" in last, last
    assert sorted(os.listdir(directory)) == ["ckpt-00000010", "ckpt-00000020"]

    # 2. Resumed at 20; rank 0 dies inside the save of step 30, before the rename.
    interrupted = launch(2, "python", script, env={**env, "INTERRUPT_SAVE": "30"}, timeout=300)
    assert interrupted.returncode != 0
    assert _rank0(interrupted, "RESTORED") == "20"
    assert "KILLED MID-SAVE" in interrupted.stdout
    left = sorted(os.listdir(directory))
    assert "ckpt-00000030" not in left
    assert any(n.startswith(".ckpt-00000030.tmp-") for n in left), left

    # 3. The half-written step 30 is never restored: resume at 20 and finish.
    done = check(launch(2, "python", script, env=env, timeout=300))
    assert _rank0(done, "RESTORED") == "20"
    iterations, maxdiff = re.fullmatch(r"(\d+) MAXDIFF (\S+)", _rank0(done, "ITERATIONS")).groups()
    assert iterations == "40"  # Adam's step count restored too
    assert float(maxdiff) <= 1e-6
    assert sorted(os.listdir(directory)) == ["ckpt-00000020", "ckpt-00000030", "ckpt-00000040"]


def test_keras_callback_resumes_fit_at_the_right_epoch(tmp_path):
    script = python_script(tmp_path, FIT)
    env = {"CKPT_DIR": str(tmp_path / "ckpt")}
    crashed = launch(2, "python", script, env={**env, "CRASH_EPOCH": "3"}, timeout=300)
    assert crashed.returncode != 0
    assert "rank 1 crashes at epoch 3" in crashed.stderr
    done = check(launch(2, "python", script, env=env, timeout=300))
    assert _rank0(done, "INITIAL_EPOCH") == "3"
    iterations, maxdiff = re.fullmatch(r"(\d+) MAXDIFF (\S+)", _rank0(done, "ITERATIONS")).groups()
    assert iterations == "20"  # 5 epochs of 4 batches
    assert float(maxdiff) <= 1e-6
