"""A rank of a small job, once per mode of a comma list: DDP (`ddp`) or SlimGC (`slimgc` with
JSON options), each from the same initial weights; records the weights of each. Options
`accumulate` (backward passes per step), `steps` and `optimizer` (sgd, adam, adamw) are the
script's."""
import json
import sys

import torch
import torch.distributed as dist

import slimgc_mx.torch as slimgc
from common import batch, buffers, model, record, weights

out, modes = sys.argv[1], sys.argv[2].split(",")
options = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
steps = options.pop("steps", 20)
accumulate = options.pop("accumulate", 1)
#: The inner optimizer of each mode, by name.
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-4),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=1e-4),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.05),
}
make_optimizer = OPTIMIZERS[options.pop("optimizer", "sgd")]
dist.init_process_group("gloo")
rank = dist.get_rank()


def run(mode):
    net = model()
    base = make_optimizer(net.parameters())
    if mode == "ddp":
        wrapped, opt = torch.nn.parallel.DistributedDataParallel(net), base
    else:
        wrapped, opt = net, slimgc.DistributedOptimizer(base, net, **options)
    sched = torch.optim.lr_scheduler.StepLR(opt, 5, 0.5)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accumulate):
            x, y = batch(step * accumulate + micro, rank)
            if mode == "ddp" and micro + 1 < accumulate:
                with wrapped.no_sync():
                    torch.nn.functional.cross_entropy(wrapped(x), y).backward()
            else:
                loss = torch.nn.functional.cross_entropy(wrapped(x), y)
                loss.backward()
        losses.append(loss.item())
        opt.step()
        sched.step()
    if mode != "ddp":
        slimgc.flush(opt)
        stats = opt.stats()
        opt.close()
    else:
        stats = {}
    w = weights(net)
    record(out, mode, rank, weights=w.tolist(), buffers=buffers(net).tolist(), losses=losses,
           compressed=stats.get("compressed_transfers"), transfers=stats.get("transfers"))


for mode in modes:
    run(mode)
dist.destroy_process_group()
