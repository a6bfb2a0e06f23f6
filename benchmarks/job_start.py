"""What PMIx's job-data store costs a job's start: the hash store syncdp-run asks for against
PMIx 5.0's default shared-memory store (``gds shmem2``, which crashed Open MPI's daemon after a
spawn: docs/elastic-host-loss.md).

Each repetition runs ``mpirun -np N --with-ft ulfm`` (as an elastic job starts) of a program
that only imports mpi4py and passes one barrier, once with ``--pmixmca gds hash`` and once
without, in alternating order. It prints each variant's median wall time and the paired ratio
hash / default with a bootstrap 95% interval (below 1: the hash store starts faster).

Usage::

    python benchmarks/job_start.py [--np 2] [--repeats 20]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import alternate, fmt_interval, machine, median, paired_ratio  # noqa: E402

PROGRAM = "from mpi4py import MPI; MPI.COMM_WORLD.Barrier()"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2, help="ranks per job (default 2)")
    parser.add_argument("--repeats", type=int, default=20, help="alternating rounds (default 20)")
    args = parser.parse_args(argv)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.pop("PMIX_MCA_gds", None)
    head = ["mpirun", "-np", str(args.np), "--oversubscribe", "--bind-to", "none"]
    head += ["--with-ft", "ulfm"]

    def job(*store: str):
        command = [*head, *store, sys.executable, "-c", PROGRAM]
        return lambda: subprocess.run(command, env=env, check=True, capture_output=True)

    times = alternate({"default": job(), "hash": job("--pmixmca", "gds", "hash")}, args.repeats)
    print(machine(f"np={args.np}, {args.repeats} alternating rounds"))
    for name, values in times.items():
        print(f"{name:>8}: median {median(values):.3f} s")
    # paired_ratio(base, other) is base / other: hash time over the default's.
    ratio = paired_ratio(times["hash"], times["default"])
    print(f"hash / default start time: {fmt_interval(ratio)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
