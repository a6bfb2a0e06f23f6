"""The collectives of Horovod's Keras modules, whose arguments come in another order than the
TensorFlow module's.

``horovod.keras`` and ``horovod.tensorflow.keras`` take ``allreduce(value, name, average,
...)`` and ``reducescatter(value, name, op)``, where ``horovod.tensorflow`` takes
``allreduce(tensor, average, ...)`` and ``reducescatter(tensor, device_dense, compression,
op, ...)``. A Keras program that passes them positionally gets Horovod's meaning here. Both
call :mod:`syncdp.tensorflow.collectives`; ``allgather`` and ``broadcast`` take the same order
in both modules and are the TensorFlow ones.
"""

from __future__ import annotations

from syncdp.tensorflow import collectives
from syncdp.tensorflow.compression import Compression

__all__ = ["allreduce", "reducescatter"]


def allreduce(
    value,
    name: str | None = None,
    average=None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    op=None,
    compression=Compression.none,
    *,
    process_set=collectives.global_process_set,
):
    """Reduces ``value`` over the ranks; every one of them gets the result.

    A synchronization point: all ranks of the set must call it, in the same order, with the
    same shape and dtype. Horovod's Keras signature; otherwise
    :func:`syncdp.tensorflow.allreduce`.

    Args:
        value: A tensor, NumPy array or number.
        name: Name of the collective in the timeline. Defaults to "allreduce".
        average: Deprecated Horovod spelling: True for Average, False for Sum.
        prescale_factor: Multiplies the value before the reduction. Defaults to 1.
        postscale_factor: Multiplies the result after it. Defaults to 1.
        op: ``Average``, ``Sum``, ``Min``, ``Max``, ``Product`` or ``Adasum``. Defaults to
            ``Average``.
        compression: ``Compression.none`` or ``Compression.fp16``. Defaults to none.
        process_set: The ranks that reduce together. Defaults to the whole job.

    Returns:
        The reduced tensor.

    Example:
        >>> mean_loss = hvd.allreduce(np.float32(loss), "loss")
    """
    return collectives.allreduce(
        value,
        average=average,
        compression=compression,
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        name=name,
        process_set=process_set,
    )


def reducescatter(
    value,
    name: str | None = None,
    op=collectives.Average,
    *,
    process_set=collectives.global_process_set,
):
    """Reduces ``value`` over the ranks and gives each rank a slice of the first dimension.

    A synchronization point, with every rank passing the same shape. Horovod's Keras
    signature; otherwise :func:`syncdp.tensorflow.reducescatter`.

    Args:
        value: A tensor, NumPy array or list of rank >= 1.
        name: Name of the collective in the timeline. Defaults to "reducescatter".
        op: ``Average``, ``Sum``, ``Min``, ``Max`` or ``Product``. Defaults to ``Average``.
        process_set: The ranks that take part. Defaults to the whole job.

    Returns:
        This rank's rows of the reduction.

    Example:
        >>> rows = hvd.reducescatter(np.ones([hvd.size(), 3], np.float32), "rows", hvd.Sum)
    """
    return collectives.reducescatter(
        value,
        op=op,
        name=name,
        process_set=process_set,
    )
