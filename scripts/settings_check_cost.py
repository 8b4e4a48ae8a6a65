"""What the per-step check of the ranks' hyperparameters costs (docs/pytorch.md).

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 scripts/settings_check_cost.py

One job times its steps in alternating blocks with the check on and off (a small MLP, 2bit
with backup; the smaller the step, the larger the check's share) and rank 0 prints the
median wall and CPU time of a step each way and the median difference of adjacent blocks
(CPU time, of all the rank's threads, is the steadier on a loaded machine).
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import slimgc_mx.torch as slimgc  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=300, help="width of the MLP (default 300)")
    p.add_argument("--blocks", type=int, default=20, help="blocks per mode (default 20)")
    p.add_argument("--steps", type=int, default=50, help="steps per block (default 50)")
    p.add_argument("--compression", default="2bit")
    args = p.parse_args()
    slimgc.init_process_group()
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, args.hidden), torch.nn.ReLU(),
                              torch.nn.Linear(args.hidden, 3))
    opt = slimgc.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
                                      net, compression=args.compression, comm_threshold=0,
                                      warmup_steps=3)
    check = opt._check
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(rank))
    y = torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(rank))

    def block(on):
        opt._check = opt._agg.update.check = check if on else None
        opt.flush()
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
        opt.flush()
        return ((time.perf_counter() - start) / args.steps,
                (time.process_time() - cpu) / args.steps)

    block(True)  # warm-up
    times = {True: [], False: []}
    for i in range(2 * args.blocks):
        on = i % 2 == 0
        times[on].append(block(on))
    if rank == 0:
        for i, what in ((0, "wall"), (1, "CPU (all threads)")):
            on = statistics.median(t[i] for t in times[True])
            off = statistics.median(t[i] for t in times[False])
            paired = statistics.median(a[i] - b[i] for a, b in zip(times[True], times[False]))
            print("%s per step: %.3f ms with the check, %.3f ms without; adjacent blocks "
                  "differ by %+.3f ms (%+.2f %%) (medians of %d blocks of %d steps)"
                  % (what, on * 1e3, off * 1e3, paired * 1e3, 100 * paired / off,
                     args.blocks, args.steps))
    opt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
