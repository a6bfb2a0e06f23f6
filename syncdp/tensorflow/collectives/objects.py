"""Variables and Python objects: broadcast_variables, broadcast_object(_fn), allgather_object,
and the barrier and join of the whole job.

Part of :mod:`syncdp.tensorflow.collectives` (its docstring says what every collective
promises).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from syncdp import engine
from syncdp.engine import joining
from syncdp.job import runtime
from syncdp.job.process_sets import global_process_set
from syncdp.tensorflow.collectives._common import (
    _check_sendable,
    _comm,
    _root,
    _signature,
    _spec,
)
from syncdp.tensorflow.graph import ordered_call, standalone

__all__ = [
    "broadcast_",
    "broadcast_variables",
    "broadcast_global_variables",
    "broadcast_object",
    "broadcast_object_fn",
    "allgather_object",
    "barrier",
    "join",
]


@tf.autograph.experimental.do_not_convert
def broadcast_(variables, root_rank: int, name: str | None = None, process_set=global_process_set):
    """In-place broadcast: assigns rank ``root_rank``'s values to ``variables`` on every rank.

    Returns:
        The variables' new values, as tensors, in the order given.
    """
    variables = list(variables)
    done = broadcast_variables(variables, root_rank, process_set=process_set)
    if done is None:
        return [tf.convert_to_tensor(v) for v in variables]
    with tf.control_dependencies([done]):  # read the values after the assignments
        return [tf.identity(v) for v in variables]


@tf.autograph.experimental.do_not_convert
def broadcast_variables(
    variables: Sequence[tf.Variable],
    root_rank: int = 0,
    process_set=global_process_set,
    inplace: bool = False,
):
    """Assigns rank ``root_rank``'s values to ``variables`` on every rank.

    A synchronization point. Variables are fused by dtype, so a whole model takes a few
    broadcasts. Call it after the variables exist and before the first gradient is applied.

    Args:
        variables: The variables (e.g. ``model.variables`` plus ``optimizer.variables``).
        root_rank: The rank whose values everyone receives (a job rank). Defaults to 0.
        process_set: The ranks that take part. Defaults to the whole job.
        inplace: Accepted for Horovod compatibility (values are always assigned in place).

    Returns:
        None eagerly; inside ``tf.function`` or a TF1 graph, the assign op group.
    """
    comm = _comm(process_set)
    root = _root(process_set, root_rank)
    variables = list(variables)
    for v in variables:  # at any size; Keras 3 variables report their dtype as a string
        _check_sendable(tf.as_dtype(v.dtype).base_dtype, "broadcast_variables")  # TF1: float32_ref
    if comm.size == 1 or not variables:
        return None if tf.executing_eagerly() else tf.no_op()
    assigns = []
    cap = runtime.get_config().fusion_threshold
    # Plan on the tensors' values (the variables' dtypes may be strings).
    current = [tf.convert_to_tensor(v) for v in variables]
    buckets = engine.plan([_spec(c) for c in current], first_bytes=0, cap_bytes=cap)
    for b, bucket in enumerate(buckets):
        values = [current[i] for i in bucket.indices]
        name = f"broadcast_variables.bucket{b}"

        def run(*arrays, name=name):
            comm = _comm(process_set)
            shapes = tuple(np.shape(a) for a in arrays)
            comm.agree(_signature(name, arrays[0], shapes=shapes, root=root_rank), name=name)
            return engine.broadcast_bucket(comm, arrays, root, name=name)

        received = ordered_call(
            run, values, [v.dtype for v in values], [v.shape for v in values], name
        )
        for i, value in zip(bucket.indices, received):
            assigns.append(variables[i].assign(value))
    return None if tf.executing_eagerly() else tf.group(*assigns)


def broadcast_global_variables(root_rank: int = 0):
    """The TF1 op that assigns ``root_rank``'s values to every global variable of the graph.

    Raises:
        RuntimeError: Called eagerly, where there are no global variables; use
            :func:`broadcast_variables` with the model's and optimizer's variables instead.
    """
    if tf.executing_eagerly():
        raise RuntimeError(
            "broadcast_global_variables() does not support eager execution; use "
            "syncdp.broadcast_variables(model.variables + optimizer.variables) instead."
        )
    # Run on its own (by a hook, as the session opens): kept out of the chain of collectives,
    # so running it does not also run the training step's collectives and read a batch.
    with standalone():
        return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def broadcast_object(
    obj, root_rank: int = 0, session=None, name: str | None = None, process_set=global_process_set
):
    """Returns rank ``root_rank``'s picklable Python object on every rank (a collective).

    ``session`` is accepted for Horovod compatibility (objects never pass through a graph).
    """
    comm = _comm(process_set)
    root = _root(process_set, root_rank)
    name = name or "broadcast_object"
    _agree_object(comm, name, "broadcast_object", root=int(root_rank))  # the job's rank
    return comm.broadcast_object(obj, root, name=name)


def broadcast_object_fn(
    root_rank: int = 0, session=None, name: str | None = None, process_set=global_process_set
):
    """Returns ``fn(obj)`` that broadcasts ``obj`` from ``root_rank`` (Horovod's TF1 helper)."""

    def fn(obj):
        return broadcast_object(obj, root_rank, name=name, process_set=process_set)

    return fn


def allgather_object(
    obj, session=None, name: str | None = None, process_set=global_process_set
) -> list:
    """Returns a list of every rank's picklable object, in rank order (a collective)."""
    comm = _comm(process_set)
    name = name or "allgather_object"
    _agree_object(comm, name, "allgather_object")
    return comm.allgather_object(obj, name=name)


def _agree_object(comm, name: str, collective: str, **fields) -> None:
    """The argument check of an object collective: every rank must be in the same one, under
    the same name (and root). Joined ranks cannot stand in for it: while a rank has joined it
    raises on every active rank (the joined ranks wait on)."""
    comm.agree((("name", name), ("collective", collective), *fields.items()), name=name)


def barrier(process_set=global_process_set) -> None:
    """Waits until every rank of ``process_set`` has called it (a collective).

    Raises:
        CollectiveError: A rank of the set has called :func:`join` and not every rank has.
    """
    _comm(process_set).enter("barrier")  # the argument check is the whole barrier


def join(device: int = -1, process_set=global_process_set) -> tf.Tensor:
    """Declares that this rank has no more data; returns once every rank has joined.

    Horovod's semantics: until every rank of ``process_set`` has joined, a joined rank stands
    in for the others' reductions (``allreduce``, ``grouped_allreduce``, gradient reductions,
    any dtype), adding nothing: zeros to a sum or an average (which still divides by the
    set's size, as Horovod's does), the identity to a min, max or product; to an
    ``allgather`` (sparse gradients' too) it gives no rows. So ranks with uneven data can
    each train on what they have, then join. Other collectives raise on the active ranks
    while a rank has joined. The last to join took part in none of the others' collectives
    while joined; ranks that joined with no collective between them are ordered on rank 0's
    clock alone, never by comparing hosts' clocks. Adasum gets zeros, which it leaves out.

    A synchronization point: every rank of the set must call it.

    Args:
        device: Accepted for Horovod compatibility.
        process_set: The ranks that join together. Defaults to the whole job.

    Returns:
        The job rank that joined last, as an int32 scalar tensor, the same on every rank
        (inside ``tf.function`` or a TF1 graph, computed when the graph runs).

    Example:
        >>> for batch in my_uneven_share:
        ...     train_step(batch)
        >>> syncdp.join()
    """

    def run():
        last = joining.join(_comm(process_set))  # its rank within the set's communicator
        return np.int32((process_set or global_process_set).ranks[last])

    if tf.executing_eagerly():
        return tf.constant(run(), tf.int32)
    return ordered_call(lambda: (run(),), [], [tf.int32], [[]], "join")[0]
