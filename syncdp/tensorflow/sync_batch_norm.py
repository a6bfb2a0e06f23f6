"""SyncBatchNormalization: batch normalization whose statistics come from every rank's batch.

In training each rank computes, over its own batch, the count ``n_r``, the mean ``m_r`` and the
mean of squares ``m_r^2 + v_r``; one allreduce sums ``n_r``, ``n_r m_r`` and
``n_r (m_r^2 + v_r)`` over the ranks, which gives the mean and (biased) variance of the
concatenated global batch exactly, whatever each rank's batch size (with a mask, the sums of
the mask's weights, of the weighted values and of their squares). Those normalize the batch
and update the moving statistics, as one process on the whole batch would. Inference uses the
moving statistics and sends nothing.

The layer is a subclass of the ``BatchNormalization`` of one Keras: :func:`for_package` builds
it for a Keras package (once per package), and ``SyncBatchNormalization`` here, as in Horovod's
``horovod.tensorflow``, is the one for the Keras ``tf.keras`` stands for (Keras 2 under
``TF_USE_LEGACY_KERAS=1``, Keras 3 otherwise); ``syncdp.keras.SyncBatchNormalization`` is Keras
3's.
"""

from __future__ import annotations

import functools
import inspect
from types import ModuleType

import tensorflow as tf

from syncdp.job import runtime
from syncdp.tensorflow import collectives
from syncdp.tensorflow.keras2_names import package_behind_tf_keras

__all__ = ["SyncBatchNormalization"]  # noqa: F822 - from __getattr__


@functools.cache
def for_package(keras: ModuleType) -> type:
    """The SyncBatchNormalization layer class for ``keras`` (Keras 3's or tf-keras's package).

    Args:
        keras: The Keras package whose ``layers.BatchNormalization`` the layer extends.

    Returns:
        The layer class, registered with that Keras as ``syncdp>SyncBatchNormalization``.
    """
    base = keras.layers.BatchNormalization
    # Keras 2's layer takes fused= (and picks the fused kernel by default for 4-D inputs,
    # which computes its moments where they cannot be reduced); Keras 3's has no such argument.
    # tf-keras declares it on BatchNormalizationBase, below the class's **kwargs.
    takes_fused = any(
        "fused" in inspect.signature(cls.__init__).parameters
        for cls in base.__mro__
        if "__init__" in vars(cls)
    )

    @keras.saving.register_keras_serializable(package="syncdp")
    class SyncBatchNormalization(base):
        """``BatchNormalization`` with batch statistics reduced across the ranks.

        Takes its Keras' arguments (``axis``, ``momentum``, ``epsilon``, ..., and Keras 2's
        ``renorm``, ``virtual_batch_size``, ...). ``fused`` is accepted for Horovod
        compatibility and must be False. Every rank must call the layer in training at the same
        points (the reduction is a collective).

        Raises:
            ValueError: ``fused`` is True or None.

        Example:
            >>> bn = syncdp.tensorflow.SyncBatchNormalization(momentum=0.9)
            >>> y = bn(x, training=True)  # normalized with the global batch's statistics
        """

        def __init__(self, fused=False, **kwargs):
            if fused in (True, None):
                raise ValueError("SyncBatchNormalization does not support fused=True.")
            kwargs.setdefault("name", "sync_batch_normalization")
            if takes_fused:
                kwargs["fused"] = False
            super().__init__(**kwargs)

        def build(self, input_shape):
            super().build(input_shape)
            if getattr(self, "fused", False):  # its moments would be this rank's alone
                raise ValueError(
                    f"{type(self).__name__}: this Keras chose its fused kernel, whose batch "
                    "statistics cannot be reduced across the ranks."
                )

        # Keras 2 computes this rank's batch moments in _calculate_mean_and_var (its own
        # synchronized layer's hook), Keras 3 in _moments (a name Keras 2 also has, with other
        # arguments): the layer takes its Keras' hook, and both end in the same reduction.
        if hasattr(base, "_calculate_mean_and_var"):

            def _calculate_mean_and_var(self, inputs, reduction_axes, keep_dims, mask=None):
                mean, variance = super()._calculate_mean_and_var(
                    inputs, reduction_axes, keep_dims, mask=mask
                )
                if mask is not None:  # tf.nn.weighted_moments: the mask's values weigh rows
                    weights = tf.cast(mask, tf.float64)
                    return _global_masked_moments(inputs, weights, reduction_axes, mean, 0.0)
                return _global_moments(inputs, mean, variance)

        else:

            def _moments(self, inputs, mask):
                mean, variance = super()._moments(inputs, mask)
                if mask is not None:  # Keras 3: rows in or out, sums over (weights + epsilon)
                    weights = tf.cast(tf.cast(mask, tf.bool), tf.float64)
                    epsilon = keras.config.epsilon()
                    axes = self._reduction_axes
                    return _global_masked_moments(inputs, weights, axes, mean, epsilon)
                return _global_moments(inputs, mean, variance)

    SyncBatchNormalization.__qualname__ = SyncBatchNormalization.__name__
    return SyncBatchNormalization


def _global_moments(inputs, mean, variance):
    """The mean and variance of every rank's batch together, from this rank's (a collective)."""
    if runtime.size() == 1:
        return mean, variance
    dtype = mean.dtype
    mean64, var64 = tf.cast(mean, tf.float64), tf.cast(variance, tf.float64)
    count = tf.cast(tf.size(inputs), tf.float64) / tf.cast(tf.size(mean), tf.float64)
    # An empty batch (a rank's share of an uneven split) has NaN moments: it adds nothing.
    local = tf.concat(
        [
            tf.reshape(count, [1]),
            tf.reshape(tf.math.multiply_no_nan(mean64, count), [-1]),
            tf.reshape(tf.math.multiply_no_nan(var64 + tf.square(mean64), count), [-1]),
        ],
        axis=0,
    )
    total = collectives.allreduce(local, op=collectives.Sum, name="sync_batch_norm")
    k = tf.size(mean)
    n = total[0]
    global_mean = tf.reshape(total[1 : 1 + k] / n, tf.shape(mean))
    mean_square = tf.reshape(total[1 + k :] / n, tf.shape(mean))
    global_var = tf.maximum(mean_square - tf.square(global_mean), 0.0)
    return tf.cast(global_mean, dtype), tf.cast(global_var, dtype)


def _global_masked_moments(inputs, weights, axes, like, epsilon: float):
    """The weighted mean and variance of every rank's batch together (a collective), as the
    layer's Keras computes them on one batch with a mask: ``weights`` (the mask, one weight
    per row) weigh each row, over ``axes``; sums are divided by the weights' sum plus
    ``epsilon`` (0: divided where not 0). Shaped and typed as ``like``, this rank's mean.

    From each rank the sums of the weights, of the weighted values and of their squares,
    reduced together: the variance about the global mean is ``Q - 2 m S + m^2 W`` over them.
    """
    x = tf.cast(inputs, tf.float64)
    w = tf.broadcast_to(tf.expand_dims(weights, -1), tf.shape(x))
    sums = [tf.reduce_sum(t, axis=axes) for t in (w, w * x, w * tf.square(x))]
    local = tf.concat([tf.reshape(t, [-1]) for t in sums], axis=0)
    if runtime.size() > 1:
        local = collectives.allreduce(local, op=collectives.Sum, name="sync_batch_norm")
    total_w, total_s, total_q = tf.split(local, 3)
    if epsilon:
        mean = total_s / (total_w + epsilon)
        spread = total_q - 2.0 * mean * total_s + tf.square(mean) * total_w
        variance = spread / (total_w + epsilon)
    else:
        mean = tf.math.divide_no_nan(total_s, total_w)
        spread = total_q - 2.0 * mean * total_s + tf.square(mean) * total_w
        variance = tf.math.divide_no_nan(spread, total_w)
    variance = tf.maximum(variance, 0.0)
    shape = tf.shape(like)
    return (
        tf.cast(tf.reshape(mean, shape), like.dtype),
        tf.cast(tf.reshape(variance, shape), like.dtype),
    )


def __getattr__(name: str):
    # Built on first use, for the Keras tf.keras stands for (Horovod's tf.keras layer).
    if name == "SyncBatchNormalization":
        return for_package(package_behind_tf_keras())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
