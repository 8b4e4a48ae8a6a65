"""A rank trains 10 steps taking state_dict() after step 5 twice: going on (`straight`), and
restarting from it in fresh objects (`resumed`, via torch.save/torch.load weights_only);
records both weights. The two must agree bitwise."""
import os
import sys

import torch
import torch.distributed as dist

import slimgc_mx.torch as slimgc
from common import batch, model, record, weights

out, codec = sys.argv[1], sys.argv[2]
backup = sys.argv[3] == "backup"
dist.init_process_group("gloo")
rank = dist.get_rank()


def make(seed=0):
    net = model(seed)
    base = torch.optim.Adam(net.parameters(), lr=0.01) if codec == "adam" else \
        torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    opt = slimgc.DistributedOptimizer(base, net, compression="none" if codec == "adam" else
                                      codec, comm_threshold=0, warmup_steps=3, backup=backup)
    return net, opt, torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)


def train(net, opt, sched, steps):
    for step in steps:
        opt.zero_grad()
        x, y = batch(step, rank)
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        sched.step()


def run(mode):
    net, opt, sched = make()
    train(net, opt, sched, range(5))
    path = os.path.join(out, "state_%s_%d.pt" % (mode, rank))
    torch.save({"slimgc": opt.state_dict(), "model": net.state_dict(),
                "sched": sched.state_dict()}, path)
    if mode == "resumed":
        opt.close()
        net, opt, sched = make(seed=1)  # other initial weights: all must come from the file
        saved = torch.load(path, weights_only=True)
        net.load_state_dict(saved["model"])
        opt.load_state_dict(saved["slimgc"])
        sched.load_state_dict(saved["sched"])
    train(net, opt, sched, range(5, 10))
    slimgc.flush(opt)
    record(out, mode, rank, weights=weights(net).tolist())
    opt.close()


run("straight")
run("resumed")
dist.destroy_process_group()
