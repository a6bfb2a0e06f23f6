"""Rank 0's side of CheckpointManager in one process: atomic writes, listing, pruning.

These call the manager's rank-0 steps (``_write``, ``_read_newest``) directly, without MPI;
the collective parts are covered end to end by tests/integration/test_checkpoint.py.
"""

import ast
import errno
import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import syncdp.checkpoint
from syncdp.checkpoint import MANIFEST, CheckpointManager, list_checkpoints
from syncdp.core.errors import CheckpointError
from tests.launcher import rank_env


def _manager(directory, value=1.0, max_to_keep=3):
    v = tf.Variable([value, value])
    return CheckpointManager(directory, max_to_keep=max_to_keep, v=v), v


def test_write_is_complete_and_listed(tmp_path):
    manager, v = _manager(tmp_path)
    path = manager._write(10, {"epoch": 2})
    assert list_checkpoints(tmp_path) == [(10, path)]
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []
    manifest = json.loads((tmp_path / "ckpt-00000010" / MANIFEST).read_text())
    assert manifest["step"] == 10 and manifest["metadata"] == {"epoch": 2}
    v.assign([5.0, 5.0])
    assert manager._read_newest() == (10, {"epoch": 2}, None)
    np.testing.assert_array_equal(v.numpy(), [1.0, 1.0])


def test_a_crash_before_the_rename_leaves_nothing_restorable(tmp_path, monkeypatch):
    manager, v = _manager(tmp_path)
    manager._write(10, {})
    v.assign([2.0, 2.0])

    def crash(src, dst):
        raise KeyboardInterrupt("the process dies here")

    monkeypatch.setattr(os, "rename", crash)
    with pytest.raises(KeyboardInterrupt):
        manager._write(20, {})
    monkeypatch.undo()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [10]
    assert manager._read_newest()[0] == 10
    np.testing.assert_array_equal(v.numpy(), [1.0, 1.0])


def test_a_leftover_temporary_directory_is_ignored_and_removed(tmp_path):
    manager, v = _manager(tmp_path)
    manager._write(10, {})
    # What a save killed mid-write leaves: files and even a manifest, but never renamed.
    temp = tmp_path / ".ckpt-00000020.tmp-123-456"
    temp.mkdir()
    (temp / "ckpt.index").write_bytes(b"partial")
    (temp / MANIFEST).write_text('{"step": 20, "files": {}}')
    assert [s for s, _ in list_checkpoints(tmp_path)] == [10]
    assert manager._read_newest()[0] == 10
    assert not temp.exists()


def _data_file(checkpoint: str) -> str:
    return os.path.join(checkpoint, next(n for n in os.listdir(checkpoint) if "data" in n))


def _flip_first_byte(file):
    with open(file, "r+b") as f:
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0xFF]))


def _truncate(file):
    os.truncate(file, os.path.getsize(file) - 1)


@pytest.mark.parametrize(
    "damage, warning",
    [
        (_flip_first_byte, "does not match its SHA-256"),
        (_truncate, "bytes, not the"),
        (os.remove, "is missing"),
    ],
    ids=["flipped-byte", "truncated", "deleted"],
)
def test_a_damaged_checkpoint_is_skipped_for_the_previous_one(tmp_path, capsys, damage, warning):
    manager, v = _manager(tmp_path)
    manager._write(10, {})
    v.assign([3.0, 3.0])
    damage(_data_file(manager._write(20, {})))
    assert manager._read_newest() == (10, {}, None)
    assert warning in capsys.readouterr().err
    np.testing.assert_array_equal(v.numpy(), [1.0, 1.0])


def _directory_in_place(file):
    os.remove(file)
    os.mkdir(file)


def test_an_unreadable_file_is_an_error_not_a_fallback(tmp_path, capsys):
    manager, v = _manager(tmp_path)
    manager._write(10, {})
    v.assign([3.0, 3.0])
    data = _data_file(manager._write(20, {}))
    _directory_in_place(data)  # open() fails with EISDIR; as root, chmod 000 would not
    step, metadata, error = manager._read_newest()
    assert (step, metadata) == (0, {})
    assert f"Rank 0 could not read {data} to restore from {tmp_path}: Is a directory." in error
    assert "move its checkpoint directory out of" in error
    assert "skipping" not in capsys.readouterr().err
    np.testing.assert_array_equal(v.numpy(), [3.0, 3.0])  # step 10 was not restored


def test_an_io_error_while_hashing_names_the_file(tmp_path, monkeypatch):
    manager, v = _manager(tmp_path)
    manager._write(10, {})
    data = _data_file(manager._write(20, {}))

    def eio(file):
        raise OSError(errno.EIO, os.strerror(errno.EIO))  # as read() raises it: no file name

    monkeypatch.setattr(syncdp.checkpoint, "_sha256", eio)
    _, _, error = manager._read_newest()
    assert f"Rank 0 could not read {data} " in error
    assert os.strerror(errno.EIO) in error


def test_a_directory_that_cannot_be_listed_is_an_error(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    manager, _ = _manager(tmp_path / "file")
    _, _, error = manager._read_newest()
    assert f"Rank 0 could not read {tmp_path / 'file'} " in error
    assert os.strerror(errno.ENOTDIR) in error


def test_only_the_newest_are_kept(tmp_path):
    manager, _ = _manager(tmp_path, max_to_keep=2)
    for step in (10, 20, 30):
        manager._write(step, {})
    assert [s for s, _ in list_checkpoints(tmp_path)] == [20, 30]
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000020", "ckpt-00000030"]


def test_a_mismatched_checkpoint_is_reported(tmp_path):
    manager, _ = _manager(tmp_path)
    manager._write(10, {})
    other = CheckpointManager(tmp_path, w=tf.Variable(tf.zeros([3, 3])))
    step, _, error = other._read_newest()
    assert error and "does not match the objects given to CheckpointManager (w)" in error


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
