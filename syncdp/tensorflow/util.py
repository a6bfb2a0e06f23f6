"""Small helpers Horovod programs import from ``horovod.tensorflow`` and its ``util``."""

from __future__ import annotations

import warnings

import tensorflow as tf

from syncdp.tensorflow import collectives

__all__ = [
    "_executing_eagerly",
    "handle_average_backwards_compatibility",
    "check_num_rank_power_of_2",
    "split_list",
]


def _executing_eagerly() -> bool:
    """Whether TensorFlow runs eagerly here (not inside a graph or ``tf.function``)."""
    return tf.executing_eagerly()


def handle_average_backwards_compatibility(op, average, ops=collectives):
    """The op meant by Horovod's ``op=`` and its deprecated ``average=`` (True: Average).

    ``ops`` is the module whose ``Average`` and ``Sum`` are meant (Horovod's
    ``get_average_backwards_compatibility_fun`` passes one). Defaults to syncdp's.

    Raises:
        ValueError: Both are given.
    """
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        warnings.warn(
            "Parameter `average` has been replaced with `op` and will be removed.",
            DeprecationWarning,
            stacklevel=2,
        )
        return ops.Average if average else ops.Sum
    return ops.Average if op is None else op


def check_num_rank_power_of_2(num_rank: int) -> bool:
    """Whether ``num_rank`` is a positive power of two."""
    return num_rank > 0 and num_rank & (num_rank - 1) == 0


def split_list(items: list, parts: int) -> list[list]:
    """``items`` cut into ``parts`` contiguous pieces whose lengths differ by at most one."""
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out
