"""The main job: classify handwritten digits with Keras ``model.fit`` on N synchronous ranks.

Run it on 2 ranks (no arguments needed; nothing is downloaded)::

    syncdp-run -np 2 python examples/train.py

The data is scikit-learn's bundled digits (1,797 8x8 images, 10 classes). Rank 0 writes it
once to TFRecord shards (a training and a held-out set); every rank then reads its own,
disjoint share of the training shards through tf.data, with the same number of batches on every
rank. Training is ordinary Keras: the syncdp lines are marked ``# syncdp:``. Rank 0 keeps
checkpoints, so running the same command again resumes where the last run stopped, and prints
the held-out accuracy at the end.

Its folders are ``runs/digits/data`` and ``runs/digits/checkpoints`` under the current
directory (``--data-dir``, ``--checkpoint-dir``; both printed at the start). Each checkpoint
records the epochs done, the samples seen and the number of ranks and global batch of the run
that wrote it: a run with another number of ranks resumes at the same epoch and says so (pass
``--fresh`` or another ``--checkpoint-dir`` to start from scratch).

Each rank trains on ``--batch-size`` examples per step, so the global batch is
``size * batch_size``; the learning rate is scaled by ``size`` and warmed up over the first
epochs (Goyal et al. 2017), as with Horovod.
"""

from __future__ import annotations

import argparse
import os

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

import syncdp.checkpoint
import syncdp.data
import syncdp.keras as hvd

PIXELS, CLASSES = 64, 10


def parse_args(argv=None) -> argparse.Namespace:
    base = os.path.join("runs", "digits")
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=20, help="epochs to train (default 20)")
    p.add_argument("--batch-size", type=int, default=32, help="examples per rank per step")
    p.add_argument("--lr", type=float, default=0.02, help="learning rate of one rank")
    p.add_argument("--warmup-epochs", type=int, default=3, help="learning-rate warmup epochs")
    p.add_argument(
        "--data-dir",
        default=os.path.join(base, "data"),
        help="where the TFRecord shards are written once and read from",
    )
    p.add_argument(
        "--checkpoint-dir",
        default=os.path.join(base, "checkpoints"),
        help="where rank 0 keeps checkpoints (resumed from if present)",
    )
    p.add_argument(
        "--fresh", action="store_true", help="ignore existing checkpoints (they are kept)"
    )
    p.add_argument("--verbose", type=int, default=2, help="Keras fit verbosity on rank 0")
    return p.parse_args(argv)


def write_digits(directory: str) -> None:
    """Writes the digits once, as 8 training shards and 4 held-out shards (80/20 split)."""
    digits = load_digits()
    images = (digits.images.reshape(-1, PIXELS) / 16.0).astype(np.float32)
    order = np.random.default_rng(0).permutation(len(images))
    held_out = len(images) // 5
    for name, rows, shards in (("test", order[:held_out], 4), ("train", order[held_out:], 8)):
        examples = ({"image": images[i], "label": int(digits.target[i])} for i in rows)
        syncdp.data.write_tfrecord_shards(examples, os.path.join(directory, name), shards)


def parse(record):
    features = tf.io.parse_single_example(
        record,
        {
            "image": tf.io.FixedLenFeature([PIXELS], tf.float32),
            "label": tf.io.FixedLenFeature([], tf.int64),
        },
    )
    return features["image"], features["label"]


def held_out_accuracy(model: keras.Model, data_dir: str) -> float:
    """The model's accuracy on every held-out record (one process, no collective)."""
    files = sorted(tf.io.gfile.glob(os.path.join(data_dir, "test", "*.tfrecord")))
    count = sum(syncdp.data.count_records(f) for f in files)
    held_out = (
        tf.data.TFRecordDataset(files)
        .map(parse)
        .apply(tf.data.experimental.assert_cardinality(count))
        .batch(256)
    )
    _, accuracy = model.evaluate(held_out, verbose=0)
    return accuracy


def build_model() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((PIXELS,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(CLASSES),
        ]
    )


class SaveCheckpoint(keras.callbacks.Callback):
    """Saves a checkpoint at the end of every epoch (rank 0 writes; every rank calls save),
    with what a later run needs to resume at the right epoch whatever its number of ranks."""

    def __init__(self, manager, global_batch: int, samples_per_epoch: int):
        super().__init__()
        self.manager = manager
        self.record = {"ranks": hvd.size(), "global_batch": global_batch}
        self.samples_per_epoch = samples_per_epoch

    def on_epoch_end(self, epoch, logs=None):
        record = dict(self.record, epochs=epoch + 1, samples=(epoch + 1) * self.samples_per_epoch)
        self.manager.save(int(self.model.optimizer.iterations), metadata=record)


def main(argv=None) -> None:
    args = parse_args(argv)
    hvd.init()  # syncdp: start MPI, learn this process's rank
    keras.utils.set_random_seed(1234)
    if hvd.rank() == 0:
        print(f"data: {os.path.abspath(args.data_dir)}")
        print(f"checkpoints: {os.path.abspath(args.checkpoint_dir)}")

    # syncdp: rank 0 writes the data once (training shards last); the others wait for it.
    if hvd.rank() == 0 and not os.path.isdir(os.path.join(args.data_dir, "train")):
        write_digits(args.data_dir)
    hvd.barrier()

    # syncdp: this rank's disjoint share of the records, the same number of batches everywhere.
    train = syncdp.data.tfrecord_dataset(
        os.path.join(args.data_dir, "train", "*.tfrecord"),
        parse,
        args.batch_size,
        shuffle_buffer=2048,
        seed=1,
    )
    val = syncdp.data.tfrecord_dataset(
        os.path.join(args.data_dir, "test", "*.tfrecord"), parse, args.batch_size
    )
    steps_per_epoch = int(train.cardinality())
    global_batch = hvd.size() * args.batch_size

    model = build_model()
    # syncdp: scale the learning rate by the number of ranks; average gradients across them.
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(args.lr * hvd.size(), momentum=0.9))
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        jit_compile=False,
    )

    # syncdp: rank 0 restores the newest checkpoint (if any) and every rank receives it.
    manager = syncdp.checkpoint.CheckpointManager(
        args.checkpoint_dir, model=model, optimizer=optimizer
    )
    resumed = resume(manager, args)
    initial_epoch = min(resumed.get("epochs", 0), args.epochs)

    callbacks = [
        # syncdp: every rank starts from rank 0's weights, before the first step.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        # syncdp: loss and accuracy averaged over ranks, so every rank logs the same numbers.
        hvd.callbacks.MetricAverageCallback(),
        # syncdp: start at lr, reach lr * size after the warmup epochs.
        hvd.callbacks.LearningRateWarmupCallback(
            initial_lr=args.lr * hvd.size(),
            warmup_epochs=args.warmup_epochs,
            steps_per_epoch=steps_per_epoch,
        ),
        SaveCheckpoint(manager, global_batch, steps_per_epoch * global_batch),  # rank 0 writes
    ]
    verbose = args.verbose if hvd.rank() == 0 else 0  # syncdp: progress output on rank 0
    model.fit(
        train,
        epochs=args.epochs,
        initial_epoch=initial_epoch,
        validation_data=val,
        shuffle=False,  # tfrecord_dataset already shuffles
        callbacks=callbacks,
        verbose=verbose,
    )

    if hvd.rank() == 0:  # syncdp: the whole held-out set, evaluated once
        accuracy = held_out_accuracy(model, args.data_dir)
        history = ""
        if resumed:
            history = (
                f"; epochs 1-{resumed['epochs']} by a run of {resumed['ranks']} rank(s), "
                f"global batch {resumed['global_batch']}"
            )
        print(
            f"held-out accuracy: {accuracy:.4f} ({hvd.size()} ranks, global batch "
            f"{global_batch}, {args.epochs} epochs{history})"
        )


def resume(manager, args) -> dict:
    """Restores the newest checkpoint unless ``--fresh``; returns its record ({} if none) and
    says on rank 0 what is resumed, and from a run of how many ranks."""
    if args.fresh or manager.restore() == 0:
        return {}
    record = manager.metadata
    if "epochs" not in record:  # written by another program: start afresh rather than guess
        if hvd.rank() == 0:
            print(f"{args.checkpoint_dir} holds checkpoints of another program: not resumed")
        return {}
    if hvd.rank() == 0:
        note = ""
        if record["ranks"] != hvd.size():
            note = (
                f" (written by a run of {record['ranks']} rank(s), global batch "
                f"{record['global_batch']}; this run has {hvd.size()}: training goes on at the "
                f"same epoch, {record['samples']} samples seen)"
            )
        print(f"Resuming after epoch {record['epochs']} from {args.checkpoint_dir}{note}")
    return record


if __name__ == "__main__":
    main()
