"""Horovod's names in ``hvd.elastic``: object broadcasts and ``run_fn``, at any number of ranks."""

import syncdp.tensorflow as hvd


def test_broadcast_object_gives_every_rank_the_roots_object():
    root = hvd.size() - 1
    mine = {"rank": hvd.rank(), "ranks": list(range(hvd.rank() + 1)), "name": f"r{hvd.rank()}"}
    got = hvd.elastic.broadcast_object(mine, root_rank=root)
    assert got == {"rank": root, "ranks": list(range(root + 1)), "name": f"r{root}"}


def test_broadcast_object_fn_returns_a_broadcast_from_its_root():
    bcast = hvd.elastic.broadcast_object_fn(root_rank=0, name="test.fn")
    assert bcast(("epoch", 10 + hvd.rank())) == ("epoch", 10)
    assert bcast([hvd.rank()] * 2) == [0, 0]  # the function can be called again


def test_run_fn_syncs_the_state_from_rank_0_and_runs_without_a_reset():
    resets = []
    state = hvd.elastic.ObjectState(epoch=hvd.rank(), seen=[hvd.rank()])

    def train(state, extra):
        return state.epoch, state.seen, extra

    train = hvd.elastic.run_fn(train, lambda: resets.append(hvd.rank()))
    assert train(state, extra=hvd.rank()) == (0, [0], hvd.rank())
    assert resets == []  # no membership change: nothing to reset
