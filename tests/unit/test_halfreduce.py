"""The arithmetic of half-precision buckets (syncdp.halfreduce._combine), at any number of ranks.

The parallel tests run at 1 and 2 ranks; the float32 accumulation used from 3 ranks on is
checked here directly, on rows as the Alltoall would deliver them.
"""

import numpy as np
import pytest
import tensorflow as tf

from syncdp.halfreduce import _combine


@pytest.mark.parametrize(
    "dtype, big", [(tf.float16, 2048.0), (tf.bfloat16, 256.0)], ids=["float16", "bfloat16"]
)
def test_three_ranks_accumulate_in_float32(dtype, big):
    # big + 1 rounds back to big in this dtype (its spacing there is 2), so adding in the
    # bucket's dtype would lose both ones; the exact sum big + 2 is representable.
    rows = tf.constant([[big, 1.0], [1.0, 2.0], [1.0, 3.0]], dtype)
    out = _combine(rows, "sum", 3, 1.0, 1.0)
    assert out.dtype == dtype
    np.testing.assert_array_equal(tf.cast(out, tf.float64).numpy(), [big + 2, 6.0])


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_every_op_and_scale_matches_the_formula(size):
    data = np.arange(size * 6, dtype=np.float64).reshape(size, 6) % 7 - 3  # small integers
    rows = tf.constant(data, tf.float16)
    cases = [
        ("sum", 1.0, 1.0, data.sum(0)),
        ("average", 1.0, 1.0, data.mean(0)),
        ("min", -1.0, 1.0, (-data).min(0)),
        ("max", 1.0, 0.5, data.max(0) * 0.5),
        ("sum", 0.25, 4.0, data.sum(0)),
    ]
    for op, pre, post, expected in cases:
        out = _combine(rows, op, size, pre, post)
        want = tf.cast(tf.constant(expected), tf.float16)
        np.testing.assert_array_equal(out.numpy(), want.numpy(), err_msg=f"{op} {pre} {post}")
