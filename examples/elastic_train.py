"""Elastic Keras training: kill any rank mid-epoch and the job replaces it and finishes.

    syncdp-run -np 3 --min-np 2 python examples/elastic_train.py

The digits classifier of ``examples/train.py``, trained with ``model.fit`` inside
``hvd.elastic.run``. Try it: while it trains, ``kill -9`` one of the ranks' python processes
(``pgrep -f elastic_train.py``); the launcher logs the loss, the survivors restore the last
commit, a replacement starts and receives the state, and training goes on from the committed
batch. The global batch is fixed (``--global-batch``) and split among whichever ranks exist, so
the learning rate needs no rescaling and ``syncdp.data.elastic_tfrecord_dataset`` uses every
record of every epoch exactly once, however the membership changes. The elastic lines are
marked ``# elastic:``.

Every rank prints ``RESULT {json}`` at the end (label, rank, size, epochs done, a checksum of
its weights), and rank 0 the held-out accuracy.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time

import keras
import numpy as np
import tensorflow as tf

import syncdp.data
import syncdp.keras as hvd
from syncdp.membership import membership

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train import (  # noqa: E402 - the same data, model and evaluation
    build_model,
    held_out_accuracy,
    parse,
    write_digits,
)


def parse_args(argv=None) -> argparse.Namespace:
    base = os.path.join(tempfile.gettempdir(), "syncdp-digits")
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=8, help="epochs to train (default 8)")
    p.add_argument("--global-batch", type=int, default=96, help="examples per step, all ranks")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate")
    p.add_argument("--batches-per-commit", type=int, default=2, help="steps between commits")
    p.add_argument("--data-dir", default=os.path.join(base, "data"), help="TFRecord shards")
    p.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step (demos)")
    p.add_argument("--verbose", type=int, default=2, help="Keras fit verbosity on rank 0")
    return p.parse_args(argv)


def wait_for_data(directory: str) -> None:
    """The first rank 0 writes the shards once; the others (and replacements) wait for them.

    No collective here: a replacement runs this part alone (see syncdp.elastic).
    """
    done = os.path.join(directory, "DONE")
    first = os.environ.get("OMPI_COMM_WORLD_RANK", "0") == "0"
    if first and not os.environ.get("SYNCDP_REPLACEMENT") and not os.path.exists(done):
        write_digits(directory)
        open(done, "w").close()
    deadline = time.monotonic() + 300
    while not os.path.exists(done):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no data appeared in {directory}")
        time.sleep(0.1)


class Pause(keras.callbacks.Callback):
    """Sleeps after every step, so a demo leaves time to kill a rank by hand."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(self.seconds)


def main(argv=None) -> int:
    args = parse_args(argv)
    wait_for_data(args.data_dir)
    hvd.init()  # elastic: a replacement joins the running job here
    keras.utils.set_random_seed(1234)
    files = sorted(tf.io.gfile.glob(os.path.join(args.data_dir, "train", "*.tfrecord")))
    model = build_model()
    # The global batch is fixed, so the learning rate does not depend on the number of ranks.
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(args.lr, momentum=0.9))
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        jit_compile=False,
    )
    # elastic: what survives a lost rank, committed in memory on every rank.
    state = hvd.elastic.KerasState(model, optimizer, epoch=0, batch=0)
    callbacks = [
        hvd.elastic.UpdateBatchStateCallback(state),  # elastic: state.batch = steps done
        hvd.elastic.UpdateEpochStateCallback(state),  # elastic: state.epoch = next epoch
        hvd.elastic.CommitStateCallback(state, batches_per_commit=args.batches_per_commit),
    ]
    if args.step_seconds:
        callbacks.append(Pause(args.step_seconds))

    @hvd.elastic.run  # elastic: on a lost rank, restore, heal, sync, and call train again
    def train(state):
        while state.epoch < args.epochs:
            # elastic: the rest of this epoch, split among the ranks there are now.
            data = syncdp.data.elastic_tfrecord_dataset(
                files,
                parse,
                args.global_batch,
                epoch=state.epoch,
                start_batch=state.batch,
                shuffle_files=True,
                seed=1,
                sample_weights=True,  # shares of a batch differ by one: fit weighs them equal
            )
            model.fit(
                data,
                initial_epoch=state.epoch,
                epochs=state.epoch + 1,
                callbacks=callbacks,
                shuffle=False,  # the file order is shuffled per epoch, the same on every rank
                verbose=args.verbose if hvd.rank() == 0 else 0,
            )

    train(state)
    weights = np.concatenate([w.reshape(-1) for w in model.get_weights()]).astype(np.float32)
    result = {
        "label": membership.me().label,
        "rank": hvd.rank(),
        "size": hvd.size(),
        "epoch": state.epoch,
        "weights_sha1": hashlib.sha1(weights.tobytes()).hexdigest(),
    }
    print("RESULT " + json.dumps(result), flush=True)
    if hvd.rank() == 0:
        accuracy = held_out_accuracy(model, args.data_dir)
        print(f"held-out accuracy: {accuracy:.4f} ({hvd.size()} ranks at the end)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
