"""Fusion in one process: bucket plans, aligned layouts, the buffer pool, the bucket reducer.

The reducer runs against a stand-in communicator that plays N identical ranks (a sum is N
times the input), with a tiny chunk so that chunks cut through members.
"""

import numpy as np
import pytest
import tensorflow as tf

from syncdp import ops
from syncdp.fusion import ALIGN, BufferPool, Layout, aligned_empty, pack, plan_buckets, unpack


class _FakeComm:
    """N ranks holding the same data, reduced chunk by chunk like Communicator does."""

    def __init__(self, size, chunk_elems=7):
        self.size = size
        self.chunk = chunk_elems
        self.calls = 0

    def allreduce_inplace(self, buf, op, *, name, before=None, after=None, info=None, nbytes=None):
        self.calls += 1
        for lo in range(0, buf.size, self.chunk):
            hi = min(buf.size, lo + self.chunk)
            if before is not None:
                before(lo, hi)
            if op is ops._MPI_OPS[ops.Sum]:
                buf[lo:hi] *= self.size
            if after is not None:
                after(lo, hi)
        return buf


def _reduce(arrays, op, size, prescale=1.0, postscale=1.0):
    comm = _FakeComm(size)
    fn = ops._bucket_reducer(comm, arrays[0].dtype, op, prescale, postscale, "t", {})
    return fn(*arrays), comm


def test_plan_gives_a_large_tensor_its_own_bucket():
    specs = [
        tf.TensorSpec([10], tf.float32),
        tf.TensorSpec([1000], tf.float32),
        tf.TensorSpec([5], tf.float32),
        tf.TensorSpec([0], tf.float32),
    ]
    buckets = plan_buckets(specs, threshold=200)
    assert sorted(i for b in buckets for i in b.indices) == [0, 1, 2, 3]
    assert [b.indices for b in buckets if 1 in b.indices] == [(1,)]


def test_plan_separates_dtypes_and_zero_threshold_splits_all():
    specs = [
        tf.TensorSpec([4], tf.float32),
        tf.TensorSpec([4], tf.int32),
        tf.TensorSpec([4], tf.float32),
    ]
    assert [b.indices for b in plan_buckets(specs, 1 << 20)] == [(0, 2), (1,)]
    assert [b.indices for b in plan_buckets(specs, 0)] == [(0,), (1,), (2,)]


def test_layout_aligns_every_member():
    layout = Layout([3, 0, 17, 16, 1], itemsize=4)
    assert all(off * 4 % ALIGN == 0 for off in layout.offsets)
    ends = [o + n for o, n in zip(layout.offsets, layout.sizes)]
    assert all(e <= nxt for e, nxt in zip(ends, layout.offsets[1:] + (layout.total,)))
    assert layout.padding()[0] == (3, 16)


def test_aligned_empty_is_aligned():
    for dtype in (np.float16, np.float32, np.float64, np.int8):
        assert aligned_empty(33, dtype).ctypes.data % ALIGN == 0


def test_pool_reuses_only_free_buffers():
    pool = BufferPool()
    a = pool.get("k", 100, np.float32)
    view = a[10:20]
    del a
    b = pool.get("k", 100, np.float32)
    c = pool.get("k", 100, np.float32)
    assert not np.shares_memory(b, view) and b is not c
    del view, b, c
    d = pool.get("k", 100, np.float32)
    assert not d[:].any()  # padding and unused elements stay zero


def test_hundreds_of_tiny_tensors_sum_exactly():
    rng = np.random.default_rng(0)
    arrays = [rng.integers(-50, 50, size=rng.integers(0, 5)).astype(np.float32) for _ in range(400)]
    out, comm = _reduce(arrays, ops.Sum, 3)
    assert comm.calls == 1
    for a, o in zip(arrays, out):
        np.testing.assert_array_equal(o, a * 3)
        assert o.shape == a.shape


def test_average_with_zero_size_and_scalars():
    arrays = [
        np.zeros((0, 4), np.float32),
        np.array(2.5, np.float32),
        np.arange(37, dtype=np.float32).reshape(37, 1),
    ]
    for size in (1, 2, 3, 4):
        out, _ = _reduce(arrays, ops.Average, size)
        assert out[0].shape == (0, 4)
        np.testing.assert_allclose(out[1], 2.5, rtol=1e-6)
        np.testing.assert_allclose(out[2], arrays[2], rtol=1e-6)


def test_integer_average_floors_and_scales():
    arrays = [np.array([1, 2, 3, -3], np.int64)]
    out, _ = _reduce(arrays, ops.Average, 2)
    np.testing.assert_array_equal(out[0], [1, 2, 3, -3])
    out, _ = _reduce([np.array([1.0, 2.0], np.float64)], ops.Sum, 2, prescale=0.5, postscale=3)
    np.testing.assert_array_equal(out[0], [3.0, 6.0])


def test_outputs_are_aligned_views_that_survive_the_next_call():
    arrays = [np.full(5, 1.0, np.float32), np.full(9, 2.0, np.float32)]
    comm = _FakeComm(2)
    fn = ops._bucket_reducer(comm, np.dtype(np.float32), ops.Sum, 1.0, 1.0, "keep", {})
    first = fn(*arrays)
    assert all(o.ctypes.data % ALIGN == 0 for o in first)
    second = fn(*[a * 10 for a in arrays])
    np.testing.assert_array_equal(first[1], 4.0)  # not overwritten by the second call
    np.testing.assert_array_equal(second[1], 40.0)


def test_pack_unpack_round_trip():
    tensors = [tf.reshape(tf.range(6.0), [2, 3]), tf.zeros([0]), tf.constant([7.0])]
    back = unpack(pack(tensors), tensors)
    for t, b in zip(tensors, back):
        np.testing.assert_array_equal(t.numpy(), b.numpy())


@pytest.mark.parametrize("dtype", [np.float16, np.float64, np.int32, np.uint8])
def test_dtypes_sum(dtype):
    arrays = [np.arange(20).astype(dtype), np.ones(3, dtype)]
    out, _ = _reduce(arrays, ops.Sum, 2)
    np.testing.assert_array_equal(out[0], (np.arange(20) * 2).astype(dtype))
    np.testing.assert_array_equal(out[1], np.full(3, 2, dtype))
