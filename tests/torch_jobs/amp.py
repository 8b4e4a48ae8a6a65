"""A rank under torch.autocast (bfloat16 on CPU) and a GradScaler, with an inf injected into
rank 1's gradient at step 3: that step is skipped on every rank alike; records the weights
after each step and the scale. argv[2], if given: the data_path (host or device)."""
import sys

import torch
import torch.distributed as dist

import slimgc_mx.torch as slimgc
from common import batch, model, record, weights

out = sys.argv[1]
path = sys.argv[2] if len(sys.argv) > 2 else "host"
dist.init_process_group("gloo")
rank = dist.get_rank()
net = model()
opt = slimgc.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                                  net, compression="2bit", comm_threshold=0, warmup_steps=2,
                                  backup=False, data_path=path)
scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
history, scales = [], []
for step in range(6):
    opt.zero_grad()
    x, y = batch(step, rank)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(net(x), y)
    scaler.scale(loss).backward()
    if step == 3 and rank == 1:
        next(net.parameters()).grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    slimgc.flush(opt)
    history.append(weights(net).tolist())
    scales.append(scaler.get_scale())
record(out, "amp", rank, history=history, scales=scales)
opt.close()
dist.destroy_process_group()
