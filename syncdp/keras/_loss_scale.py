"""Mixed precision: a loss scale around a DistributedOptimizer skips a step on every rank or none.

Under the ``mixed_float16`` policy Keras' ``compile()`` wraps the optimizer in a
``LossScaleOptimizer``, which skips the update when the gradients overflow. It decides on the
gradients it sees: were those each rank's own, a rank whose gradients overflowed would skip the
step, and its collectives, while the others reduce, and the ranks would go on averaging the
gradients of different batches. So the ranks are made to agree:

- Keras 3: the loss scale checks the gradients before the optimizer it wraps sees them, so its
  check is patched, on that one instance, to ask every rank (:func:`agree_on_overflow`: one
  small allreduce per step).
- Keras 2 (tf-keras): the loss scale asks the optimizer it wraps to aggregate the gradients
  before its check (``aggregate_gradients``), where the DistributedOptimizer reduces them: a
  value that overflowed on one rank overflows in the sum on every rank. When gradients are
  accumulated locally (``backward_passes_per_step > 1``) there is no sum yet, and
  :func:`nan_unless_finite_everywhere` makes them agree.

``DistributedOptimizer(LossScaleOptimizer(opt))`` is turned around under Keras 3
(:func:`inside_loss_scale`) and refused under Keras 2 (:func:`is_keras2_loss_scale`): compile
would wrap anything but a loss scale in a second one, which unscales the gradients twice.
"""

from __future__ import annotations

import types
from types import ModuleType

import tensorflow as tf

from syncdp.tensorflow import collectives as ops

__all__ = [
    "agree_on_overflow",
    "inside_loss_scale",
    "is_keras2_loss_scale",
    "loss_scale_class",
    "nan_unless_finite_everywhere",
]


def loss_scale_class(keras_: ModuleType | None) -> type | None:
    """Keras 3's ``LossScaleOptimizer`` class; None for Keras 2 (whose loss scale checks what
    the DistributedOptimizer's ``aggregate_gradients`` returns, so its check needs no patch)."""
    if keras_ is None or not hasattr(keras_.optimizers, "LossScaleOptimizer"):
        return None
    scaler = keras_.optimizers.LossScaleOptimizer
    return scaler if hasattr(scaler, "check_finite") else None


def is_keras2_loss_scale(optimizer) -> bool:
    """Whether ``optimizer`` is tf-keras' ``LossScaleOptimizer``."""
    return "LossScaleOptimizer" in type(optimizer).__name__ and not hasattr(
        optimizer, "check_finite"
    )


def inside_loss_scale(cls, scaled, scaler: type, args, kwargs):
    """``DistributedOptimizer(LossScaleOptimizer(opt))`` under Keras 3, made
    ``LossScaleOptimizer(DistributedOptimizer(opt))`` with the same scaling: Keras' compile
    keeps a LossScaleOptimizer as it is, and the loss scale's overflow check then runs on every
    rank alike (:func:`agree_on_overflow`)."""
    if scaled.built:
        raise ValueError(
            "Wrap the LossScaleOptimizer in DistributedOptimizer before it is built (before "
            "compile() or its first step)."
        )
    inner = cls(scaled.inner_optimizer, *args, **kwargs)
    return scaler(
        inner,
        initial_scale=scaled.initial_scale,
        dynamic_growth_steps=scaled.dynamic_growth_steps,
        name=scaled.name,
    )


def agree_on_overflow(optimizer, caller) -> None:
    """Makes a Keras 3 ``LossScaleOptimizer`` around the DistributedOptimizer ``optimizer``
    skip a step on every rank or on none.

    The loss scale is found as ``caller``, the frame that called ``optimizer.build()``: it
    builds the optimizer it wraps before its first check. Its ``check_finite`` is replaced, on
    that instance, by one that asks every rank of the optimizer's process set.
    """
    scaler = loss_scale_class(optimizer._keras)
    outer = caller.f_locals.get("self")
    if scaler is None or not isinstance(outer, scaler):
        return
    if getattr(outer, "inner_optimizer", None) is not optimizer:
        return
    if "check_finite" in vars(outer):  # done already
        return
    local_check = type(outer).check_finite
    name = f"{optimizer._collective_name}.finite"

    def check_finite(self, grads):
        return _everywhere(local_check(self, grads), name, optimizer.process_set)

    outer.check_finite = types.MethodType(check_finite, outer)


def nan_unless_finite_everywhere(grads, *, name: str, process_set) -> list:
    """``grads`` as they are where every rank's are finite; all NaN, on every rank, where one
    rank's are not (a collective: one small allreduce).

    Args:
        grads: Gradients (tensors, ``tf.IndexedSlices`` or None).
        name: The collective's name.
        process_set: The ranks that agree.

    Returns:
        The gradients, in order.
    """
    finite = tf.reduce_all(
        [tf.reduce_all(tf.math.is_finite(_values(g))) for g in grads if g is not None]
    )
    keep = tf.where(_everywhere(finite, name, process_set), 1.0, float("nan"))
    return [None if g is None else _scaled(g, keep) for g in grads]


def _everywhere(finite, name: str, process_set):
    """Whether ``finite`` (a boolean tensor) holds on every rank of ``process_set``."""
    everywhere = ops.allreduce(
        tf.cast(finite, tf.int32), op=ops.Min, name=name, process_set=process_set
    )
    return tf.equal(everywhere, 1)


def _values(grad):
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def _scaled(grad, factor):
    if isinstance(grad, tf.IndexedSlices):
        values = grad.values * tf.cast(factor, grad.values.dtype)
        return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
    return grad * tf.cast(factor, grad.dtype)
