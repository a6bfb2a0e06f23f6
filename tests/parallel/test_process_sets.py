"""Process sets, SyncBatchNormalization, local gradients and TF1 optimizers across the ranks.

The sets are the issue's {0}, {0, 2} and {1, 2} where three ranks exist ({0} and {1} at two);
each is checked against the sum over its own ranks, used alternately and at the same time as
the whole job.
"""

import threading

import keras
import numpy as np
import pytest
import tensorflow as tf


def _candidate_sets(n):
    return {1: [], 2: [[0], [1]], 3: [[0], [0, 2], [1, 2]]}[n]


@pytest.fixture(scope="module")
def sets():
    import syncdp

    registered = [syncdp.add_process_set(ranks) for ranks in _candidate_sets(syncdp.size())]
    yield registered
    for ps in registered:
        assert syncdp.remove_process_set(ps)


def test_sets_are_registered_alike_on_every_rank(hvd, sets):
    r = hvd.rank()
    ids = hvd.allgather_object([(ps.process_set_id, ps.ranks) for ps in sets])
    assert all(i == ids[0] for i in ids)
    for ps in sets:
        assert ps.included() == (r in ps.ranks)
        assert ps.size() == len(ps.ranks)
        assert int(hvd.size_op(process_set_id=ps.process_set_id)) == len(ps.ranks)
        assert int(hvd.process_set_included_op(ps.process_set_id)) == int(r in ps.ranks)
    if sets:
        with pytest.raises(ValueError, match="duplicate"):
            hvd.add_process_set(sets[0].ranks)


def test_a_set_of_every_rank_is_the_global_set_and_is_not_added_again(hvd):
    # As Horovod refuses it: the global set (id 0) already holds every rank. It was registered
    # a second time, under a new id, unlike init(process_sets=[every rank]), which gives id 0.
    before = hvd.get_process_set_ids_and_ranks()
    with pytest.raises(ValueError, match="duplicate process set"):
        hvd.add_process_set(list(range(hvd.size())))
    assert hvd.get_process_set_ids_and_ranks() == before


def test_collectives_of_each_set_alternating_with_the_job(hvd, sets):
    r, n = hvd.rank(), hvd.size()
    for _ in range(2):
        for ps in sets:
            if ps.included():
                total = hvd.allreduce(tf.constant([r + 1.0]), op=hvd.Sum, process_set=ps)
                assert total.numpy()[0] == sum(s + 1 for s in ps.ranks)
                gathered = hvd.allgather(tf.constant([r]), process_set=ps)
                assert gathered.numpy().tolist() == ps.ranks
                root = ps.ranks[-1]  # roots are job ranks, as in Horovod
                assert hvd.broadcast(tf.constant([r]), root, process_set=ps).numpy()[0] == root
                scattered = hvd.reducescatter(tf.ones([2 * ps.size()]), op=hvd.Sum, process_set=ps)
                np.testing.assert_array_equal(scattered.numpy(), [ps.size()] * 2)
                assert hvd.allgather_object(r, process_set=ps) == ps.ranks
            whole = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum)
            assert whole.numpy()[0] == n


def test_a_set_and_the_job_at_the_same_time(hvd, sets):
    """Two threads: one reduces on a set, the other on the whole job; neither waits on the
    other's messages (each set has its own communicator)."""
    n = hvd.size()
    results = {}

    def on_the_job():
        results["job"] = [
            hvd.allreduce(tf.constant([1.0]), op=hvd.Sum, name="job").numpy()[0] for _ in range(20)
        ]

    for ps in sets:
        worker = threading.Thread(target=on_the_job)
        worker.start()
        if ps.included():
            mine = [
                hvd.allreduce(tf.constant([2.0]), op=hvd.Sum, process_set=ps).numpy()[0]
                for _ in range(20)
            ]
            assert mine == [2.0 * ps.size()] * 20
        worker.join(timeout=60)
        assert not worker.is_alive()
        assert results["job"] == [float(n)] * 20


def test_a_rank_outside_the_set_is_refused(hvd, sets):
    for ps in sets:
        if not ps.included():
            with pytest.raises(tf.errors.InvalidArgumentError, match="not in"):
                hvd.allreduce(tf.ones([2]), process_set=ps)
    unknown = hvd.ProcessSet([0])
    unknown.process_set_id = 999
    with pytest.raises(ValueError, match="not registered"):
        hvd.allreduce(tf.ones([2]), process_set=unknown)


def test_tape_and_optimizer_average_over_the_set_only(hvd, sets):
    r = hvd.rank()
    for ps in sets:
        x = tf.constant(float(r))
        with tf.GradientTape() as g:
            g.watch(x)
            y = x * x
        grad = hvd.DistributedGradientTape(g, process_set=ps).gradient(y, [x])[0]
        expected = 2.0 * np.mean(ps.ranks) if ps.included() else 2.0 * r
        assert float(grad) == pytest.approx(expected)


# ---- SyncBatchNormalization: exact against one process on the concatenated batch ----


@pytest.mark.parametrize("unequal", [False, True])
def test_sync_batch_norm_equals_one_process_on_the_whole_batch(hvd, unequal):
    r, n = hvd.rank(), hvd.size()
    sizes = [2 + (s if unequal else 0) for s in range(n)]
    rng = np.random.default_rng(7)
    whole = rng.normal(size=(sum(sizes), 3, 2)).astype(np.float32) * 3 + 1
    start = sum(sizes[:r])
    reference = keras.layers.BatchNormalization(axis=1, momentum=0.5)
    synced = hvd.SyncBatchNormalization(axis=1, momentum=0.5)
    expected = reference(whole, training=True).numpy()[start : start + sizes[r]]
    out = synced(whole[start : start + sizes[r]], training=True).numpy()
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)
    for attr in ("moving_mean", "moving_variance"):
        np.testing.assert_allclose(
            getattr(synced, attr).numpy(), getattr(reference, attr).numpy(), rtol=1e-5, atol=1e-7
        )
    with pytest.raises(ValueError, match="fused"):
        hvd.SyncBatchNormalization(fused=True)


def test_sync_batch_norm_of_images_with_a_rank_whose_batch_is_empty(hvd):
    # The last rank's share of an uneven split is empty: its moments are NaN (0/0) and must
    # add nothing (they made every rank's statistics NaN).
    r, n = hvd.rank(), hvd.size()
    sizes = [3] * (n - 1) + [0] if n > 1 else [3]
    whole = np.random.default_rng(8).normal(size=(sum(sizes), 4, 4, 3)).astype(np.float32) * 2
    start = sum(sizes[:r])
    reference = keras.layers.BatchNormalization(momentum=0.0)
    synced = hvd.SyncBatchNormalization(momentum=0.0)
    expected = reference(whole, training=True).numpy()[start : start + sizes[r]]
    out = synced(whole[start : start + sizes[r]], training=True).numpy()
    assert out.shape == expected.shape
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(synced.moving_mean.numpy(), whole.mean((0, 1, 2)), rtol=1e-5)


def test_masked_sync_batch_norm_equals_one_process_on_the_whole_masked_batch(hvd):
    """A mask (Embedding(mask_zero=True) passes one on) leaves rows out of the statistics: the
    global batch's masked mean and variance, and the gradients of the whole batch's loss."""
    r, n = hvd.rank(), hvd.size()
    sizes = [2 + q for q in range(n)]
    rng = np.random.default_rng(8)
    whole = (rng.normal(size=(sum(sizes), 5, 3)) * 2 + 1).astype(np.float32)
    mask = rng.random((sum(sizes), 5)) > 0.3
    upstream = rng.normal(size=whole.shape).astype(np.float32)
    mine = slice(sum(sizes[:r]), sum(sizes[: r + 1]))
    reference = keras.layers.BatchNormalization(momentum=0.5)
    synced = hvd.SyncBatchNormalization(momentum=0.5)

    def forward(layer, x, m, up):
        x = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True, mask=tf.constant(m))
            loss = tf.reduce_sum(y * up)
        return y.numpy(), tape.gradient(loss, x).numpy()

    want_y, want_dx = forward(reference, whole, mask, upstream)
    y, dx = forward(synced, whole[mine], mask[mine], upstream[mine])
    np.testing.assert_allclose(y, want_y[mine], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dx, want_dx[mine], rtol=1e-4, atol=1e-5)
    for attr in ("moving_mean", "moving_variance"):
        np.testing.assert_allclose(
            getattr(synced, attr).numpy(), getattr(reference, attr).numpy(), rtol=1e-5, atol=1e-6
        )


# ---- local gradients ----


def test_partial_tape_keeps_local_layers_gradients_local_and_scaled(hvd):
    r, n = hvd.rank(), hvd.size()
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(2, kernel_initializer=keras.initializers.Constant(r + 1.0)),
            keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(r + 1.0)),
        ]
    )
    x = tf.ones([4, 3]) * (r + 1)
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_sum(model(x) ** 2)
    plain = [g.numpy() for g in tape.gradient(loss, model.trainable_weights)]
    everyone = hvd.allgather_object(plain)
    partial = hvd.PartialDistributedGradientTape(tape, local_layers=model.layers[0])
    local, shared = partial.get_local_and_global_gradients(loss, model.trainable_weights)
    assert len(local) == 2 and len(shared) == 2
    for k, (_, g) in enumerate(local):  # the first layer's kernel and bias
        np.testing.assert_allclose(g.numpy(), plain[k] / n, rtol=1e-6)
    for k, (_, g) in enumerate(shared, start=2):
        np.testing.assert_allclose(g.numpy(), np.mean([e[k] for e in everyone], 0), rtol=1e-6)


def test_tf1_optimizer_in_a_monitored_session_matches_one_process(hvd):
    """Each rank's loss is w * (rank + 1); one process on the mean loss takes the same step."""
    r, n = hvd.rank(), hvd.size()
    with tf.Graph().as_default():
        w = tf.compat.v1.get_variable("w", initializer=tf.constant([1.0 + r, -2.0]))
        batches = tf.compat.v1.get_variable("batches", initializer=0, trainable=False)
        with tf.control_dependencies([batches.assign_add(1)]):  # counts "input batches" read
            loss = tf.reduce_sum(w * (r + 1.0))
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.5))
        assert isinstance(opt, tf.compat.v1.train.Optimizer)
        train = opt.minimize(loss)
        hooks = [hvd.BroadcastGlobalVariablesHook(0)]
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as sess:
            np.testing.assert_array_equal(sess.run(w), [1.0, -2.0])  # rank 0's start
            assert sess.run(batches) == 0  # the hook's broadcast ran no training step
            sess.run(train)
            assert sess.run(batches) == 1
            mean_grad = np.mean([s + 1.0 for s in range(n)])
            np.testing.assert_allclose(sess.run(w), [1.0 - 0.5 * mean_grad, -2.0 - 0.5 * mean_grad])
    with pytest.raises(RuntimeError, match="eager"):
        hvd.broadcast_global_variables(0)


def test_partial_keras_optimizer_and_horovods_gradient_hooks(hvd):
    import syncdp.keras as hk

    r, n = hvd.rank(), hvd.size()
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(2, kernel_initializer=keras.initializers.Constant(r + 1.0)),
            keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(r + 1.0)),
        ]
    )
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_sum(model(tf.ones([2, 3])) ** 2)
    plain = [g.numpy() for g in tape.gradient(loss, model.trainable_weights)]
    everyone = hvd.allgather_object(plain)
    opt = hk.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=model.layers[0])
    pairs = opt._compute_gradients(loss, model.trainable_weights, tape=tape)
    for k, (g, _) in enumerate(pairs):
        expected = plain[k] / n if k < 2 else np.mean([e[k] for e in everyone], 0)
        np.testing.assert_allclose(g.numpy(), expected, rtol=1e-6)
    before = [w.numpy() for w in model.trainable_weights]
    opt.apply_gradients(pairs)  # applied as given: not reduced a second time
    for w, b, (g, _) in zip(model.trainable_weights, before, pairs):
        np.testing.assert_allclose(w.numpy(), b - 0.1 * g.numpy(), rtol=1e-6)
    accumulating = hk.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2)
    x = tf.Variable([0.0])
    for _ in range(3):
        accumulating.apply_gradients(accumulating._compute_gradients(lambda: x * (r + 1.0), [x]))
    assert int(accumulating._agg_helper.counter) == 1  # 3 passes, 2 per update
    # Horovod's default: the update is the sum of the 2 passes' rank-averaged gradients.
    np.testing.assert_allclose(x.numpy(), [-2 * np.mean([s + 1.0 for s in range(n)])])


def test_init_again_takes_every_rank_as_the_job_and_refuses_an_empty_set(hvd):
    n = hvd.size()
    whole = hvd.ProcessSet(list(range(n)))  # every rank: the job's own set, id 0, as in Horovod
    hvd.init(process_sets=[whole])  # already initialized: gives the set its id
    hvd.init(process_sets=[whole])  # and again, the same
    assert whole.process_set_id == 0 and whole.included()
    total = hvd.allreduce(tf.ones([1]), op=hvd.Sum, process_set=whole)
    assert total.numpy()[0] == n
    assert not hvd.remove_process_set(whole)  # the job's set is never removed
    empty = hvd.ProcessSet([])  # what an "odd ranks" set is at np=1
    with pytest.raises(ValueError, match="at least one rank"):
        hvd.init(process_sets=[whole, empty])
    assert empty.process_set_id is None


def test_sets_from_split_communicators_are_registered_as_horovods_init_does(hvd):
    """Horovod's "static process sets from MPI communicators": each rank passes its own half
    of a split; every rank registers both halves, in one order, and each object gets its id."""
    from mpi4py import MPI

    from syncdp.job import process_sets

    r, n = hvd.rank(), hvd.size()
    split = MPI.COMM_WORLD.Split(color=r % 2, key=r)
    clone, split_clone = MPI.COMM_WORLD.Dup(), split.Dup()
    even, odd = list(range(0, n, 2)), list(range(1, n, 2))
    mine = even if r % 2 == 0 else odd
    before = hvd.get_process_set_ids_and_ranks()
    sets = [
        hvd.ProcessSet(split),
        hvd.ProcessSet(even),  # the same ranks as the even ranks' split: one set
        hvd.ProcessSet(clone),  # every rank: the job's set
        hvd.ProcessSet(split_clone),
        hvd.ProcessSet([0]),
    ]
    hvd.init(process_sets=sets)
    after = hvd.get_process_set_ids_and_ranks()
    try:
        assert hvd.allgather_object(after) == [after] * n
        # Registered in Horovod's order: rank 0's first set (the even ranks), rank 1's (the odd
        # ones), ..., then the next position; each set once; every rank is the job's (id 0).
        expected = dict(before)
        for ranks in (even, odd, [0]):
            if ranks and ranks != list(range(n)) and ranks not in expected.values():
                expected[max(expected) + 1] = ranks
        assert after == expected
        id_of = {tuple(v): k for k, v in sorted(after.items(), reverse=True)}  # lowest id wins
        assert [ps.process_set_id for ps in sets] == [
            id_of[tuple(mine)],
            id_of[tuple(even)],
            0,
            id_of[tuple(mine)],
            id_of[(0,)],
        ]
        assert sets[0].ranks == mine and sets[0].included()
        assert hvd.comm_process_set_id(split) == id_of[tuple(mine)]
        assert hvd.comm_process_set_id(clone) == 0
        total = hvd.allreduce(tf.constant([r + 1.0]), op=hvd.Sum, process_set=sets[0])
        assert total.numpy()[0] == sum(q + 1.0 for q in mine)
    finally:
        added = sorted(set(after) - set(before))
        for i in added:
            assert hvd.remove_process_set(process_sets.process_set_by_id(i))
        for c in (split, clone, split_clone):
            c.Free()
    # Every object of a removed set loses its id, as in Horovod; the others keep theirs.
    removed = [after[i] for i in added]
    assert [ps.process_set_id is None for ps in sets] == [ps.ranks in removed for ps in sets]
    assert hvd.get_process_set_ids_and_ranks() == before


@pytest.mark.parametrize("bad", ["empty", "outside"])
def test_a_bad_set_on_one_rank_at_init_is_refused_on_every_rank(hvd, bad):
    r, n = hvd.rank(), hvd.size()
    before = hvd.get_process_set_ids_and_ranks()
    wrong = [] if bad == "empty" else [n]
    asked = [hvd.ProcessSet([0]), hvd.ProcessSet(wrong if r == n - 1 else [0])]
    with pytest.raises(ValueError, match="at least one rank" if bad == "empty" else "ranks in"):
        hvd.init(process_sets=asked)
    # Nothing was registered, nobody waits: the job goes on.
    assert hvd.get_process_set_ids_and_ranks() == before
    assert all(ps.process_set_id is None or ps.ranks == list(range(n)) for ps in asked)
    assert hvd.allreduce(tf.ones([1]), op=hvd.Sum).numpy()[0] == n


@pytest.mark.parametrize("empty", [[], (), "ProcessSet"], ids=["list", "tuple", "ProcessSet"])
def test_an_empty_set_is_refused_on_every_rank(hvd, empty):
    from syncdp.job import process_sets

    before = [(ps.process_set_id, ps.ranks) for ps in process_sets.registered()]
    ranks = hvd.ProcessSet([]) if empty == "ProcessSet" else empty
    with pytest.raises(ValueError) as refused:
        hvd.add_process_set(ranks)
    message = str(refused.value)
    assert "needs at least one rank" in message  # what must hold
    assert "got an empty one (ranks=[])" in message  # what was given
    assert "if ranks: syncdp.add_process_set(ranks)" in message  # the fix
    # Every rank refused it at the same point: nothing was registered, nobody waits.
    assert [(ps.process_set_id, ps.ranks) for ps in process_sets.registered()] == before
    assert hvd.allreduce(tf.ones([1]), op=hvd.Sum).numpy()[0] == hvd.size()
