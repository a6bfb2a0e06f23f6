"""Fusion: many tensors -> few contiguous buffers -> one collective each -> the tensors again.

The plan is made once, when the graph is traced, from the tensors' static sizes and dtypes,
so every rank (running the same graph) gets the same buckets in the same order without
negotiating at run time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import tensorflow as tf

__all__ = ["Bucket", "plan_buckets", "pack", "unpack"]


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Tensors reduced together in one buffer.

    Attributes:
        dtype: The dtype of every tensor in the bucket.
        indices: Positions of the tensors in the list given to :func:`plan_buckets`.
        nbytes: The buffer's size, or -1 when a tensor's size is only known at run time.
    """

    dtype: tf.DType
    indices: tuple[int, ...]
    nbytes: int


def _nbytes(tensor) -> int:
    """Static size in bytes, or -1 when the shape is not fully known."""
    shape = tensor.shape
    if not shape.is_fully_defined():
        return -1
    return shape.num_elements() * tensor.dtype.size


def plan_buckets(tensors: Sequence, threshold: int) -> list[Bucket]:
    """Groups ``tensors`` into buckets of one dtype and at most ``threshold`` bytes each.

    Tensors keep their order inside a bucket, and buckets are ordered by their first tensor, so
    the plan depends only on the list's shapes and dtypes. A tensor larger than the threshold,
    or of unknown size, gets a bucket of its own; ``threshold=0`` gives every tensor its own.

    Args:
        tensors: Anything with ``.shape`` and ``.dtype`` (tensors, variables, TensorSpecs).
        threshold: Most bytes per bucket.

    Returns:
        The buckets, covering every index exactly once.
    """
    buckets: list[Bucket] = []
    open_by_dtype: dict[tf.DType, int] = {}  # dtype -> position in buckets of its open bucket
    for i, tensor in enumerate(tensors):
        size = _nbytes(tensor)
        slot = open_by_dtype.get(tensor.dtype)
        if size >= 0 and slot is not None and buckets[slot].nbytes + size <= threshold:
            old = buckets[slot]
            buckets[slot] = Bucket(old.dtype, old.indices + (i,), old.nbytes + size)
            continue
        buckets.append(Bucket(tensor.dtype, (i,), size))
        if 0 <= size < threshold:
            open_by_dtype[tensor.dtype] = len(buckets) - 1
        else:
            open_by_dtype.pop(tensor.dtype, None)
    return buckets


def pack(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    """Flattens and concatenates ``tensors`` (one dtype) into one 1-D buffer."""
    flat = [tf.reshape(t, [-1]) for t in tensors]
    return flat[0] if len(flat) == 1 else tf.concat(flat, axis=0)


def unpack(buffer: tf.Tensor, like: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """Splits a buffer made by :func:`pack` back into tensors shaped like ``like``."""
    if len(like) == 1:
        return [tf.reshape(buffer, _shape_of(like[0]))]
    if all(t.shape.is_fully_defined() for t in like):
        sizes = [t.shape.num_elements() for t in like]
    else:
        sizes = tf.stack([tf.size(t) for t in like])
    pieces = tf.split(buffer, sizes, num=len(like))
    return [tf.reshape(p, _shape_of(t)) for p, t in zip(pieces, like)]


def _shape_of(tensor):
    return tensor.shape if tensor.shape.is_fully_defined() else tf.shape(tensor)
