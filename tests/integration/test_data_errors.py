"""Bad input data through the real launcher at np=2: a clear error naming the file, no hang.

Errors found before training (a missing file, a pattern matching nothing, a corrupt or
truncated file, a file that differs between the ranks' hosts, arguments that would give the
ranks overlapping records) are raised on every rank; left uncaught they end the job. Counting
a large input is I/O, not a stall: it may outlast the stall timeout. A corrupt record met
mid-epoch, while the other rank waits in an allreduce, ends the job too.
"""

import pytest

from syncdp.data import write_tfrecord_shards
from tests.launcher import check, launch, python_script

# Longer than any of these jobs should take, shorter than the stall timeout given to the
# launcher, so a job that ends did so because of the error, not because of the watchdog.
TIMEOUT = 150
LAUNCHER_ARGS = ("--stall-timeout", "400")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    good = write_tfrecord_shards(({"id": i} for i in range(80)), root / "good", 2)
    corrupt = write_tfrecord_shards(({"id": i} for i in range(40)), root / "corrupt", 1)[0]
    raw = bytearray(open(corrupt, "rb").read())
    record = len(raw) // 40
    bad_crc = bytearray(raw)
    bad_crc[10 * record + 14] ^= 0xFF  # a payload byte of record 10
    (root / "bad_crc.tfrecord").write_bytes(bytes(bad_crc))
    (root / "truncated.tfrecord").write_bytes(bytes(raw[: 25 * record + 7]))
    bad_length = bytearray(raw)
    bad_length[3 * record + 2] ^= 0x40  # a bit of record 3's length field
    (root / "bad_length.tfrecord").write_bytes(bytes(bad_length))
    # Each host's own copy of the data, under the same names: rank 1's first file is shorter.
    for rank, first in ((0, 20), (1, 5)):
        write_tfrecord_shards(({"id": i} for i in range(first)), root / f"host{rank}" / "a", 1)
        write_tfrecord_shards(({"id": i} for i in range(20)), root / f"host{rank}" / "b", 1)
    return {"root": str(root), "good": good}


CAUGHT = """
import os
import sys

import syncdp
from syncdp.data import shard_files, tfrecord_dataset

syncdp.init()
root, good = sys.argv[1], sys.argv[2:]
here = os.getcwd()


def on_own_copy():  # the same relative names, each rank in its own host's directory
    os.chdir(f"{root}/host{syncdp.rank()}")
    try:
        return tfrecord_dataset(["a/shard-00000-of-00001.tfrecord",
                                 "b/shard-00000-of-00001.tfrecord"], None, 4)
    finally:
        os.chdir(here)


cases = {
    "missing": lambda: tfrecord_dataset(good + [root + "/missing.tfrecord"], None, 4),
    "glob": lambda: tfrecord_dataset(root + "/nothing-*.tfrecord", None, 4),
    "bad_crc": lambda: tfrecord_dataset(good + [root + "/bad_crc.tfrecord"], None, 4),
    "truncated": lambda: tfrecord_dataset(good + [root + "/truncated.tfrecord"], None, 4),
    "bad_length": lambda: tfrecord_dataset(good + [root + "/bad_length.tfrecord"], None, 4,
                                           verify=False),
    "few_files": lambda: tfrecord_dataset(good[:1], None, 4, shard_by="files"),
    "shard_files_missing": lambda: shard_files(good + [root + "/missing.tfrecord"]),
    "through_a_file": lambda: tfrecord_dataset(good + [good[0] + "/x.tfrecord"], None, 4),
    "own_copies": on_own_copy,
    # A per-rank seed (a common habit) would give the ranks different file assignments.
    "seed_per_rank": lambda: tfrecord_dataset(good, None, 4, shuffle_buffer=8,
                                              seed=syncdp.rank()),
    "epoch_per_rank": lambda: tfrecord_dataset(good, None, 4, shuffle_buffer=8,
                                               epoch=syncdp.rank()),
    "shard_files_seed": lambda: shard_files(good, seed=syncdp.rank()),
}
for name, make in cases.items():
    try:
        make()
        print(f"CASE {name} rank {syncdp.rank()}: no error", flush=True)
    except (syncdp.DataError, syncdp.MismatchError) as error:
        text = str(error).replace(chr(10), " | ")
        print(f"CASE {name} rank {syncdp.rank()}: {type(error).__name__}: {text}", flush=True)
syncdp.barrier()
"""

EXPECTED = {
    "missing": "missing.tfrecord: no such file",
    "glob": "nothing-*.tfrecord' matches no files",
    "bad_crc": "bad_crc.tfrecord: corrupt TFRecord file (corrupted record at",
    "truncated": "truncated.tfrecord: truncated TFRecord file: record 25",
    "bad_length": "bad_length.tfrecord: corrupt TFRecord file: record 3 ",
    "few_files": "got 1 files for 2 ranks",
    "shard_files_missing": "missing.tfrecord: no such file",
    "through_a_file": "x.tfrecord: cannot be read (Not a directory)",
    "own_copies": "a/shard-00000-of-00001.tfrecord: not the same file on every rank (rank 0: ",
    "seed_per_rank": "ranks passed different file_seed (rank 0: file_seed=0; rank 1: file_seed=1)",
    "epoch_per_rank": "ranks passed different epoch (rank 0: epoch=0; rank 1: epoch=1)",
    "shard_files_seed": "ranks passed different seed (rank 0: seed=0; rank 1: seed=1)",
}
# Arguments that differ between ranks are a MismatchError; bad files a DataError.
MISMATCHES = {"seed_per_rank", "epoch_per_rank", "shard_files_seed"}


def test_every_bad_input_raises_a_clear_error_on_every_rank(data, tmp_path):
    script = python_script(tmp_path, CAUGHT)
    result = check(
        launch(
            2,
            "python",
            script,
            data["root"],
            *data["good"],
            timeout=TIMEOUT,
            launcher_args=LAUNCHER_ARGS,
        )
    )
    for name, words in EXPECTED.items():
        for rank in range(2):
            lines = [
                line for line in result.stdout.splitlines() if f"CASE {name} rank {rank}:" in line
            ]
            assert len(lines) == 1, (name, rank, result.stdout[-3000:])
            kind = "MismatchError" if name in MISMATCHES else "DataError"
            assert f": {kind}: " in lines[0] and words in lines[0], lines[0]


UNCAUGHT = """
import sys

import syncdp
import tensorflow as tf
from syncdp.data import tfrecord_dataset

syncdp.init()
files, verify = sys.argv[2:], sys.argv[1] == "verify"
dataset = tfrecord_dataset(files, None, 4, verify=verify)
print(f"rank {syncdp.rank()}: {int(dataset.cardinality())} steps", flush=True)
for step, batch in enumerate(dataset):
    total = syncdp.allreduce(tf.strings.length(batch), op=syncdp.Sum)
print(f"rank {syncdp.rank()}: finished {step + 1} steps", flush=True)
"""


@pytest.mark.parametrize(
    "case, verify, words",
    [
        ("missing.tfrecord", "verify", "DataError: tfrecord_dataset: 1 bad input file(s):"),
        ("bad_crc.tfrecord", "verify", "DataError: tfrecord_dataset: 1 bad input file(s):"),
        # Not checked up front: rank 0's reader meets the corrupt record after 10 records, while
        # rank 1 is inside an allreduce waiting for it.
        ("bad_crc.tfrecord", "no-verify", "DataLossError"),
    ],
)
def test_a_bad_input_left_uncaught_ends_the_job(data, tmp_path, case, verify, words):
    script = python_script(tmp_path, UNCAUGHT)
    files = [f"{data['root']}/{case}", data["good"][0]]
    result = launch(
        2, "python", script, verify, *files, timeout=TIMEOUT, launcher_args=LAUNCHER_ARGS
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert words in output, output[-3000:]
    assert case in output or verify == "no-verify", output[-3000:]
    assert "finished" not in output
    assert "syncdp: rank" in output and "ending the job" in output


SLOW_COUNT = """
import sys
import time

import syncdp
from syncdp.data import _sharding, tfrecord_dataset

syncdp.init()
count_one = _sharding._count_one


def slow(*args, **kwargs):  # rank 0's disk is slow: its share takes longer than the stall timeout
    time.sleep(6)
    return count_one(*args, **kwargs)


if syncdp.rank() == 0:
    _sharding._count_one = slow
dataset = tfrecord_dataset(sys.argv[1:], None, 4)
print(f"rank {syncdp.rank()}: {int(dataset.cardinality())} steps", flush=True)
"""


def test_counting_records_may_outlast_the_stall_timeout(data, tmp_path):
    """Counting is I/O: a rank that counts a large share is not a stalled rank."""
    script = python_script(tmp_path, SLOW_COUNT)
    result = check(
        launch(
            2,
            "python",
            script,
            *data["good"],
            timeout=TIMEOUT,
            launcher_args=("--stall-timeout", "3"),
        )
    )
    for rank in range(2):
        assert f"rank {rank}: 10 steps" in result.stdout, result.stdout[
            -3000:
        ]  # 80 records / 2 / 4
