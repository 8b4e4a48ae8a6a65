"""The device path (data_path='device') on CPU tensors, 2 ranks, against the host path, DDP
and itself resumed; each rank records what it found.

    device_path.py OUT match      every codec it serves x backup on/off x SGD/Adam: the
                                  flushed weights of both paths (and DDP's, full precision)
    device_path.py OUT nan        rank 1's gradient is NaN at step 3: the error, and the
                                  global weights before and after it
    device_path.py OUT settings   rank 1 changes its lr at step 4: the error
    device_path.py OUT resume     state_dict at step 5, resumed in a new optimizer: the
                                  weights at step 10 of both runs
"""
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import slimgc_mx.torch as slimgc
from common import batch, digest, model, record, weights

out, mode = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
STEPS = 8


def make_opt(net, name):
    if name == "adam":
        return torch.optim.Adam(net.parameters(), lr=0.01)
    return torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)


def train(path, compression, backup, optimizer, steps=STEPS, cap=None, hook=None):
    """The flushed weights after `steps` (None for path: DDP), and the stats."""
    net = model()
    if path is None:
        ddp = torch.nn.parallel.DistributedDataParallel(net)
        opt = make_opt(net, optimizer)
        for step in range(steps):
            opt.zero_grad()
            x, y = batch(step, rank)
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
        return weights(net).clone(), {}
    extra = {"bucket_cap_mb": cap} if cap is not None else {}
    opt = slimgc.DistributedOptimizer(make_opt(net, optimizer), net, compression=compression,
                                      backup=backup, data_path=path, comm_threshold=1024,
                                      **extra)
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(step, rank)
        F.cross_entropy(net(x), y).backward()
        if hook is not None:
            hook(step, net, opt)
        opt.step()
    opt.flush()
    stats = opt.stats()
    opt.close()
    return weights(net).clone(), stats


if mode == "match":
    result = {}
    for compression in ("none", "1bit", "2bit", "4bit"):
        for backup in (True, False):
            for optimizer in ("sgd", "adam"):
                host, _ = train("host", compression, backup, optimizer)
                device, stats = train("device", compression, backup, optimizer)
                small, _ = train("device", compression, backup, optimizer, cap=0.001)
                case = "%s-%s-%s" % (compression, "backup" if backup else "nobackup", optimizer)
                result[case] = {"host": digest(host), "device": digest(device),
                                "small_buckets": digest(small),
                                "max_diff": float((host - device).abs().max()),
                                "buckets": stats["buckets"], "data_path": stats["data_path"],
                                "compressed_buckets": stats["compressed_buckets"]}
    for optimizer in ("sgd", "adam"):
        ddp, _ = train(None, "none", False, optimizer)
        device, _ = train("device", "none", False, optimizer)
        result["ddp-" + optimizer] = {"ddp": digest(ddp), "device": digest(device)}
    record(out, "match", rank, **result)

elif mode == "nan":
    seen = {}

    def poison(step, net, opt):
        if step == 3:
            seen["before"] = [b.glo.clone() for b in opt._device.buckets]
            if rank == 1:
                next(net.parameters()).grad[0, 0] = float("nan")
    error = after = None
    try:
        train("device", "2bit", True, "sgd", hook=poison)
    except Exception as exc:  # noqa: BLE001 -- recorded for the test
        error = "%s: %s" % (type(exc).__name__, exc)
    record(out, "nan", rank, error=error, before=seen.get("before") is not None)

elif mode == "settings":
    def change(step, net, opt):
        if step == 4 and rank == 1:
            opt.param_groups[0]["lr"] = 0.01
    error = None
    try:
        train("device", "2bit", True, "sgd", hook=change)
    except Exception as exc:  # noqa: BLE001
        error = "%s: %s" % (type(exc).__name__, exc)
    record(out, "settings", rank, error=error)

elif mode == "resume":
    def run(stop, state=None):
        net = model()
        opt = slimgc.DistributedOptimizer(make_opt(net, "sgd"), net, compression="2bit",
                                          data_path="device", comm_threshold=1024)
        start = 0
        if state is not None:
            opt.load_state_dict(state)
            start = 5
        saved = None
        for step in range(start, stop):
            if step == 5 and state is None:
                saved = opt.state_dict()
            opt.zero_grad()
            x, y = batch(step, rank)
            F.cross_entropy(net(x), y).backward()
            opt.step()
        params = weights(net).clone()
        opt.flush()
        flushed = weights(net).clone()
        opt.close()
        return params, flushed, saved
    p1, f1, state = run(10)
    p2, f2, _ = run(10, state)
    record(out, "resume", rank, params=[digest(p1), digest(p2)], flushed=[digest(f1), digest(f2)])
dist.destroy_process_group()
