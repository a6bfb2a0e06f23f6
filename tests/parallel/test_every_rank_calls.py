"""Operations that run collectives of their own (a checkpoint's save and restore, adding and
removing a process set, verify_synchronized, shard_files' counting): every rank must call
them. A rank that skips one (the Horovod habit of ``if hvd.rank() == 0: save()``) or is in
another collective makes every rank raise MismatchError at once, naming where each rank is,
and the job goes on. Before, their first internal collective met the other ranks' collective
and paired with it: MPI_ERR_TRUNCATE on one rank, a wrong "step mismatch" on another, or a
wait until the stall timeout.
"""

import os
import pathlib
import re

import pytest
import tensorflow as tf

from syncdp.checkpoint import CheckpointManager


@pytest.fixture
def others_allreduce(hvd):
    """What the ranks other than 0 run instead: a gradient-sized allreduce."""
    if hvd.size() == 1:
        pytest.skip("one rank cannot skip a call the others make")
    return lambda: hvd.allreduce(tf.ones([2]), name="others.allreduce")


def _shards(hvd, directory):
    """One file of one record per rank (shard_files needs as many as there are ranks)."""
    paths = [str(directory / f"shard-{i}.tfrecord") for i in range(hvd.size())]
    for path in paths:
        if not os.path.exists(path):
            with tf.io.TFRecordWriter(path) as writer:
                writer.write(b"x")
    return paths


OPERATIONS = {
    "CheckpointManager.save": lambda hvd, directory: CheckpointManager(
        directory / "ck", v=tf.Variable([1.0])
    ).save(1),
    "CheckpointManager.restore": lambda hvd, directory: CheckpointManager(
        directory / "ck", v=tf.Variable([1.0])
    ).restore(allow_fresh=True),
    "add_process_set": lambda hvd, directory: hvd.add_process_set([0]),
    "verify_synchronized": lambda hvd, directory: hvd.verify_synchronized([tf.Variable([1.0])]),
    "shard_files.count_records": lambda hvd, directory: hvd.data.shard_files(
        _shards(hvd, directory)
    ),
}


@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_an_operation_only_rank_0_calls_raises_on_every_rank(
    hvd, tmp_path, others_allreduce, operation
):
    r, n = hvd.rank(), hvd.size()
    shared = pathlib.Path(hvd.broadcast_object(str(tmp_path)))  # rank 0's, on this one host
    if r == 0:
        _shards(hvd, shared)
    hvd.barrier()
    with pytest.raises(hvd.MismatchError) as info:
        if r == 0:
            OPERATIONS[operation](hvd, shared)
        else:
            others_allreduce()
    message = str(info.value)
    assert re.search(f"rank 0 in {operation}[;( ]", message), message
    for other in range(1, n):
        assert f"rank {other} in others.allreduce" in message, message
    assert "if rank() == 0:" in message
    # The job goes on: the operation works when every rank makes it.
    assert hvd.allreduce(tf.ones([1]), op=hvd.Sum).numpy()[0] == n
    if operation == "add_process_set":
        hvd.remove_process_set(hvd.add_process_set([0]))
    else:
        OPERATIONS[operation](hvd, shared)


def test_removing_a_process_set_on_one_rank_only_raises_on_every_rank(hvd, others_allreduce):
    ps = hvd.add_process_set([0])
    with pytest.raises(
        hvd.MismatchError,
        match=r"rank 0 in remove_process_set \(ranks=\[0\], process_set_id=\d+\);",
    ):
        hvd.remove_process_set(ps) if hvd.rank() == 0 else others_allreduce()
    assert hvd.remove_process_set(ps)


def test_a_save_of_different_steps_raises_on_every_rank(hvd, tmp_path):
    if hvd.size() == 1:
        pytest.skip("one rank cannot pass another step than itself")
    manager = CheckpointManager(tmp_path / "ck", v=tf.Variable([1.0]))
    with pytest.raises(hvd.MismatchError) as info:
        manager.save(10 + hvd.rank())
    assert "CheckpointManager.save: ranks passed different step" in str(info.value)
    assert "rank 0: step=10; rank 1: step=11" in str(info.value)
    # Nothing was written, and a save at one step works.
    assert not (tmp_path / "ck").exists() or not list((tmp_path / "ck").iterdir())
    written = manager.save(12)
    if hvd.rank() == 0:
        assert written.endswith("ckpt-00000012")
    else:
        assert written is None
