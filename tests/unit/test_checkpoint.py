"""CheckpointManager and CheckpointCallback in one process: atomic writes, listing, pruning,
damaged checkpoints.

A checkpoint of step ``s`` here holds the variable ``[s, s]``, so which state a restore brings
back follows from which step it restores: no stored output is needed. The collective parts at
several ranks are covered by tests/integration/test_checkpoint.py.
"""

import ast
import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import syncdp
import syncdp.checkpoint
from syncdp.base.errors import CheckpointError
from syncdp.checkpoint import MANIFEST, CheckpointManager, list_checkpoints
from syncdp.keras import CheckpointCallback
from tests.launcher import rank_env

DATA = "ckpt.data-00000-of-00001"


@pytest.fixture(scope="module", autouse=True)
def _init():
    syncdp.init()


def _manager(directory, value=1.0, max_to_keep=3):
    v = tf.Variable([value, value])
    return CheckpointManager(directory, max_to_keep=max_to_keep, v=v), v


def _save_steps(directory, steps, max_to_keep=None):
    """Saves a checkpoint of each step, holding ``[step, step]``."""
    manager, v = _manager(directory, max_to_keep=max_to_keep)
    for step in steps:
        v.assign([step, step])
        manager.save(step)


def _steps(directory) -> list[int]:
    return [step for step, _ in list_checkpoints(directory)]


def _flip_first_byte(checkpoint):
    with open(os.path.join(checkpoint, DATA), "r+b") as f:
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0xFF]))


def _truncate(checkpoint):
    file = os.path.join(checkpoint, DATA)
    os.truncate(file, os.path.getsize(file) - 1)


def _remove_data(checkpoint):
    os.remove(os.path.join(checkpoint, DATA))


def _remove_manifest(checkpoint):
    os.remove(os.path.join(checkpoint, MANIFEST))


# Each damage and the words of the warning that names it (after the checkpoint's path).
DAMAGES = [
    pytest.param(_flip_first_byte, f"/{DATA} does not match its SHA-256 in {MANIFEST}", id="flip"),
    pytest.param(_truncate, f"/{DATA} has ", id="truncated"),
    pytest.param(_remove_data, f"/{DATA} is missing", id="missing-file"),
    pytest.param(_remove_manifest, f" has no {MANIFEST}", id="missing-manifest"),
]


def _moved_aside(directory, step, words) -> str:
    """The warning every rank prints when rank 0 moved the checkpoint of ``step`` aside."""
    path = os.path.join(directory, f"ckpt-{step:08d}")
    return f"syncdp: warning: checkpoint {path} is damaged ({path}{words}"


@pytest.mark.parametrize("max_to_keep", [1, 3])
@pytest.mark.parametrize("damage, words", DAMAGES)
def test_a_damaged_newest_checkpoint_is_moved_aside_and_costs_no_progress(
    tmp_path, capsys, damage, words, max_to_keep
):
    # The directory: an intact step 1, a damaged newest step 3.
    _save_steps(tmp_path, [1, 3])
    damage(tmp_path / "ckpt-00000003")
    capsys.readouterr()

    manager, v = _manager(tmp_path, value=-1.0, max_to_keep=max_to_keep)
    assert manager.restore() == 1
    np.testing.assert_array_equal(v.numpy(), [1.0, 1.0])
    err = capsys.readouterr().err
    assert _moved_aside(tmp_path, 3, words) in err, err
    assert f"rank 0 moved it to {tmp_path}/ckpt-00000003.damaged, kept for inspection" in err
    assert _steps(tmp_path) == [1]
    assert (tmp_path / "ckpt-00000003.damaged").is_dir()

    v.assign([2.0, 2.0])
    assert manager.save(2) == str(tmp_path / "ckpt-00000002")
    assert _steps(tmp_path) == ([2] if max_to_keep == 1 else [1, 2])

    # The next job resumes at 2, and the saves after it are kept; so is the damaged one.
    manager, v = _manager(tmp_path, value=-1.0, max_to_keep=max_to_keep)
    assert manager.restore() == 2
    np.testing.assert_array_equal(v.numpy(), [2.0, 2.0])
    for step in (3, 4, 5):
        v.assign([step, step])
        manager.save(step)
    assert _steps(tmp_path) == ([5] if max_to_keep == 1 else [3, 4, 5])
    assert "warning" not in capsys.readouterr().err
    assert (tmp_path / "ckpt-00000003.damaged").is_dir()
    manager, v = _manager(tmp_path, value=-1.0, max_to_keep=max_to_keep)
    assert manager.restore() == 5
    np.testing.assert_array_equal(v.numpy(), [5.0, 5.0])


@pytest.mark.parametrize("max_to_keep", [1, 3])
@pytest.mark.parametrize("damage, words", DAMAGES)
def test_pruning_moves_a_damaged_newer_checkpoint_aside_instead_of_keeping_it(
    tmp_path, capsys, damage, words, max_to_keep
):
    _save_steps(tmp_path, [1, 3])
    damage(tmp_path / "ckpt-00000003")
    capsys.readouterr()
    # A job that saves without restoring first: the count meets the damaged step 3.
    manager, v = _manager(tmp_path, value=2.0, max_to_keep=max_to_keep)
    manager.save(2)
    assert _moved_aside(tmp_path, 3, words) in capsys.readouterr().err
    assert _steps(tmp_path) == ([2] if max_to_keep == 1 else [1, 2])
    manager, v = _manager(tmp_path, value=-1.0)
    assert manager.restore() == 2
    np.testing.assert_array_equal(v.numpy(), [2.0, 2.0])


@pytest.mark.parametrize("max_to_keep", [1, 3])
@pytest.mark.parametrize("damage, words", DAMAGES)
def test_a_damaged_older_checkpoint_takes_no_place(tmp_path, capsys, damage, words, max_to_keep):
    _save_steps(tmp_path, [1, 2, 3])
    damage(tmp_path / "ckpt-00000002")
    capsys.readouterr()
    manager, v = _manager(tmp_path, value=-1.0, max_to_keep=max_to_keep)
    assert manager.restore() == 3  # step 2 is not read
    np.testing.assert_array_equal(v.numpy(), [3.0, 3.0])
    v.assign([4.0, 4.0])
    manager.save(4)
    err = capsys.readouterr().err
    if max_to_keep == 1:  # past max_to_keep: deleted unread, like any old checkpoint
        assert _steps(tmp_path) == [4] and "warning" not in err
        assert sorted(os.listdir(tmp_path)) == ["ckpt-00000004"]
    else:  # counted in turn: moved aside, and step 1 keeps its place
        assert _moved_aside(tmp_path, 2, words) in err
        assert _steps(tmp_path) == [1, 3, 4]
        assert (tmp_path / "ckpt-00000002.damaged").is_dir()


@pytest.mark.parametrize("damage, words", DAMAGES)
def test_no_intact_checkpoint_raises_unless_a_fresh_start_is_asked_for(
    tmp_path, capsys, damage, words
):
    _save_steps(tmp_path, [1, 3])
    damage(tmp_path / "ckpt-00000001")
    damage(tmp_path / "ckpt-00000003")
    before = sorted(os.listdir(tmp_path))
    capsys.readouterr()

    manager, v = _manager(tmp_path, value=-1.0, max_to_keep=1)
    with pytest.raises(CheckpointError) as raised:
        manager.restore()
    message = str(raised.value)
    assert message.startswith(
        "restore() resumes only from an intact checkpoint, and each of the 2 checkpoints "
        f"(ckpt-00000001, ckpt-00000003) in {tmp_path} is damaged: {tmp_path}/ckpt-00000003"
    ), message
    for step in (1, 3):
        assert f"{tmp_path}/ckpt-{step:08d}{words}" in message
    assert "Nothing was moved or deleted." in message
    assert "pass allow_fresh=True to restore() (or to CheckpointCallback)" in message
    assert sorted(os.listdir(tmp_path)) == before
    np.testing.assert_array_equal(v.numpy(), [-1.0, -1.0])

    # Asked for: rank 0's current state, the damaged ones kept aside, new saves kept.
    assert manager.restore(allow_fresh=True) == 0
    np.testing.assert_array_equal(v.numpy(), [-1.0, -1.0])
    err = capsys.readouterr().err
    assert _moved_aside(tmp_path, 1, words) in err and _moved_aside(tmp_path, 3, words) in err
    assert "starting from step 0 with rank 0's current state, as restore(allow_fresh=True)" in err
    assert _steps(tmp_path) == []
    v.assign([1.0, 1.0])
    manager.save(1)
    assert sorted(os.listdir(tmp_path)) == [
        "ckpt-00000001",
        "ckpt-00000001.damaged",
        "ckpt-00000003.damaged",
    ]
    manager, v = _manager(tmp_path, value=-1.0)
    assert manager.restore() == 1
    np.testing.assert_array_equal(v.numpy(), [1.0, 1.0])


def test_a_step_damaged_twice_keeps_both_damaged_copies(tmp_path, capsys):
    for _ in range(2):
        _save_steps(tmp_path, [1, 3])
        _flip_first_byte(tmp_path / "ckpt-00000003")
        assert _manager(tmp_path)[0].restore() == 1
    assert sorted(os.listdir(tmp_path)) == [
        "ckpt-00000001",
        "ckpt-00000003.damaged",
        "ckpt-00000003.damaged-2",
    ]


@pytest.mark.parametrize(
    "manifest",
    ["{not json", "[]", "{}", '{"files": {}}', '{"files": {"ckpt.index": 3}}'],
    ids=["not-json", "a-list", "no-files", "no-index", "no-sizes"],
)
def test_a_manifest_that_does_not_list_the_files_is_damage(tmp_path, manifest):
    _save_steps(tmp_path, [1, 3])
    (tmp_path / "ckpt-00000003" / MANIFEST).write_text(manifest)
    manager, v = _manager(tmp_path, value=-1.0)
    assert manager.restore() == 1
    assert _steps(tmp_path) == [1]


def test_pruning_keeps_the_checkpoint_just_written_and_the_newest_intact_one(tmp_path):
    _save_steps(tmp_path, [5])
    # A job started over in the same directory, without restore(): its step 2 is kept, and so
    # is step 5, the newest intact one (one more than max_to_keep).
    manager, v = _manager(tmp_path, value=2.0, max_to_keep=1)
    assert manager.save(2) == str(tmp_path / "ckpt-00000002")
    assert _steps(tmp_path) == [2, 5]
    v.assign([3.0, 3.0])
    manager.save(3)
    assert _steps(tmp_path) == [3, 5]
    manager, v = _manager(tmp_path, value=-1.0)
    assert manager.restore() == 5
    np.testing.assert_array_equal(v.numpy(), [5.0, 5.0])


def test_only_the_newest_are_kept(tmp_path):
    _save_steps(tmp_path, [10, 20, 30], max_to_keep=2)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000020", "ckpt-00000030"]


def test_pruning_hashes_a_checkpoint_once(tmp_path, monkeypatch):
    _save_steps(tmp_path, [1, 2])
    checked = []
    real_check = syncdp.checkpoint._check
    monkeypatch.setattr(syncdp.checkpoint, "_check", lambda p: checked.append(p) or real_check(p))
    manager, v = _manager(tmp_path, max_to_keep=3)
    for step in (3, 4, 5):
        manager.save(step)
    # Steps 1 and 2 were written by another manager: hashed once each, the own ones never.
    assert sorted(os.path.basename(p) for p in checked) == ["ckpt-00000001", "ckpt-00000002"]
    assert _steps(tmp_path) == [3, 4, 5]


def test_saving_a_step_again_replaces_it(tmp_path):
    manager, v = _manager(tmp_path, value=5.0)
    manager.save(5)
    v.assign([6.0, 6.0])
    assert manager.save(5) == str(tmp_path / "ckpt-00000005")
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000005"]
    manager, v = _manager(tmp_path, value=-1.0)
    assert manager.restore() == 5
    np.testing.assert_array_equal(v.numpy(), [6.0, 6.0])


@pytest.mark.parametrize("new_one_arrived", [False, True], ids=["before", "after"])
def test_a_crash_while_replacing_a_step_keeps_one_of_the_two(tmp_path, new_one_arrived):
    _save_steps(tmp_path, [5])
    # What a save of step 5 killed between its two renames leaves, and one killed after them.
    (tmp_path / "ckpt-00000005").rename(tmp_path / ".ckpt-00000005.replaced-1-2")
    (tmp_path / ".ckpt-00000005.tmp-1-2").mkdir()
    if new_one_arrived:
        manager, v = _manager(tmp_path, value=6.0)
        manager._write(5, {})  # the new one, written by rank 0 alone
    manager, v = _manager(tmp_path, value=-1.0)
    assert manager.restore() == 5
    np.testing.assert_array_equal(v.numpy(), [6.0, 6.0] if new_one_arrived else [5.0, 5.0])
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000005"]


def test_a_restore_leaves_alone_a_save_still_under_way_in_another_process(tmp_path):
    # Another job saving into the same directory: it has set step 5's old checkpoint aside
    # and is writing step 7. A restore here must neither put step 5 back under it nor delete
    # its temporary directory. A crashed save's are cleaned up as before: its process gone,
    # a later process given its pid, or another host's (a restore there follows a lost rank 0,
    # whose checkpoint must come back).
    import socket

    from syncdp.checkpoint import _files

    _save_steps(tmp_path, [3, 5])
    host = socket.gethostname()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        ticks = _files._start_ticks(sleeper.pid)
        assert ticks
        owner = f"{host}@{sleeper.pid}.{ticks}"
        aside = tmp_path / f".ckpt-00000005.replaced-{owner}-1"
        (tmp_path / "ckpt-00000005").rename(aside)
        writing = tmp_path / f".ckpt-00000007.tmp-{owner}-1"
        crashed = [
            tmp_path / f".ckpt-00000009.tmp-{host}@{gone.pid}.{ticks}-1",
            tmp_path / f".ckpt-00000011.tmp-{host}@{sleeper.pid}.{ticks - 1}-1",  # pid reused
            tmp_path / f".ckpt-00000013.tmp-otherhost@{sleeper.pid}.{ticks}-1",
        ]
        for path in (writing, *crashed):
            path.mkdir()
        manager, v = _manager(tmp_path, value=-1.0)
        assert manager.restore() == 3  # step 5 is set aside by the other save
        assert aside.exists() and writing.exists()
        assert not any(path.exists() for path in crashed)
        assert not (tmp_path / "ckpt-00000005").exists()
    finally:
        sleeper.kill()
        sleeper.wait()
    # Once that process is gone, its save crashed: step 5 goes back in place.
    manager, v = _manager(tmp_path, value=-1.0)
    assert manager.restore() == 5
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000003", "ckpt-00000005"]
    # The owner a save writes into its names is the one a restore reads back.
    owner = _files._OWNER.search(f".ckpt-00000006.tmp-{_files._owner()}-7")
    assert (owner["host"], int(owner["pid"])) == (host, os.getpid())
    assert int(owner["ticks"]) == _files._start_ticks(os.getpid()) != 0


def test_a_failed_replace_puts_the_old_checkpoint_back(tmp_path, monkeypatch):
    _save_steps(tmp_path, [5])
    real_rename = os.rename

    def full_disk(src, dst):
        if ".tmp-" in os.fspath(src):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", full_disk)
    manager, v = _manager(tmp_path, value=6.0)
    with pytest.raises(CheckpointError, match="could not write the checkpoint of step 5"):
        manager.save(5)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000005"]
    manager, v = _manager(tmp_path, value=-1.0)
    assert manager.restore() == 5
    np.testing.assert_array_equal(v.numpy(), [5.0, 5.0])


def test_write_is_complete_and_listed(tmp_path):
    manager, v = _manager(tmp_path)
    path = manager.save(10, metadata={"epoch": 2})
    assert list_checkpoints(tmp_path) == [(10, path)]
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []
    manifest = json.loads((tmp_path / "ckpt-00000010" / MANIFEST).read_text())
    assert manifest["step"] == 10 and manifest["metadata"] == {"epoch": 2}
    v.assign([5.0, 5.0])
    assert manager.restore() == 10 and manager.metadata == {"epoch": 2}
    np.testing.assert_array_equal(v.numpy(), [1.0, 1.0])


def test_a_crash_before_the_rename_leaves_nothing_restorable(tmp_path, monkeypatch):
    manager, v = _manager(tmp_path)
    manager.save(10)
    v.assign([2.0, 2.0])

    def crash(src, dst):
        raise KeyboardInterrupt("the process dies here")

    monkeypatch.setattr(os, "rename", crash)
    with pytest.raises(KeyboardInterrupt):
        manager._write(20, {})
    monkeypatch.undo()
    assert _steps(tmp_path) == [10]
    assert manager.restore() == 10
    np.testing.assert_array_equal(v.numpy(), [1.0, 1.0])


def test_a_leftover_temporary_directory_is_ignored_and_removed(tmp_path):
    manager, v = _manager(tmp_path)
    manager.save(10)
    # What a save killed mid-write leaves: files and even a manifest, but never renamed.
    temp = tmp_path / ".ckpt-00000020.tmp-123-456"
    temp.mkdir()
    (temp / "ckpt.index").write_bytes(b"partial")
    (temp / MANIFEST).write_text('{"step": 20, "files": {}}')
    assert _steps(tmp_path) == [10]
    assert manager.restore() == 10
    assert not temp.exists()


def _directory_in_place(checkpoint):
    _remove_data(checkpoint)
    os.mkdir(os.path.join(checkpoint, DATA))


def test_an_unreadable_file_is_an_error_not_a_fallback(tmp_path, capsys):
    _save_steps(tmp_path, [10, 20])
    data = tmp_path / "ckpt-00000020" / DATA
    _directory_in_place(data.parent)  # open() fails with EISDIR; as root, chmod 000 would not
    manager, v = _manager(tmp_path, value=3.0)
    with pytest.raises(CheckpointError) as raised:
        manager.restore()
    assert f"Rank 0 could not read {data} to restore from {tmp_path}: Is a directory." in str(
        raised.value
    )
    assert "move its checkpoint directory out of" in str(raised.value)
    assert "warning" not in capsys.readouterr().err
    assert _steps(tmp_path) == [10, 20]  # nothing moved aside
    np.testing.assert_array_equal(v.numpy(), [3.0, 3.0])  # step 10 was not restored


def test_an_io_error_while_hashing_names_the_file(tmp_path, monkeypatch):
    _save_steps(tmp_path, [10, 20])

    def eio(file):
        raise OSError(errno.EIO, os.strerror(errno.EIO))  # as read() raises it: no file name

    monkeypatch.setattr(syncdp.checkpoint, "_sha256", eio)
    manager, _ = _manager(tmp_path)
    with pytest.raises(CheckpointError, match=os.strerror(errno.EIO)) as raised:
        manager.restore()
    assert f"Rank 0 could not read {tmp_path / 'ckpt-00000020' / DATA} " in str(raised.value)


def test_a_directory_that_cannot_be_listed_is_an_error(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    manager, _ = _manager(tmp_path / "file")
    with pytest.raises(CheckpointError, match=os.strerror(errno.ENOTDIR)) as raised:
        manager.restore()
    assert f"Rank 0 could not read {tmp_path / 'file'} " in str(raised.value)


def test_a_mismatched_checkpoint_is_reported(tmp_path):
    _save_steps(tmp_path, [10])
    other = CheckpointManager(tmp_path, w=tf.Variable(tf.zeros([3, 3])))
    with pytest.raises(CheckpointError, match=r"does not match the objects given to .* \(w\)"):
        other.restore()
    assert _steps(tmp_path) == [10]


def test_bad_arguments_say_what_to_do(tmp_path):
    with pytest.raises(CheckpointError, match="needs the objects to save"):
        CheckpointManager(tmp_path)
    with pytest.raises(CheckpointError, match="max_to_keep must be at least 1"):
        CheckpointManager(tmp_path, max_to_keep=0, v=tf.Variable(1.0))
    with pytest.raises(CheckpointError, match="got data=list"):
        CheckpointManager(tmp_path, data=[1, 2])._variables()
    assert list_checkpoints(tmp_path / "missing") == []


def test_models_and_optimizers_are_recognized_without_isinstance(tmp_path):
    with pytest.raises(CheckpointError, match="needs built models; model has no variables yet"):
        CheckpointManager(tmp_path, model=keras.Sequential([keras.layers.Dense(2)]))._variables()
    with pytest.raises(CheckpointError, match="The optimizer opt has no slot variables yet"):
        CheckpointManager(tmp_path, opt=keras.optimizers.Adam())._variables()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer = keras.optimizers.Adam()
    k = keras.Variable([1.0])
    variables = CheckpointManager(
        tmp_path, model=model, optimizer=optimizer, k=k, module=tf.Module()
    )._variables()
    # kernel and bias, Adam's iterations and learning rate, two slots per weight, k
    assert optimizer.built and len(variables) == 2 + 2 + 2 * 2 + 1
    assert variables[-1] is k


# --- through CheckpointCallback and model.fit ---------------------------------------------

BATCHES = 2  # per epoch: 32 samples in batches of 16


class _Probe(keras.callbacks.Callback):
    """Records the weights fit starts from (after the restore) and those of every epoch end."""

    def on_train_begin(self, logs=None):
        self.begin = [w.numpy().copy() for w in self.model.weights]
        self.begin_step = int(self.model.optimizer.iterations.numpy())
        self.epochs = {}

    def on_epoch_end(self, epoch, logs=None):
        self.epochs[epoch] = [w.numpy().copy() for w in self.model.weights]


def _fit(directory, epochs=3, **options):
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=False)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16 * BATCHES, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    callback, probe = CheckpointCallback(directory, **options), _Probe()
    model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[callback, probe])  # fmt: skip
    return callback, probe


@pytest.fixture(scope="module")
def three_epochs(tmp_path_factory):
    """A directory with the checkpoints of epochs 1, 2, 3 (steps 2, 4, 6) and what they hold."""
    directory = tmp_path_factory.mktemp("fit")
    _, probe = _fit(directory, max_to_keep=None)
    assert _steps(directory) == [BATCHES, 2 * BATCHES, 3 * BATCHES]
    return directory, probe


@pytest.mark.parametrize("max_to_keep", [1, 3])
@pytest.mark.parametrize("damage, words", DAMAGES)
def test_fit_resumes_after_a_damaged_newest_checkpoint(
    tmp_path, capsys, three_epochs, damage, words, max_to_keep
):
    template, first = three_epochs
    shutil.copytree(template, tmp_path, dirs_exist_ok=True)
    damage(tmp_path / f"ckpt-{3 * BATCHES:08d}")
    capsys.readouterr()
    callback, probe = _fit(tmp_path, max_to_keep=max_to_keep)
    # Resumed at epoch 2 with what the checkpoint of epoch 2 (step 4) holds ...
    assert callback.initial_epoch == 2 and probe.begin_step == 2 * BATCHES
    for restored, saved in zip(probe.begin, first.epochs[1], strict=True):
        np.testing.assert_array_equal(restored, saved)
    assert _moved_aside(tmp_path, 3 * BATCHES, words) in capsys.readouterr().err
    # ... and epoch 3 trained again from there, as in the uninterrupted run.
    for trained, expected in zip(probe.epochs[2], first.epochs[2], strict=True):
        np.testing.assert_allclose(trained, expected, rtol=0, atol=1e-6)
    assert _steps(tmp_path) == (
        [3 * BATCHES] if max_to_keep == 1 else [BATCHES, 2 * BATCHES, 3 * BATCHES]
    )
    assert (tmp_path / f"ckpt-{3 * BATCHES:08d}.damaged").is_dir()


@pytest.mark.parametrize("damage, words", DAMAGES)
def test_fit_with_no_intact_checkpoint_raises_unless_allowed_to_start_fresh(
    tmp_path, three_epochs, damage, words
):
    template, first = three_epochs
    shutil.copytree(template, tmp_path, dirs_exist_ok=True)
    for _, path in list_checkpoints(tmp_path):
        damage(path)
    with pytest.raises(CheckpointError, match="each of the 3 checkpoints .* pass allow_fresh=True"):
        _fit(tmp_path, epochs=1)
    assert _steps(tmp_path) == [BATCHES, 2 * BATCHES, 3 * BATCHES]
    callback, probe = _fit(tmp_path, epochs=1, allow_fresh=True, max_to_keep=1)
    assert callback.initial_epoch == 0 and probe.begin_step == 0
    for trained, expected in zip(probe.epochs[0], first.epochs[0], strict=True):
        np.testing.assert_allclose(trained, expected, rtol=0, atol=1e-6)
    assert _steps(tmp_path) == [BATCHES]


def test_the_core_manager_imports_no_keras(tmp_path):
    source = open(syncdp.checkpoint.__file__).read()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert "keras" not in imported
    # TensorFlow 2.21 imports Keras itself, so "keras" in sys.modules proves nothing. Making
    # Keras unimportable does (TensorFlow copes): the manager must still save and restore.
    script = textwrap.dedent(
        """
        import sys
        sys.modules["keras"] = None
        import tensorflow as tf
        import syncdp
        from syncdp.checkpoint import CheckpointManager
        syncdp.init()
        module = tf.Module()
        module.w = tf.Variable([1.0, 2.0])
        manager = CheckpointManager(sys.argv[1], module=module, v=tf.Variable(3.0))
        manager.save(4)
        module.w.assign([0.0, 0.0])
        assert manager.restore() == 4
        assert module.w.numpy().tolist() == [1.0, 2.0], module.w.numpy()
        assert "syncdp.keras" not in sys.modules
        print("SAVED AND RESTORED WITHOUT KERAS")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        env=rank_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "SAVED AND RESTORED WITHOUT KERAS" in result.stdout


@pytest.mark.parametrize("legacy", [False, True], ids=["current", "legacy"])
def test_a_plain_keras2_optimizer_is_saved_and_restored_with_its_slots(tmp_path, legacy):
    tf_keras = pytest.importorskip("tf_keras")
    model = tf_keras.Sequential([tf_keras.Input((3,)), tf_keras.layers.Dense(2)])
    kind = tf_keras.optimizers.legacy if legacy else tf_keras.optimizers
    opt = kind.Adam(0.1)
    manager = CheckpointManager(str(tmp_path), model=model, optimizer=opt)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(np.ones((1, 3), "float32")))
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.weights))
    manager.save(1)
    variables = opt.variables() if legacy else opt.variables
    saved = [v.numpy().copy() for v in variables]
    assert len(saved) == 1 + 2 * 2  # the step count, then m and v of the kernel and the bias
    for v in variables:
        v.assign(tf.zeros_like(v))
    assert manager.restore() == 1
    for v, before in zip(variables, saved):
        np.testing.assert_array_equal(v.numpy(), before)
