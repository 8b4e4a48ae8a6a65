"""A rank of jobs that go wrong, one way per case of a comma list (argv[2]), one after the
other in the same process group; records the error each rank raised in each case. 'again'
builds a sound optimizer after 'nan' failed an aggregation on the group."""
import sys

import torch
import torch.distributed as dist

import slimgc_mx.torch as slimgc
from common import batch, model, record

out, cases = sys.argv[1], sys.argv[2].split(",")
dist.init_process_group("gloo")
rank = dist.get_rank()


def run(case):
    net = model(hidden=300 if case != "model" or rank == 0 else 301)
    options = dict(compression="2bit", comm_threshold=0, warmup_steps=2)
    if case == "options" and rank == 1:
        options["threshold"] = 0.75
    lr = 0.2 if case == "optimizer" and rank == 1 else 0.1
    opt = slimgc.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=lr), net, **options)
    try:
        for step in range(4):
            opt.zero_grad()
            x, y = batch(step, rank)
            torch.nn.functional.cross_entropy(net(x), y).backward()
            if case == "nan" and step == 2 and rank == 1:
                net[3].weight.grad[0, 0] = float("nan")
            opt.step()
        slimgc.flush(opt)
    finally:
        opt.close()  # its threads stopped: nothing of it issues a collective later


for case in cases:
    error = None
    try:
        run(case)
    except Exception as exc:  # recorded for the test
        error = "%s: %s" % (type(exc).__name__, exc)
    record(out, "errors-" + case, rank, error=error)
