"""Input data for synchronous training: each rank its own records, every rank the same steps.

In synchronous data parallelism every rank must run the same number of steps (a rank that
runs out of data first leaves the others waiting in their next allreduce forever) and no
record may be read by two ranks in one epoch. :func:`tfrecord_dataset` guarantees both.

    shard_files              this rank's files, balanced by record counts
    tfrecord_dataset         this rank's batches: disjoint records, equal count on every rank
    write_tfrecord_shards    write ``tf.train.Example`` records into N shards
    count_records            a TFRecord file's record count, from its headers alone
    elastic_tfrecord_dataset an epoch split by position, so shards follow an elastic job's
                             membership (each record used once from the committed batch on)

Example:
    >>> import syncdp
    >>> syncdp.init()
    >>> if syncdp.rank() == 0:
    ...     syncdp.data.write_tfrecord_shards(examples, "data", num_shards=8)
    >>> syncdp.barrier()
    >>> ds = syncdp.data.tfrecord_dataset("data/*.tfrecord", parse, batch_size=32)
"""

from syncdp.data._dataset import tfrecord_dataset
from syncdp.data._elastic import elastic_tfrecord_dataset
from syncdp.data._sharding import shard_files
from syncdp.data._tfrecord import count_records, write_tfrecord_shards

__all__ = [
    "shard_files",
    "tfrecord_dataset",
    "elastic_tfrecord_dataset",
    "write_tfrecord_shards",
    "count_records",
]
