"""Fusion: many tensors -> few contiguous buffers -> one collective each -> the tensors again.

The plan is made once, when the graph is traced, from the tensors' static sizes and dtypes,
so every rank (running the same graph) gets the same buckets in the same order without
negotiating at run time.

Two ways to fill a buffer live here. :func:`pack` and :func:`unpack` do it with TensorFlow ops
(used for broadcasts, where speed does not matter). The allreduce path does it in NumPy, inside
its collective: :class:`Layout` places every member at an offset aligned to :data:`ALIGN` bytes,
so a reduced member can be handed back to TensorFlow as a view of the buffer with no copy
(TensorFlow adopts aligned NumPy memory as is), and :class:`BufferPool` reuses a buffer once
TensorFlow has released every view of it, so steady-state steps neither allocate nor page-fault.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

__all__ = [
    "ALIGN",
    "Bucket",
    "BufferPool",
    "Layout",
    "aligned_empty",
    "pack",
    "plan_buckets",
    "unpack",
]

# TensorFlow adopts NumPy memory without copying when it is aligned to this many bytes
# (Allocator::kAllocatorAlignment).
ALIGN = 64


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


class Layout:
    """Where each member of a fused buffer lives: aligned offsets, in elements.

    Args:
        sizes: Number of elements of each member, in order.
        itemsize: Bytes per element.

    Attributes:
        offsets: First element of each member in the buffer.
        total: Elements in the buffer, padding included.
    """

    def __init__(self, sizes: Sequence[int], itemsize: int):
        self.sizes = tuple(int(n) for n in sizes)
        step = max(1, ALIGN // itemsize) if ALIGN % itemsize == 0 else 1
        offsets, at = [], 0
        for n in self.sizes:
            offsets.append(at)
            at += -(-n // step) * step
        self.offsets = tuple(offsets)
        self.total = at

    def padding(self) -> list[tuple[int, int]]:
        """The [start, end) element ranges that belong to no member."""
        gaps = []
        for off, n, nxt in zip(self.offsets, self.sizes, self.offsets[1:] + (self.total,)):
            if off + n < nxt:
                gaps.append((off + n, nxt))
        return gaps


def aligned_empty(size: int, dtype) -> np.ndarray:
    """A 1-D uninitialized array of ``size`` elements whose data starts on an :data:`ALIGN`
    byte boundary."""
    dtype = np.dtype(dtype)
    raw = np.empty(size * dtype.itemsize + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start : start + size * dtype.itemsize].view(dtype)


class BufferPool:
    """Aligned buffers kept between steps, reused only when nothing else refers to them.

    A buffer handed out is in use for as long as any NumPy view of it (and so any TensorFlow
    tensor adopting that view) is alive; every view holds a reference to the buffer's base
    array, so the base's reference count says when it is free again.

    Args:
        per_key: Most buffers kept for one key. Defaults to 2 (one in use while the next step
            fills the other).
    """

    def __init__(self, per_key: int = 2):
        self.per_key = per_key
        self._buffers: dict[tuple, list[np.ndarray]] = {}
        # What the counts read for a buffer that only the pool holds, measured the same way.
        probe = [aligned_empty(1, np.uint8)]
        self._idle_refs = self._counts(probe[0])

    def get(self, key, size: int, dtype) -> np.ndarray:
        """A zero-padded aligned buffer of ``size`` elements for ``key``, reused when free.

        The caller overwrites every element it uses; elements it never writes (padding) stay
        as they were, zero.
        """
        dtype = np.dtype(dtype)
        kept = self._buffers.setdefault((key, size, dtype.str), [])
        for i in range(len(kept)):
            counts = self._counts(kept[i])
            if counts[0] <= self._idle_refs[0] and counts[1] <= self._idle_refs[1]:
                return kept[i]
        buf = aligned_empty(size, dtype)
        buf.view(np.uint8)[...] = 0
        if len(kept) < self.per_key:
            kept.append(buf)
        return buf

    @staticmethod
    def _counts(buf: np.ndarray) -> tuple[int, int]:
        # Views of buf point at its memory-owning base, so both counts matter: buf's for
        # holders of the buffer itself, the base's for every view. Measured through this one
        # function, so the references the call itself adds are the same every time.
        return sys.getrefcount(buf), sys.getrefcount(buf.base)

    def clear(self) -> None:
        """Drops every kept buffer (views in use stay valid)."""
        self._buffers.clear()
