"""Step agreement, carried inside a gradient bucket instead of a collective of its own.

Every rank writes its training step into a small region at the end of the first gradient
bucket: ``size`` slots of ``limbs`` elements, zero everywhere except its own slot, which holds
the step split into limbs small enough that the bucket's dtype represents them exactly (8 bits
for float16/bfloat16, 16 for float32, 32 for float64 and wide integers). The region is summed
with the gradients but never scaled; since each slot has one non-zero contribution, the sum is
exact, and afterwards every rank reads every rank's step. If they differ, every rank raises
:class:`~syncdp.StepMismatchError` naming the ranks, and the step's update is never applied.

``join()`` ends that agreement on purpose: ranks with uneven data made different numbers of
steps before it. A group's :class:`Agreement` then counts each rank's steps from where that
rank stood at its first reduction after the join, so the next epoch's steps agree again.
"""

from __future__ import annotations

import numpy as np

from syncdp.base.errors import StepMismatchError

__all__ = [
    "limbs_for",
    "encode",
    "decode",
    "check",
    "Agreement",
    "agreement",
    "rebase",
    "JOINED_STEP",
]

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


def check(steps: list[int], counted: str = "") -> int:
    """Returns the step every rank reported; raises StepMismatchError naming the odd ones.
    Joined ranks (:data:`JOINED_STEP`) are left out. ``counted`` says how the steps were
    counted, for the message."""
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
        f"{odd}; {_ranks(by_step[majority])} at step {majority}{counted}. A rank skipped or "
        "repeated a step (uneven data, a rank-dependent `continue` or early exit); give every "
        "rank the same number of steps (syncdp.data.tfrecord_dataset does), or end each "
        "rank's data with syncdp.join()."
    )


class Agreement:
    """The step check of one group (a communicator), across ``join()``.

    Until a rank joins, it is :func:`check` itself. When a ``join()`` ends (:meth:`rebase`, on
    every rank of the group at the same point of its collectives), each rank's step at the
    group's next reduction it takes part in becomes its new start: from then on a rank's step
    is counted as the steps it made since, added to the step of a rank that stood at the join
    (the first such rank's, else the first active rank's). So uneven epochs, each ended by
    ``join()``, agree again afterwards, and a rank that skips a step later is still caught.
    When every rank's step falls back to one value below every step of the check before (a
    count started anew on every rank: a new optimizer's ``iterations``), the shift ends. Steps
    made equal right after a join (``iterations`` broadcast from the last rank to join) are
    taken as each rank's new start anyway; made equal later, they read as a skipped step.
    Every rank that checks reads the same steps in the same checks, so every rank shifts them
    alike (a joined rank's stand-ins check nothing, and after a join every rank's start is
    taken anew).

    Args:
        size: The number of ranks in the group.
    """

    def __init__(self, size: int):
        self.offsets = [0] * size  # subtracted from each rank's step before the check
        self.shifted = False  # whether any offset is not 0
        self.pending: set[int] = set()  # ranks whose start is not known yet since a join
        self.floor: int | None = None  # while shifted, the lowest step of the last check

    def rebase(self) -> None:
        """A ``join()`` of the group has ended: every rank's steps start anew."""
        self.pending = set(range(len(self.offsets)))

    def check(self, steps: list[int]) -> int:
        """:func:`check` on the steps counted as above; returns the agreed (counted) step."""
        if self.pending:
            self._restart(steps)
        if not self.shifted:
            self.floor = None
            return check(steps)
        restarted = self.floor is not None and steps[0] < self.floor
        if restarted and JOINED_STEP not in steps and steps.count(steps[0]) == len(steps):
            # Every rank's count went back to one value: a count started anew on every rank
            # (a new optimizer's iterations). No longer shifted.
            self.offsets = [0] * len(self.offsets)
            self.shifted = False
            self.floor = None
            return steps[0]
        active = [s for s in steps if s != JOINED_STEP]
        if active:
            self.floor = min(active)
        counted = [s if s == JOINED_STEP else s - o for s, o in zip(steps, self.offsets)]
        return check(counted, " (steps counted on from the last join(), where ranks differed)")

    def _restart(self, steps: list[int]) -> None:
        active = [r for r, s in enumerate(steps) if s != JOINED_STEP]
        if not active:
            return
        settled = [r for r in active if r not in self.pending]
        if settled:
            ref = steps[settled[0]] - self.offsets[settled[0]]
        else:
            ref = steps[active[0]]
        for r in active:
            if r in self.pending:
                self.offsets[r] = steps[r] - ref
                self.pending.discard(r)
        self.shifted = any(self.offsets)


class _Agreements:
    """A group's step checks, one per source of steps (the bucket that carries them: a
    tape's count, an optimizer's ``iterations``), each shifted on its own after a join. One
    first used after a join counts from where each rank stands then."""

    def __init__(self, size: int):
        self.size = size
        self.joined = False
        self.by_source: dict[str, Agreement] = {}

    def get(self, source: str) -> Agreement:
        found = self.by_source.get(source)
        if found is None:
            found = self.by_source[source] = Agreement(self.size)
            if self.joined:
                found.rebase()
        return found

    def rebase(self) -> None:
        self.joined = True
        for each in self.by_source.values():
            each.rebase()


def agreement(comm, source: str) -> Agreement:
    """The step check of communicator ``comm``'s group for steps from ``source`` (the name of
    the bucket that carries them), made at its first use."""
    if comm.steps is None:
        comm.steps = _Agreements(comm.size)
    return comm.steps.get(source)


def rebase(comm) -> None:
    """A ``join()`` of ``comm``'s group has ended: every source's steps start anew."""
    if comm.steps is None:
        comm.steps = _Agreements(comm.size)
    comm.steps.rebase()
