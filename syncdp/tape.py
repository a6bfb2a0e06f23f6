"""DistributedGradientTape: a tf.GradientTape whose gradients are averaged over all ranks."""

from __future__ import annotations

import tensorflow as tf

from syncdp import ops
from syncdp.compression import Compression

__all__ = ["DistributedGradientTape", "reduce_gradients"]


def reduce_gradients(grads, *, op=ops.Average, compression=Compression.none,
                     sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                     name: str = "gradients"):
    """Averages (or sums) a list of gradients over all ranks in fused collectives.

    A synchronization point. Gradients are bucketed from the last one to the first, because the
    backward pass produces the last layers' gradients first: the first bucket can then start
    reducing while earlier layers are still being differentiated.

    Args:
        grads: Tensors, ``tf.IndexedSlices`` or None (kept None).
        op: ``Average`` or ``Sum``. Defaults to ``Average``.
        compression: ``Compression.none`` or ``Compression.fp16``. Defaults to none.
        sparse_as_dense: Reduce IndexedSlices as dense tensors. Defaults to False.
        gradient_predivide_factor: Divide by this before the sum and by size/factor after it
            (Average only). Defaults to 1.
        name: Name prefix in the timeline. Defaults to "gradients".

    Returns:
        The reduced gradients, in the order given.
    """
    grads = list(grads)
    if sparse_as_dense:
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                 for g in grads]
    prescale = postscale = 1.0
    if gradient_predivide_factor != 1.0:
        if op is not ops.Average:
            raise ValueError("gradient_predivide_factor needs op=Average.")
        prescale = 1.0 / gradient_predivide_factor
        postscale = gradient_predivide_factor
    reduced = ops.grouped_allreduce(grads[::-1], op=op, compression=compression,
                                    prescale_factor=prescale, postscale_factor=postscale,
                                    name=name)
    return reduced[::-1]


class DistributedGradientTape:
    """Wraps a ``tf.GradientTape`` so that ``gradient()`` returns gradients averaged over ranks.

    Use it like Horovod's: record with a tape, wrap it, and ask for gradients; or open it as
    the context manager itself. ``gradient()`` is a synchronization point.

    Args:
        gradtape: The ``tf.GradientTape`` to wrap.
        device_dense: Accepted for Horovod compatibility.
        device_sparse: Accepted for Horovod compatibility.
        compression: ``Compression.none`` or ``Compression.fp16``. Defaults to none.
        sparse_as_dense: Reduce IndexedSlices gradients as dense tensors. Defaults to False.
        op: ``Average`` or ``Sum``. Defaults to ``Average``.
        gradient_predivide_factor: See :func:`reduce_gradients`. Defaults to 1.
        num_groups: Accepted for Horovod compatibility; fusion is set by the threshold.
        groups: Accepted for Horovod compatibility.

    Example:
        >>> with tf.GradientTape() as tape:
        ...     loss = loss_fn(model(x), y)
        >>> tape = syncdp.DistributedGradientTape(tape)
        >>> grads = tape.gradient(loss, model.trainable_variables)
    """

    def __init__(self, gradtape: tf.GradientTape, device_dense: str = "",
                 device_sparse: str = "", compression=Compression.none,
                 sparse_as_dense: bool = False, op=ops.Average,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None):
        self._tape = gradtape
        self._options = dict(op=op, compression=compression, sparse_as_dense=sparse_as_dense,
                             gradient_predivide_factor=gradient_predivide_factor)

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def __getattr__(self, name):
        # watch(), stop_recording(), reset(), jacobian() ... belong to the wrapped tape.
        return getattr(self._tape, name)

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        """Like ``tf.GradientTape.gradient``, then reduced over all ranks (a collective)."""
        grads = self._tape.gradient(target, sources, output_gradients, unconnected_gradients)
        flat = tf.nest.flatten(grads, expand_composites=False)
        reduced = reduce_gradients(flat, **self._options)
        return tf.nest.pack_sequence_as(grads, reduced)
