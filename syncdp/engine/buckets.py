"""Bucket planning: which tensors are reduced together, and in what order.

The plan is made once, when a step is traced, from the tensors' static sizes and dtypes, so
every rank (running the same program) gets the same buckets in the same order without
negotiating at run time.

The order is PyTorch DDP's. Gradients are planned from the *last* variable to the first
(``reverse=True``), because backpropagation produces the last layers' gradients first. The
first bucket is small (``first_bytes``, 1 MiB by default) so that its collective can start as
soon as the last layers are differentiated, while the earlier layers are still being computed;
every later bucket fills up to ``cap_bytes`` (25 MiB by default). Each bucket holds one dtype
and is launched when all of its members exist: a bucket's collective depends only on its own
gradients (and, for a fixed order on every rank, on the previous bucket's collective).

Example, three float32 gradients of 0.5, 3 and 2 MiB planned in reverse with the defaults:
bucket 0 = [2] (2 MiB: alone, larger than the first bucket's 1 MiB), bucket 1 = [1, 0]
(3.5 MiB, under the 25 MiB cap).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

__all__ = ["Bucket", "TensorSpec", "plan"]


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """What planning needs to know of a tensor.

    Attributes:
        nbytes: Its size in bytes, or -1 when its shape is only known at run time.
        dtype: Any hashable dtype key; only tensors with equal keys share a bucket.
    """

    nbytes: int
    dtype: Hashable


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Tensors reduced together in one buffer.

    Attributes:
        dtype: The dtype key of every member.
        indices: Positions of the members in the list given to :func:`plan`, in the order
            they are packed.
        nbytes: The members' total size, or -1 when one of them is only known at run time.
    """

    dtype: Hashable
    indices: tuple[int, ...]
    nbytes: int


def plan(
    specs: Sequence[TensorSpec], *, first_bytes: int, cap_bytes: int, reverse: bool = False
) -> list[Bucket]:
    """Groups tensors into buckets of one dtype; returns them in the order to launch them.

    Walks the tensors in order (from the last one when ``reverse``), adding each to the open
    bucket of its dtype while the bucket stays within its limit: ``first_bytes`` for the very
    first bucket, ``cap_bytes`` for every later one. A tensor larger than the limit, or of
    unknown size, gets a bucket of its own. ``cap_bytes=0`` gives every tensor its own bucket.
    Buckets are launched in the order of their first member.

    Args:
        specs: The tensors' sizes and dtypes.
        first_bytes: Most bytes in the first bucket (0: same as ``cap_bytes``).
        cap_bytes: Most bytes in every other bucket.
        reverse: Walk from the last tensor to the first (gradients: backprop order).

    Returns:
        The buckets, covering every index exactly once.
    """
    order = range(len(specs) - 1, -1, -1) if reverse else range(len(specs))
    buckets: list[Bucket] = []
    open_by_dtype: dict[Hashable, int] = {}  # dtype -> index in buckets of its open bucket

    def limit(position: int) -> int:
        if position == 0 and first_bytes and cap_bytes:
            return min(first_bytes, cap_bytes)
        return cap_bytes

    for i in order:
        spec = specs[i]
        slot = open_by_dtype.get(spec.dtype)
        if spec.nbytes >= 0 and slot is not None:
            old = buckets[slot]
            if old.nbytes + spec.nbytes <= limit(slot):
                buckets[slot] = Bucket(old.dtype, old.indices + (i,), old.nbytes + spec.nbytes)
                continue
        buckets.append(Bucket(spec.dtype, (i,), spec.nbytes))
        if 0 <= spec.nbytes < limit(len(buckets) - 1):
            open_by_dtype[spec.dtype] = len(buckets) - 1
        else:
            open_by_dtype.pop(spec.dtype, None)
    return buckets
