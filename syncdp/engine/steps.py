"""Step agreement, carried inside a gradient bucket instead of a collective of its own.

Every rank writes its training step into a small region at the end of the first gradient
bucket: ``size`` slots of ``limbs`` elements, zero everywhere except its own slot, which holds
the step split into limbs small enough that the bucket's dtype represents them exactly (8 bits
for float16/bfloat16, 16 for float32, 32 for float64 and wide integers). The region is summed
with the gradients but never scaled; since each slot has one non-zero contribution, the sum is
exact, and afterwards every rank reads every rank's step. If they differ, every rank raises
:class:`~syncdp.StepMismatchError` naming the ranks, and the step's update is never applied.
"""

from __future__ import annotations

import numpy as np

from syncdp.base.errors import StepMismatchError

__all__ = ["limbs_for", "encode", "decode", "check", "JOINED_STEP"]

_STEP_BITS = 64

# The step of a rank that has called join() and stands in for a reduction: left out of the
# check (no training step is negative).
JOINED_STEP = -(1 << 62)


def _limb_bits(dtype: np.dtype) -> int:
    if dtype.kind == "f" or dtype.name == "bfloat16":
        return {2: 8, 4: 16, 8: 32}[dtype.itemsize]
    return min(8 * dtype.itemsize - 1, 32)


def limbs_for(dtype) -> int:
    """Elements per rank that hold a 64-bit step in ``dtype``."""
    bits = _limb_bits(np.dtype(dtype))
    return -(-_STEP_BITS // bits)


def encode(region: np.ndarray, step: int, rank: int, size: int) -> None:
    """Writes this rank's ``step`` into its slot of ``region`` and zeros elsewhere."""
    bits = _limb_bits(region.dtype)
    limbs = limbs_for(region.dtype)
    value = int(step) & ((1 << _STEP_BITS) - 1)
    region[...] = 0
    mask = (1 << bits) - 1
    mine = [(value >> (k * bits)) & mask for k in range(limbs)]
    region[rank * limbs : (rank + 1) * limbs] = np.array(mine, dtype=np.float64).astype(
        region.dtype
    )


def decode(region: np.ndarray, size: int) -> list[int]:
    """Every rank's step from a summed region, in rank order."""
    bits = _limb_bits(region.dtype)
    limbs = limbs_for(region.dtype)
    values = np.asarray(region, dtype=np.float64).reshape(size, limbs)
    steps = []
    for row in values:
        value = sum(int(round(v)) << (k * bits) for k, v in enumerate(row))
        if value >= 1 << (_STEP_BITS - 1):
            value -= 1 << _STEP_BITS
        steps.append(value)
    return steps


def _ranks(ranks) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def first_active(steps: list[int]) -> int:
    """The first step that is not a joined rank's."""
    return next((s for s in steps if s != JOINED_STEP), steps[0])


def check(steps: list[int]) -> int:
    """Returns the step every rank reported; raises StepMismatchError naming the odd ones.
    Joined ranks (:data:`JOINED_STEP`) are left out."""
    if steps.count(steps[0]) == len(steps):  # every step alike: the check of every step
        return steps[0]
    first = first_active(steps)
    if all(s == first or s == JOINED_STEP for s in steps):
        return first
    by_step: dict[int, list[int]] = {}
    for r, s in enumerate(steps):
        if s != JOINED_STEP:
            by_step.setdefault(s, []).append(r)
    majority = max(by_step, key=lambda s: (len(by_step[s]), 0 in by_step[s]))
    odd = ", ".join(
        f"rank {r} is at step {s}" for r, s in enumerate(steps) if s not in (majority, JOINED_STEP)
    )
    raise StepMismatchError(
        "Ranks must reduce gradients of the same step, but they disagree: "
        f"{odd}; {_ranks(by_step[majority])} at step {majority}. A rank skipped or repeated a "
        "step (uneven data, a rank-dependent `continue` or early exit); give every rank the "
        "same number of steps (syncdp.data.tfrecord_dataset does)."
    )
