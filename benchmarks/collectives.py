"""What the Horovod-parity collectives cost, side by side with raw MPI in one run.

For each collective, at a small (4 KiB) and a large (4 MiB) float32 message, times in
alternating repetitions:

- ``raw mpi4py``: the MPI call on NumPy buffers (``Allreduce``, ``Allgather``, ``Alltoall``,
  ``Reduce_scatter``, ``Bcast``);
- ``syncdp``: the syncdp function on a tensor, eagerly, with the per-call argument check;
- ``syncdp, no check``: the same with the check (``Communicator.agree``) switched off, to show
  what the check costs.

Prints and writes a table of medians and the ratios ``syncdp / raw`` and
``syncdp / no check``. Also times the argument check alone (one 8-byte ``Allgather``).

Usage::

    syncdp-run -np 2 python benchmarks/collectives.py

Results go to ``benchmarks/results/collectives.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import alternate, machine, median, say, setup_threads, write_markdown

__all__ = ["main"]


def _cases(comm, MPI, syncdp, nbytes: int) -> dict:
    """Name -> (raw MPI call, syncdp call) on ``nbytes`` of float32, buffers made once."""
    import numpy as np
    import tensorflow as tf

    n = comm.Get_size()
    elems = nbytes // 4
    elems -= elems % n
    x = np.ones(elems, np.float32)
    t = tf.constant(x)
    out = np.empty_like(x)
    gathered = np.empty(elems * n, np.float32)
    piece = np.empty(elems // n, np.float32)
    return {
        "allreduce": (
            lambda: comm.Allreduce(x, out, MPI.SUM),
            lambda: syncdp.allreduce(t, op=syncdp.Sum),
        ),
        "allgather": (lambda: comm.Allgather(x, gathered), lambda: syncdp.allgather(t)),
        "alltoall": (lambda: comm.Alltoall(x, out), lambda: syncdp.alltoall(t)),
        "reducescatter": (
            lambda: comm.Reduce_scatter(x, piece, [elems // n] * n, MPI.SUM),
            lambda: syncdp.reducescatter(t, op=syncdp.Sum),
        ),
        "broadcast": (lambda: comm.Bcast(out, root=0), lambda: syncdp.broadcast(t, 0)),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    setup_threads(1)
    import numpy as np
    from mpi4py import MPI

    import syncdp
    from syncdp.transport.communicator import Communicator

    syncdp.init()
    comm, n = MPI.COMM_WORLD, syncdp.size()
    if n < 2:
        raise SystemExit("needs 2 or more ranks")
    real_agree = Communicator.agree

    def without_check(fn):
        def run():
            Communicator.agree = lambda self, signature, *, name: None
            try:
                return fn()
            finally:
                Communicator.agree = real_agree

        return run

    rows = []
    for nbytes in (4 << 10, 4 << 20):
        cases = _cases(comm, MPI, syncdp, nbytes)
        for name, (raw, ours) in cases.items():
            times = alternate(
                {"raw": raw, "syncdp": ours, "no check": without_check(ours)},
                args.repeats,
                sync=comm.Barrier,
            )
            m = {k: median(v) * 1e6 for k, v in times.items()}
            rows.append(
                [
                    name,
                    f"{nbytes >> 10} KiB",
                    f"{m['raw']:.0f}",
                    f"{m['syncdp']:.0f}",
                    f"{m['no check']:.0f}",
                    f"{m['syncdp'] / m['raw']:.2f}",
                    f"{m['syncdp'] / m['no check']:.3f}",
                ]
            )
            say(" | ".join(rows[-1]))
    digest, digests = np.zeros(1, np.int64), np.zeros(n, np.int64)
    check = alternate({"check": lambda: comm.Allgather(digest, digests)}, args.repeats * 5)
    check_us = median(check["check"]) * 1e6
    say(f"argument check alone (8-byte Allgather): {check_us:.1f} us")
    if syncdp.rank() == 0 and not args.no_write:
        header = [
            "collective",
            "size",
            "raw MPI (us)",
            "syncdp (us)",
            "syncdp, no check (us)",
            "syncdp / raw",
            "syncdp / no check",
        ]
        write_markdown(
            "collectives",
            f"Collectives, {n} ranks, median of {args.repeats} alternating repetitions",
            header,
            rows,
            notes=f"{machine()}. The argument check alone (8-byte Allgather): {check_us:.1f} us.",
        )


if __name__ == "__main__":
    main()
