"""Registering and removing process sets: every rank alike, sets compared as objects.

Apart from test_process_sets.py, whose sets stay registered for its whole module.
"""

import pytest
import tensorflow as tf


def test_ranks_that_remove_different_sets_are_refused_on_every_rank(hvd):
    # Rank 0 removing one set while the others remove another would leave the ranks with
    # different sets, and number the next set added differently: refused everywhere, nothing
    # removed.
    from syncdp.base.errors import MismatchError

    n = hvd.size()
    if n == 1:
        pytest.skip("one rank has no set but the global one")
    first, last = hvd.add_process_set([0]), hvd.add_process_set([n - 1])
    before = hvd.get_process_set_ids_and_ranks()
    with pytest.raises(MismatchError, match="remove_process_set"):
        hvd.remove_process_set(first if hvd.rank() == 0 else last)
    assert hvd.get_process_set_ids_and_ranks() == before
    with pytest.raises(MismatchError, match="remove_process_set"):
        hvd.remove_process_set(first if hvd.rank() == 0 else hvd.global_process_set)
    assert hvd.remove_process_set(last) and hvd.remove_process_set(first)
    assert not hvd.remove_process_set(first)  # already removed, on every rank alike
    assert hvd.get_process_set_ids_and_ranks() == {0: list(range(n))}


def test_a_set_is_a_dict_key_before_and_after_it_is_registered(hvd):
    # As in Horovod, sets compare as objects: registering one (its id and ranks change) keeps
    # it where a dict put it.
    if hvd.size() == 1:
        pytest.skip("one rank has no set but the global one")
    first = hvd.ProcessSet([0])
    rates = {first: 0.1}
    hvd.add_process_set(first)
    assert rates[first] == 0.1
    assert hvd.ProcessSet([0]) not in rates
    assert hvd.remove_process_set(first)
    assert rates[first] == 0.1


def test_the_global_set_under_another_object_is_removed_like_it(hvd):
    # init(process_sets=[every rank]) gives that object id 0: the global set, which no rank
    # removes, whichever object it passes.
    whole = hvd.ProcessSet(list(range(hvd.size())))
    hvd.init(process_sets=[whole])
    assert whole.process_set_id == 0
    assert not hvd.remove_process_set(whole if hvd.rank() == 0 else hvd.global_process_set)
    assert hvd.get_process_set_ids_and_ranks() == {0: list(range(hvd.size()))}


def test_a_removed_set_answers_none_to_included_until_it_is_added_again(hvd):
    # Horovod invalidates a removed set: included() answers None, so a program's
    # `if ps.included(): hvd.allreduce(..., process_set=ps)` skips a set that is gone on
    # every rank alike, including the set's own ranks and other objects given its id.
    n = hvd.size()
    if n == 1:
        pytest.skip("one rank has no set but the global one")
    ps = hvd.add_process_set([0])
    alias = hvd.ProcessSet([0])
    hvd.init(process_sets=[alias])  # another object given the same id
    assert alias.process_set_id == ps.process_set_id
    assert ps.included() == alias.included() == (hvd.rank() == 0)
    assert hvd.remove_process_set(ps)
    assert ps.included() is None and alias.included() is None
    assert ps.size() is None and ps.rank() is None
    # A tape of the removed set is refused, not skipped as by a rank outside it.
    v = tf.Variable([1.0])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(v * v)
    with pytest.raises(ValueError, match="is not registered"):
        hvd.DistributedGradientTape(tape, process_set=ps).gradient(loss, [v])
    hvd.add_process_set(ps)
    assert ps.included() == (hvd.rank() == 0)
    assert hvd.remove_process_set(ps)
