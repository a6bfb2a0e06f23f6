"""CheckpointCallback: resumable ``model.fit`` on :class:`syncdp.checkpoint.CheckpointManager`.

A callback is an object of one Keras: :func:`for_package` builds the class for a Keras package
(once per package); ``CheckpointCallback`` here is Keras 3's, and
``syncdp.tensorflow.keras.CheckpointCallback`` the one for the Keras ``tf.keras`` stands for
(Keras 2 under ``TF_USE_LEGACY_KERAS=1``).
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import keras as _keras3

from syncdp.base.errors import CheckpointError
from syncdp.checkpoint import CheckpointManager
from syncdp.keras import _callback
from syncdp.tensorflow.keras2_names import create_optimizer_variables

__all__ = ["CheckpointCallback"]


@functools.cache
def for_package(keras: ModuleType) -> type:
    """The CheckpointCallback class for ``keras`` (Keras 3's ``keras`` or tf-keras's
    ``tf_keras``), built once per package."""

    class CheckpointCallback(_callback.base_for(keras)):
        """Saves checkpoints during ``model.fit`` on rank 0 and resumes from the newest one.

        At the start of training it restores the newest checkpoint in ``directory`` (or broadcasts
        rank 0's initial state when there is none, like ``BroadcastGlobalVariablesCallback``) and
        makes ``fit`` continue from the epoch after the one saved, like Keras's
        ``BackupAndRestore``: a restarted job that calls the same ``fit`` resumes where it stopped.
        Saves are synchronization points; every rank must use the callback.

        A damaged checkpoint is moved aside and ``fit`` resumes from the newest intact one (every
        rank warns); when every checkpoint is damaged, ``fit`` raises
        :class:`~syncdp.base.errors.CheckpointError` on every rank unless ``allow_fresh`` is True
        (see :class:`~syncdp.checkpoint.CheckpointManager`).

        Resume is exact for checkpoints written at the end of an epoch. A checkpoint written every
        ``save_freq`` batches resumes at the start of the epoch it was written in, with the weights
        it saved, because ``fit`` cannot skip the batches already seen.

        Args:
            directory: Where rank 0 keeps the checkpoints.
            save_freq: "epoch" to save at the end of every ``every`` epochs, or an int N to save
                every N batches. Defaults to "epoch".
            every: With ``save_freq="epoch"``, save every this many epochs. Defaults to 1.
            max_to_keep: How many intact checkpoints to keep. Defaults to 3.
            allow_fresh: When checkpoints exist but every one is damaged, train from epoch 0
                (moving them aside) instead of raising. Defaults to False.

        Raises:
            CheckpointError: From ``fit``, on every rank, when no checkpoint can be restored
                (see ``CheckpointManager.restore``).

        Attributes:
            initial_epoch: The epoch ``fit`` resumed at (0 without a checkpoint).
            manager: The :class:`CheckpointManager` (model and its optimizer).

        Example:
            >>> model.fit(x, y, epochs=10, callbacks=[
            ...     syncdp.keras.CheckpointCallback("/ckpt", save_freq="epoch")])
        """

        def __init__(
            self,
            directory: str | os.PathLike,
            *,
            save_freq: str | int = "epoch",
            every: int = 1,
            max_to_keep: int | None = 3,
            allow_fresh: bool = False,
        ):
            super().__init__()
            if save_freq != "epoch" and not (isinstance(save_freq, int) and save_freq > 0):
                raise CheckpointError(
                    f"save_freq must be 'epoch' or a positive int; got {save_freq!r}."
                )
            if every < 1:
                raise CheckpointError(f"every must be at least 1; got {every}.")
            self.directory = directory
            self.save_freq = save_freq
            self.every = every
            self.max_to_keep = max_to_keep
            self.allow_fresh = allow_fresh
            self.manager: CheckpointManager | None = None
            self.initial_epoch = 0
            self._epoch = 0
            self._batches = 0

        def on_train_begin(self, logs=None):
            trackables = {"model": self.model}
            optimizer = getattr(self.model, "optimizer", None)
            if optimizer is not None:
                # Its slots exist before the first save, so every checkpoint holds them.
                create_optimizer_variables(optimizer, self.model.trainable_variables)
                trackables["optimizer"] = optimizer
            self.manager = CheckpointManager(
                self.directory, max_to_keep=self.max_to_keep, **trackables
            )
            self.manager.restore(allow_fresh=self.allow_fresh)
            self.initial_epoch = int(self.manager.metadata.get("epoch", 0))
            self._epoch = self.initial_epoch
            if self.initial_epoch:
                _resume_at(self.model, self.initial_epoch)

        def on_train_end(self, logs=None):
            _resume_at(self.model, None)

        def on_epoch_begin(self, epoch, logs=None):
            self._epoch = epoch

        def _step(self) -> int:
            optimizer = getattr(self.model, "optimizer", None)
            return int(optimizer.iterations.numpy()) if optimizer is not None else self._batches

        def on_train_batch_end(self, batch, logs=None):
            self._batches += 1
            if isinstance(self.save_freq, int) and self._batches % self.save_freq == 0:
                self.manager.save(self._step(), metadata={"epoch": self._epoch})

        def on_epoch_end(self, epoch, logs=None):
            if self.save_freq == "epoch" and (epoch + 1) % self.every == 0:
                self.manager.save(self._step(), metadata={"epoch": epoch + 1})

    CheckpointCallback.__qualname__ = CheckpointCallback.__name__
    return CheckpointCallback


def _resume_at(model, epoch: int | None) -> None:
    """Makes ``model.fit`` start at ``epoch`` (None: where it was asked to), as Keras'
    ``BackupAndRestore`` does: ``fit`` reads it right after ``on_train_begin``."""
    if hasattr(model, "_maybe_load_initial_counters_from_ckpt"):  # Keras 2
        model._training_state = None if epoch is None else _ResumeAt(epoch)
    else:
        model._initial_epoch = epoch


class _ResumeAt:
    """Keras 2's record of where ``fit`` resumes: epoch ``epoch``, its first batch."""

    def __init__(self, epoch: int):
        self.epoch = epoch

    def maybe_load_initial_counters_from_ckpt(self, steps_per_epoch, initial_epoch, mode=None):
        return self.epoch, 0


CheckpointCallback = for_package(_keras3)
