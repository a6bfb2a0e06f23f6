"""Hello from every rank: the smallest syncdp program.

    syncdp-run -np 2 python examples/hello.py

Each rank prints who it is; then the ranks add up their rank numbers with an allreduce and
receive rank 0's message with a broadcast, so the output shows both collectives agree.
"""

import tensorflow as tf

import syncdp


def main() -> None:
    syncdp.init()  # syncdp: start MPI; every rank learns its rank and the job's size
    rank, size = syncdp.rank(), syncdp.size()
    print(f"hello from rank {rank} of {size} (local rank {syncdp.local_rank()})")

    # syncdp: a collective; every rank gets 0 + 1 + ... + (size - 1).
    total = syncdp.allreduce(tf.constant(float(rank)), op=syncdp.Sum)
    # syncdp: a collective; every rank gets rank 0's object.
    message = syncdp.broadcast_object(f"greetings from rank {rank}" if rank == 0 else None)
    print(
        f"rank {rank}: sum of ranks = {total.numpy():g} (expected {size * (size - 1) / 2:g}); "
        f"rank 0 says {message!r}"
    )
    syncdp.barrier()  # syncdp: nobody leaves before everyone has printed


if __name__ == "__main__":
    main()
