"""syncdp.data at any number of ranks: disjoint records, full coverage, equal step counts."""

import re
import shutil
import tempfile
import warnings

import numpy as np
import pytest
import tensorflow as tf

import syncdp
from syncdp import DataError
from syncdp.data import shard_files, tfrecord_dataset, write_tfrecord_shards

SPEC = {"id": tf.io.FixedLenFeature([], tf.int64)}


def parse_id(record):
    return tf.io.parse_single_example(record, SPEC)["id"]


def _write(directory, name, ids):
    """One shard holding the given record ids (written by rank 0 only)."""
    paths = write_tfrecord_shards(
        ({"id": i, "x": np.full(4, i, np.float32)} for i in ids), f"{directory}/{name}", 1
    )
    return paths[0]


@pytest.fixture(scope="module")
def data():
    """Shared files: 100/37/64-record shards, one 50-record file, six small shards, one bad."""
    hvd = syncdp
    directory = hvd.broadcast_object(tempfile.mkdtemp() if hvd.rank() == 0 else None)
    spans = {"a": range(0, 100), "b": range(100, 137), "c": range(137, 201)}
    paths = {name: f"{directory}/{name}/shard-00000-of-00001.tfrecord" for name in spans}
    single = f"{directory}/single/shard-00000-of-00001.tfrecord"
    six = [f"{directory}/six/shard-0000{k}-of-00006.tfrecord" for k in range(6)]
    corrupt = f"{directory}/corrupt/shard-00000-of-00001.tfrecord"
    if hvd.rank() == 0:
        for name, ids in spans.items():
            _write(directory, name, ids)
        _write(directory, "single", range(1000, 1050))
        write_tfrecord_shards(({"id": 2000 + i} for i in range(60)), f"{directory}/six", 6)
        _write(directory, "corrupt", range(3000, 3020))
        raw = bytearray(open(corrupt, "rb").read())
        record = len(raw) // 20
        raw[5 * record + 20] ^= 0xFF  # a payload byte of record 5: records 5..19 are lost
        open(corrupt, "wb").write(bytes(raw))
    hvd.barrier()
    yield {
        "dir": directory,
        "abc": [paths["a"], paths["b"], paths["c"]],
        "single": single,
        "six": six,
        "corrupt": corrupt,
        "good": [paths["a"], paths["c"]],
    }
    hvd.barrier()
    if hvd.rank() == 0:
        shutil.rmtree(directory)


def _epoch_ids(dataset):
    batches = [b.numpy() for b in dataset]
    return batches, (np.concatenate(batches) if batches else np.zeros(0, np.int64))


def _check_disjoint_equal(hvd, dataset, batch_size, expected_steps, universe):
    """Every rank yields ``expected_steps`` full batches, no id twice, all from ``universe``."""
    batches, ids = _epoch_ids(dataset)
    assert int(dataset.cardinality()) == expected_steps
    assert len(batches) == expected_steps
    assert all(len(b) == batch_size for b in batches)
    everyone = hvd.allgather_object(ids.tolist())
    assert [len(r) for r in everyone] == [expected_steps * batch_size] * hvd.size()
    flat = [i for r in everyone for i in r]
    assert len(flat) == len(set(flat)), "a record was read twice"
    assert set(flat) <= set(universe)
    return flat


def test_unequal_files_give_equal_steps_and_disjoint_records(hvd, data):
    size = hvd.size()
    # np=1: 201 records -> 25 batches of 8. np=2: files balanced to 100 and 37+64=101 records,
    # so 100 // 8 = 12 batches on each rank.
    expected = {1: 25, 2: 12}.get(size)
    dataset = tfrecord_dataset(data["abc"], parse_id, 8)
    if expected is None:
        expected = int(dataset.cardinality())
    used = _check_disjoint_equal(hvd, dataset, 8, expected, range(201))
    assert len(used) >= 0.9 * 201
    # A glob gives the same files (sorted), and a second pass gives the same batches.
    again = tfrecord_dataset(f"{data['dir']}/[abc]/*.tfrecord", parse_id, 8)
    assert [b.tolist() for b in _epoch_ids(again)[0]] == [
        b.tolist() for b in _epoch_ids(dataset)[0]
    ]


def test_shuffled_epochs_differ_but_stay_disjoint(hvd, data):
    size = hvd.size()
    orders = []
    for epoch in range(2):
        dataset = tfrecord_dataset(data["abc"], parse_id, 8, shuffle_buffer=50, seed=7, epoch=epoch)
        steps = int(dataset.cardinality())
        assert steps == {1: 25, 2: 12}.get(size, steps)
        orders.append(_check_disjoint_equal(hvd, dataset, 8, steps, range(201)))
    assert orders[0] != orders[1]


def test_per_epoch_file_reshuffle_agrees_across_ranks(hvd, data):
    size = hvd.size()
    assignments = []
    for epoch in range(3):
        mine = shard_files(data["six"], seed=11, epoch=epoch)
        everyone = hvd.allgather_object(mine)
        # Every rank computed the same assignment: the shares partition the files.
        flat = [p for share in everyone for p in share]
        assert sorted(flat) == sorted(data["six"])
        agreed = hvd.allgather_object(everyone)
        assert all(view == everyone for view in agreed)
        assignments.append(everyone)
    for before, after in zip(assignments, assignments[1:], strict=False):
        assert before != after
    # Without a seed the assignment is fixed and needs no record counts to agree.
    fixed = shard_files(data["six"])
    assert fixed == shard_files(data["six"], epoch=5)
    assert shard_files(data["six"], balance=False) == data["six"][hvd.rank() :: size]


def test_unbalanced_shard_files_checks_the_ranks_agree(hvd, data):
    # balance=False reads nothing, but ranks with another seed or epoch, or the files in
    # another order, would read some files twice and others never: refused on every rank.
    files = list(data["six"])
    mine = shard_files(files, balance=False, seed=3, epoch=1)
    everyone = hvd.allgather_object(mine)
    assert sorted(p for share in everyone for p in share) == sorted(files)
    if hvd.size() == 1:
        return
    with pytest.raises(hvd.MismatchError, match="seed"):
        shard_files(files, balance=False, seed=hvd.rank())
    with pytest.raises(hvd.MismatchError, match="epoch"):
        shard_files(files, balance=False, seed=3, epoch=hvd.rank())
    with pytest.raises(DataError, match="ranks were given different files"):
        shard_files(files[::-1] if hvd.rank() == 1 else files, balance=False)


def test_fewer_files_than_ranks_split_by_record(hvd, data):
    size = hvd.size()
    share = len(range(hvd.rank(), 50, size))
    expected = min(len(range(r, 50, size)) for r in range(size)) // 4
    records = tfrecord_dataset(data["single"], parse_id, 4, shard_by="records")
    _check_disjoint_equal(hvd, records, 4, expected, range(1000, 1050))
    assert share >= expected * 4
    with pytest.raises(DataError, match="at least batch_size=64 records on every rank"):
        tfrecord_dataset(data["single"], parse_id, 64, shard_by="records")
    if size == 1:
        return
    with pytest.raises(DataError, match=f"got 1 files for {size} ranks"):
        tfrecord_dataset(data["single"], parse_id, 4, shard_by="files")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        auto = tfrecord_dataset([data["single"]], parse_id, 4)
    if hvd.rank() == 0:
        assert any("shard_by='records'" in str(w.message) for w in caught)
    _check_disjoint_equal(hvd, auto, 4, expected, range(1000, 1050))
    with pytest.raises(DataError, match="at least as many files as ranks"):
        shard_files([data["single"]])


def test_skip_corrupt_skips_the_damaged_part_and_reports_it(hvd, data):
    files = data["good"] + [data["corrupt"]]
    with pytest.raises(DataError, match="corrupt/shard-00000-of-00001.tfrecord: corrupt"):
        tfrecord_dataset(files, parse_id, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dataset = tfrecord_dataset(files, parse_id, 8, skip_corrupt=True)
    if hvd.rank() == 0:
        # Records 0..4 of the damaged file are read; 5..19 are skipped.
        assert any("skipping 15 corrupt" in str(w.message) for w in caught), caught
    usable = list(range(0, 100)) + list(range(137, 201)) + list(range(3000, 3005))
    steps = int(dataset.cardinality())
    if hvd.size() == 1:
        assert steps == len(usable) // 8
    _check_disjoint_equal(hvd, dataset, 8, steps, usable)


def test_keras_fit_runs_the_agreed_steps(hvd, data):
    def parse(record):
        example = tf.io.parse_single_example(
            record, {"x": tf.io.FixedLenFeature([4], tf.float32), **SPEC}
        )
        return example["x"], tf.cast(example["id"], tf.float32)

    dataset = tfrecord_dataset(data["abc"], parse, 8)
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    seen = []
    batches = tf.keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append(batch)
    )
    model.fit(dataset, epochs=1, verbose=0, callbacks=[batches], shuffle=False)
    assert len(seen) == int(dataset.cardinality())
    assert hvd.allgather_object(len(seen)) == [len(seen)] * hvd.size()
    assert syncdp.size() == hvd.size()


def _elastic_ids(hvd, files, global_batch, start_batch):
    """Every step's record ids over all ranks, gathered in rank order."""
    from syncdp.data import elastic_tfrecord_dataset

    ds = elastic_tfrecord_dataset(files, parse_id, global_batch, start_batch=start_batch)
    steps = []
    for batch in ds:
        shares = hvd.allgather_object(batch.numpy().tolist())
        steps.append(shares)
    return int(ds.cardinality()), steps


@pytest.mark.parametrize("start_batch", [0, 3])
def test_elastic_dataset_uses_each_record_once_from_the_committed_batch(hvd, data, start_batch):
    # 201 records in file order (a, b, c: ids 0..200) in global batches of 40: 5 batches, the
    # last takes the remainder (41 records). Whatever the number of ranks, batch k is records
    # [40k, 40(k+1)) split into contiguous shares differing by one at most.
    cardinality, steps = _elastic_ids(hvd, data["abc"], 40, start_batch)
    assert cardinality == len(steps) == 5 - start_batch
    for k, shares in enumerate(steps, start=start_batch):
        end = 201 if k == 4 else 40 * (k + 1)
        assert [i for share in shares for i in share] == list(range(40 * k, end))
        sizes = [len(share) for share in shares]
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_elastic_dataset_weights_make_keras_fit_one_process_whatever_the_shares(hvd, data):
    # 201 records (ids 0..200) in global batches of 10, the last of 11: at 2 ranks the last
    # batch's shares are 6 and 5, at 3 ranks every batch's are 4, 3 and 3 (or 4). With the
    # sample weights, fit's loss (the mean over a rank's share, then the ranks' average) is
    # the global batch's mean: one process's steps (without them, 1e-3 apart).
    import keras

    from syncdp.data import elastic_tfrecord_dataset
    from syncdp.keras import DistributedOptimizer

    spec = {"id": tf.io.FixedLenFeature([], tf.int64), "x": tf.io.FixedLenFeature([4], tf.float32)}

    def parse(record):
        parsed = tf.io.parse_single_example(record, spec)
        return parsed["x"] / 100.0, tf.cast(parsed["id"] % 5, tf.float32)[None]

    def model():
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, kernel_initializer="ones")])
        return m

    mine = model()
    opt = DistributedOptimizer(keras.optimizers.SGD(0.05))
    mine.compile(optimizer=opt, loss="mse")
    dataset = elastic_tfrecord_dataset(data["abc"], parse, 10, sample_weights=True)
    mine.fit(dataset, epochs=1, verbose=0, shuffle=False)

    ids = np.arange(201)
    x = np.repeat(ids[:, None] / 100.0, 4, axis=1).astype(np.float32)
    y = (ids % 5).astype(np.float32)[:, None]
    bounds = [*range(0, 200, 10), 201]
    reference = model()
    reference.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        reference.train_on_batch(x[lo:hi], y[lo:hi])
    for got, want in zip(mine.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r"needs a parse_fn that returns \(features, label\)"):
        elastic_tfrecord_dataset(data["abc"], parse_id, 40, sample_weights=True)


@pytest.mark.parametrize("seed", [None, -1, 1.5, "7"])
def test_a_seed_that_is_not_an_integer_is_named(hvd, data, seed):
    # It decides which rank reads which file, so it has no random default; None failed deep
    # in NumPy with a TypeError.
    from syncdp.data import tfrecord_dataset

    with pytest.raises(ValueError, match="tfrecord_dataset needs seed to be an integer >= 0"):
        tfrecord_dataset(data["abc"], parse_id, 4, shuffle_buffer=8, seed=seed)


def test_elastic_dataset_bad_input(hvd, data):
    from syncdp.data import elastic_tfrecord_dataset

    with pytest.raises(ValueError, match="at least the number of ranks"):
        elastic_tfrecord_dataset(data["abc"], parse_id, hvd.size() - 1 or 0)
    with pytest.raises(ValueError, match="start_batch must be in"):
        elastic_tfrecord_dataset(data["abc"], parse_id, 40, start_batch=6)
    with pytest.raises(DataError, match="do not fill one global batch"):
        elastic_tfrecord_dataset(data["abc"], parse_id, 500)
    # Refused on every rank before anything is read: a fraction of a batch was truncated, a
    # start_batch of None or 1.5 a TypeError, an unknown compression read as none.
    with pytest.raises(ValueError, match="global_batch_size must be an integer"):
        elastic_tfrecord_dataset(data["abc"], parse_id, 40.5)
    whole = elastic_tfrecord_dataset(data["abc"], parse_id, 40.0)  # the integer it equals
    assert whole.cardinality() == elastic_tfrecord_dataset(data["abc"], parse_id, 40).cardinality()
    for start in (None, 1.5, -1):
        with pytest.raises(ValueError, match="needs start_batch to be an integer >= 0"):
            elastic_tfrecord_dataset(data["abc"], parse_id, 40, start_batch=start)
    with pytest.raises(ValueError, match="compression_type must be None, 'GZIP' or 'ZLIB'"):
        elastic_tfrecord_dataset(data["abc"], parse_id, 40, compression_type="gzip")


def test_shard_files_refuses_an_unknown_compression(hvd, data):
    from syncdp.data import shard_files

    for balance in (True, False):
        with pytest.raises(ValueError, match="shard_files: compression_type must be None"):
            shard_files(data["abc"], balance=balance, compression_type="BOGUS")


def test_every_rank_writing_the_same_shards_at_once_leaves_whole_files(hvd):
    """write_tfrecord_shards is not a collective: ranks (or hosts sharing a directory) that
    write the same shards at the same time each put a whole file in place."""
    from syncdp.data import count_records

    directory = hvd.broadcast_object(tempfile.mkdtemp() if hvd.rank() == 0 else None)
    try:
        hvd.barrier()
        examples = ({"id": i, "pad": b"x" * 200} for i in range(3000))
        paths = write_tfrecord_shards(examples, directory, 4)
        hvd.barrier()
        assert [count_records(p, verify=True) for p in paths] == [750] * 4
        ids = sorted(
            i for p in paths for i in tf.data.TFRecordDataset(p).map(parse_id).as_numpy_iterator()
        )
        assert ids == list(range(3000))
        import os

        assert sorted(os.listdir(directory)) == sorted(os.path.basename(p) for p in paths)
    finally:
        hvd.barrier()
        if hvd.rank() == 0:
            shutil.rmtree(directory)


def test_split_by_record_needs_the_same_interleave_on_every_rank(hvd, data):
    # The ranks split one stream of records, which num_parallel_reads orders: ranks that
    # passed different widths would read some records twice and others never.
    batch = 4
    default = tfrecord_dataset(data["six"], parse_id, batch, shard_by="records")
    steps = int(default.cardinality())
    flat = _check_disjoint_equal(hvd, default, batch, steps, range(2000, 2060))
    # AUTOTUNE follows each host's cores: it reads as the default here.
    tuned = tfrecord_dataset(
        data["six"], parse_id, batch, shard_by="records", num_parallel_reads=tf.data.AUTOTUNE
    )
    assert _check_disjoint_equal(hvd, tuned, batch, steps, range(2000, 2060)) == flat
    if hvd.size() == 1:
        return
    with pytest.raises(hvd.MismatchError, match="num_parallel_reads"):
        tfrecord_dataset(
            data["six"], parse_id, batch, shard_by="records", num_parallel_reads=1 + hvd.rank()
        )
    # Each rank reads its own files (by file, or "auto" choosing it): their widths may differ.
    auto = tfrecord_dataset(data["six"], parse_id, 2, num_parallel_reads=1 + hvd.rank())
    _check_disjoint_equal(hvd, auto, 2, int(auto.cardinality()), range(2000, 2060))
    mine = tfrecord_dataset(
        data["six"], parse_id, 2, shard_by="files", num_parallel_reads=1 + hvd.rank()
    )
    _check_disjoint_equal(hvd, mine, 2, int(mine.cardinality()), range(2000, 2060))


def _on_one_rank(rank_files, other_files):
    """The last rank's list is ``rank_files``, the others' ``other_files``."""
    return rank_files if syncdp.rank() == syncdp.size() - 1 else other_files


@pytest.mark.parametrize("caller", ["tfrecord_dataset", "shard_files", "unbalanced", "elastic"])
def test_a_glob_that_matches_nothing_on_one_rank_fails_every_rank(hvd, data, caller):
    """Hosts with their own copies of the data: where one host lacks them, its rank's pattern
    matches nothing. Every rank raises the DataError, naming that rank, instead of the others
    waiting for it until the stall timeout (forever without one)."""
    from syncdp.data import elastic_tfrecord_dataset

    files = _on_one_rank(f"{data['dir']}/nowhere/*.tfrecord", f"{data['dir']}/six/*.tfrecord")
    build = {
        "tfrecord_dataset": lambda: tfrecord_dataset(files, parse_id, 2),
        "shard_files": lambda: shard_files(files),
        "unbalanced": lambda: shard_files(files, balance=False),
        "elastic": lambda: elastic_tfrecord_dataset(files, parse_id, 6),
    }[caller]
    with pytest.raises(DataError) as info:
        build()
    assert "matches no files" in str(info.value)
    if hvd.size() > 1:
        assert f"failed on 1 rank(s):\n  rank {hvd.size() - 1}: " in str(info.value)
    assert hvd.allreduce(tf.ones([1]), op=hvd.Sum).numpy()[0] == hvd.size()  # the job goes on


@pytest.mark.parametrize("caller", ["tfrecord_dataset", "shard_files", "unbalanced", "elastic"])
def test_a_bad_argument_on_one_rank_fails_every_rank(hvd, data, caller):
    """A value computed per rank (a seed from the rank, an epoch counter) that is bad on one
    rank only: every rank raises its ValueError, naming that rank, instead of the others
    waiting for it until the stall timeout (forever without one)."""
    from syncdp.data import elastic_tfrecord_dataset

    files = f"{data['dir']}/six/*.tfrecord"
    bad = _on_one_rank(-1, 0)
    build = {
        "tfrecord_dataset": lambda: tfrecord_dataset(files, parse_id, 2, seed=bad),
        "shard_files": lambda: shard_files(files, epoch=bad),
        "unbalanced": lambda: shard_files(files, balance=False, seed=bad),
        "elastic": lambda: elastic_tfrecord_dataset(files, parse_id, 6, epoch=bad),
    }[caller]
    with pytest.raises(ValueError) as info:
        build()
    assert type(info.value) is ValueError  # an argument's fault, not the data's
    assert "to be an integer >= 0" in str(info.value)
    if hvd.size() > 1:
        assert f"failed on 1 rank(s):\n  rank {hvd.size() - 1}: " in str(info.value)
    assert hvd.allreduce(tf.ones([1]), op=hvd.Sum).numpy()[0] == hvd.size()  # the job goes on
    build = {  # and the same call with good arguments works
        "tfrecord_dataset": lambda: tfrecord_dataset(files, parse_id, 2, seed=1),
        "shard_files": lambda: shard_files(files, epoch=1),
        "unbalanced": lambda: shard_files(files, balance=False, seed=1),
        "elastic": lambda: elastic_tfrecord_dataset(files, parse_id, 6, epoch=1),
    }[caller]
    assert build() is not None


def test_a_glob_that_matches_nothing_anywhere_is_said_once(hvd, data):
    with pytest.raises(DataError) as info:
        shard_files(f"{data['dir']}/nowhere/*.tfrecord")
    assert str(info.value).startswith("shard_files: the pattern"), str(info.value)
    assert "rank" not in str(info.value)


def test_fewer_files_than_ranks_on_one_rank_fails_every_rank(hvd, data):
    if hvd.size() == 1:
        pytest.skip("one rank has files enough")
    files = _on_one_rank(data["single"], data["six"][: hvd.size()])
    with pytest.raises(DataError, match="ranks were given different files"):
        shard_files(files)
    with pytest.raises(DataError, match="at least as many files as ranks"):
        shard_files([data["single"]])


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"seed": -1}, "shard_files needs seed to be an integer >= 0 (or None)"),
        ({"seed": 1.5}, "needs seed to be an integer"),
        ({"epoch": -1}, "shard_files needs epoch to be an integer >= 0"),
        ({"epoch": 1.0}, "needs epoch to be an integer"),
    ],
)
def test_shard_files_names_a_bad_seed_or_epoch(hvd, data, kwargs, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        shard_files(data["six"], **kwargs)


@pytest.mark.parametrize("epoch", [-1, 1.0, None])
def test_a_dataset_names_a_bad_epoch(hvd, data, epoch):
    from syncdp.data import elastic_tfrecord_dataset

    with pytest.raises(ValueError, match="tfrecord_dataset needs epoch to be an integer >= 0"):
        tfrecord_dataset(data["abc"], parse_id, 4, shuffle_buffer=8, seed=1, epoch=epoch)
    with pytest.raises(ValueError, match="elastic_tfrecord_dataset needs epoch"):
        elastic_tfrecord_dataset(data["abc"], parse_id, 6, epoch=epoch)


def test_a_shuffle_that_differs_is_named_as_the_user_wrote_it(hvd, data):
    """One rank shuffles records (and so, by default, files), another does not, both with
    seed 3: the error names shuffle_files, whose default follows shuffle_buffer."""
    if hvd.size() == 1:
        pytest.skip("one rank cannot disagree with itself")
    buffer = 10 if hvd.rank() == 0 else 0
    with pytest.raises(hvd.MismatchError, match="different shuffle_files"):
        tfrecord_dataset(data["six"], parse_id, 2, shuffle_buffer=buffer, seed=3)
