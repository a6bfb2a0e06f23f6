"""Horovod's ``hvd.elastic`` for Keras: ``KerasState`` and the callbacks that keep it current.

``import syncdp.keras as hvd`` (or ``syncdp.tensorflow.keras``) gives ``hvd.elastic.run``,
``hvd.elastic.KerasState`` and the callbacks below. With ``model.fit`` the usual list is::

    callbacks = [
        hvd.elastic.UpdateBatchStateCallback(state),
        hvd.elastic.UpdateEpochStateCallback(state),
        hvd.elastic.CommitStateCallback(state, batches_per_commit=10),
    ]

in any order: a commit always holds the batch and epoch counters of the weights it saved. A
commit every k batches is taken when the next batch begins, after every callback has updated
the state. The commit at an epoch's end is taken there and then (first bringing the state's
epoch and batch counters up to date through the callbacks above, wherever they are in the
list), before any later callback's collective (``MetricAverageCallback``'s) can meet a lost
rank and lose the epoch; and once more when the next epoch begins (or training ends), to take
in what other callbacks changed at the epoch's end (a learning rate reduced on a plateau).

:class:`KerasState` takes a model and optimizer of either Keras. The callbacks are objects of
one Keras: :func:`for_package` builds them for a Keras package (once per package); the ones here
are Keras 3's, and ``syncdp.tensorflow.keras.elastic`` has those of the Keras ``tf.keras``
stands for (Keras 2 under ``TF_USE_LEGACY_KERAS=1``).
"""

from __future__ import annotations

import functools
import types
import weakref
from types import ModuleType

import keras as _keras3

from syncdp.base.errors import HorovodInternalError, HostsUpdatedInterrupt, RankFailureError
from syncdp.elastic import ObjectState, State, run
from syncdp.keras import _callback
from syncdp.tensorflow.elastic import TensorFlowKerasState

__all__ = [
    "run",
    "State",
    "ObjectState",
    "KerasState",
    "TensorFlowKerasState",
    "CommitStateCallback",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "RankFailureError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
]


class KerasState(TensorFlowKerasState):
    """State of a Keras model and its optimizer, plus picklable values (Horovod's name).

    Keras 3 and Keras 2 alike (tf-keras, its legacy optimizers included): ``commit()`` copies
    the weights and the optimizer's variables (slots, step count) to host memory.

    Args:
        model: A built Keras model.
        optimizer: Its optimizer. Defaults to ``model.optimizer``.
        **kwargs: Picklable values, read back as attributes (``state.epoch``, ``state.batch``).
    """

    def __init__(self, model, optimizer=None, **kwargs):
        super().__init__(model, optimizer, **kwargs)


# id(state) -> (a weak reference to the state, its current fit: the epoch and batch callbacks
# of the state, by the epoch they last began). Begun by the state's CommitStateCallback; the
# callbacks of one state meet here. The state itself is not touched (its attributes are what it
# commits), nor hashed (a user's State may define __eq__).
_FITS: dict[int, tuple[weakref.ref, dict]] = {}


def _begin_fit(state) -> None:
    for key in [k for k, (ref, _) in _FITS.items() if ref() is None]:
        del _FITS[key]  # states gone since
    _FITS[id(state)] = (weakref.ref(state), {})


def _fit_of(state) -> dict | None:
    entry = _FITS.get(id(state))
    return entry[1] if entry is not None and entry[0]() is state else None


def _began(state, callback, epoch: int) -> None:
    """An epoch or batch callback of ``state`` began ``epoch`` in the current fit."""
    fit = _fit_of(state)
    if fit is not None:
        fit[id(callback)] = (callback, epoch)


def _bring_up_to_date(state, epoch: int, logs) -> None:
    """Ends ``epoch`` for the epoch and batch callbacks of ``state`` that began it in the
    current fit (their ``on_epoch_end`` sets the same values when Keras calls it again)."""
    fit = _fit_of(state)
    for callback, began in list(fit.values()) if fit is not None else []:
        if began == epoch:
            callback.on_epoch_end(epoch, logs)


@functools.cache
def for_package(keras: ModuleType) -> types.SimpleNamespace:
    """The callbacks below built for ``keras`` (Keras 3's ``keras`` or tf-keras's
    ``tf_keras``), once per package: a namespace with ``CommitStateCallback``,
    ``UpdateBatchStateCallback`` and ``UpdateEpochStateCallback``."""

    class CommitStateCallback(_callback.base_for(keras)):
        """Commits the state every ``batches_per_commit`` batches and at the end of every epoch
        (see the module's docstring for when).

        The count of batches starts again at every ``fit`` and runs on across epochs (as
        Horovod's does), so the ranks of a resumed ``fit`` commit at the same batches.

        Args:
            state: The elastic state.
            batches_per_commit: Batches between commits, or 0 to commit at the ends of epochs
                only, as Horovod's does; a commit copies the model and optimizer to host
                memory, so commit less often for large models. Defaults to 1.

        Raises:
            ValueError: ``batches_per_commit`` is not an integer >= 0.
        """

        def __init__(self, state: State, batches_per_commit: int = 1):
            super().__init__()
            if int(batches_per_commit) != batches_per_commit or batches_per_commit < 0:
                raise ValueError(
                    "batches_per_commit must be an integer >= 0 (0: at the ends of epochs only); "
                    f"got {batches_per_commit!r}."
                )
            self.state = state
            self.batches_per_commit = int(batches_per_commit)
            self._since = 0
            self._pending = False

        def _commit_pending(self) -> None:
            if self._pending:
                self._pending = False
                self.state.commit()

        def on_train_begin(self, logs=None):
            # Every fit counts from 0 on every rank: after a reset, a rank that replaced a
            # lost one starts at 0, and commits are collectives with spares or a discovery
            # script, so the survivors must not carry their count into the resumed fit.
            self._since = 0
            self._pending = False
            _begin_fit(self.state)

        def on_train_batch_begin(self, batch, logs=None):
            self._commit_pending()

        def on_train_batch_end(self, batch, logs=None):
            self._since += 1
            if self.batches_per_commit and self._since >= self.batches_per_commit:
                self._since = 0
                self._pending = True

        def on_epoch_begin(self, epoch, logs=None):
            self._commit_pending()

        def on_epoch_end(self, epoch, logs=None):
            _bring_up_to_date(self.state, epoch, logs)
            self.state.commit()  # holds a batch's commit due too
            self._pending = True  # again, with what later callbacks change at the epoch's end

        def on_train_end(self, logs=None):
            self._commit_pending()

    class UpdateBatchStateCallback(_callback.base_for(keras)):
        """Keeps ``state.batch`` = batches of the current epoch done, counting from where this
        ``fit`` resumed (``state.batch`` when it began); 0 again when the epoch ends.

        After a reset, ``fit`` runs the interrupted epoch's ``steps_per_epoch`` batches in full
        (a callback cannot shorten a Keras epoch; Horovod's changed only the progress bar's
        count), so ``state.batch`` may then exceed ``steps_per_epoch``.

        Args:
            state: The elastic state; it needs a ``batch`` value.
        """

        def __init__(self, state: State):
            super().__init__()
            self.state = state
            self._start = 0

        def on_epoch_begin(self, epoch, logs=None):
            self._start = self.state.batch
            _began(self.state, self, epoch)

        def on_train_batch_end(self, batch, logs=None):
            self.state.batch = self._start + batch + 1

        def on_epoch_end(self, epoch, logs=None):
            self.state.batch = 0
            self._start = 0

    class UpdateEpochStateCallback(_callback.base_for(keras)):
        """Keeps ``state.epoch`` = the next epoch to run, counted over the whole training.

        Either way of resuming works: Horovod's, ``fit(epochs=total - state.epoch)`` (Keras
        numbers this ``fit``'s epochs from 0), and Keras', ``fit(initial_epoch=state.epoch,
        epochs=total)``. The first epoch of each ``fit`` is taken to be ``state.epoch``.

        Args:
            state: The elastic state; it needs an ``epoch`` value.
        """

        def __init__(self, state: State):
            super().__init__()
            self.state = state
            self._offset = None  # state.epoch less Keras' number for the same epoch, in this fit

        def on_train_begin(self, logs=None):
            self._offset = None

        def on_epoch_begin(self, epoch, logs=None):
            if self._offset is None:
                self._offset = self.state.epoch - epoch
            _began(self.state, self, epoch)

        def on_epoch_end(self, epoch, logs=None):
            self.state.epoch = (self._offset or 0) + epoch + 1

    classes = types.SimpleNamespace(
        CommitStateCallback=CommitStateCallback,
        UpdateBatchStateCallback=UpdateBatchStateCallback,
        UpdateEpochStateCallback=UpdateEpochStateCallback,
    )
    for name, cls in vars(classes).items():
        cls.__qualname__ = name
    return classes


_classes = for_package(_keras3)
CommitStateCallback = _classes.CommitStateCallback
UpdateBatchStateCallback = _classes.UpdateBatchStateCallback
UpdateEpochStateCallback = _classes.UpdateEpochStateCallback
