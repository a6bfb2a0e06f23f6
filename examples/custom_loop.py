"""A custom TensorFlow training loop on N synchronous ranks, with DistributedGradientTape.

    syncdp-run -np 2 python examples/custom_loop.py

The same digits as ``train.py``, kept in memory: each rank takes its own slice of every global
batch, computes gradients on it, and ``DistributedGradientTape`` averages them over all ranks
before the optimizer applies them, so every rank makes the same update. The syncdp lines are
marked ``# syncdp:``.
"""

from __future__ import annotations

import argparse

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

import syncdp


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument("--batch-size", type=int, default=32, help="examples per rank per step")
    p.add_argument("--lr", type=float, default=0.001, help="learning rate of one rank")
    return p.parse_args(argv)


def load() -> tuple[np.ndarray, ...]:
    """The digits, split 80/20 into training and held-out sets the same way on every rank."""
    digits = load_digits()
    images = (digits.images.reshape(-1, 64) / 16.0).astype(np.float32)
    order = np.random.default_rng(0).permutation(len(images))
    test, train = order[: len(images) // 5], order[len(images) // 5 :]
    return images[train], digits.target[train], images[test], digits.target[test]


def main(argv=None) -> None:
    args = parse_args(argv)
    syncdp.init()  # syncdp: start MPI, learn this process's rank
    rank, size = syncdp.rank(), syncdp.size()
    x_train, y_train, x_test, y_test = load()

    keras.utils.set_random_seed(rank)  # different initial weights, fixed by the broadcast below
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    optimizer = keras.optimizers.Adam(args.lr * size)  # syncdp: scale the rate by the ranks
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    # syncdp: start every rank from rank 0's weights and optimizer state, before step 1.
    syncdp.broadcast_variables(model.weights + optimizer.variables, root_rank=0)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = syncdp.DistributedGradientTape(tape)  # syncdp: average gradients over ranks
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    global_batch = args.batch_size * size
    rng = np.random.default_rng(1)  # the same shuffle on every rank
    order = rng.permutation(len(x_train))
    for step in range(args.steps):
        start = (step * global_batch) % (len(order) - global_batch + 1)
        batch = order[start : start + global_batch]
        mine = batch[rank * args.batch_size : (rank + 1) * args.batch_size]  # syncdp: my slice
        loss = train_step(x_train[mine], y_train[mine])
        if step % 50 == 0 or step == args.steps - 1:
            # syncdp: the loss averaged over ranks, printed once.
            mean_loss = syncdp.allreduce(loss, op=syncdp.Average)
            if rank == 0:
                print(f"step {step}: loss {float(mean_loss):.4f}")

    if rank == 0:  # syncdp: every replica is identical, so rank 0 alone evaluates
        predictions = np.argmax(model(x_test, training=False), axis=1)
        print(f"held-out accuracy: {np.mean(predictions == y_test):.4f} ({size} ranks)")


if __name__ == "__main__":
    main()
