"""The peer of ``breakdown.py`` where PyTorch is installed: DDP (Gloo, CPU) on the same CNN.

The benchmark CNN of ``synthetic.py --model cnn`` (32x32x3 images, batch 32 per rank, SGD with
momentum 0.9, one intra-op thread per rank), timed as ``breakdown.py`` times syncdp: short
repetitions of ``--steps`` steps that alternate between DDP (gradients averaged) and
``no_sync()`` (no communication), a barrier before each, the slowest rank's time, and the
ratio of each round's two times (no communication / DDP: the throughput ratio) as a median
with a bootstrap 95% interval (``common.interval``).

Run under Open MPI (ranks find each other through mpi4py; Gloo rendezvous on 127.0.0.1)::

    mpirun -np 8 --bind-to none python benchmarks/manycore/ddp_cnn.py --repeats 20

PyTorch is not a dependency of syncdp: this runs only where it is installed (the 16-core
measuring machine, ../shared/manycore/README.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import fmt_interval, interval, paired_ratio  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="steps per repetition")
    p.add_argument("--repeats", type=int, default=20, help="repetitions of each kind")
    p.add_argument("--batch-size", type=int, default=32, help="images per rank per step")
    p.add_argument("--port", type=int, default=29811, help="Gloo rendezvous port")
    args = p.parse_args()

    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    from torch import nn

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(128 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10),
    )  # fmt: skip
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    x = torch.rand(args.batch_size, 3, 32, 32, generator=gen)
    y = torch.randint(0, 10, (args.batch_size,), generator=gen)
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(ddp(x), y).backward()
        opt.step()

    def run(averaged: bool) -> None:
        for _ in range(args.steps):
            if averaged:
                step()
            else:
                with ddp.no_sync():
                    step()

    for averaged in (True, False, True):  # warm up both paths
        run(averaged)
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.repeats):
        for averaged in (True, False) if r % 2 == 0 else (False, True):
            world.Barrier()
            start = time.perf_counter()
            run(averaged)
            times[averaged].append(world.allreduce(time.perf_counter() - start, op=MPI.MAX))
    if rank == 0:
        params = sum(t.numel() for t in model.parameters())
        step_ms = interval([t * 1e3 / args.steps for t in times[False]])
        print(
            f"torch DDP cnn ({params} params, batch {args.batch_size}) np={size}: "
            f"{args.repeats} alternating repetitions of {args.steps} steps, slowest rank; "
            f"no_sync step {fmt_interval(step_ms, 1)} ms; "
            f"throughput DDP / no_sync {fmt_interval(paired_ratio(times[False], times[True]))}",
            flush=True,
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
