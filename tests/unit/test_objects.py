"""Object collectives in one process: cloudpickle, as Horovod's, and the root's own object.

tests/parallel/test_collectives.py checks the same across ranks.
"""

import threading

import pytest

import syncdp
from syncdp.base.errors import CollectiveError


@pytest.fixture(scope="module", autouse=True)
def _init():
    syncdp.init()


def test_broadcast_object_returns_the_roots_own_object():
    state = {"epoch": 3, "seen": [1, 2]}
    assert syncdp.broadcast_object(state, root_rank=0) is state


def test_lambdas_and_local_classes_travel_by_value():
    offset = 10

    class Local:  # defined in a function: plain pickle can only name it, and fails
        def __init__(self, value):
            self.value = value

    (add,) = syncdp.allgather_object(lambda x: x + offset)
    assert add(1) == 11
    (copy,) = syncdp.allgather_object(Local(5))
    assert copy.value == 5 and type(copy).__name__ == "Local"
    assert syncdp.broadcast_object(lambda: 7, root_rank=0)() == 7


def test_an_object_that_cannot_be_pickled_raises_collective_error():
    with pytest.raises(CollectiveError, match="rank 0: TypeError: cannot pickle"):
        syncdp.broadcast_object(threading.Lock(), root_rank=0)
    with pytest.raises(CollectiveError, match="rank 0: TypeError: cannot pickle"):
        syncdp.allgather_object(threading.Lock())
