"""syncdp.data in one process: the record counter, the balancing, the plan, the shard writer."""

import os

import numpy as np
import pytest
import tensorflow as tf

from syncdp import DataError
from syncdp.data import count_records, write_tfrecord_shards
from syncdp.data._dataset import _plan
from syncdp.data._sharding import _assign, _resolve_files
from syncdp.data._tfrecord import _masked_crc32c


def _write_raw(path, payloads):
    with tf.io.TFRecordWriter(str(path)) as writer:
        for payload in payloads:
            writer.write(payload)
    return str(path)


def _offsets(payloads):
    """Byte offset of each record: 12 header bytes, the payload, 4 checksum bytes."""
    return np.concatenate([[0], np.cumsum([16 + len(p) for p in payloads])]).tolist()


PAYLOADS = [b"", b"a", b"x" * 300, b"\x00" * 7, b"last record"]


def test_crc32c_matches_the_standard_check_value():
    # CRC-32C("123456789") is 0xE3069283 (RFC 3720); TFRecord masks it by rotating right by 15
    # bits and adding 0xA282EAD8.
    crc = 0xE3069283
    masked = (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
    assert _masked_crc32c(b"123456789") == masked


def test_count_records_counts_from_headers(tmp_path):
    path = _write_raw(tmp_path / "a.tfrecord", PAYLOADS)
    assert count_records(path) == len(PAYLOADS)
    assert count_records(path, verify=True) == len(PAYLOADS)
    assert count_records(_write_raw(tmp_path / "empty.tfrecord", [])) == 0


def test_count_records_of_a_large_file_reads_only_headers(tmp_path):
    path = _write_raw(tmp_path / "big.tfrecord", [bytes(1 << 20)] * 8)
    assert count_records(path) == 8


def _write_compressed(path, compression: str) -> str:
    with tf.io.TFRecordWriter(str(path), options=compression) as writer:
        for payload in PAYLOADS:
            writer.write(payload)
    return str(path)


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB"])
def test_count_records_compressed(tmp_path, compression):
    path = _write_compressed(tmp_path / "c.tfrecord", compression)
    assert count_records(path, compression_type=compression) == len(PAYLOADS)


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB"])
def test_a_compressed_file_read_as_plain_names_its_compression(tmp_path, compression):
    path = _write_compressed(tmp_path / "c.tfrecord", compression)
    with pytest.raises(DataError, match=f"pass compression_type='{compression}' to read it"):
        count_records(path)


def test_count_records_rejects_a_missing_file(tmp_path):
    with pytest.raises(DataError, match="nope.tfrecord: no such file"):
        count_records(tmp_path / "nope.tfrecord")
    with pytest.raises(DataError, match="no such file"):
        count_records(tmp_path / "nope.tfrecord", compression_type="GZIP")


@pytest.mark.parametrize("cut", [3, 12 + 100, 16 + 300 - 1])
def test_count_records_rejects_a_truncated_file(tmp_path, cut):
    good = _write_raw(tmp_path / "good.tfrecord", PAYLOADS)
    data = open(good, "rb").read()
    end = _offsets(PAYLOADS)[2] + cut  # inside record 2 (300 bytes of payload)
    bad = tmp_path / "trunc.tfrecord"
    bad.write_bytes(data[:end])
    with pytest.raises(DataError, match=r"trunc\.tfrecord: truncated .* record 2 "):
        count_records(bad)


def test_count_records_rejects_a_bad_length_checksum(tmp_path):
    data = bytearray(open(_write_raw(tmp_path / "g.tfrecord", PAYLOADS), "rb").read())
    data[_offsets(PAYLOADS)[3] + 9] ^= 0x01  # a bit of record 3's length checksum
    bad = tmp_path / "bad.tfrecord"
    bad.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"bad\.tfrecord: corrupt .* record 3 .*length checksum"):
        count_records(bad)


def test_verify_finds_a_corrupt_payload(tmp_path):
    data = bytearray(open(_write_raw(tmp_path / "g.tfrecord", PAYLOADS), "rb").read())
    data[_offsets(PAYLOADS)[2] + 12 + 150] ^= 0xFF  # a payload byte of record 2
    bad = tmp_path / "bad.tfrecord"
    bad.write_bytes(bytes(data))
    assert count_records(bad) == len(PAYLOADS)  # headers alone cannot see it
    with pytest.raises(DataError, match=r"bad\.tfrecord: corrupt TFRecord file"):
        count_records(bad, verify=True)


def test_not_a_gzip_file_is_a_data_error(tmp_path):
    path = _write_raw(tmp_path / "plain.tfrecord", PAYLOADS)
    with pytest.raises(DataError, match="plain.tfrecord"):
        count_records(path, compression_type="GZIP")


def test_assign_balances_100_37_64_over_two_ranks():
    # Largest first: 100 -> rank 0, then 64 and 37 -> rank 1 (loads 100 and 101).
    assert _assign([100, 37, 64], 2) == [[0], [1, 2]]


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_assign_is_a_balanced_partition(size):
    rng = np.random.default_rng(size)
    for _ in range(20):
        weights = rng.integers(0, 1000, rng.integers(size, 30)).tolist()
        for seed, epoch in [(None, 0), (7, 0), (7, 3)]:
            groups = _assign(weights, size, seed=seed, epoch=epoch)
            assert sorted(i for g in groups for i in g) == list(range(len(weights)))
            assert all(groups), "every rank gets at least one file"
            loads = [sum(weights[i] for i in g) for g in groups]
            # Greedy onto the least loaded: the last item added to the fullest group went onto
            # the emptiest, so the spread is at most the largest weight.
            assert max(loads) - min(loads) <= max(weights)


def test_assign_with_a_seed_is_reproducible_and_moves_every_epoch():
    weights = [100, 37, 64, 80, 12, 55]
    assert _assign(weights, 2, seed=5, epoch=1) == _assign(weights, 2, seed=5, epoch=1)
    for epoch in range(5):
        now = _assign(weights, 2, seed=5, epoch=epoch)
        after = _assign(weights, 2, seed=5, epoch=epoch + 1)
        assert sorted(now[0]) != sorted(after[0])


def test_plan_files_mode_uses_balanced_counts():
    plan, note = _plan([100, 37, 64], 2, 8, "auto", seed=None, epoch=0)
    assert (plan.mode, plan.records, plan.steps, note) == ("files", [100, 101], 12, None)
    assert 2 * plan.steps * 8 >= 0.9 * 201


def test_plan_fewer_files_than_ranks():
    with pytest.raises(DataError, match="got 1 files for 2 ranks.*shard_by='records'"):
        _plan([50], 2, 4, "files", seed=None, epoch=0)
    plan, note = _plan([50], 2, 4, "auto", seed=None, epoch=0)
    assert (plan.mode, plan.records, plan.steps) == ("records", [25, 25], 6)
    assert "every 2-th record" in note


def test_plan_auto_splits_by_record_when_files_are_too_unequal():
    # By file: 100 vs 37 records -> 4 batches of 8 each; by record: 69 and 68 -> 8 each.
    plan, note = _plan([100, 37], 2, 8, "auto", seed=None, epoch=0)
    assert (plan.mode, plan.records, plan.steps) == ("records", [69, 68], 8)
    assert "too unequal" in note
    plan, _ = _plan([100, 37], 2, 8, "files", seed=None, epoch=0)
    assert (plan.mode, plan.steps) == ("files", 4)


def test_resolve_files(tmp_path):
    for name in ["b.tfrecord", "a.tfrecord"]:
        (tmp_path / name).write_bytes(b"")
    assert _resolve_files(str(tmp_path / "*.tfrecord"), "f") == [
        str(tmp_path / "a.tfrecord"),
        str(tmp_path / "b.tfrecord"),
    ]
    with pytest.raises(DataError, match="matches no files"):
        _resolve_files(str(tmp_path / "*.nothing"), "f")
    with pytest.raises(DataError, match="listed twice"):
        _resolve_files([str(tmp_path / "a.tfrecord"), str(tmp_path / "./a.tfrecord")], "f")
    with pytest.raises(DataError, match="at least one file"):
        _resolve_files([], "f")


def test_a_path_that_exists_is_never_read_as_a_pattern(tmp_path):
    # run[1]/ is a folder's real name; s[0].tfrecord a file's, beside s0.tfrecord, which the
    # same text read as a pattern would name instead (another file's records, silently).
    (tmp_path / "run[1]").mkdir()
    (tmp_path / "run[1]" / "part-0.tfrecord").write_bytes(b"")
    (tmp_path / "s[0].tfrecord").write_bytes(b"")
    (tmp_path / "s0.tfrecord").write_bytes(b"")
    named = [str(tmp_path / "run[1]" / "part-0.tfrecord"), str(tmp_path / "s[0].tfrecord")]
    assert _resolve_files(named, "f") == named
    # A pattern that names no file by itself is still one; escaped, it matches the literal name.
    assert _resolve_files(str(tmp_path / "s[0-9].tfrecord"), "f") == [str(tmp_path / "s0.tfrecord")]
    assert _resolve_files(str(tmp_path / "run[[]1]" / "*.tfrecord"), "f") == [named[0]]


def test_write_tfrecord_shards_round_robin(tmp_path):
    examples = (
        {
            "id": i,
            "x": np.arange(3, dtype=np.float32) + i,
            "name": f"n{i}",
            "raw": bytes([i]),
            "w": 0.5 * i,
            "m": np.ones((2, 2), np.int32),
        }
        for i in range(10)
    )
    paths = write_tfrecord_shards(examples, tmp_path / "out", 3)
    assert paths == [str(tmp_path / "out" / f"shard-0000{k}-of-00003.tfrecord") for k in range(3)]
    assert sorted(os.listdir(tmp_path / "out")) == [os.path.basename(p) for p in paths]
    spec = {
        "id": tf.io.FixedLenFeature([], tf.int64),
        "x": tf.io.FixedLenFeature([3], tf.float32),
        "name": tf.io.FixedLenFeature([], tf.string),
        "raw": tf.io.FixedLenFeature([], tf.string),
        "w": tf.io.FixedLenFeature([], tf.float32),
        "m": tf.io.FixedLenFeature([4], tf.int64),
    }
    for k, path in enumerate(paths):
        rows = [tf.io.parse_single_example(r, spec) for r in tf.data.TFRecordDataset(path)]
        ids = [int(r["id"]) for r in rows]
        assert ids == list(range(k, 10, 3))
        assert count_records(path) == len(ids)
        for i, row in zip(ids, rows, strict=True):
            np.testing.assert_array_equal(row["x"].numpy(), np.arange(3) + i)
            assert row["name"].numpy() == f"n{i}".encode()
            assert row["raw"].numpy() == bytes([i])
            assert row["w"].numpy() == pytest.approx(0.5 * i)
            assert row["m"].numpy().tolist() == [1, 1, 1, 1]


def test_write_tfrecord_shards_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="num_shards >= 1; got 0"):
        write_tfrecord_shards([], tmp_path, 0)
    with pytest.raises(DataError, match="feature 'bad' must be"):
        write_tfrecord_shards([{"bad": {"a": 1}}], tmp_path / "x", 2)
    assert os.listdir(tmp_path / "x") == []  # no partial shards are left behind
