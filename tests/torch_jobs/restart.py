"""The restart drill under torchrun --max-restarts: a rank checkpoints every 2 steps (its own
state_dict file) and, in the first attempt, rank 1 kills itself with SIGKILL at step 7;
every rank then resumes from the newest checkpoint all ranks completed."""
import os
import signal
import sys

import torch
import torch.distributed as dist

import slimgc_mx.torch as slimgc
from common import batch, model, record, weights

out, kill = sys.argv[1], sys.argv[2] == "kill"
STEPS = 12
slimgc.init_process_group()
rank = dist.get_rank()
net = model()
opt = slimgc.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                                  net, compression="2bit", comm_threshold=0, warmup_steps=3)
done = os.path.join(out, "done")
start = 0
if os.path.exists(done):
    start = int(open(done).read())
    saved = torch.load(os.path.join(out, "ckpt_%d_%d.pt" % (start, rank)), weights_only=True)
    net.load_state_dict(saved["model"])
    opt.load_state_dict(saved["slimgc"])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
for step in range(start, STEPS):
    if kill and attempt == 0 and rank == 1 and step == 7:
        os.kill(os.getpid(), signal.SIGKILL)
    opt.zero_grad()
    x, y = batch(step, rank)
    torch.nn.functional.cross_entropy(net(x), y).backward()
    opt.step()
    if (step + 1) % 2 == 0:
        torch.save({"model": net.state_dict(), "slimgc": opt.state_dict()},
                   os.path.join(out, "ckpt_%d_%d.pt" % (step + 1, rank)))
        dist.barrier()  # every rank's file is written before the step counts as done
        if rank == 0:
            with open(done + ".tmp", "w") as f:
                f.write(str(step + 1))
            os.replace(done + ".tmp", done)
slimgc.flush(opt)
record(out, "restart", rank, weights=weights(net).tolist(), attempt=attempt)
opt.close()
dist.destroy_process_group()
