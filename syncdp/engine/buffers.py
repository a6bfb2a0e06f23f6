"""Fused buffers: where each member lives, and aligned memory reused between steps.

:class:`Layout` places every member of a bucket at an offset aligned to :data:`ALIGN` bytes,
so a reduced member can be handed back to TensorFlow as a view of the buffer with no copy
(TensorFlow adopts aligned NumPy memory as is). :class:`BufferPool` reuses a buffer once
every view of it has been released, so steady-state steps neither allocate nor page-fault.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np

__all__ = ["ALIGN", "BufferPool", "Layout", "aligned_empty"]

# TensorFlow adopts NumPy memory without copying when it is aligned to this many bytes
# (Allocator::kAllocatorAlignment).
ALIGN = 64


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
        # What the reference counts read (as take() reads them) for a buffer only a shelf holds.
        probe = [aligned_empty(1, np.uint8)]
        self._idle_refs = (sys.getrefcount(probe[0]), sys.getrefcount(probe[0].base))

    def get(self, key, size: int, dtype) -> np.ndarray:
        """A zero-padded aligned buffer of ``size`` elements for ``key``, reused when free.

        The caller overwrites every element it uses; elements it never writes (padding) stay
        as they were, zero.
        """
        return self.take(self.shelf(key, size, dtype), size, dtype)

    def shelf(self, key, size: int, dtype) -> list[np.ndarray]:
        """Where the buffers for ``key`` are kept: a caller that asks for the same buffer at
        every step looks its shelf up once and passes it to :meth:`take`."""
        dtype = np.dtype(dtype)  # np.float32 and np.dtype("float32") are one shelf
        kept = self._buffers.get((key, size, dtype))
        if kept is None:
            kept = self._buffers[(key, size, dtype)] = []
        return kept

    def take(self, kept: list[np.ndarray], size: int, dtype) -> np.ndarray:
        """A free buffer from the shelf ``kept``, or a new one (kept there when it has room):
        what :meth:`get` returns."""
        idle_buf, idle_base = self._idle_refs
        for i in range(len(kept)):
            # Views of a buffer point at its memory-owning base, so both counts matter: the
            # buffer's for holders of the buffer itself, the base's for every view.
            if sys.getrefcount(kept[i]) <= idle_buf and sys.getrefcount(kept[i].base) <= idle_base:
                return kept[i]
        buf = aligned_empty(size, dtype)
        buf.view(np.uint8)[...] = 0
        if len(kept) < self.per_key:
            kept.append(buf)
        return buf
