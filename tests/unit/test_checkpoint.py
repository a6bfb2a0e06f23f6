"""Rank 0's side of CheckpointManager in one process: atomic writes, listing, pruning.

These call the manager's rank-0 steps (``_write``, ``_read_newest``) directly, without MPI;
the collective parts are covered end to end by tests/integration/test_checkpoint.py.
"""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

from syncdp._exceptions import CheckpointError
from syncdp.checkpoint import MANIFEST, CheckpointManager, list_checkpoints


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


def test_a_corrupt_checkpoint_is_skipped_for_the_previous_one(tmp_path, capsys):
    manager, v = _manager(tmp_path)
    manager._write(10, {})
    v.assign([3.0, 3.0])
    newest = manager._write(20, {})
    data = next(n for n in os.listdir(newest) if n.startswith("ckpt.data"))
    with open(os.path.join(newest, data), "r+b") as f:
        f.seek(0)
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert manager._read_newest()[0] == 10
    assert "does not match its SHA-256" in capsys.readouterr().err
    np.testing.assert_array_equal(v.numpy(), [1.0, 1.0])


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
