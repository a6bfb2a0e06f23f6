"""Horovod's ``join()``: a rank out of data stands in for the others' reductions until all join.

A rank that calls ``join()`` (:func:`join`) leaves its training loop but keeps answering the
argument check that starts every reduction of the others (:meth:`Communicator.join_round`).
When an active rank's reduction finds joined ranks there, the active ranks send them a
:func:`task`: what the bucket is (dtype, op, its members' sizes, whether it carries the step).
Each joined rank then runs the same :class:`~syncdp.engine.reducer.BucketReducer` on arrays of
that reduction's identity (zeros for a sum or an average, so the joined rank adds nothing; the
largest value for a min, the smallest for a max, ones for a product), so every rank runs the
same collectives in the same order. An average still divides by every rank of the group, as
Horovod's does. A joined rank's step is :data:`~syncdp.engine.steps.JOINED_STEP`, which the
step check leaves out; once every rank has joined, the group's step check counts each rank's
steps anew (:class:`~syncdp.engine.steps.Agreement`).

An allgather's task (:func:`gather_task`) has the joined rank give no rows, as Horovod's does,
so sparse gradients (gathered rows and indices) train on too. An Adasum's
(:func:`adasum_task`) has it give zeros, which Adasum leaves out.

Once every rank has joined, ``join()`` returns on every rank the rank that joined last.
Other collectives (broadcasts, alltoall, reducescatter, barriers, objects) cannot run while a
rank has joined: they raise on the active ranks, and the joined ranks wait on.
"""

from __future__ import annotations

import numpy as np

from syncdp.engine import steps as _steps
from syncdp.engine.reducer import BucketReducer

__all__ = ["task", "gather_task", "adasum_task", "stand_in", "join"]


def task(reducer: BucketReducer, sizes) -> dict:
    """What a joined rank needs to stand in for ``reducer`` on members of ``sizes`` elements."""
    return {
        "kind": "reduce",
        "dtype": reducer.dtype.name,
        "op": reducer.op,
        "sizes": tuple(int(n) for n in sizes),
        "carry_step": reducer.carry_step,
        "name": reducer.name,
        # A rank may scale a share of every rank's sum (float16's path): the joined one too.
        # Every other reduction is scaled by each rank before it sends, and a joined rank's
        # identity must go out unscaled (the product's 1 would become the prescale, and an
        # integer minimum's largest value would overflow).
        "prescale": reducer.prescale if reducer.scales_on_receipt else 1.0,
        "postscale": reducer.postscale,
    }


def gather_task(array: np.ndarray, name: str) -> dict:
    """What a joined rank needs to stand in for an allgather of ``array``: it gives no rows."""
    return {
        "kind": "allgather",
        "dtype": array.dtype.name,
        "trailing": tuple(int(d) for d in array.shape[1:]),
        "name": name,
    }


def adasum_task(array: np.ndarray, name: str) -> dict:
    """What a joined rank needs to stand in for an Adasum of ``array``: it gives zeros, which
    Adasum leaves out (a zero gradient combined with any other gives that other)."""
    return {"kind": "adasum", "dtype": array.dtype.name, "size": int(array.size), "name": name}


def _identity(dtype: np.dtype, op: str):
    if op in ("sum", "average"):
        return 0
    if op == "product":
        return 1
    if dtype.kind == "f" or dtype.name == "bfloat16":
        return np.inf if op == "min" else -np.inf
    info = np.iinfo(dtype)
    return info.max if op == "min" else info.min


def _dtype(spec: dict) -> np.dtype:
    if spec["dtype"] == "bfloat16":  # not a dtype NumPy knows by name
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(spec["dtype"])


def stand_in(comm, spec: dict) -> None:
    """Runs the collective ``spec`` (a :func:`task` or :func:`gather_task`) with this rank's
    identity contribution: the op's identity, or no rows."""
    dtype = _dtype(spec)
    if spec["kind"] == "allgather":
        comm.allgather(np.empty((0, *spec["trailing"]), dtype), name=spec["name"])
        return
    if spec["kind"] == "adasum":
        comm.allgather_equal(np.zeros(spec["size"], dtype), name=spec["name"])
        return
    reducer = BucketReducer(
        dtype,
        spec["op"],
        prescale=spec["prescale"],
        postscale=spec["postscale"],
        name=spec["name"],
        carry_step=spec["carry_step"],
    )
    fill = _identity(dtype, spec["op"])
    arrays = [np.full(n, fill, dtype) for n in spec["sizes"]]
    step = _steps.JOINED_STEP if spec["carry_step"] else None
    reducer(comm, arrays, step, check_step=False)


def join(comm) -> int:
    """This rank's ``join()``: stands in for the others' reductions until every rank of
    ``comm`` has joined; returns the rank that joined last, the same on every rank.

    A synchronization point: every rank of the group must call it once it has no more data.
    """
    comm.join_arrive()
    served = rounds = 0  # collectives stood in for; rounds of the others' collectives
    while comm.size > 1:
        spec = comm.join_round(served)
        if spec is None:
            break
        rounds += 1
        if spec:  # an empty task: the others skip a collective while ranks have joined
            stand_in(comm, spec)
            served += 1
    last = comm.join_last(rounds)
    _steps.rebase(comm)  # the ranks made different numbers of steps before it
    return last
