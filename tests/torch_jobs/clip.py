"""A rank of a small job with gradient clipping, once per mode of a comma list, each from
the same initial weights: DDP with torch's clip_grad_norm_ (`ddp`), SlimGC with
slimgc.clip_grad_norm_ (`slimgc`) or with torch's on the parameters (`plain`). JSON
options: max_norm, steps, momentum, `probe` (flush before each step and record how far
the local and the global update moved the weights, over lr), the rest SlimGC's. SlimGC's
global_grad_norm of each step is read once the step is applied: at once with backup off,
after the next flush with backup."""
import json
import sys

import torch
import torch.distributed as dist

import slimgc_mx.torch as slimgc
from common import batch, model, record, weights

out, modes = sys.argv[1], sys.argv[2].split(",")
options = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
max_norm = options.pop("max_norm")
steps = options.pop("steps", 20)
momentum = options.pop("momentum", 0.9)
probe = options.pop("probe", False)
LR = 0.1
dist.init_process_group("gloo")
rank = dist.get_rank()


def run(mode):
    net = model()
    base = torch.optim.SGD(net.parameters(), lr=LR, momentum=momentum,
                           weight_decay=1e-4 if momentum else 0.0)
    if mode == "ddp":
        wrapped, opt = torch.nn.parallel.DistributedDataParallel(net), base
    else:
        wrapped, opt = net, slimgc.DistributedOptimizer(base, net, **options)
    losses, norms, global_norms, moved_local, moved_global = [], [], [], [], []
    before = None
    for step in range(steps):
        if probe:
            slimgc.flush(opt)  # the model holds the global weights of this step
            now = weights(net)
            if before is not None:
                moved_global.append((now - before).norm().item() / LR)
                global_norms.append(opt.global_grad_norm)
            before = now
        opt.zero_grad()
        x, y = batch(step, rank)
        loss = torch.nn.functional.cross_entropy(wrapped(x), y)
        loss.backward()
        losses.append(loss.item())
        if mode == "slimgc":
            norms.append(slimgc.clip_grad_norm_(opt, max_norm).item())
        else:
            norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm).item())
        opt.step()
        if probe:
            moved_local.append((weights(net) - before).norm().item() / LR)
        if mode == "slimgc" and not probe:
            global_norms.append(opt.global_grad_norm)  # backup off: applied by step()
    stats = {}
    if mode != "ddp":
        slimgc.flush(opt)
        if probe:
            moved_global.append((weights(net) - before).norm().item() / LR)
            global_norms.append(opt.global_grad_norm)
        stats = opt.stats()
        opt.close()
    record(out, mode, rank, weights=weights(net).tolist(), losses=losses, norms=norms,
           global_norms=global_norms, moved_local=moved_local, moved_global=moved_global,
           compressed=stats.get("compressed_transfers", stats.get("compressed_buckets")),
           fused=stats.get("fused_buckets", stats.get("buckets")))


for mode in modes:
    run(mode)
dist.destroy_process_group()
