"""The shared-memory data plane: the sums of the mathematics, bit-identical on every rank."""

import zlib

import numpy as np
import pytest

from syncdp.job import runtime
from syncdp.transport import shm


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64])
@pytest.mark.parametrize("size", [1, 7, (1 << 18) + 3, 3 * (1 << 18) + 11])  # 1 to 4+ segments
def test_allreduce_through_the_plane_is_exact_and_identical_everywhere(hvd, dtype, size):
    comm = runtime.communicator()
    n, r = comm.size, comm.rank
    base = np.arange(size) % 1013
    mine = (base * (r + 1) + r).astype(dtype)
    out = comm.allreduce(mine, "sum")
    if n > 1:  # every rank of this job shares the host, so the plane carries it
        assert isinstance(comm._planes.get("group"), shm.SharedPlane)
    expected = base * (n * (n + 1) // 2) + n * (n - 1) // 2  # integers: exact in float too
    np.testing.assert_array_equal(out, expected.astype(dtype))
    assert np.array_equal(comm.allreduce(mine, "max"), (base * n + n - 1).astype(dtype))
    digests = hvd.allgather_object(zlib.crc32(out.tobytes()))
    assert len(set(digests)) == 1


def test_float_sums_are_bit_identical_and_match_mpi(hvd):
    comm = runtime.communicator()
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal(5 * (1 << 18) + 5).astype(np.float32)
    through_plane = comm.allreduce(x, "sum")
    assert len(set(hvd.allgather_object(zlib.crc32(through_plane.tobytes())))) == 1
    planes, comm._planes = comm._planes, {"group": None}  # Open MPI's allreduce instead
    try:
        through_mpi = comm.allreduce(x, "sum")
    finally:
        comm._planes = planes
    np.testing.assert_allclose(through_plane, through_mpi, rtol=1e-5, atol=1e-5)
