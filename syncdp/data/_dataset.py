"""``tfrecord_dataset``: this rank's disjoint records, the same number of batches on every rank.

The number of batches is agreed before the first record is read: ranks count every file's
records together (one ``allgather``), and each computes from those counts what every rank
will yield and takes the minimum. A rank can therefore never run out of data while another
waits for it in an allreduce, which is how synchronous jobs freeze at the end of an epoch.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from syncdp.base.errors import DataError
from syncdp.data._sharding import (
    _assign,
    _check_compression,
    _check_whole,
    _gather_counts,
    _resolved,
)
from syncdp.job import runtime

__all__ = ["tfrecord_dataset"]

AUTOTUNE = tf.data.AUTOTUNE
_SHARD_BY = ("auto", "files", "records")
# Files read at once by default. More than the cores: a reader mostly waits on I/O, and
# measured on 2 cores, 8 files at once read raw records about twice as fast as AUTOTUNE's 2.
# Capped because every open file holds a read buffer.
_DEFAULT_PARALLEL_READS = 16
# shard_by="auto" splits by file unless that would use less than this share of the records
# that splitting by record would use.
_AUTO_FILES_MIN_USE = 0.9


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What every rank reads, identical on all ranks."""

    mode: str  # "files" or "records"
    groups: list[list[int]] | None  # files mode: file indices per rank
    records: list[int]  # records each rank's stream holds before batching
    steps: int  # batches every rank yields


def _records_mode_counts(total: int, size: int) -> list[int]:
    return [len(range(r, total, size)) for r in range(size)]


def _plan(
    counts: Sequence[int],
    size: int,
    batch_size: int,
    shard_by: str,
    *,
    seed: int | None,
    epoch: int,
) -> tuple[_Plan, str | None]:
    """Chooses the split and the step count; returns it and a warning for rank 0, if any."""
    total = sum(counts)
    by_record = _Plan(
        "records",
        None,
        _records_mode_counts(total, size),
        min(_records_mode_counts(total, size)) // batch_size,
    )
    if shard_by == "records":
        return by_record, None
    if len(counts) < size:
        if shard_by == "files":
            raise DataError(
                f"tfrecord_dataset needs at least as many files as ranks: got "
                f"{len(counts)} files for {size} ranks. Write more shards, or pass "
                "shard_by='records'."
            )
        return by_record, (
            f"tfrecord_dataset: {len(counts)} files for {size} ranks, so each "
            "rank reads every file and keeps every "
            f"{size}-th record (shard_by='records'). Write at least {size} "
            "shards to read each file on one rank only."
        )
    groups = _assign(counts, size, seed=seed, epoch=epoch)
    records = [sum(counts[i] for i in group) for group in groups]
    by_file = _Plan("files", groups, records, min(records) // batch_size)
    if shard_by == "auto" and by_file.steps < _AUTO_FILES_MIN_USE * by_record.steps:
        return by_record, (
            f"tfrecord_dataset: the files' record counts are too unequal to "
            f"split by file ({by_file.steps} batches per rank instead of "
            f"{by_record.steps}), so each rank reads every file and keeps every "
            f"{size}-th record (shard_by='records'). Write shards of similar "
            "sizes, or pass shard_by='files' to accept the loss."
        )
    return by_file, None


def _check_args(batch_size, shuffle_buffer, shard_by, compression_type, seed, epoch) -> None:
    if (
        isinstance(batch_size, bool)
        or not isinstance(batch_size, (int, np.integer))
        or batch_size < 1
    ):
        raise ValueError(
            f"tfrecord_dataset needs a positive integer batch_size; got {batch_size!r}."
        )
    if not isinstance(shuffle_buffer, (int, np.integer)) or shuffle_buffer < 0:
        raise ValueError(
            f"tfrecord_dataset needs shuffle_buffer >= 0 (0: no shuffling); got {shuffle_buffer!r}."
        )
    if shard_by not in _SHARD_BY:
        raise ValueError(
            f"tfrecord_dataset: shard_by must be one of {_SHARD_BY}; got {shard_by!r}."
        )
    _check_compression("tfrecord_dataset", compression_type)
    # The same on every rank (it decides which rank reads which file): no random default.
    _check_whole("tfrecord_dataset", "seed", seed)
    _check_whole("tfrecord_dataset", "epoch", epoch)


def _describe_damage(damaged) -> str:
    known = sum(n for _, _, n in damaged if n is not None)
    unknown = [p for p, _, n in damaged if n is None]
    lines = "\n  ".join(why for _, why, _ in damaged[:10])
    rest = (
        f", plus the rest of {len(unknown)} file(s) whose damage hides their record count"
        if unknown
        else ""
    )
    return (
        f"tfrecord_dataset: skip_corrupt=True: skipping {known} corrupt or unreadable "
        f"record(s){rest} in {len(damaged)} file(s):\n  {lines}"
    )


def tfrecord_dataset(
    files,
    parse_fn: Callable | None,
    batch_size: int,
    *,
    shuffle_buffer: int = 0,
    seed: int = 0,
    epoch: int = 0,
    compression_type: str | None = None,
    shard_by: str = "auto",
    skip_corrupt: bool = False,
    verify: bool = True,
    shuffle_files: bool | None = None,
    num_parallel_reads: int | None = None,
    num_parallel_calls: int = AUTOTUNE,
    buffer_size: int | None = None,
    prefetch: int = AUTOTUNE,
) -> tf.data.Dataset:
    """This rank's batches of TFRecord records: disjoint from every other rank's, equal in number.

    A synchronization point: all ranks must call it, in the same order, with the same
    arguments. Ranks count the files' records together (one ``allgather``; every rank gets
    every count and every error), assign files to ranks so that record counts are balanced,
    and agree on the number of batches: the fewest any rank can fill. Each rank reads its files
    with parallel interleave, optionally shuffles, parses, batches with ``drop_remainder`` and
    prefetches; the dataset's ``cardinality()`` is the agreed number of batches, so Keras
    ``fit`` knows its steps per epoch.

    With fewer files than ranks (or, with ``shard_by="auto"``, files too unequal to split well
    by file), every rank reads every file and keeps every ``size``-th record instead. No record
    is ever given to two ranks.

    Args:
        files: A list of TFRecord paths, or a glob pattern (matches are sorted).
        parse_fn: Applied to each serialized record (a scalar string tensor), e.g. a function
            calling ``tf.io.parse_single_example``. ``None`` yields the raw records.
        batch_size: Records per batch on this rank (the global batch is ``size()`` times it).
        shuffle_buffer: Records in the shuffle buffer; 0 reads in a fixed order. Defaults to 0.
        seed: Seed for the shuffles. Where it decides which rank reads which file (with
            ``shuffle_files``) it must be the same on every rank: ranks that pass different
            ones raise MismatchError, as for ``batch_size``, ``shard_by``, ``epoch``,
            ``compression_type`` and ``skip_corrupt``. Defaults to 0.
        epoch: Combined with ``seed`` to reshuffle which rank reads which file each epoch
            (identically on every rank); build the dataset again with the new epoch. Defaults
            to 0.
        compression_type: ``None``, ``"GZIP"`` or ``"ZLIB"``. Compressed files are read in full
            to be counted. Defaults to None.
        shard_by: ``"files"`` (each file read by one rank; needs at least as many files as
            ranks), ``"records"`` (every rank reads every file and keeps every ``size``-th
            record), or ``"auto"`` (files, unless there are fewer files than ranks or splitting
            by file would use under 90% of the batches that splitting by record gives; a
            warning says when). Defaults to ``"auto"``.
        skip_corrupt: Skip damaged records instead of failing. TensorFlow's reader skips from
            the first damaged record to the end of its file; rank 0 warns how many records
            were skipped and where. Defaults to False.
        verify: Check every record's payload checksum before training (each rank reads its
            share of the files once; cached for later epochs), so a corrupt record fails on
            every rank, naming its file, before the first step. If False only the record
            headers are checked up front, and a corrupt payload fails mid-epoch with
            TensorFlow's ``DataLossError`` (which ends the job without naming the file).
            Defaults to True.
        shuffle_files: Reshuffle the file assignment with ``(seed, epoch)``. Defaults to
            ``shuffle_buffer > 0``.
        num_parallel_reads: Files read at once (interleave's cycle length), or
            ``tf.data.AUTOTUNE``. Defaults to this rank's file count, at most 16. Split by
            record, the ranks must read with the same width (they split one stream of
            records, which it orders; MismatchError otherwise), and AUTOTUNE, whose width
            follows each host's cores, reads as the default.
        num_parallel_calls: Parallel calls of ``parse_fn``. Defaults to ``tf.data.AUTOTUNE``.
        buffer_size: Read buffer per file, in bytes. Defaults to TensorFlow's default.
        prefetch: Batches to prefetch. Defaults to ``tf.data.AUTOTUNE``.

    Returns:
        A ``tf.data.Dataset`` of batches with known cardinality, the same on every rank.

    Raises:
        DataError: On every rank: a file is missing or corrupt, a pattern matches nothing, a
            file is listed twice, ranks see a file with different sizes (or not at all),
            ``shard_by="files"`` with fewer files than ranks, or some rank would get fewer than
            ``batch_size`` records.
        MismatchError: On every rank, when ranks passed different values of an argument that
            decides who reads what (see ``seed``).
        ValueError: An argument is out of range, on any rank: raised on every rank.

    Example:
        >>> def parse(record):
        ...     spec = {"x": tf.io.FixedLenFeature([4], tf.float32),
        ...             "y": tf.io.FixedLenFeature([], tf.int64)}
        ...     example = tf.io.parse_single_example(record, spec)
        ...     return example["x"], example["y"]
        >>> ds = syncdp.data.tfrecord_dataset("data/*.tfrecord", parse, 32, shuffle_buffer=1000)
        >>> model.fit(ds, epochs=3)  # every rank runs ds.cardinality() steps per epoch
    """
    size, rank = runtime.size(), runtime.rank()
    paths, problem = _resolved(
        files,
        "tfrecord_dataset",
        lambda: _check_args(batch_size, shuffle_buffer, shard_by, compression_type, seed, epoch),
    )
    if problem is None:  # else raised on every rank by the counting's agreement
        batch_size = int(batch_size)
        if shuffle_files is None:
            shuffle_files = shuffle_buffer > 0
    file_seed = seed if shuffle_files else None
    counts, damaged = _gather_counts(
        paths,
        verify=verify,
        compression_type=compression_type,
        skip_corrupt=skip_corrupt,
        caller="tfrecord_dataset",
        # What decides which records each rank reads and how many batches: different on two
        # ranks, records would be read twice and others never (a per-rank seed is a common
        # habit). The record shuffle's seed may differ: it only orders this rank's records.
        agree={
            "batch_size": batch_size,
            "shard_by": shard_by,
            "epoch": epoch,
            "shuffle_files": bool(shuffle_files),  # its default: shuffle_buffer > 0
            "file_seed": file_seed,
            "compression_type": compression_type or None,
            "skip_corrupt": bool(skip_corrupt),
        },
        problem=problem,
    )
    plan, note = _plan(counts, size, batch_size, shard_by, seed=file_seed, epoch=epoch)
    if plan.steps == 0:
        raise DataError(
            f"tfrecord_dataset needs at least batch_size={batch_size} records on every rank: "
            f"{sum(counts)} records in {len(paths)} file(s) give the ranks {plan.records} "
            "records, so no rank could run a step. Use a smaller batch_size or more data."
        )
    if rank == 0:
        for message in filter(None, [note, _describe_damage(damaged) if damaged else None]):
            warnings.warn(message, stacklevel=2)

    def read(path):
        records = tf.data.TFRecordDataset(
            path, compression_type=compression_type or "", buffer_size=buffer_size
        )
        return records.ignore_errors() if skip_corrupt else records

    # Splitting by record needs the same stream on every rank: a fixed file order and a
    # deterministic interleave.
    deterministic = True if plan.mode == "records" or shuffle_buffer == 0 else None
    if plan.mode == "files":
        mine = [paths[i] for i in plan.groups[rank]]
    else:
        order = np.arange(len(paths))
        if file_seed is not None:
            order = np.random.default_rng([file_seed, epoch]).permutation(len(paths))
        mine = [paths[i] for i in order]
    if num_parallel_reads is None or (num_parallel_reads == AUTOTUNE and plan.mode == "records"):
        # AUTOTUNE's width follows each host's cores: in records mode the ranks' streams would
        # differ, and their shards overlap.
        cycle = min(len(mine), _DEFAULT_PARALLEL_READS)
    elif num_parallel_reads == AUTOTUNE:
        cycle = AUTOTUNE
    else:
        cycle = max(1, min(int(num_parallel_reads), len(mine)))
    if plan.mode == "records" and size > 1:  # every rank has the same plan: all or none
        # The width orders the one stream the ranks split: different widths would read
        # records twice and others never.
        runtime.communicator().enter("tfrecord_dataset.interleave", num_parallel_reads=cycle)
    dataset = tf.data.Dataset.from_tensor_slices(mine).interleave(
        read, cycle_length=cycle, num_parallel_calls=AUTOTUNE, deterministic=deterministic
    )
    if plan.mode == "records":
        dataset = dataset.shard(size, rank)
    if shuffle_buffer:
        dataset = dataset.shuffle(
            shuffle_buffer, seed=_record_seed(seed, epoch, rank), reshuffle_each_iteration=True
        )
    if parse_fn is not None:
        dataset = dataset.map(
            parse_fn, num_parallel_calls=num_parallel_calls, deterministic=deterministic
        )
    dataset = dataset.batch(batch_size, drop_remainder=True).take(plan.steps)
    dataset = dataset.apply(tf.data.experimental.assert_cardinality(plan.steps))
    options = tf.data.Options()
    # syncdp has already sharded; tf.distribute must not shard again.
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return dataset.with_options(options).prefetch(prefetch)


def _record_seed(seed: int, epoch: int, rank: int) -> int:
    return int(np.random.default_rng([seed, epoch, rank, 2]).integers(2**31 - 1))
