"""``elastic_tfrecord_dataset``: an epoch's records split by position, so shards follow the
membership of an elastic job.

An elastic job changes size mid-epoch, so a split fixed at the start (files per rank) would read
some records twice and skip others. Here an epoch is one global sequence of records (the files
in order, or in an order shuffled by ``(seed, epoch)``), cut into global batches of
``global_batch_size``; the last batch also takes the records that do not fill a batch of their
own, so none is dropped. Global batch ``k`` is split among the ranks that exist when it runs:
rank ``r`` of ``n`` takes its ``r``-th contiguous share (sizes differ by one at most). The
position is a batch count (``state.batch``, committed with the model), so after a membership
change every rank, a replacement included, rebuilds the dataset from the committed batch and
each record of the epoch is used exactly once.

Every rank reads the whole sequence and keeps its share: simple and exact, at the cost of
reading every record on every rank (fine for the sizes one host trains on; the shuffle does
not hold records in memory).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tensorflow as tf

from syncdp.base.errors import DataError
from syncdp.data._sharding import _check_compression, _check_whole, _gather_counts, _resolved
from syncdp.job import runtime

__all__ = ["elastic_tfrecord_dataset", "elastic_steps"]


def elastic_steps(total_records: int, global_batch_size: int) -> int:
    """Global batches in an epoch of ``total_records`` (the last one takes the remainder)."""
    return total_records // global_batch_size


def _weighted(element: tuple, weight: tf.Tensor) -> tuple:
    """``(features, label)`` with its sample weight."""
    if len(element) != 2:
        raise ValueError(
            "elastic_tfrecord_dataset(sample_weights=True) needs a parse_fn that returns "
            f"(features, label); each element has {len(element)} value(s)."
        )
    return (*element, weight)


def elastic_tfrecord_dataset(
    files,
    parse_fn: Callable | None,
    global_batch_size: int,
    *,
    epoch: int = 0,
    start_batch: int = 0,
    seed: int = 0,
    shuffle_files: bool = False,
    compression_type: str | None = None,
    verify: bool = True,
    sample_weights: bool = False,
    prefetch: int = tf.data.AUTOTUNE,
) -> tf.data.Dataset:
    """This rank's share of the rest of one epoch, from global batch ``start_batch`` on.

    A synchronization point: all ranks must call it, in the same order, with the same
    arguments (the files' records are counted together, as in ``tfrecord_dataset``). Build it
    again after every membership change and every epoch.

    Args:
        files: A list of TFRecord paths, or a glob pattern (matches are sorted).
        parse_fn: Applied to each serialized record; ``None`` yields the raw records.
        global_batch_size: Records per step over all ranks, whatever their number; at least
            the number of ranks.
        epoch: The epoch (reshuffles the file order with ``shuffle_files``). Defaults to 0.
        start_batch: Global batches of this epoch already done (the committed
            ``state.batch``). Defaults to 0.
        seed: Seed of the file shuffle. Defaults to 0.
        shuffle_files: Read the files in an order shuffled by ``(seed, epoch)``. Defaults to
            False.
        compression_type: ``None``, ``"GZIP"`` or ``"ZLIB"``. Defaults to None.
        verify: Check every record's checksum before training. Defaults to True.
        sample_weights: Yield ``(features, label, weight)`` instead of what ``parse_fn``
            returns (which must then be ``(features, label)``), for Keras ``fit``. The shares
            of a global batch differ by one record when the ranks do not divide it, and a
            loss averaged over each rank's share, then over the ranks, would weigh a record of
            a smaller share more. Each record's weight, ``ranks * share / global batch``,
            makes it the global batch's mean again, whatever the number of ranks, for a loss
            reduced as Keras' default ``"sum_over_batch_size"`` (the weighted sum over the
            share's size). A custom loop can instead sum its loss and divide by the global
            batch. Defaults to False.
        prefetch: Batches to prefetch. Defaults to ``tf.data.AUTOTUNE``.

    Returns:
        A dataset of this rank's batches, one per remaining global batch (its cardinality).

    Raises:
        DataError: A file is missing or corrupt, ranks see a file with different sizes, or
            the epoch has fewer records than one global batch.
        MismatchError: Ranks passed different ``global_batch_size``, ``epoch``,
            ``start_batch`` or (with ``shuffle_files``) ``seed``.
        ValueError: ``global_batch_size`` is not an integer at least the number of ranks,
            ``seed``, ``epoch`` or ``start_batch`` is not an integer >= 0, ``compression_type``
            is unknown, or ``start_batch`` is past the epoch: raised on every rank.
    """
    size, rank = runtime.size(), runtime.rank()

    def check():
        # A whole float (64.0, from arithmetic) is the integer it equals; 40.5 is refused.
        whole = not isinstance(global_batch_size, bool) and (
            isinstance(global_batch_size, (int, np.integer))
            or (
                isinstance(global_batch_size, (float, np.floating))
                and global_batch_size.is_integer()
            )
        )
        if not whole or global_batch_size < size:
            raise ValueError(
                f"global_batch_size must be an integer at least the number of ranks ({size}) "
                f"so every rank gets a record each step; got {global_batch_size!r}."
            )
        _check_whole("elastic_tfrecord_dataset", "seed", seed)
        _check_whole("elastic_tfrecord_dataset", "epoch", epoch)
        _check_whole("elastic_tfrecord_dataset", "start_batch", start_batch)
        _check_compression("elastic_tfrecord_dataset", compression_type)

    paths, problem = _resolved(files, "elastic_tfrecord_dataset", check)
    if problem is None:  # else raised on every rank by the counting's agreement
        global_batch_size = int(global_batch_size)
    counts, _ = _gather_counts(
        paths,
        verify=verify,
        compression_type=compression_type,
        skip_corrupt=False,
        caller="elastic_tfrecord_dataset",
        # What decides which records each rank reads: different on two ranks, records would be
        # read twice and others never.
        agree={
            "global_batch_size": global_batch_size,
            "epoch": epoch,
            "start_batch": start_batch,
            "file_order_seed": seed if shuffle_files else None,
            "sample_weights": bool(sample_weights),
        },
        problem=problem,
    )
    total = sum(counts)
    steps = elastic_steps(total, global_batch_size)
    if steps == 0:
        raise DataError(
            f"elastic_tfrecord_dataset: {total} records in {len(paths)} file(s) do not fill one "
            f"global batch of {global_batch_size}. Use a smaller batch or more data."
        )
    if not 0 <= start_batch <= steps:
        raise ValueError(f"start_batch must be in [0, {steps}] for this epoch; got {start_batch}.")
    order = np.arange(len(paths))
    if shuffle_files:
        order = np.random.default_rng([seed, epoch]).permutation(len(paths))
    records = tf.data.TFRecordDataset(
        [paths[i] for i in order], compression_type=compression_type or ""
    )
    left = steps - start_batch
    if left == 0:
        batches = records.take(0).batch(1)
    else:
        records = records.skip(start_batch * global_batch_size)
        full = (left - 1) * global_batch_size
        last = total - start_batch * global_batch_size - full  # a batch plus the remainder
        batches = (
            records.take(full).batch(global_batch_size).concatenate(records.skip(full).batch(last))
        )

    def share(batch):
        n = tf.shape(batch, out_type=tf.int64)[0]
        per, extra = n // size, n % size
        lo = rank * per + tf.minimum(tf.constant(rank, tf.int64), extra)
        hi = lo + per + tf.cast(rank < extra, tf.int64)
        mine = tf.data.Dataset.from_tensor_slices(batch[lo:hi])
        if parse_fn is not None:
            mine = mine.map(parse_fn)
        if sample_weights:
            weight = tf.cast(size * (hi - lo), tf.float32) / tf.cast(n, tf.float32)
            mine = mine.map(lambda *element: _weighted(element, weight))
        return mine.batch(global_batch_size + total)  # one batch: all of the share

    dataset = batches.flat_map(share)
    dataset = dataset.apply(tf.data.experimental.assert_cardinality(left))
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return dataset.with_options(options).prefetch(prefetch)
