"""A rank trains 30 steps three ways: without a checkpoint (`plain`), taking state_dict()
after step 15 and going on (`saved`), and resuming from that state in fresh objects
(`resumed`); records the parameters before and after the final flush of each. A checkpoint
must not change training: the three must agree bitwise."""
import os
import sys

import torch
import torch.distributed as dist

import slimgc_mx.torch as slimgc
from common import batch, model, record, weights

out, codec, backup = sys.argv[1], sys.argv[2], sys.argv[3] == "backup"
STEPS, SAVE_AT = 30, 15
dist.init_process_group("gloo")
rank = dist.get_rank()
path = os.path.join(out, "midway_%d.pt" % rank)


def make(seed=0):
    net = model(seed)
    opt = slimgc.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), net, compression=codec,
        comm_threshold=0, warmup_steps=3, backup=backup)
    return net, opt, torch.optim.lr_scheduler.StepLR(opt, 10, 0.5)


def train(net, opt, sched, steps):
    for step in steps:
        opt.zero_grad()
        x, y = batch(step, rank)
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        sched.step()


def run(mode):
    net, opt, sched = make()
    if mode == "resumed":
        opt.close()
        net, opt, sched = make(seed=1)  # other initial weights: all must come from the file
        saved = torch.load(path, weights_only=True)
        net.load_state_dict(saved["model"])
        opt.load_state_dict(saved["slimgc"])
        sched.load_state_dict(saved["sched"])
    else:
        train(net, opt, sched, range(SAVE_AT))
        if mode == "saved":
            torch.save({"slimgc": opt.state_dict(), "model": net.state_dict(),
                        "sched": sched.state_dict()}, path)
    train(net, opt, sched, range(SAVE_AT, STEPS))
    params = weights(net).tolist()
    slimgc.flush(opt)
    record(out, mode, rank, params=params, flushed=weights(net).tolist())
    opt.close()


for mode in ("plain", "saved", "resumed"):
    run(mode)
dist.destroy_process_group()
