"""The reduction engine in one process: bucket plans, layouts, the pool, the bucket reducer.

The reducer runs against a stand-in communicator that plays N ranks in one process: a list of
per-rank inputs is reduced exactly as N real ranks would (sum, min, max over the list), with a
tiny chunk so that chunks cut through members. The parallel suite runs the same engine over
real MPI at 1, 2 and 3 ranks.
"""

import threading

import ml_dtypes
import numpy as np
import pytest

from syncdp.base.errors import StepMismatchError
from syncdp.engine import BucketReducer, TensorSpec, plan
from syncdp.engine import reducer as reducer_mod
from syncdp.engine import steps as steps_mod
from syncdp.engine.buffers import ALIGN, BufferPool, Layout, aligned_empty

MiB = 1 << 20


class _Job:
    """A fake job of ``size`` ranks in threads: each collective is an exchange at a barrier."""

    def __init__(self, size):
        self.size = size
        self._barrier = threading.Barrier(size, timeout=20)
        self._slots = [None] * size

    def exchange(self, rank, value):
        self._slots[rank] = value
        self._barrier.wait()
        everyone = list(self._slots)
        self._barrier.wait()
        return everyone


class _Comm:
    """One rank of a _Job, with the Communicator methods the engine calls (tiny chunks)."""

    def __init__(self, job, rank, chunk=7):
        self.job, self.rank, self.size, self.chunk = job, rank, job.size, chunk
        self.steps = None  # the engine's step agreement, as on a Communicator

    def allreduce_inplace(self, buf, op, *, name, before=None, after=None, info=None, nbytes=None):
        fold = {"sum": np.add, "min": np.minimum, "max": np.maximum}[op]
        for lo in range(0, buf.size, self.chunk):
            hi = min(buf.size, lo + self.chunk)
            # Packed into a separate slot, as the shared-memory plane does: whatever the
            # engine leaves out of the slot (padding, the step) would be lost.
            slot = np.full(hi - lo, 99, buf.dtype)
            if before is not None:
                before(lo, hi, slot)
            else:
                slot[...] = buf[lo:hi]
            everyone = self.job.exchange(self.rank, slot)
            acc = everyone[0]
            for other in everyone[1:]:
                acc = fold(acc, other)
            buf[lo:hi] = acc
            if after is not None:
                after(lo, hi)
        return buf

    def alltoall(self, array, *, name, out, info=None):
        everyone = self.job.exchange(self.rank, array.copy())
        for r in range(self.size):
            out[r] = everyone[r][self.rank]
        return out

    def allgather_bytes(self, send, out, *, name, info=None, **kw):
        return self.allgather_equal(send, name=name, out=out)

    def allgather_equal(self, array, *, name, out, info=None):
        everyone = self.job.exchange(self.rank, array.copy())
        out = out.reshape((self.size,) + array.shape)
        for r in range(self.size):
            out[r] = everyone[r]
        return out


@pytest.fixture(params=["gathered", "in place"])
def engine_path(request, monkeypatch):
    """Runs a test on both paths of a bucket: gathered and summed by every rank (small
    buckets), and reduced in place in chunks (the rest)."""
    if request.param == "in place":
        monkeypatch.setattr(reducer_mod, "GATHER_BYTES", 0)
    return request.param


def reduce_on_ranks(per_rank, dtype, op, *, pre=1.0, post=1.0, steps=None, check_step=True):
    """Every rank's ``(results, agreed step)`` for one bucket, from the real reducer."""
    size = len(per_rank)
    steps = steps or [None] * size
    job = _Job(size)
    results, errors = [None] * size, [None] * size

    def rank_main(r):
        reducer = BucketReducer(
            dtype,
            op,
            prescale=pre,
            postscale=post,
            name=f"test{r}",
            carry_step=steps[0] is not None,
        )
        try:
            results[r] = reducer(_Comm(job, r), per_rank[r], steps[r], check_step=check_step)
        except Exception as e:  # re-raised below, from the test's thread
            errors[r] = e

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    for e in errors:
        if e is not None:
            raise e
    return results


def test_plan_reverse_small_first_bucket_then_cap():
    specs = [TensorSpec(MiB // 2, "f4"), TensorSpec(3 * MiB, "f4"), TensorSpec(2 * MiB, "f4")]
    buckets = plan(specs, first_bytes=MiB, cap_bytes=25 * MiB, reverse=True)
    assert [b.indices for b in buckets] == [(2,), (1, 0)]
    many = [TensorSpec(100 * 1024, "f4") for _ in range(40)]  # 4 MB of small gradients
    buckets = plan(many, first_bytes=MiB, cap_bytes=2 * MiB, reverse=True)
    assert buckets[0].indices[0] == 39 and buckets[0].nbytes <= MiB
    assert all(b.nbytes <= 2 * MiB for b in buckets)
    assert sorted(i for b in buckets for i in b.indices) == list(range(40))


def test_plan_separates_dtypes_and_unknown_sizes_and_zero_cap_splits_all():
    specs = [TensorSpec(16, "f4"), TensorSpec(16, "i4"), TensorSpec(16, "f4"), TensorSpec(-1, "f4")]
    assert [b.indices for b in plan(specs, first_bytes=0, cap_bytes=MiB)] == [(0, 2), (1,), (3,)]
    assert [b.indices for b in plan(specs, first_bytes=0, cap_bytes=0)] == [(0,), (1,), (2,), (3,)]


def test_layout_aligns_every_member():
    layout = Layout([3, 0, 17, 16, 1], itemsize=4)
    assert all(off * 4 % ALIGN == 0 for off in layout.offsets)
    ends = [o + n for o, n in zip(layout.offsets, layout.sizes)]
    assert all(e <= nxt for e, nxt in zip(ends, layout.offsets[1:] + (layout.total,)))


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


def test_pool_hands_a_buffer_out_again_once_nothing_holds_it_or_a_view():
    pool = BufferPool()
    shelf = pool.shelf("k", 64, np.dtype(np.float32))
    first = pool.take(shelf, 64, np.dtype(np.float32))
    where = first.ctypes.data
    held = first  # the buffer itself, not a view of it
    del first
    second = pool.take(shelf, 64, np.dtype(np.float32))
    assert not np.shares_memory(second, held)
    view = second[3:5]
    del second
    third = pool.take(shelf, 64, np.dtype(np.float32))  # both kept ones are in use
    assert not np.shares_memory(third, held) and not np.shares_memory(third, view)
    del held, third
    assert pool.get("k", 64, np.float32).ctypes.data == where  # the same shelf, free again


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16])
def test_every_op_matches_the_formula(size, dtype, engine_path):
    rng = np.random.default_rng(size)
    # Small integers: every sum, mean and scale below is exact in every dtype.
    data = [
        [rng.integers(-8, 8, 5).astype(np.float64), rng.integers(-8, 8, (2, 3)).astype(np.float64)]
        for _ in range(size)
    ]
    cases = [
        ("sum", 1.0, 1.0, lambda xs: np.sum(xs, 0)),
        ("average", 1.0, 1.0, lambda xs: np.sum(xs, 0) / size),
        ("min", 1.0, 1.0, lambda xs: np.min(xs, 0)),
        ("max", 1.0, 0.5, lambda xs: np.max(xs, 0) * 0.5),
        ("sum", 0.25, 4.0, lambda xs: np.sum(xs, 0)),
        ("min", -1.0, 1.0, lambda xs: np.min(-np.asarray(xs), 0)),
    ]
    for op, pre, post, formula in cases:
        per_rank = [[a.astype(dtype) for a in arrays] for arrays in data]
        results = reduce_on_ranks(per_rank, dtype, op, pre=pre, post=post)
        for m in range(2):
            want = formula([arrays[m] for arrays in data])
            for r in range(size):
                got = np.asarray(results[r][0][m], dtype=np.float64)
                np.testing.assert_allclose(
                    got,
                    np.asarray(want.astype(dtype), np.float64),
                    rtol=0,
                    atol=0,
                    err_msg=f"{op} pre={pre} post={post} rank {r}",
                )


@pytest.mark.parametrize("dtype, big", [(np.float16, 2048.0), (ml_dtypes.bfloat16, 256.0)])
def test_half_precision_accumulates_in_float32_at_three_ranks(dtype, big, engine_path):
    # big + 1 rounds back to big in this dtype (its spacing there is 2), so adding in the
    # bucket's dtype would lose both ones; the exact sum big + 2 is representable.
    per_rank = [
        [np.array([big, 1.0], dtype)],
        [np.array([1.0, 2.0], dtype)],
        [np.array([1.0, 3.0], dtype)],
    ]
    results = reduce_on_ranks(per_rank, dtype, "sum")
    for r in range(3):
        np.testing.assert_array_equal(np.asarray(results[r][0][0], np.float64), [big + 2, 6.0])


def test_integer_average_truncates_toward_zero(engine_path):
    per_rank = [[np.array([1, 2, 3, -3], np.int64)], [np.array([2, 2, 4, -4], np.int64)]]
    results = reduce_on_ranks(per_rank, np.int64, "average")
    np.testing.assert_array_equal(results[0][0][0], [1, 2, 3, -3])  # C's (a + b) / 2


def test_hundreds_of_tiny_tensors_in_one_collective(engine_path):
    rng = np.random.default_rng(0)
    arrays = [rng.integers(-50, 50, size=rng.integers(0, 5)).astype(np.float32) for _ in range(400)]
    per_rank = [arrays, [a * 2 for a in arrays], [a * 3 for a in arrays]]
    results = reduce_on_ranks(per_rank, np.float32, "sum")
    for a, o in zip(arrays, results[1][0]):
        np.testing.assert_array_equal(o, a * 6)
        assert o.shape == a.shape


def test_outputs_are_aligned_views_that_survive_the_next_call():
    reducer = BucketReducer(np.float32, "sum", name="keep")

    class One:
        rank, size = 0, 1

        def allreduce_inplace(self, buf, op, *, name, before=None, after=None, **kw):
            before(0, buf.size, buf)
            return buf

    first, _ = reducer(One(), [np.full(5, 1.0, np.float32), np.full(9, 2.0, np.float32)])
    assert all(o.ctypes.data % ALIGN == 0 for o in first)
    second, _ = reducer(One(), [np.full(5, 10.0, np.float32), np.full(9, 20.0, np.float32)])
    np.testing.assert_array_equal(first[1], 2.0)  # not overwritten by the second call
    np.testing.assert_array_equal(second[1], 20.0)


@pytest.mark.parametrize(
    "dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.int32, np.int64, np.int8]
)
def test_step_round_trips_through_a_summed_region(dtype):
    size = 3
    limbs = steps_mod.limbs_for(dtype)
    regions = []
    for r, step in enumerate([2**40 + 5, 2**40 + 5, 2**40 + 5]):
        region = np.zeros(size * limbs, dtype)
        steps_mod.encode(region, step, r, size)
        regions.append(region)
    total = np.sum(np.stack(regions).astype(np.float64), 0).astype(dtype)
    assert steps_mod.decode(total, size) == [2**40 + 5] * size


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("op", ["average", "sum"])
def test_the_step_rides_in_the_bucket_unscaled(dtype, op, engine_path):
    per_rank = [[np.array([2.0, 4.0], dtype)], [np.array([6.0, 8.0], dtype)]]
    results = reduce_on_ranks(per_rank, dtype, op, pre=0.5, post=2.0, steps=[70000, 70000])
    want = np.array([8.0, 12.0]) if op == "sum" else np.array([4.0, 6.0])
    for values, agreed in results:
        np.testing.assert_array_equal(np.asarray(values[0], np.float64), want)
        assert agreed == 70000


def test_ranks_at_different_steps_raise_on_every_rank_naming_them(engine_path):
    per_rank = [[np.ones(3, np.float32)]] * 3
    with pytest.raises(StepMismatchError, match=r"rank 2 is at step 8; ranks 0, 1 at step 7"):
        reduce_on_ranks(per_rank, np.float32, "average", steps=[7, 7, 8])


def test_after_a_join_each_ranks_steps_count_from_where_it_stood():
    J = steps_mod.JOINED_STEP
    agreement = steps_mod.Agreement(3)
    assert agreement.check([4, 4, 4]) == 4
    agreement.rebase()  # the ranks made 4, 6 and 5 steps before the join
    assert agreement.check([5, 7, 6]) == 5  # where each stands: rank 0's count goes on
    assert agreement.check([6, 8, 7]) == 6
    with pytest.raises(StepMismatchError, match=r"rank 1 is at step 8; ranks 0, 2 at step 7"):
        agreement.check([7, 10, 8])  # rank 1 skipped a step
    # A rank that had joined again when the others restarted takes its place at its next step.
    agreement = steps_mod.Agreement(3)
    agreement.rebase()
    assert agreement.check([J, 10, 12]) == 10
    assert agreement.check([3, 11, 13]) == 11
    assert agreement.check([4, 12, 14]) == 12
    with pytest.raises(StepMismatchError, match=r"rank 0 is at step 12"):
        agreement.check([4, 13, 15])  # rank 0 repeated its step
    # A new optimizer: every rank's count back to one value.
    assert agreement.check([0, 0, 0]) == 0 and not agreement.shifted
    with pytest.raises(StepMismatchError):
        agreement.check([1, 2, 1])
    # Counts made equal right after a join (iterations broadcast from the last to join) are
    # each rank's new start.
    agreement = steps_mod.Agreement(2)
    assert agreement.check([5, 5]) == 5
    agreement.rebase()
    assert agreement.check([9, 9]) == 9 and not agreement.shifted
    assert agreement.check([10, 10]) == 10
    # One rank left active beside joined ones agrees with itself: the shift stays.
    agreement = steps_mod.Agreement(3)
    agreement.rebase()
    assert agreement.check([5, 7, 6]) == 5
    assert agreement.check([J, 8, J]) == 6 and agreement.shifted
    assert agreement.check([7, 9, 8]) == 7


def test_without_the_step_check_rank_0s_step_is_agreed_and_the_sum_is_exact(engine_path):
    # Elastic mode between a membership change and the state sync: a replacement's optimizer
    # counts from 0, the survivors' from their commit.
    per_rank = [[np.array([1.0, 2.0], np.float32)], [np.array([3.0, 5.0], np.float32)]]
    results = reduce_on_ranks(per_rank, np.float32, "sum", steps=[15, 0], check_step=False)
    for values, agreed in results:
        np.testing.assert_array_equal(values[0], [4.0, 7.0])
        assert agreed == 15


def test_the_last_to_join_took_part_in_none_of_the_others_collectives():
    from syncdp.transport.communicator import _last_to_join

    # Rank 2 joined and took part in rank 1's last step; its arrival note reached rank 0 after
    # rank 1's (relayed through rank 1, the collective ended before the note came).
    assert _last_to_join(order=[0, 1, 2], rounds=[2, 0, 1]) == 1
    # Ranks that joined with no collective between them: rank 0's clock orders them.
    assert _last_to_join(order=[2, 0, 1], rounds=[0, 0, 3]) == 1
    assert _last_to_join(order=[2, 1, 0], rounds=[0, 0, 3]) == 0
    assert _last_to_join(order=[0, 2, 1], rounds=[1, 0, 0]) == 1
    assert _last_to_join(order=[0], rounds=[0]) == 0
