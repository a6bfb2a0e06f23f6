"""Horovod's ``hvd.elastic`` for TensorFlow: states of variables and Keras models.

``import syncdp.tensorflow as hvd`` gives ``hvd.elastic.run``, ``hvd.elastic.run_fn``,
``hvd.elastic.State``, ``hvd.elastic.ObjectState``, ``hvd.elastic.TensorFlowState`` and
``hvd.elastic.TensorFlowKerasState`` (see :mod:`syncdp.elastic` for how recovery works), and,
as Horovod's module does, ``broadcast_object`` and ``broadcast_object_fn``.
A state's ``commit()`` copies the variables' values into host memory on every rank; nothing is
written to disk. ``sync()`` broadcasts rank 0's values (fused, like
:func:`~syncdp.tensorflow.broadcast_variables`).
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from syncdp.base.errors import HorovodInternalError, HostsUpdatedInterrupt, RankFailureError
from syncdp.elastic import ObjectState, State, run, run_fn
from syncdp.tensorflow.collectives import broadcast_object, broadcast_object_fn, broadcast_variables
from syncdp.tensorflow.keras2_names import create_optimizer_variables, optimizer_state

__all__ = [
    "run",
    "run_fn",
    "broadcast_object",
    "broadcast_object_fn",
    "State",
    "ObjectState",
    "TensorFlowState",
    "TensorFlowKerasState",
    "RankFailureError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
]


class _VariablesState(ObjectState):
    """An ObjectState that also saves, restores and syncs a list of variables."""

    def _variables(self) -> list:
        raise NotImplementedError

    def save(self) -> None:
        self._saved_values = [v.numpy() for v in self._variables()]
        super().save()

    def restore(self) -> None:
        for v, value in zip(self._variables(), self._saved_values):
            v.assign(value)
        super().restore()

    def sync(self) -> None:
        broadcast_variables(self._variables(), root_rank=0)
        super().sync()  # ends with save()


class TensorFlowState(_VariablesState):
    """State of TensorFlow variables plus any picklable values (eager TensorFlow 2).

    Args:
        variables: The variables to keep. Defaults to every global variable (TF1 only, so
            give them in TensorFlow 2).
        session: Accepted for Horovod compatibility; TF1 sessions are not supported here.
        **kwargs: Picklable values, read back as attributes (``state.epoch``).

    Raises:
        ValueError: No variables were given.
    """

    def __init__(self, variables: Sequence[tf.Variable] | None = None, session=None, **kwargs):
        if session is not None:
            raise ValueError(
                "TensorFlowState with a TF1 session is not supported; pass the variables of an "
                "eager TensorFlow 2 program."
            )
        if variables is None:
            variables = tf.compat.v1.global_variables()
        self.variables = list(variables)
        if not self.variables:
            raise ValueError("TensorFlowState needs the variables to keep; got none.")
        super().__init__(**kwargs)
        self._saved_values = [v.numpy() for v in self.variables]

    def _variables(self) -> list:
        return self.variables


def _wraps(outer, optimizer) -> bool:
    """Whether ``outer`` is ``optimizer`` (None: any), or wraps it (``inner_optimizer``)."""
    while outer is not None:
        if optimizer is None or outer is optimizer:
            return True
        outer = getattr(outer, "inner_optimizer", None)
    return False


class TensorFlowKerasState(_VariablesState):
    """State of a Keras model and its optimizer, plus any picklable values.

    The optimizer's variables (slots, iteration count) are created before the first sync, so a
    replacement, whose optimizer has not run yet, receives them too. Keras 3 and Keras 2
    (tf-keras, its legacy optimizers included) alike: the state follows the objects given.

    Args:
        model: A built Keras model.
        optimizer: Its optimizer. Defaults to ``model.optimizer``, which is also taken when
            it wraps ``optimizer`` (the LossScaleOptimizer ``compile()`` puts around it under
            mixed precision, whose loss scale is then kept too).
        backend: Accepted for Horovod compatibility.
        **kwargs: Picklable values, read back as attributes (``state.epoch``, ``state.batch``).
    """

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        if not getattr(model, "built", True):
            # Its optimizer would be built for no variables, and fit() would fail naming it.
            raise ValueError(
                "the model must be built before its state is made: give it an Input layer, "
                "or call model.build(input_shape) or model(batch) first."
            )
        self.model = model
        compiled = getattr(model, "optimizer", None)
        # compile() under mixed precision wraps the optimizer given it in a LossScaleOptimizer,
        # whose scale is state too: replicas that scale differently round differently.
        self.optimizer = compiled if _wraps(compiled, optimizer) else optimizer
        super().__init__(**kwargs)
        self._saved_values = [v.numpy() for v in self._variables()]

    def save(self) -> None:
        """Keeps the current values (``commit()`` calls it on every rank). Partway through a
        ``backward_passes_per_step`` window, every rank first takes the ranks' mean of the
        gradients accumulated so far (a collective then): a reset restores the commit and gives
        every rank rank 0's, which then carries every rank's passes, not rank 0's alone."""
        optimizer = self.optimizer
        while optimizer is not None and not hasattr(optimizer, "share_pending_gradients"):
            optimizer = getattr(optimizer, "inner_optimizer", None)  # a LossScaleOptimizer's
        if optimizer is not None and tf.executing_eagerly():
            optimizer.share_pending_gradients()
        super().save()

    def _variables(self) -> list:
        variables = list(self.model.variables)
        opt = self.optimizer
        if opt is not None:
            create_optimizer_variables(opt, self.model.trainable_variables)
            variables += optimizer_state(opt)
        return variables
