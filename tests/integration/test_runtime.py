"""init() and shutdown() through the real launcher: importing starts no MPI, shutdown releases
everything and a later init() works, and init() accepts an existing mpi4py communicator."""

import os
import subprocess
import sys

import pytest

from tests.launcher import check, launch, python_script

JOB = """
import sys
import tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(1)
import syncdp

assert "mpi4py.MPI" not in sys.modules, "import syncdp started MPI"
assert not syncdp.is_initialized()

syncdp.init()
n, r = syncdp.size(), syncdp.rank()
total = syncdp.allreduce(tf.constant([float(r)]), op=syncdp.Sum)
assert total.numpy()[0] == n * (n - 1) / 2, total

syncdp.shutdown()
assert not syncdp.is_initialized()
try:
    syncdp.rank()
    raise AssertionError("rank() after shutdown() must raise")
except syncdp.NotInitializedError:
    pass

# Again, on a communicator the program made: even and odd ranks train apart.
from mpi4py import MPI
group = MPI.COMM_WORLD.Split(color=r % 2, key=r)
syncdp.init(comm=group)
members = [k for k in range(n) if k % 2 == r % 2]
assert syncdp.size() == len(members), (syncdp.size(), members)
assert syncdp.rank() == members.index(r)
total = syncdp.allreduce(tf.constant([float(r)]), op=syncdp.Sum)
assert total.numpy()[0] == sum(members), (total, members)
assert syncdp.local_size() == len(members) and syncdp.cross_size() == 1
syncdp.shutdown()

syncdp.init()  # and the whole world once more
assert syncdp.size() == n
assert syncdp.allgather_object(r) == list(range(n))
print(f"rank {r}: ok")
"""


@pytest.mark.parametrize("np_", [1, 2, 3])
def test_init_shutdown_init_and_a_given_communicator(tmp_path, np_):
    result = check(launch(np_, "python", python_script(tmp_path, JOB), timeout=240))
    for r in range(np_):
        assert f"[{r}]<stdout>:rank {r}: ok" in result.stdout


RANKS_JOB = """
import os
import tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(1)
import syncdp

world_rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
world_size = int(os.environ["OMPI_COMM_WORLD_SIZE"])
ranks = list(range(world_size - 1, -1, -2))  # np=3: [2, 0]; np=2: [1]; np=1: [0]
if world_rank in ranks:
    syncdp.init(comm=ranks)
    assert syncdp.size() == len(ranks), syncdp.size()
    assert syncdp.rank() == ranks.index(world_rank)  # the i-th listed is rank i
    total = syncdp.allreduce(tf.constant([float(world_rank)]), op=syncdp.Sum)
    assert total.numpy()[0] == sum(ranks), total
    assert syncdp.allgather_object(world_rank) == ranks
    print(f"world rank {world_rank}: rank {syncdp.rank()} of {syncdp.size()}")
else:
    try:
        syncdp.init(comm=ranks)
    except ValueError as e:  # Horovod programs catch ValueError
        assert isinstance(e, syncdp.ConfigError) and "not in the list" in str(e), e
        print(f"world rank {world_rank}: refused")
    else:
        raise AssertionError("init() took a list that does not name this process")
    assert not syncdp.is_initialized()
"""


@pytest.mark.parametrize("np_", [1, 2, 3])
def test_init_on_a_list_of_world_ranks(tmp_path, np_):
    result = check(launch(np_, "python", python_script(tmp_path, RANKS_JOB), timeout=240))
    ranks = list(range(np_ - 1, -1, -2))
    for world_rank in range(np_):
        if world_rank in ranks:
            line = f"rank {ranks.index(world_rank)} of {len(ranks)}"
        else:
            line = "refused"
        assert f"[{world_rank}]<stdout>:world rank {world_rank}: {line}" in result.stdout


@pytest.mark.parametrize(
    "variable, launcher",
    [("SLURM_STEP_NUM_TASKS", "srun"), ("PMI_SIZE", "a PMI launcher")],
)
def test_a_process_started_as_one_of_several_whose_mpi_found_no_other_is_refused(
    variable, launcher
):
    # `srun -n 2 python train.py` without --mpi=pmix (or another MPI's mpiexec) starts
    # processes whose MPI finds no other: each would train alone as a rank 0 of its own.
    program = "import syncdp; syncdp.init(); print('SIZE', syncdp.size())"
    alone = program.replace("init()", "init(comm=MPI.COMM_SELF)")
    alone = f"from mpi4py import MPI; {alone}"
    launchers = ("SLURM_", "PMI_", "PMIX_", "OMPI_")
    base = {k: v for k, v in os.environ.items() if not k.startswith(launchers)}
    # On purpose, with the program's own communicator, a process may train alone.
    result = subprocess.run(
        [sys.executable, "-c", alone],
        env={**base, variable: "2"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and "SIZE 1" in result.stdout, result.stderr[-3000:]
    for started, refused in (("2", True), ("1", False)):
        result = subprocess.run(
            [sys.executable, "-c", program],
            env={**base, variable: started},
            capture_output=True,
            text=True,
            timeout=120,
        )
        if refused:
            assert result.returncode != 0, result.stdout
            assert f"{launcher}" in result.stderr and f"({variable}=2)" in result.stderr
            assert "MPI found none of the others" in result.stderr
            assert "syncdp.init(comm=MPI.COMM_SELF)" in result.stderr
            assert "SIZE" not in result.stdout
        else:
            assert result.returncode == 0, result.stderr[-3000:]
            assert "SIZE 1" in result.stdout
