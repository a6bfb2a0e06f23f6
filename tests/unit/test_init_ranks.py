"""init(comm=[ranks]) in one process (COMM_WORLD of one): Horovod's list of ranks is taken,
and a bad list is refused with a ValueError that says what must hold.

tests/integration/test_runtime.py runs a list of ranks at np=1, 2 and 3 through the launcher.
"""

import numpy as np
import pytest

import syncdp
from syncdp.base.errors import ConfigError


@pytest.fixture(autouse=True)
def _uninitialized():
    syncdp.shutdown()
    yield
    syncdp.shutdown()


@pytest.mark.parametrize("ranks", [[0], (0,), [np.int64(0)]], ids=["list", "tuple", "numpy"])
def test_a_list_of_world_ranks_is_the_job(ranks):
    syncdp.init(comm=ranks)
    assert syncdp.size() == 1 and syncdp.rank() == 0
    assert syncdp.allgather_object("me") == ["me"]


@pytest.mark.parametrize(
    "ranks, match",
    [
        ([], r"non-empty list of COMM_WORLD ranks \(integers\); got \[\]"),
        ([0.0], r"non-empty list of COMM_WORLD ranks \(integers\); got \[0\.0\]"),
        ([True], r"non-empty list of COMM_WORLD ranks \(integers\); got \[True\]"),
        ([0, 1], r"COMM_WORLD has ranks 0 to 0; got \[1\]"),
        ([-1], r"COMM_WORLD has ranks 0 to 0; got \[-1\]"),
        ([0, 0], r"names rank\(s\) \[0\] more than once"),
    ],
    ids=["empty", "float", "bool", "too-high", "negative", "twice"],
)
def test_a_bad_list_is_refused_with_a_value_error(ranks, match):
    with pytest.raises(ConfigError, match=match) as refused:
        syncdp.init(comm=ranks)
    assert isinstance(refused.value, ValueError)  # what Horovod programs catch
    assert not syncdp.is_initialized()
