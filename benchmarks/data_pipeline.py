"""Records per second per rank: ``syncdp.data.tfrecord_dataset`` vs a plain ``TFRecordDataset``.

Both pipelines read the same files (this rank's share, as ``tfrecord_dataset`` assigns them),
parse the same ``tf.train.Example`` records, batch with ``drop_remainder`` and prefetch; the
only difference is syncdp's sharding (interleave over the rank's files, ``take`` of the agreed
step count, ``assert_cardinality``). Repetitions alternate between the two, in alternating
order, so drifting load on the machine affects both alike; the table gives the median.
The one-time cost of counting and checksumming the files before training is reported apart.

Per-rank throughput needs no second rank, so this runs at any ``-np``. Run::

    syncdp-run -np 2 python benchmarks/data_pipeline.py
    syncdp-run -np 2 python benchmarks/data_pipeline.py --files 32 --records-per-file 4000

Rank 0 prints a Markdown table and writes it to ``benchmarks/results/data_pipeline.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time

import numpy as np
import tensorflow as tf

import syncdp  # syncdp:
from syncdp import data as sdata  # syncdp:
from syncdp.data import _sharding  # to time counting without its cache

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=16, help="TFRecord shards (default 16)")
    parser.add_argument(
        "--records-per-file",
        type=int,
        default=4000,
        help="records in the first shard; shard k holds (1 - k/(2*files)) of "
        "that, so shards are unequal (default 4000)",
    )
    parser.add_argument(
        "--floats",
        type=int,
        default=64,
        help="float features per record (default 64: ~300-byte records)",
    )
    parser.add_argument("--batch-size", type=int, default=64, help="per rank (default 64)")
    parser.add_argument(
        "--repeats", type=int, default=7, help="epochs timed per pipeline, interleaved (default 7)"
    )
    parser.add_argument(
        "--output",
        default=os.path.join(RESULTS, "data_pipeline.md"),
        help="where rank 0 writes the table ('' for nowhere)",
    )
    return parser


def write_data(directory: str, args) -> list[str]:
    """Unequal shards of ``{"id", "x"}`` examples (rank 0 writes, the others wait)."""
    sizes = [int(args.records_per_file * (1 - k / (2 * args.files))) for k in range(args.files)]
    paths = []
    start = 0
    for k, n in enumerate(sizes):
        rng = np.random.default_rng(k)
        examples = (
            {"id": i, "x": rng.random(args.floats, np.float32)} for i in range(start, start + n)
        )
        path = sdata.write_tfrecord_shards(examples, f"{directory}/s{k:03d}", 1)[0]
        paths.append(path)
        start += n
    return paths


def make_parse(floats: int):
    spec = {
        "id": tf.io.FixedLenFeature([], tf.int64),
        "x": tf.io.FixedLenFeature([floats], tf.float32),
    }

    def parse(record):
        example = tf.io.parse_single_example(record, spec)
        return example["x"], example["id"]

    return parse


def plain_dataset(files, parse, batch_size) -> tf.data.Dataset:
    """What a user would write by hand over the same files, reading as many files at once."""
    dataset = tf.data.TFRecordDataset(files, num_parallel_reads=min(len(files), 16))
    if parse is not None:
        dataset = dataset.map(parse, num_parallel_calls=tf.data.AUTOTUNE)
    return dataset.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)


def records_per_second(dataset: tf.data.Dataset, batch_size: int) -> float:
    start = time.perf_counter()
    batches = 0
    for _ in dataset:
        batches += 1
    return batches * batch_size / (time.perf_counter() - start)


def compare(files, mine, parse, args) -> dict:
    """Interleaved epochs of both pipelines; the ratio is the median of adjacent pairs."""
    ours = sdata.tfrecord_dataset(files, parse, args.batch_size)  # syncdp:
    plain = plain_dataset(mine, parse, args.batch_size)
    records_per_second(ours, args.batch_size)  # warm-up: tracing, page cache
    records_per_second(plain, args.batch_size)
    rates = {"plain": [], "syncdp": []}
    for r in range(args.repeats):
        order = [("plain", plain), ("syncdp", ours)]
        for name, dataset in order if r % 2 == 0 else order[::-1]:
            rates[name].append(records_per_second(dataset, args.batch_size))
    ratios = [a / b for a, b in zip(rates["syncdp"], rates["plain"], strict=True)]
    return {
        "steps": int(ours.cardinality()),
        "plain": statistics.median(rates["plain"]),
        "syncdp": statistics.median(rates["syncdp"]),
        "ratio": statistics.median(ratios),
        "ratio_range": (min(ratios), max(ratios)),
    }


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    syncdp.init()  # syncdp:
    rank, size = syncdp.rank(), syncdp.size()
    directory = syncdp.broadcast_object(tempfile.mkdtemp() if rank == 0 else None)
    try:
        files = write_data(directory, args) if rank == 0 else None
        files = syncdp.broadcast_object(files)
        setup = {}
        for verify in (True, False):
            _sharding._count_cache.clear()
            start = time.perf_counter()
            sdata.tfrecord_dataset(files, None, args.batch_size, verify=verify)
            setup[verify] = time.perf_counter() - start
        mine = sdata.shard_files(files)  # the same files tfrecord_dataset gives this rank
        row = {
            "rank": rank,
            "files": len(mine),
            "setup": setup,
            "records": sum(sdata.count_records(f) for f in mine),
        }
        for kind, parse in (("parsed", make_parse(args.floats)), ("raw", None)):
            row[kind] = compare(files, mine, parse, args)
        rows = syncdp.allgather_object(row)  # syncdp:
        total = sum(sdata.count_records(f) for f in files)
    finally:
        syncdp.barrier()
        if rank == 0:
            shutil.rmtree(directory, ignore_errors=True)
    if rank == 0:
        report(rows, files, total, args, size)


def report(rows, files, total, args, size) -> None:
    used = sum(r["parsed"]["steps"] * args.batch_size for r in rows)
    threads = os.environ.get("TF_NUM_INTRAOP_THREADS", "-")
    lines = [
        "# syncdp.data pipeline throughput",
        "",
        f"Machine: {platform.node()} ({platform.machine()}, {os.cpu_count()} cores, shared with "
        f"other jobs: load average {os.getloadavg()[0]:.1f}), Python "
        f"{platform.python_version()}, TensorFlow {tf.__version__}, "
        f"TF_NUM_INTRAOP_THREADS={threads}.",
        "",
        f"Config: np={size}, {len(files)} unequal shards, {total} records (tf.train.Example of "
        f"{args.floats} floats + an id), batch {args.batch_size} per rank. Both pipelines read "
        f"this rank's files; {args.repeats} epochs each, interleaved in alternating order; rec/s "
        "are medians, the ratio is the median of adjacent pairs (range in brackets). Records "
        f"used per epoch: {used} of {total} ({100 * used / total:.1f}%).",
        "",
        "| rank | records | steps | pipeline | plain TFRecordDataset rec/s "
        "| tfrecord_dataset rec/s | ratio |",
        "|---:|---:|---:|---|---:|---:|---|",
    ]
    for r in rows:
        for kind in ("parsed", "raw"):
            m = r[kind]
            low, high = m["ratio_range"]
            lines.append(
                f"| {r['rank']} | {r['records']} | {m['steps']} | {kind} | "
                f"{m['plain']:,.0f} | {m['syncdp']:,.0f} | {m['ratio']:.3f} "
                f"[{low:.2f}-{high:.2f}] |"
            )
    lines += [
        "",
        "One-time setup before the first step (count every file's records together, agree on "
        "the steps), first call, no cache:",
        "",
        "| rank | files read | headers only (verify=False) s | headers + checksums (default) s |",
        "|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rank']} | {r['files']} | {r['setup'][False]:.3f} | {r['setup'][True]:.3f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    if args.output:
        os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
        with open(args.output, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
