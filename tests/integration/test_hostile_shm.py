"""A shared-memory filesystem that fills up never kills a rank with SIGBUS.

The shared-memory plane's window lives in a file of Open MPI's backing directory; a tmpfs only
finds a page when it is first touched. These jobs point that directory at a small tmpfs of
their own (``OMPI_MCA_osc_sm_backing_directory``), never at the machine's ``/dev/shm``: either
the plane claimed its pages when it opened and later allreduces run through it whatever
happens to the filesystem, or it could not and the job runs through MPI, with a line that names
the directory.
"""

from __future__ import annotations

import os
import subprocess
import uuid

import pytest

from tests.launcher import check, launch, python_script

# Rank 0 fills the filesystem once the plane is open (after a first, small allreduce), then a
# buffer of three segments touches every slot of the window.
JOB = r"""
import os
import numpy as np
from syncdp.job import runtime
from syncdp.transport import shm

mount = os.environ["HOSTILE_SHM"]


def fill():
    with open(os.path.join(mount, "filler"), "wb", buffering=0) as f:
        try:
            while True:
                f.write(bytes(1 << 20))
        except OSError as e:
            print("FILLED", e.strerror, flush=True)


if os.environ.get("HOSTILE_FILL_BEFORE_CLAIM"):  # the room goes between the check and the claim
    real_claim = shm.SharedPlane.claim

    def claim(self):
        if self.rank == 0:
            fill()
        self.comm.Barrier()
        return real_claim(self)

    shm.SharedPlane.claim = claim
fail_on = int(os.environ.get("HOSTILE_CLAIM_FAILS_ON", "-1"))
if fail_on >= 0:
    real_claim = shm.SharedPlane.claim
    shm.SharedPlane.claim = lambda self: (
        "No space left on device" if self.rank == fail_on else real_claim(self)
    )
runtime.init()
comm = runtime.communicator()
n, r = comm.size, comm.rank
np.testing.assert_array_equal(comm.allreduce(np.ones(8, np.float32), "sum"), np.full(8, n))
plane = comm._planes.get("group")
print("PLANE", type(plane).__name__, flush=True)
if r == 0 and os.environ.get("HOSTILE_FILL"):
    fill()
comm.barrier()
base = np.arange(3 * (1 << 18) + 5) % 1013
for _ in range(3):
    out = comm.allreduce((base * (r + 1)).astype(np.float32), "sum")
    np.testing.assert_array_equal(out, (base * (n * (n + 1) // 2)).astype(np.float32))
print("SUMS OK", flush=True)
"""


@pytest.fixture
def small_tmpfs(tmp_path):
    """A tmpfs of 32 MiB (the plane of 2 ranks needs 6 MiB, and 4 times that free to open)."""
    mount = tmp_path / f"shm-{uuid.uuid4().hex[:8]}"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _run(tmp_path, mount, **env):
    script = python_script(tmp_path, JOB, name=f"shm_{os.getpid()}_{uuid.uuid4().hex[:6]}.py")
    env = {
        "HOSTILE_SHM": str(mount),
        "OMPI_MCA_osc_sm_backing_directory": str(mount),
        "SYNCDP_STALL_TIMEOUT": "60",
        **env,
    }
    return launch(2, "python", script, timeout=120, env=env)


def _no_sigbus(result):
    text = result.stdout + result.stderr
    assert result.returncode not in (135, -7), text[-4000:]
    assert "Bus error" not in text and "SIGBUS" not in text, text[-4000:]
    return text


def test_filesystem_filling_after_the_plane_opened_is_no_sigbus(tmp_path, small_tmpfs):
    result = _run(tmp_path, small_tmpfs, HOSTILE_FILL="1")
    text = _no_sigbus(result)
    check(result)
    assert "[0]<stdout>:FILLED No space left on device" in text, text[-4000:]
    # The pages were claimed when the plane opened, so the plane carried the sums.
    assert text.count("<stdout>:PLANE SharedPlane") == 2, text[-4000:]
    assert text.count("<stdout>:SUMS OK") == 2, text[-4000:]


def test_a_claim_that_fails_for_real_runs_through_mpi_and_names_the_directory(
    tmp_path, small_tmpfs
):
    result = _run(tmp_path, small_tmpfs, HOSTILE_FILL_BEFORE_CLAIM="1")
    text = _no_sigbus(result)
    check(result)
    assert "[0]<stdout>:FILLED No space left on device" in text, text[-4000:]
    assert text.count("<stdout>:PLANE NoneType") == 2, text[-4000:]
    assert text.count("<stdout>:SUMS OK") == 2, text[-4000:]
    said = [line for line in text.splitlines() if "shared-memory plane" in line]
    assert len(said) == 1, text[-4000:]
    assert str(small_tmpfs) in said[0] and "No space left on device" in said[0], said


def test_one_rank_that_cannot_claim_sends_every_rank_through_mpi(tmp_path):
    # No mount needed: rank 1's claim reports a full filesystem; the ranks agree on MPI.
    result = _run(tmp_path, "/dev/shm", HOSTILE_CLAIM_FAILS_ON="1")
    text = _no_sigbus(result)
    check(result)
    assert text.count("<stdout>:PLANE NoneType") == 2, text[-4000:]
    assert text.count("<stdout>:SUMS OK") == 2, text[-4000:]
    said = [line for line in text.splitlines() if "shared-memory plane" in line]
    assert len(said) == 1 and "rank 1" in said[0] and "/dev/shm" in said[0], text[-4000:]
