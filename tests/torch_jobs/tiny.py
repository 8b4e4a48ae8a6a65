"""A rank of a job of many tiny parameters, DDP (`ddp`) or SlimGC (`slimgc` with JSON
options), once per mode of a comma list: records each step's seconds and SlimGC's transfers
after each step. Options `steps`, `params` (tiny ones, 4 elements) and `large` (of 4096
elements) are the script's."""
import json
import sys
import time

import torch
import torch.distributed as dist

import slimgc_mx.torch as slimgc
from common import record

out, modes = sys.argv[1], sys.argv[2].split(",")
options = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
steps = options.pop("steps", 14)
count = options.pop("params", 500)
large = options.pop("large", 0)
dist.init_process_group("gloo")
rank = dist.get_rank()


class Tiny(torch.nn.Module):
    """`count` parameters of 4 elements and `large` of 4096, weighed by the input."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(n))
                                          for n in [4] * count + [4096] * large])

    def forward(self, x):
        return sum((x * p).sum() for p in self.ps)


def run(mode):
    net = Tiny()
    base = torch.optim.SGD(net.parameters(), lr=0.01)
    if mode == "ddp":
        wrapped, opt = torch.nn.parallel.DistributedDataParallel(net), base
    else:
        wrapped, opt = net, slimgc.DistributedOptimizer(base, net, **options)
    seconds, transfers = [], []
    for step in range(steps):
        x = torch.tensor(float(step + rank))
        start = time.perf_counter()
        opt.zero_grad()
        wrapped(x).backward()
        opt.step()
        seconds.append(time.perf_counter() - start)
        if mode != "ddp":
            transfers.append(opt.stats()["transfers"])
    stats = {}
    if mode != "ddp":
        slimgc.flush(opt)
        stats = opt.stats()
        opt.close()
    record(out, mode, rank, seconds=seconds, transfers=transfers,
           fused_keys=stats.get("fused_keys"), fused_buckets=stats.get("fused_buckets"),
           weights=torch.cat([p.detach() for p in net.parameters()]).tolist())


for mode in modes:
    run(mode)
dist.destroy_process_group()
