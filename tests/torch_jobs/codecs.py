"""A rank trains the same job once per codec, every tensor compressed, and records the
loss, a digest of the global weights and the residual watch's finding per codec.

    codecs.py OUT backup|nobackup [STEPS]   (40 steps by default)"""
import sys

import torch
import torch.distributed as dist

import slimgc_mx.torch as slimgc
from slimgc_mx import codecs
from common import batch, digest, model, record, weights

out = sys.argv[1]
backup = sys.argv[2] == "backup"
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 40
dist.init_process_group("gloo")
rank = dist.get_rank()
result = {}
for name in codecs.available():
    if name == "none":
        continue
    net = model()
    own = codecs.create(name).traits.owns_momentum
    opt = slimgc.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.0 if own else 0.9), net,
        compression=name, comm_threshold=0, warmup_steps=2, backup=backup)
    x, y = batch(0, 99, size=256)
    first = torch.nn.functional.cross_entropy(net(x), y).item()
    for step in range(steps):
        opt.zero_grad()
        xb, yb = batch(step, rank, size=64)
        torch.nn.functional.cross_entropy(net(xb), yb).backward()
        opt.step()
    slimgc.flush(opt)
    net.eval()
    last = torch.nn.functional.cross_entropy(net(x), y).item()
    stats = opt.stats()
    opt.close()
    result[name] = {"first": first, "last": last, "digest": digest(weights(net)),
                    "compressed": stats["compressed_transfers"], "transfers": stats["transfers"],
                    "growth": stats["residual_growth"]}
record(out, "codecs", rank, **result)
dist.destroy_process_group()
