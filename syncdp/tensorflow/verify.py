"""Checks that every rank holds bit-identical variables.

Synchronous data parallelism keeps replicas identical by construction: every rank starts from
rank 0's broadcast state and applies the same averaged gradients. :func:`verify_synchronized`
checks it: every rank hashes each variable's bytes (with its dtype and shape), the digests are
gathered, and any variable that is not the same everywhere is named together with the ranks
that hold a different value. Only 16 bytes per variable travel, whatever the model's size.

``SYNCDP_VERIFY_EVERY=K`` (``syncdp-run --verify-every K``) runs the check automatically:
:func:`syncdp.tensorflow.tape.reduce_gradients` (what ``DistributedGradientTape.gradient`` and
the Keras optimizer call) verifies the variables the gradients are for on every K-th agreed
step, as an ordered collective after the gradient buckets, before the update.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from syncdp.base.errors import VerificationError
from syncdp.job import runtime
from syncdp.tensorflow import collectives, graph

__all__ = ["verify_synchronized"]

_DIGEST_BYTES = 16
# The error lists at most this many variables; the count says how many differ in all.
_MAX_LISTED = 10


def variable_name(variable, index: int) -> str:
    """A readable name: a Keras variable's path, a tf.Variable's name, or its position."""
    for attr in ("path", "name"):
        value = getattr(variable, attr, None)
        if isinstance(value, str) and value:
            return value
    return f"variable #{index}"


def _digest(array: np.ndarray) -> bytes:
    array = np.ascontiguousarray(array)
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    h.update(f"{array.dtype.str}{array.shape}".encode())
    h.update(array.reshape(-1).view(np.uint8).data)
    return h.digest()


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _raise_if_different(names: Sequence[str], table: Sequence[Sequence[bytes]]) -> None:
    """Raises VerificationError when ``table[rank][i]`` is not the same for every rank."""
    sizes = {len(row) for row in table}
    if len(sizes) > 1:
        counts = ", ".join(f"rank {r}: {len(row)}" for r, row in enumerate(table))
        raise VerificationError(
            "verify_synchronized must be called with the same variables on every rank; got "
            f"different counts ({counts}). Pass the same list (e.g. model.variables) everywhere."
        )
    lines = []
    for i, name in enumerate(names):
        groups: dict[bytes, list[int]] = {}
        for rank, row in enumerate(table):
            groups.setdefault(row[i], []).append(rank)
        if len(groups) == 1:
            continue
        # The largest group is taken as the right value; on a tie, the group holding rank 0.
        majority = max(groups.values(), key=lambda ranks: (len(ranks), 0 in ranks))
        others = sorted(r for ranks in groups.values() if ranks is not majority for r in ranks)
        lines.append(f"  {name}: {_ranks(others)} differ from {_ranks(majority)}")
    if not lines:
        return
    listed = lines[:_MAX_LISTED]
    if len(lines) > _MAX_LISTED:
        listed.append(f"  ... and {len(lines) - _MAX_LISTED} more")
    raise VerificationError(
        f"Replicas are not synchronized: {len(lines)} of {len(names)} variables are not "
        "bit-identical on every rank:\n" + "\n".join(listed) + "\nEvery rank must apply the "
        "same updates from the same state. Look for rank-dependent code that changes variables, "
        "a missing syncdp.broadcast_variables at the start, or non-deterministic ops; restore "
        "rank 0's state with syncdp.broadcast_variables or CheckpointManager.restore()."
    )


def verify_arrays(
    names: Sequence[str], arrays: Sequence[np.ndarray], comm=None, *, periodic: bool = False
) -> int:
    """The eager check on NumPy arrays, one collective; returns how many were checked.

    A synchronization point of ``comm`` (defaults to the job's). Used by
    :func:`verify_synchronized` and by the ``SYNCDP_VERIFY_EVERY`` hook in
    :func:`syncdp.tape.reduce_gradients` (on its process set's communicator), which passes
    ``periodic``: while a rank has called ``join()`` its replica rightly lags behind, so the
    periodic check is skipped then (returns 0) rather than raising.
    """
    comm = comm if comm is not None else runtime.communicator()
    if comm.size > 1:
        digests = [_digest(a) for a in arrays]
        if comm.enter("verify_synchronized", unless_joined=periodic):
            return 0
        table = comm.allgather_object(digests, name="verify_synchronized")
        _raise_if_different(names, table)
    return len(arrays)


@tf.autograph.experimental.do_not_convert  # see syncdp.tensorflow.graph.host_call
def verify_synchronized(variables: Sequence, *, name: str = "verify_synchronized"):
    """Checks that every rank holds bit-identical values of ``variables``.

    A synchronization point: all ranks must call it, in the same order, with the same list.
    Each rank hashes every variable (bytes, dtype and shape); only the digests are gathered, so
    it costs one small collective whatever the model's size. Works eagerly and inside
    ``tf.function``, where the error surfaces as a ``tf.errors.OpError`` carrying the same
    message.

    Args:
        variables: Variables or tensors, e.g. ``model.variables + optimizer.variables``.
        name: Name of the collective in the timeline and in stall reports. Defaults to
            "verify_synchronized".

    Returns:
        Eagerly, the number of variables checked. Inside ``tf.function``, an int64 tensor
        holding it, which depends on the check.

    Raises:
        VerificationError: Some variables differ between ranks; the message names each one
            and the ranks that hold a different value. Raised on every rank.
        NotInitializedError: ``syncdp.init()`` has not been called.

    Example:
        >>> syncdp.verify_synchronized(model.variables + optimizer.variables)
        6
    """
    variables = list(variables)
    names = [variable_name(v, i) for i, v in enumerate(variables)]
    comm = runtime.communicator()
    if tf.executing_eagerly():
        return verify_arrays(names, [np.asarray(tf.convert_to_tensor(v)) for v in variables])
    if comm.size == 1 or not variables:
        return tf.constant(len(variables), tf.int64)
    values = [tf.convert_to_tensor(v) for v in variables]

    def digests(*arrays):
        rows = [np.frombuffer(_digest(a), np.uint8) for a in arrays]
        return np.stack(rows)

    local = graph.host_call(digests, values, tf.uint8, stateful=False, name=f"{name}_digests")
    local.set_shape([len(values), _DIGEST_BYTES])
    gathered = collectives.allgather(local, name=name)

    def compare(table):
        rows = table.reshape(comm.size, len(names), _DIGEST_BYTES)
        _raise_if_different(names, [[bytes(d) for d in row] for row in rows])
        return np.int64(len(names))

    checked = graph.host_call(compare, [gathered], tf.int64, name=f"{name}_compare")
    checked.set_shape([])
    return checked
