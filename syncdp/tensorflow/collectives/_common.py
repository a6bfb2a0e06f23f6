"""What every collective family shares: the reduce operations, the signature of a call, the
communicator of a process set and the checks of dtypes and roots.

Part of :mod:`syncdp.tensorflow.collectives` (its docstring says what every collective
promises).
"""

from __future__ import annotations

import contextlib
import enum
import numbers

import numpy as np
import tensorflow as tf

from syncdp import engine
from syncdp.job import process_sets
from syncdp.job.process_sets import global_process_set
from syncdp.tensorflow import graph

__all__ = [
    "ReduceOp",
    "reduce_op",
    "Average",
    "Sum",
    "Min",
    "Max",
    "Product",
    "Adasum",
    "NotInProcessSetError",
]


class ReduceOp(enum.IntEnum):
    """How allreduce combines the ranks' tensors: Horovod's numbers for them (its reduce ops
    are the integers of its C++ enum, so ``hvd.Sum == 1`` and an op goes into JSON as one).
    ``kind`` is the engine's name for it."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5

    @property
    def kind(self) -> str:
        """The engine's name: ``"average"``, ``"sum"``, ``"adasum"``, ``"min"``, ``"max"``,
        ``"product"``."""
        return self.name.lower()

    # An IntEnum prints as its number; messages name the op.
    def __str__(self) -> str:
        return f"ReduceOp.{self.name}"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
Adasum = ReduceOp.ADASUM


def reduce_op(op) -> ReduceOp:
    """``op`` as a :class:`ReduceOp`: one of ours, or Horovod's integer for it (0 Average,
    1 Sum, 2 Adasum, 3 Min, 4 Max, 5 Product).

    Args:
        op: A :class:`ReduceOp`, or an integer (Python's or NumPy's) from 0 to 5.

    Returns:
        The :class:`ReduceOp`.

    Raises:
        ValueError: ``op`` is neither.
    """
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, numbers.Integral) and not isinstance(op, bool):
        with contextlib.suppress(ValueError):  # not one of the enum's numbers
            return ReduceOp(int(op))
    raise ValueError(
        "op must be one of syncdp.Average, Sum, Min, Max, Product, Adasum (or Horovod's "
        f"number for one, 0-5); got {op!r}."
    )


_REDUCIBLE = {
    tf.float16,
    tf.bfloat16,
    tf.float32,
    tf.float64,
    tf.int32,
    tf.int64,
    tf.uint8,
    tf.int8,
    tf.int16,
    tf.uint16,
    tf.uint32,
    tf.uint64,
}


# What broadcast, allgather and alltoall move as bytes: the reducible dtypes, bool, complex.
_SENDABLE = _REDUCIBLE | {tf.bool, tf.complex64, tf.complex128}


def _resolve_op(op, average) -> ReduceOp:
    if op is not None and average is not None:
        raise ValueError("allreduce takes op or the deprecated average, not both.")
    if average is not None:
        return Average if average else Sum
    return Average if op is None else reduce_op(op)


def _comm(process_set):
    """The communicator of ``process_set`` (checked when a collective is built and run)."""
    try:
        return process_sets.communicator_of(process_set)
    except process_sets.NotInProcessSetError as e:
        raise NotInProcessSetError(str(e)) from None


def _root(process_set, root_rank: int) -> int:
    """The set's own rank number of job rank ``root_rank`` (Horovod's roots are job ranks)."""
    return (process_set or global_process_set).root(root_rank)


class NotInProcessSetError(process_sets.NotInProcessSetError, tf.errors.InvalidArgumentError):
    """A rank used a process set it is not in; also TensorFlow's ``InvalidArgumentError``,
    which is what Horovod raises then."""

    def __init__(self, *args):
        tf.errors.InvalidArgumentError.__init__(self, *graph.op_error_arguments(args))

    def __str__(self) -> str:
        return self.message


def _signature(name: str, tensor_like, **fields) -> tuple:
    """What every rank must pass alike to one collective (see Communicator.agree)."""
    dtype = np.dtype(tensor_like.dtype).name if hasattr(tensor_like, "dtype") else ""
    return (("name", name), ("dtype", dtype), *fields.items())


def _scale_fields(prescale, postscale) -> tuple:
    """The scale factors as fields of a collective's signature, named as the caller passed
    them: ranks that scale differently would end with different results. As floats (2 and 2.0
    agree), and -0.0 as 0.0."""
    return (
        ("prescale_factor", float(prescale) + 0.0),
        ("postscale_factor", float(postscale) + 0.0),
    )


def _spec(tensor) -> engine.TensorSpec:
    shape = tensor.shape
    nbytes = shape.num_elements() * tensor.dtype.size if shape.is_fully_defined() else -1
    return engine.TensorSpec(nbytes, tensor.dtype)


def _tunable(process_set) -> bool:
    """Whether autotuning may change how this set's gradients are bucketed: the whole job's,
    in eager code or a ``tf.function`` (not a TF1 graph)."""
    whole = process_set is None or getattr(process_set, "process_set_id", None) == 0
    return whole and not graph.in_v1_graph()


def _value(tensor) -> tf.Tensor:
    """``tensor`` as a tensor of its value: a TF1 reference (``float32_ref``, what an assign op
    returns under ``disable_v2_behavior()``) is read, as TensorFlow's own ops read it."""
    tensor = tf.convert_to_tensor(tensor)
    return tf.identity(tensor) if tensor.dtype != tensor.dtype.base_dtype else tensor


def _check_sendable(dtype: tf.DType, collective: str) -> None:
    """Refuses what no collective can move (strings, resources, variants), as Horovod's ops
    refuse them when built; the same error at any size and on every rank."""
    if dtype not in _SENDABLE:
        raise TypeError(
            f"{collective} cannot send {dtype.name} tensors; use a numeric or bool dtype "
            "(for strings or other Python values, broadcast_object or allgather_object)."
        )


def _check_reducible(tensors) -> None:
    for t in tensors:  # the same error at any size, so a 1-rank test catches it
        if t.dtype not in _REDUCIBLE:
            raise TypeError(
                f"allreduce cannot reduce {t.dtype.name} tensors; use a float or integer dtype."
            )
