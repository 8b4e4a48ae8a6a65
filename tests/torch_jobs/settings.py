"""A rank of a job in which rank 1 alone sets its lr at step AT (argv[3]; a per-rank
ReduceLROnPlateau, say), then flushes after step 19; records the error each rank raised,
where (a step, or 20 for the flush), and digests of the global weights before step AT
(flushed) and after the error."""
import sys

import torch
import torch.distributed as dist

import slimgc_mx.torch as slimgc
from common import batch, digest, model, record

out, backup, at = sys.argv[1], sys.argv[2] == "backup", int(sys.argv[3])
dist.init_process_group("gloo")
rank = dist.get_rank()
net = model()
opt = slimgc.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                                  net, compression="2bit", comm_threshold=0, warmup_steps=3,
                                  backup=backup)
sched = torch.optim.lr_scheduler.StepLR(opt, 5, 0.5)  # changes lr on every rank alike
error = raised_at = before = None


def global_weights():
    backup = opt._agg.backup
    return digest(torch.cat([backup.glo_buf(name).reshape(-1) for name, _ in opt._named]))


for step in range(21):
    try:
        if step == 20:
            slimgc.flush(opt)
            break
        if step == at:
            slimgc.flush(opt)  # every rank alike
            before = global_weights()
            if rank == 1:
                opt.param_groups[0]["lr"] = 0.01
        opt.zero_grad()
        x, y = batch(step, rank)
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        sched.step()
    except Exception as exc:  # recorded for the test
        error, raised_at = "%s: %s" % (type(exc).__name__, exc), step
        break
opt._agg.pipeline.wait_idle(60)  # (the aggregations of step AT wrote nothing)
record(out, "settings", rank, error=error, raised_at=raised_at, before=before,
       after=global_weights())
opt.close()
dist.destroy_process_group()
