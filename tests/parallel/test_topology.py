"""The topology-aware allreduce (reduce in each host, allreduce among leaders, broadcast) gives
exactly what the flat one gives, at any number of ranks. On one host it is only taken when
forced (``hierarchical_allreduce="on"``); tests/integration/test_multihost.py runs it across
namespace hosts, where ``auto`` (the default) picks it."""

import numpy as np
import pytest

from syncdp.job import runtime


def _data(rank: int) -> np.ndarray:
    # Integer-valued floats: sums, products, minima and maxima are exact in any order.
    return (np.arange(3_000_000) % 7 + rank + 1).astype(np.float64)  # 24 MB: several chunks


@pytest.mark.parametrize("op", ["sum", "min", "max", "prod"])
def test_topology_aware_equals_flat_and_the_mathematics(hvd, op):
    comm = runtime.communicator()
    every = np.stack([_data(r) for r in range(comm.size)])
    expected = {
        "sum": every.sum(0),
        "min": every.min(0),
        "max": every.max(0),
        "prod": every.prod(0),
    }
    saved = comm.prefer_hierarchy, comm.hierarchy
    try:
        for hierarchical, even in ((False, True), (True, True), (True, False)):
            comm.prefer_hierarchy = hierarchical
            comm.hierarchy = (*saved[1][:2], even)  # both layouts' algorithms
            assert np.array_equal(comm.allreduce(_data(comm.rank), op), expected[op])
    finally:
        comm.prefer_hierarchy, comm.hierarchy = saved


def test_auto_takes_it_only_across_hosts(hvd):
    comm, topo = runtime.communicator(), runtime.topology()
    mode = runtime.get_config().hierarchical_allreduce
    if mode == "auto":
        assert comm.prefer_hierarchy == (3 <= topo.hosts < comm.size)
    assert topo.hosts == 1  # this suite runs on one host
