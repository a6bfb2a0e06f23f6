"""join(): a rank out of data stands in for the others' reductions until every rank joins.

Horovod's specification (its docstring and test_horovod_join_allreduce): a joined rank adds
zeros to the others' allreduces, an average still divides by every rank, and join() returns
the rank that joined last, as an int32 tensor, the same on every rank. Expected values come
from the ranks' own numbers: every rank holds the same tensor here, so a sum over the n - 1
active ranks is the tensor times n - 1.
"""

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

from syncdp.base.errors import CollectiveError
from syncdp.job import runtime
from syncdp.tensorflow import tape as tape_mod

DTYPES = [tf.int32, tf.int64, tf.float16, tf.bfloat16, tf.float32, tf.float64]


def _first_joiners(n):
    return [0] if n == 1 else [0, n - 1]


def _tensor(dtype, shape):
    values = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) % 23 - 11
    return tf.cast(tf.constant(values), dtype)


def _average(total, n, dtype):
    if dtype.is_integer:  # truncated toward zero, as C (and Horovod) divide
        return np.trunc(total / n)
    return total / n


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_joined_rank_adds_zeros_and_join_returns_the_last(hvd, dtype, graph):
    n, r = hvd.size(), hvd.rank()
    a, b = _tensor(dtype, [5, 3]), _tensor(dtype, [17])

    def reduce():
        summed = hvd.allreduce(b, op=hvd.Sum)
        averaged = hvd.grouped_allreduce([a, b], op=hvd.Average)  # two members: one bucket
        return summed, averaged

    reduce_fn = tf.function(reduce) if graph else reduce
    join_fn = tf.function(hvd.join) if graph else hvd.join
    for first in _first_joiners(n):
        if r == first:
            last = join_fn()
        else:
            summed, (avg_a, avg_b) = reduce_fn()
            last = join_fn()
            wide = lambda t: np.asarray(tf.cast(t, tf.float64))  # noqa: E731
            np.testing.assert_array_equal(wide(summed), wide(b) * (n - 1))
            want_a = _average(wide(a) * (n - 1), n, dtype)
            want_b = _average(wide(b) * (n - 1), n, dtype)
            tol = {tf.float16: 1e-2, tf.bfloat16: 1e-2, tf.float32: 1e-6}.get(dtype, 1e-12)
            np.testing.assert_allclose(wide(avg_a), want_a, rtol=tol, atol=tol)
            np.testing.assert_allclose(wide(avg_b), want_b, rtol=tol, atol=tol)
        assert last.dtype == tf.int32 and last.shape == []
        everyone = hvd.allgather_object(int(last))
        assert len(set(everyone)) == 1, everyone
        # The rank that joined first is never the last, unless it is alone; of two, the other.
        assert int(last) != first or n == 1
        if n == 2:
            assert int(last) == 1 - first


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16, tf.float32], ids=lambda d: d.name)
def test_a_joined_rank_scales_its_share_of_a_large_reduction(hvd, dtype):
    """Above the gathered path, a half-precision sum is split into shares that each rank
    reduces and scales: a joined rank's share must get the prescale and postscale too."""
    n, r = hvd.size(), hvd.rank()
    if n == 1:
        pytest.skip("needs 2 ranks")
    values = tf.cast(tf.fill([300_000], r + 1), dtype)
    if r == 0:
        last = hvd.join()
    else:
        out = hvd.allreduce(values, op=hvd.Sum, prescale_factor=3.0, postscale_factor=0.5)
        total = sum(q + 1 for q in range(1, n))  # rank 0 has joined: it adds nothing
        np.testing.assert_array_equal(
            tf.cast(out, tf.float64).numpy(), np.full(300_000, 1.5 * total)
        )
        last = hvd.join()
    assert int(last) != 0  # rank 0 joined first


@pytest.mark.parametrize("op", ["Product", "Min", "Max"])
@pytest.mark.parametrize(
    "dtype", [tf.int32, tf.int64, tf.float16, tf.bfloat16, tf.float32], ids=lambda d: d.name
)
def test_a_joined_ranks_identity_is_not_prescaled(hvd, dtype, op):
    """With a prescale, each active rank's values are scaled before the reduction; the
    joined rank's stand-in must stay the op's identity, not be scaled too (a product's 1
    became the prescale, an integer minimum's largest value overflowed). Small buckets are
    gathered, large ones reduced in place or (half precision) in shares."""
    n, r = hvd.size(), hvd.rank()
    active = list(range(1, n)) if n > 1 else [0]
    np_dtype = dtype.as_numpy_dtype

    def scaled(rank, size, pre):  # a rank's values, prescaled as the reducer does
        x = (np.arange(size) % 5 + rank + 1).astype(np.float64)
        if dtype.is_integer:
            return np.trunc(x * pre).astype(np_dtype)
        return (x.astype(np.float32) * np.float32(pre)).astype(np_dtype)

    combine = {"Product": np.multiply, "Min": np.minimum, "Max": np.maximum}[op]
    for size in (7, 300_000):
        for pre in (2.0, -1.5):
            if r not in active:
                hvd.join()
                continue
            x = tf.cast(tf.constant(np.arange(size) % 5 + r + 1), dtype)
            got = hvd.allreduce(x, op=getattr(hvd, op), prescale_factor=pre)
            (grouped,) = hvd.grouped_allreduce([x], op=getattr(hvd, op), prescale_factor=pre)
            want = scaled(active[0], size, pre)
            for q in active[1:]:  # rank by rank, rounded to the dtype, as the reducer does
                want = combine(want, scaled(q, size, pre)).astype(np_dtype)
            for out in (got, grouped):
                np.testing.assert_array_equal(
                    tf.cast(out, tf.float64).numpy(), want.astype(np.float64)
                )
            hvd.join()


def test_ranks_with_uneven_data_train_then_join(hvd, monkeypatch):
    """Rank r has 2 + (r + 1) % n batches; each trains on what it has, then joins. Every
    step averages the active ranks' gradients over all n ranks (joined ranks add zeros), so
    the weights follow a closed recurrence every rank can compute for all."""
    n, r = hvd.size(), hvd.rank()
    monkeypatch.setattr(tape_mod, "_counters", {})  # this test's steps count from 0
    batches = [2 + (q + 1) % n for q in range(n)]
    rng = np.random.default_rng(5)
    data = [rng.normal(size=(batches[q], 4, 3)).astype(np.float32) for q in range(n)]
    w = tf.Variable(np.ones(3, np.float32))
    opt = keras.optimizers.SGD(0.1)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(tf.linalg.matvec(x, w))) / 4.0
        grads = hvd.DistributedGradientTape(tape).gradient(loss, [w])
        opt.apply_gradients(zip(grads, [w]))

    for x in data[r]:
        step(tf.constant(x))
    last = int(hvd.join())

    want = [np.ones(3, np.float64)]  # the weights after each step
    for t in range(max(batches)):
        total = np.zeros(3)
        for q in range(n):
            if t < batches[q]:
                x = data[q][t].astype(np.float64)
                total += 2.0 * x.T @ (x @ want[-1]) / 4.0
        want.append(want[-1] - 0.1 * total / n)
    # A rank stops updating when it joins; the ranks that trained to the end hold the result.
    np.testing.assert_allclose(w.numpy(), want[batches[r]], rtol=1e-5)
    assert batches[last] == max(batches)
    hvd.broadcast_variables([w], root_rank=last)  # Horovod's idiom after join()
    np.testing.assert_allclose(w.numpy(), want[-1], rtol=1e-5)
    everyone = hvd.allgather_object(w.numpy().tobytes())
    assert len(set(everyone)) == 1  # bit-identical replicas


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
def test_sparse_gradients_and_allgathers_train_on_while_a_rank_has_joined(hvd, graph, monkeypatch):
    """An embedding's gradient is gathered (rows and indices), as Horovod does: a joined rank
    gives no rows. Rank r has 1 + r batches; the average still divides by every rank."""
    n, r = hvd.size(), hvd.rank()
    monkeypatch.setattr(tape_mod, "_counters", {})  # this test's steps count from 0
    rng = np.random.default_rng(3)
    batches = [1 + q for q in range(n)]
    idx = [rng.integers(0, 6, size=(batches[q], 4)) for q in range(n)]
    vec = [rng.normal(size=(batches[q], 4, 2)).astype(np.float32) for q in range(n)]
    table = tf.Variable(np.ones((6, 2), np.float32))
    opt = keras.optimizers.SGD(0.1)

    def step(i, v):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(table, i) * v)
        (grad,) = hvd.DistributedGradientTape(tape).gradient(loss, [table])
        opt.apply_gradients([(grad, table)])
        return hvd.allgather(tf.cast(i, tf.float32), name="indices_seen")

    step_fn = tf.function(step) if graph else step
    want = np.ones((6, 2), np.float64)
    history = [want]  # the weights after each step
    for t in range(max(batches)):
        total = np.zeros((6, 2))
        active = [q for q in range(n) if t < batches[q]]
        for q in active:
            np.add.at(total, idx[q][t], vec[q][t].astype(np.float64))
        want = want - 0.1 * total / n
        history.append(want)
        if r in active:
            seen = step_fn(tf.constant(idx[r][t]), tf.constant(vec[r][t]))
            np.testing.assert_array_equal(
                seen.numpy(), np.concatenate([idx[q][t] for q in active]).astype(np.float32)
            )
    assert int(hvd.join()) == n - 1
    # A rank stops updating when it joins: rank n - 1 trained through every step.
    np.testing.assert_allclose(table.numpy(), history[batches[r]], rtol=1e-5)


def test_an_allgathers_gradient_while_a_lower_rank_has_joined(hvd):
    # Rank 0 has joined (it gives no rows): each active rank's gradient is its own rows of the
    # average over every rank (the joined one adds zeros) of the gathered tensor's gradient.
    n, r = hvd.size(), hvd.rank()
    if n == 1:
        pytest.skip("needs 2 ranks")
    rows = {q: q + 1 for q in range(1, n)}
    total = sum(rows.values())
    weights = np.arange(total * 2, dtype=np.float32).reshape(total, 2) % 7 - 3
    if r == 0:
        hvd.join()
        return
    x = tf.Variable(np.full((rows[r], 2), float(r), np.float32))
    with tf.GradientTape() as tape:
        gathered = hvd.allgather(x)
        loss = tf.reduce_sum(gathered * weights)
    grad = tape.gradient(loss, x)
    start = sum(rows[q] for q in range(1, r))
    np.testing.assert_array_equal(gathered.numpy()[start : start + rows[r]], x.numpy())
    np.testing.assert_allclose(grad.numpy(), weights[start : start + rows[r]] * (n - 1) / n)
    hvd.join()


def test_join_within_a_process_set(hvd):
    """The set of the last two ranks: its second rank joins; the first's allreduce on the set
    gets only its own values, then it joins last, and join() names it by its job rank (at
    np=3 rank 1, the set's rank 0); a rank outside the set takes no part."""
    n, r = hvd.size(), hvd.rank()
    if n == 1:
        pytest.skip("needs 2 ranks")
    first, second = n - 2, n - 1
    # At np=2 the two ranks are the job: the global set (adding it again is refused).
    ps = hvd.add_process_set([first, second]) if n > 2 else hvd.global_process_set
    try:
        x = tf.constant([1.0, 2.0]) * (r + 1)
        if r == second:
            last = hvd.join(process_set=ps)
            assert int(last) == first
        elif r == first:
            out = hvd.allreduce(x, op=hvd.Sum, process_set=ps)
            np.testing.assert_array_equal(out.numpy(), np.array([1.0, 2.0]) * (first + 1))
            assert int(hvd.join(process_set=ps)) == first
    finally:
        assert hvd.remove_process_set(ps) == (n > 2)


def _adasum_of_pair(a, b):
    # Adasum's combination of two gradients (Maleki et al., 2020); a zero side has weight 1.
    dot = float(a @ b)
    ca = 1.0 - dot / (2.0 * float(a @ a)) if a.any() else 1.0
    cb = 1.0 - dot / (2.0 * float(b @ b)) if b.any() else 1.0
    return ca * a + cb * b


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
def test_adasum_runs_while_a_rank_has_joined_which_gives_zeros(hvd, graph):
    # Rank 0 joins at once; the others reduce with Adasum (a collective and a tape). Rank 0's
    # zeros drop out of the pairwise tree: its pair with rank 1 is rank 1's gradient, and that
    # meets rank 2's (at n = 3) by Adasum's formula.
    n, r = hvd.size(), hvd.rank()
    if n == 1:
        pytest.skip("needs 2 ranks")
    rows = [np.array([1.0, 2.0 * k, -1.0, k * k], np.float64) for k in range(n)]
    want = _adasum_of_pair(np.zeros(4), rows[1])
    if n == 3:
        want = _adasum_of_pair(want, rows[2])
    v = tf.Variable(tf.zeros([4], tf.float64))

    def reduce():
        direct = hvd.allreduce(tf.constant(rows[r]), op=hvd.Adasum)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(v * tf.constant(rows[r]))
        tape = hvd.DistributedGradientTape(tape, op=hvd.Adasum)
        return direct, tape.gradient(loss, [v])[0]

    reduce = tf.function(reduce) if graph else reduce
    if r == 0:
        hvd.join()
    else:
        direct, gradient = reduce()
        hvd.join()
        np.testing.assert_allclose(direct.numpy(), want, rtol=1e-12)
        np.testing.assert_allclose(gradient.numpy(), want, rtol=1e-12)


def test_a_collective_that_cannot_stand_in_raises_while_a_rank_has_joined(hvd):
    n, r = hvd.size(), hvd.rank()
    if n == 1:
        pytest.skip("needs 2 ranks")
    if r == 0:
        hvd.join()
    else:
        with pytest.raises(CollectiveError, match=r"rank\(s\) 0 have called join\(\)"):
            hvd.barrier()
        with pytest.raises(CollectiveError, match="join"):
            hvd.broadcast_object("x", root_rank=1)
        hvd.join()
    hvd.barrier()  # everyone has joined: collectives run again


def test_active_ranks_that_disagree_while_a_rank_has_joined_are_named_by_their_ranks(hvd):
    # Rank 0 has joined; ranks 1.. reduce different shapes. Their error names each active rank
    # by its own number and the field that differs (rank 0 is not in the list).
    n, r = hvd.size(), hvd.rank()
    if n < 3:
        pytest.skip("needs 2 active ranks beside a joined one")
    if r == 0:
        hvd.join()
    else:
        with pytest.raises(hvd.MismatchError) as info:
            hvd.allreduce(tf.ones([r]), name="uneven")
        passed = "; ".join(f"rank {s}: shapes=(({s},),)" for s in range(1, n))
        assert f"uneven.bucket0: ranks passed different shapes ({passed})" in str(info.value)
        hvd.join()
    hvd.barrier()


def test_the_periodic_replica_check_is_skipped_while_a_rank_has_joined(hvd, monkeypatch):
    # A joined rank's replica rightly lags behind: with --verify-every the active ranks' steps
    # go on (the check waits for every rank to be training) instead of raising.
    n, r = hvd.size(), hvd.rank()
    if n == 1:
        pytest.skip("needs 2 ranks")
    config = runtime.get_config()
    monkeypatch.setattr(runtime._state, "config", dataclasses.replace(config, verify_every=1))
    monkeypatch.setattr(tape_mod, "_counters", {})
    w = tf.Variable([1.0, 2.0])
    if r == 0:
        hvd.join()
    else:
        for _ in range(2):
            with tf.GradientTape() as t:
                loss = tf.reduce_sum(w * w) * r
            (grad,) = hvd.DistributedGradientTape(t).gradient(loss, [w])
            # Each active rank's gradient 2 w r, averaged over all n ranks (rank 0 adds zeros).
            total = sum(range(1, n))
            np.testing.assert_allclose(grad.numpy(), 2 * w.numpy() * total / n, rtol=1e-6)
        hvd.join()
    # Every rank trains again: the check runs, and finds the replicas identical.
    assert hvd.verify_synchronized([w]) == 1


@pytest.mark.parametrize("source", ["tape", "keras"])
def test_uneven_epochs_each_ended_by_join_train_on(hvd, source, monkeypatch):
    """Horovod's pattern for uneven data: every epoch each rank trains on what it has, joins,
    and the last to join broadcasts. The steps the ranks made differ after each join; the next
    epoch's must still be taken as agreeing (the tape's own count, or the Keras optimizer's
    ``iterations``), and a rank that skips a step afterwards must still be caught."""
    n, r = hvd.size(), hvd.rank()
    monkeypatch.setattr(tape_mod, "_counters", {})
    epochs = 3
    # Rank q has 1 + (q + e) % n batches in epoch e: a different rank joins last each epoch.
    batches = [[1 + (q + e) % n for q in range(n)] for e in range(epochs)]
    rng = np.random.default_rng(11)
    data = [
        [rng.normal(size=(batches[e][q], 4, 3)).astype(np.float32) for q in range(n)]
        for e in range(epochs)
    ]
    w = tf.Variable(np.ones(3, np.float32))

    def make_step():
        if source == "keras":
            opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
        else:
            opt = keras.optimizers.SGD(0.1)

        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(tf.linalg.matvec(x, w))) / 4.0
            if source == "tape":
                tape = hvd.DistributedGradientTape(tape)
            grads = tape.gradient(loss, [w])
            opt.apply_gradients(zip(grads, [w]))

        return step, opt

    step, opt = make_step()

    want = np.ones(3, np.float64)
    for e in range(epochs):
        for x in data[e][r]:
            step(tf.constant(x))
        last = int(hvd.join())
        assert batches[e][last] == max(batches[e])
        hvd.broadcast_variables([w], root_rank=last)
        for t in range(max(batches[e])):  # joined ranks add zeros; the average divides by n
            total = np.zeros(3)
            for q in range(n):
                if t < batches[e][q]:
                    x = data[e][q][t].astype(np.float64)
                    total += 2.0 * x.T @ (x @ want) / 4.0
            want = want - 0.1 * total / n
        np.testing.assert_allclose(w.numpy(), want, rtol=1e-5)
    # The first step after a join sets where each rank's count starts; a new optimizer's
    # count, from 0 on every rank, agrees; rank 0 then skips a step: every rank is told.
    step(tf.constant(data[0][0][0]))
    step(tf.constant(data[0][0][0]))
    if source == "keras":
        step, opt = make_step()
        step(tf.constant(data[0][0][0]))
        step(tf.constant(data[0][0][0]))
    if n > 1:
        if r == 0:
            if source == "tape":
                tape_mod._step_counter().assign_add(1)
            else:
                opt.iterations.assign_add(1)
        skipped = r"StepMismatchError: .*rank \d is at step \d+; ranks? [\d, ]+ at step \d+"
        with pytest.raises(tf.errors.OpError, match=skipped):  # raised inside the function
            step(tf.constant(data[0][0][0]))
    hvd.join()  # the counts are this test's (monkeypatched): the next test's start anew
