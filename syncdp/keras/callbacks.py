"""Keras callbacks for synchronous data-parallel ``model.fit``, with Horovod's names.

Pass them to ``model.fit(callbacks=[...])`` on every rank, in this order::

    callbacks = [
        syncdp.keras.callbacks.BroadcastGlobalVariablesCallback(0),
        syncdp.keras.callbacks.MetricAverageCallback(),
        syncdp.keras.callbacks.LearningRateWarmupCallback(initial_lr=0.1 * syncdp.size()),
        # then Keras' own: ReduceLROnPlateau, EarlyStopping, ModelCheckpoint on rank 0 ...
    ]

Every syncdp callback, when attached to a model, also

- turns the model's ``jit_compile`` off (with a warning) if its optimizer is a
  :class:`~syncdp.keras.DistributedOptimizer`, because XLA cannot compile syncdp's host-side
  collectives (the train function is rebuilt without XLA);
- keeps Keras' progress output to rank 0 (see :mod:`syncdp.keras._display`).

A callback is an object of one Keras, so :func:`for_package` builds these classes for a Keras
package, once per package: the names here are Keras 3's (``horovod.keras``'s, for models of
``import keras``); ``syncdp.tensorflow.keras.callbacks`` has the same classes built for the
Keras ``tf.keras`` stands for (``horovod.tensorflow.keras``'s: Keras 2 under
``TF_USE_LEGACY_KERAS=1``). Given a model of the other Keras, a callback says so.
"""

from __future__ import annotations

import functools
import numbers
import sys
import types
import warnings
from types import ModuleType

import keras as _keras3
import numpy as np
import tensorflow as tf

from syncdp.base.errors import CollectiveError
from syncdp.job import runtime
from syncdp.keras import _callback, _display
from syncdp.keras.optimizer import turn_off_jit
from syncdp.tensorflow import collectives as ops
from syncdp.tensorflow import graph
from syncdp.tensorflow.keras2_names import (
    create_optimizer_variables,
    optimizer_state,
    package_of,
)

__all__ = [
    "BroadcastGlobalVariablesCallback",
    "MetricAverageCallback",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "BestModelCheckpoint",
]


def _numbers(value) -> np.ndarray | None:
    """A log entry as a float64 array, when it holds numbers (a number, or an array or tensor
    of them: ``Precision(thresholds=[...])`` logs one per threshold); None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, tf.Tensor | tf.Variable) and tf.executing_eagerly():
        value = value.numpy()
    if not isinstance(value, numbers.Number | np.ndarray | np.generic):
        return None
    array = np.asarray(value)
    if not np.issubdtype(array.dtype, np.number):
        return None
    return array.astype(np.float64)


def _shapes(logged: dict) -> str:
    """``['acc', 'prec (shape 2)']``: metric names, with the shape of those not one number."""
    return str(
        [k if np.ndim(v) == 0 else f"{k} (shape {np.shape(v)})" for k, v in sorted(logged.items())]
    )


def _get_lr(optimizer) -> float:
    if tf.executing_eagerly():
        return float(tf.convert_to_tensor(optimizer.learning_rate).numpy())
    # Keras 2's fit() in a TF1 graph: the rate is a variable read through Keras' session.
    return float(tf.compat.v1.keras.backend.get_value(optimizer.learning_rate))


def _scale(buffers: list, factor: float) -> None:
    """Multiplies each variable of ``buffers`` by ``factor`` now (in a TF1 graph too, where an
    ``assign`` would only build an op that nothing runs)."""
    if tf.executing_eagerly():
        for buffer in buffers:
            buffer.assign(buffer * factor)
        return
    backend = tf.compat.v1.keras.backend
    values = backend.batch_get_value(buffers)
    backend.batch_set_value([(b, v * factor) for b, v in zip(buffers, values, strict=True)])


def _steps_per_epoch(params: dict | None) -> int | None:
    """Batches per epoch as fit() tells its callbacks: ``steps``, else (Keras 2 with arrays
    in a TF1 graph) ``samples // batch_size``, as Horovod's callbacks count them."""
    params = params or {}
    if params.get("steps"):
        return int(params["steps"])
    if params.get("samples") and params.get("batch_size"):
        return int(params["samples"]) // int(params["batch_size"]) or None
    return None


def _momentum_buffers(optimizer) -> list:
    """The velocity buffers that carry the learning rate inside them (SGD, RMSprop momentum).

    Keras 3 keeps ``momentum`` as a Python number traced into the train step, so Horovod's
    trick of changing it for one batch has no effect; scaling these buffers by the ratio of
    the new to the old learning rate is the same momentum correction (Goyal et al. 2017).
    Keras 2's optimizers keep the same buffers (its legacy ones as ``momentum`` slots).
    """
    while getattr(optimizer, "inner_optimizer", None) is not None:
        optimizer = optimizer.inner_optimizer
    optimizers = package_of(optimizer).optimizers
    if isinstance(optimizer, optimizers.SGD):
        return list(getattr(optimizer, "momentums", []))
    if isinstance(optimizer, optimizers.RMSprop):
        return list(getattr(optimizer, "_momentums", []))
    legacy = getattr(optimizers, "legacy", None)
    if isinstance(getattr(legacy, "Optimizer", None), type) and isinstance(
        optimizer, (legacy.SGD, legacy.RMSprop)
    ):
        return [slots["momentum"] for slots in optimizer._slots.values() if "momentum" in slots]
    return []


@functools.cache
def for_package(keras: ModuleType) -> types.SimpleNamespace:
    """The callbacks of this module built for ``keras`` (Keras 3's ``keras`` or tf-keras's
    ``tf_keras``), once per package.

    Args:
        keras: The Keras package whose ``Callback`` (and ``ModelCheckpoint``) they extend.

    Returns:
        A namespace with one class per name in ``__all__``.
    """

    class _SyncdpCallback(_callback.base_for(keras)):
        """Makes the model fit for syncdp when attached: no XLA around collectives, quiet ranks."""

        def set_model(self, model):
            super().set_model(model)
            _display.quiet_other_ranks(keras)
            # fit() attaches callbacks before it builds its train function, so this is in time.
            turn_off_jit(model)

    class BroadcastGlobalVariablesCallback(_SyncdpCallback):
        """Broadcasts the model's weights and optimizer state from ``root_rank`` before training.

        Runs at ``on_train_begin``, before the first step (Horovod broadcast after the first step,
        so its first update mixed different initial weights): with it, N ranks on 1/N of each
        batch take exactly the steps one process would take on the whole batch. The optimizer's
        variables are created first if needed. Use it also after rank 0 alone restored a
        checkpoint. A synchronization point: every rank must pass it to ``fit``.

        If the model has no weights yet when training begins (a ``Sequential`` without
        ``keras.Input``, or a subclassed model whose shapes Keras could not infer), the broadcast
        happens after the first batch instead (Horovod's behaviour), with a warning; build the
        model first (``keras.Input``, ``model.build(shape)`` or call it on a batch) to avoid it.

        Args:
            root_rank: The rank whose state everyone receives. Defaults to 0.
            device: Accepted for Horovod compatibility.
            local_variables: Variables (one or a list) that keep each rank's own values: they are
                not broadcast. Defaults to none.

        Example:
            >>> model.fit(ds, callbacks=[BroadcastGlobalVariablesCallback(0)])
        """

        def __init__(self, root_rank: int = 0, device: str = "", local_variables=None):
            super().__init__()
            self.root_rank = root_rank
            self.device = device
            self.broadcast_done = False
            if local_variables is None:
                local_variables = []
            elif not isinstance(local_variables, (list, tuple)):
                local_variables = [local_variables]
            variable_types = (tf.Variable, getattr(keras, "Variable", tf.Variable))
            if not all(isinstance(v, variable_types) for v in local_variables):
                raise ValueError("All local variables must be tf.Variable or keras.Variable.")
            self.local_variables = list(local_variables)

        def _broadcast(self):
            model = self.model
            optimizer = getattr(model, "optimizer", None)
            variables = list(model.weights)
            if optimizer is not None:
                create_optimizer_variables(optimizer, model.trainable_variables)
                variables += optimizer_state(optimizer)
            local = {id(v) for v in self.local_variables}
            variables = [v for v in variables if id(v) not in local]
            if graph.in_v1_graph():
                # Keras 2 in a TF1 graph (disable_eager_execution): the broadcast is an op of
                # its own (not chained to the training step's collectives), run in Keras'
                # session.
                with graph.standalone():
                    assign = ops.broadcast_variables(variables, root_rank=self.root_rank)
                tf.compat.v1.keras.backend.get_session().run(assign)
            else:
                ops.broadcast_variables(variables, root_rank=self.root_rank)
            self.broadcast_done = True

        def on_train_begin(self, logs=None):
            if self.broadcast_done:
                return
            if not _has_weights(self.model):
                warnings.warn(
                    "syncdp: the model has no weights before its first step, so "
                    "BroadcastGlobalVariablesCallback broadcasts after it and the first step mixes "
                    "different initial weights. Build the model before fit() "
                    "(model.build(input_shape) or model(batch)) for an exact first step.",
                    stacklevel=2,
                )
                return
            self._broadcast()

        def on_train_batch_end(self, batch, logs=None):
            if not self.broadcast_done:
                self._broadcast()

    class MetricAverageCallback(_SyncdpCallback):
        """Averages the epoch-end metrics over all ranks, in place.

        Each rank computes its metrics on its own shard; at the end of every epoch the logs
        (``loss``, ``accuracy``, ``val_*``, ...) are replaced by their mean over ranks, so every
        rank, the progress bar and every later callback (ReduceLROnPlateau, EarlyStopping, a
        rank-0 ModelCheckpoint) see the same values. Put it before those callbacks. A
        synchronization point once per epoch. A metric that logs several numbers (one per
        threshold) is averaged element by element, as Horovod's allreduce does; non-numeric
        log entries are left alone.

        Args:
            device: Accepted for Horovod compatibility.

        Raises:
            CollectiveError: Ranks logged different metric names, or a metric of different
                shapes.
        """

        def __init__(self, device: str = ""):
            super().__init__()

        def on_epoch_end(self, epoch, logs=None):
            if logs is None:
                return
            found = {k: _numbers(v) for k, v in logs.items()}
            mine = {k: v for k, v in found.items() if v is not None}
            everyone = ops.allgather_object(mine, name="MetricAverageCallback")
            names = sorted(mine)
            for r, theirs in enumerate(everyone):
                shapes = {k: np.shape(v) for k, v in theirs.items()}
                if sorted(theirs) != names or any(shapes[k] != mine[k].shape for k in names):
                    raise CollectiveError(
                        "MetricAverageCallback needs the same metrics on every rank: rank "
                        f"{runtime.rank()} logged {_shapes(mine)}, rank {r} logged "
                        f"{_shapes(theirs)}. Compile the same metrics and validation data on "
                        "every rank."
                    )
            for k in names:
                mean = np.mean([theirs[k] for theirs in everyone], axis=0, dtype=np.float64)
                logs[k] = float(mean) if mean.ndim == 0 else mean

    class LearningRateScheduleCallback(_SyncdpCallback):
        """Sets the learning rate to ``initial_lr * multiplier(epoch)`` for epochs in a window.

        The window is ``[start_epoch, end_epoch)``, and ``multiplier`` has Horovod's meaning
        (0.23 and later): a function is called with the epoch; a number ``m`` is exponential
        decay from ``start_epoch``, the factor ``m ** (epoch - start_epoch)``, so the window
        starts at ``initial_lr`` and the rate is multiplied by ``m`` every epoch. With
        ``staircase=True`` the rate is set at the first batch of every epoch in the window, from
        the integer epoch; with ``staircase=False`` at every batch, from the fractional epoch
        ``epoch + batch / steps_per_epoch`` (a number then decays smoothly within the epoch). For
        a constant factor over a window, pass a function that ignores the epoch:
        ``multiplier=lambda epoch: 0.1``. Outside the window the rate is left as it is, so a
        schedule is several callbacks with adjacent windows. At each epoch end the rate is
        logged as ``lr``. Not a collective: every rank computes the same rates.

        Args:
            initial_lr: The learning rate the multiplier scales (usually the base rate times
                ``syncdp.size()``).
            multiplier: A function ``epoch -> factor`` (e.g. ``lambda epoch: 0.1`` for a
                constant factor), or a number ``m`` for the factor ``m ** (epoch - start_epoch)``.
            start_epoch: First epoch (0-based) to adjust. Defaults to 0.
            end_epoch: First epoch not to adjust; None for no end. Defaults to None.
            staircase: Adjust once per epoch (True) or every batch (False). Defaults to True.
            momentum_correction: When the rate changes, scale SGD/RMSprop momentum buffers by
                ``new_lr / old_lr``. Defaults to True.
            steps_per_epoch: Batches per epoch, needed when ``staircase=False``. Defaults to what
                ``fit`` reports.

        Raises:
            ValueError: ``initial_lr`` is None, or the steps per epoch cannot be known.

        Example:
            >>> # The ImageNet schedule after a 5-epoch warmup: x1 to epoch 30, x0.1 to 60,
            >>> # x0.01 to 80 (Goyal et al. 2017; Horovod's keras_imagenet_resnet50.py). The
            >>> # factors are functions: a number would decay by itself every epoch.
            >>> lr = 0.0125 * syncdp.size()
            >>> Schedule = LearningRateScheduleCallback
            >>> callbacks = [
            ...     LearningRateWarmupCallback(initial_lr=lr, warmup_epochs=5),
            ...     Schedule(lr, multiplier=lambda epoch: 1.0, start_epoch=5, end_epoch=30),
            ...     Schedule(lr, multiplier=lambda epoch: 0.1, start_epoch=30, end_epoch=60),
            ...     Schedule(lr, multiplier=lambda epoch: 0.01, start_epoch=60, end_epoch=80),
            ... ]
            >>> # Exponential decay from epoch 80: lr * 0.9 ** (epoch - 80).
            >>> LearningRateScheduleCallback(lr, multiplier=0.9, start_epoch=80)
        """

        def __init__(
            self,
            initial_lr: float,
            multiplier,
            start_epoch: int = 0,
            end_epoch: int | None = None,
            staircase: bool = True,
            momentum_correction: bool = True,
            steps_per_epoch: int | None = None,
        ):
            super().__init__()
            if initial_lr is None:
                raise ValueError(
                    f"{type(self).__name__} needs initial_lr, the learning rate the "
                    "schedule scales; got None. Pass e.g. initial_lr=0.1 * "
                    "syncdp.size()."
                )
            self.initial_lr = float(initial_lr)
            if callable(multiplier):
                self.multiplier = multiplier
            else:
                self.multiplier = functools.partial(
                    _exponential_decay, float(multiplier), start_epoch
                )
            self.start_epoch = start_epoch
            self.end_epoch = end_epoch
            self.staircase = staircase
            self.momentum_correction = momentum_correction
            self.steps_per_epoch = steps_per_epoch
            self.current_epoch = 0

        def on_train_begin(self, logs=None):
            if not self.staircase and not self.steps_per_epoch:
                steps = _steps_per_epoch(self.params)
                if not steps:
                    raise ValueError(
                        f"{type(self).__name__} needs the number of batches per epoch, and fit() "
                        "does not know it (the dataset's cardinality is unknown). Pass "
                        "steps_per_epoch= to the callback (or to fit())."
                    )
                self.steps_per_epoch = steps

        def on_epoch_begin(self, epoch, logs=None):
            self.current_epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            epoch = self.current_epoch
            if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
                return
            if self.staircase:
                if batch == 0:
                    self._set_lr(self.initial_lr * self.multiplier(epoch))
            else:
                self._set_lr(
                    self.initial_lr * self.multiplier(epoch + batch / self.steps_per_epoch)
                )

        def _set_lr(self, new_lr: float) -> None:
            optimizer = self.model.optimizer
            old_lr = _get_lr(optimizer)
            optimizer.learning_rate = new_lr
            if self.momentum_correction and old_lr > 0 and new_lr != old_lr:
                _scale(_momentum_buffers(optimizer), new_lr / old_lr)

        def on_epoch_end(self, epoch, logs=None):
            if logs is not None:
                logs["lr"] = _get_lr(self.model.optimizer)

    class LearningRateWarmupCallback(LearningRateScheduleCallback):
        """Ramps the learning rate from ``initial_lr / size`` up to ``initial_lr``, batch by batch.

        Linear scaling with gradual warmup (Goyal et al. 2017, "Accurate, Large Minibatch SGD"):
        train with ``initial_lr = base_lr * syncdp.size()``, but start at ``base_lr`` and grow
        linearly over ``warmup_epochs``. At batch ``b`` of epoch ``e`` the rate is, as in Horovod,
        ``initial_lr / size * (t * (size - 1) / warmup_epochs + 1)`` with
        ``t = e + (b + 1) / steps_per_epoch``, so the last batch of the warmup runs at
        ``initial_lr``. Not a collective: every rank computes the same rates.

        Args:
            initial_lr: The rate reached at the end of the warmup (base rate times size).
            warmup_epochs: Epochs the warmup lasts. Defaults to 5.
            momentum_correction: Scale SGD/RMSprop momentum buffers when the rate changes.
                Defaults to True.
            steps_per_epoch: Batches per epoch. Defaults to what ``fit`` reports.
            verbose: 1 to print (on rank 0) when the warmup ends. Defaults to 0.

        Example:
            >>> LearningRateWarmupCallback(initial_lr=0.01 * syncdp.size(), warmup_epochs=3)
        """

        def __init__(
            self,
            initial_lr: float,
            warmup_epochs: int = 5,
            momentum_correction: bool = True,
            steps_per_epoch: int | None = None,
            verbose: int = 0,
        ):
            super().__init__(
                initial_lr,
                self._warmup_factor,
                start_epoch=0,
                end_epoch=warmup_epochs,
                staircase=False,
                momentum_correction=momentum_correction,
                steps_per_epoch=steps_per_epoch,
            )
            self.warmup_epochs = warmup_epochs
            self.verbose = verbose

        def _warmup_factor(self, epoch: float) -> float:
            size = runtime.size()
            # The +1/steps shifts each batch to its end, so epoch boundaries give round rates.
            t = epoch + 1.0 / self.steps_per_epoch
            return (t * (size - 1) / self.warmup_epochs + 1) / size

        def on_epoch_end(self, epoch, logs=None):
            super().on_epoch_end(epoch, logs)
            if epoch == self.warmup_epochs - 1 and self.verbose and runtime.rank() == 0:
                print(
                    f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                    f"{_get_lr(self.model.optimizer):g}.",
                    file=sys.stdout,
                    flush=True,
                )

    class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
        """Keeps the best model seen so far, judged by ``monitor`` (Horovod's name).

        A ``keras.callbacks.ModelCheckpoint`` with ``save_best_only=True``. Horovod's Spark
        estimator sets the path later; here ``filepath`` may be given, or set on the callback
        (``callback.filepath = ...``) before ``fit``. Give it to rank 0 only (or average the metric
        with :class:`MetricAverageCallback` first) so one file is written.

        Args:
            monitor: The metric to watch. Defaults to ``"val_loss"``.
            verbose: Keras' verbosity. Defaults to 0.
            save_weights_only: Save only the weights. Defaults to False.
            mode: ``"auto"``, ``"min"`` or ``"max"``. Defaults to ``"auto"``.
            save_freq: ``"epoch"`` or a number of batches. Defaults to ``"epoch"``.
            filepath: Where to save. Defaults to a placeholder ``best.keras`` (or
                ``best.weights.h5`` with ``save_weights_only``) to be replaced before ``fit``.
        """

        def __init__(
            self,
            monitor="val_loss",
            verbose=0,
            save_weights_only=False,
            mode="auto",
            save_freq="epoch",
            filepath=None,
        ):
            if filepath is None:  # Keras 3 checks the extension at construction time
                filepath = "best.weights.h5" if save_weights_only else "best.keras"
            super().__init__(
                filepath=filepath,
                monitor=monitor,
                verbose=verbose,
                save_best_only=True,
                save_weights_only=save_weights_only,
                mode=mode,
                save_freq=save_freq,
            )

        def set_model(self, model):
            _callback.check_same_keras(self, model)
            super().set_model(model)

    # Each class under its public name (they print and pickle as that), one namespace.
    classes = types.SimpleNamespace(
        BroadcastGlobalVariablesCallback=BroadcastGlobalVariablesCallback,
        MetricAverageCallback=MetricAverageCallback,
        LearningRateScheduleCallback=LearningRateScheduleCallback,
        LearningRateWarmupCallback=LearningRateWarmupCallback,
        BestModelCheckpoint=BestModelCheckpoint,
    )
    for name, cls in vars(classes).items():
        cls.__qualname__ = name
    return classes


_classes = for_package(_keras3)
BroadcastGlobalVariablesCallback = _classes.BroadcastGlobalVariablesCallback
MetricAverageCallback = _classes.MetricAverageCallback
LearningRateScheduleCallback = _classes.LearningRateScheduleCallback
LearningRateWarmupCallback = _classes.LearningRateWarmupCallback
BestModelCheckpoint = _classes.BestModelCheckpoint


def _exponential_decay(base: float, start_epoch: int, epoch: float) -> float:
    """``base ** (epoch - start_epoch)``: what a constant ``multiplier`` means in Horovod."""
    return base ** (epoch - start_epoch)


def _has_weights(model) -> bool:
    """Whether ``model`` has its weights yet (Keras 2 raises ValueError where Keras 3 has [])."""
    try:
        return bool(model.weights)
    except ValueError:
        return False
