"""The device path (data_path='device') on CPU tensors, 2 ranks, against the host path, DDP
and itself resumed; each rank records what it found.

    device_path.py OUT match [CASES]
                                  every codec it serves x backup on/off x SGD/Adam: the
                                  flushed weights of both paths (and DDP's, full precision)
    device_path.py OUT nan        rank 1's input, so its gradient, is NaN at step 3: the error
    device_path.py OUT settings   rank 1 changes its lr at step 4: the error
    device_path.py OUT changed    rank 1 scales its gradient after backward at step 3, when
                                  buckets start in backward: the error
    device_path.py OUT overlap    buckets started in backward against in step() (backup on
                                  and off, none and 2bit), and with accumulation
    device_path.py OUT resume     state_dict at step 5, resumed in a new optimizer: the
                                  weights at step 10 of both runs (2bit, terngrad)
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


#: The codecs of mode match: (case name, compression, codec options).
CODECS = [(name, name, {}) for name in ("none", "1bit", "2bit", "4bit", "terngrad", "qsgd",
                                        "thc", "randomk")] + [
    ("thc_hadamard", "thc", {"hadamard": True}),
    ("qsgd_small", "qsgd", {"bucket_size": 4, "levels": 3})]


def train(path, compression, backup, optimizer, steps=STEPS, cap=None, hook=None, data=None,
          overlap=True, accumulate=1, options=None):
    """The flushed weights after `steps` (None for path: DDP), and the stats. hook(step, net,
    opt) runs between backward and step(); data(step, x) may change a step's input;
    options: the codec's."""
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
    extra = dict(options or {})
    if cap is not None:
        extra["bucket_cap_mb"] = cap
    opt = slimgc.DistributedOptimizer(make_opt(net, optimizer), net, compression=compression,
                                      backup=backup, data_path=path, comm_threshold=1024,
                                      overlap=overlap, **extra)
    for step in range(steps):
        opt.zero_grad()
        for part in range(accumulate):
            x, y = batch(step * accumulate + part, rank)
            if data is not None:
                data(step, x)
            F.cross_entropy(net(x), y).backward()
        if hook is not None:
            hook(step, net, opt)
        opt.step()
    opt.flush()
    stats = opt.stats()
    opt.close()
    return weights(net).clone(), stats


def error_of(**kw):
    """What a 2bit job with backup on the device path raised (None: nothing)."""
    try:
        train("device", "2bit", True, "sgd", **kw)
    except Exception as exc:  # noqa: BLE001 -- recorded for the test
        return "%s: %s" % (type(exc).__name__, exc)
    return None


if mode == "match":
    # argv[3], optional: the cases to run (comma-separated names of CODECS), for a quick look
    only = sys.argv[3].split(",") if len(sys.argv) > 3 else None
    result = {}
    for name, compression, options in CODECS:
        if only is not None and name not in only:
            continue
        for backup in (True, False):
            for optimizer in ("sgd", "adam"):
                host, _ = train("host", compression, backup, optimizer, options=options)
                device, stats = train("device", compression, backup, optimizer,
                                      options=options)
                case = "%s-%s-%s" % (name, "backup" if backup else "nobackup", optimizer)
                result[case] = {"host": digest(host), "device": digest(device),
                                "max_diff": float((host - device).abs().max()),
                                "buckets": stats["buckets"], "data_path": stats["data_path"],
                                "compressed_buckets": stats["compressed_buckets"]}
                if stats["compressed_buckets"] > 1:
                    continue  # one bucket per compressed tensor already: little to cut
                small, _ = train("device", compression, backup, optimizer, cap=0.001,
                                 options=options)
                result[case]["small_buckets"] = digest(small)
    for optimizer in ("sgd", "adam"):
        ddp, _ = train(None, "none", False, optimizer)
        device, _ = train("device", "none", False, optimizer)
        result["ddp-" + optimizer] = {"ddp": digest(ddp), "device": digest(device)}
    record(out, "match", rank, **result)

elif mode == "nan":
    def poison(step, x):
        if step == 3 and rank == 1:
            x[0, 0] = float("nan")
    record(out, "nan", rank, error=error_of(data=poison))

elif mode == "changed":
    def scale(step, net, opt):
        if step == 3 and rank == 1:
            next(net.parameters()).grad.mul_(0.5)
    record(out, "changed", rank, error=error_of(hook=scale))

elif mode == "overlap":
    result = {}
    for compression in ("none", "2bit"):
        for backup in (True, False):
            on, stats = train("device", compression, backup, "sgd", cap=0.001)
            off, _ = train("device", compression, backup, "sgd", cap=0.001, overlap=False)
            result["%s-%s" % (compression, backup)] = {"on": digest(on), "off": digest(off),
                                                       "overlap": stats["overlap"]}
    on, stats = train("device", "2bit", True, "sgd", accumulate=2)
    off, _ = train("device", "2bit", True, "sgd", accumulate=2, overlap=False)
    result["accumulate"] = {"on": digest(on), "off": digest(off), "overlap": stats["overlap"]}
    record(out, "overlap", rank, **result)

elif mode == "settings":
    def change(step, net, opt):
        if step == 4 and rank == 1:
            opt.param_groups[0]["lr"] = 0.01
    record(out, "settings", rank, error=error_of(hook=change))

elif mode == "resume":
    def run(stop, state=None, compression="2bit"):
        net = model()
        opt = slimgc.DistributedOptimizer(make_opt(net, "sgd"), net, compression=compression,
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
    result = {}
    for compression in ("2bit", "terngrad"):  # terngrad: its scale kept on the device
        p1, f1, state = run(10, compression=compression)
        p2, f2, _ = run(10, state, compression=compression)
        result[compression] = dict(params=[digest(p1), digest(p2)],
                                   flushed=[digest(f1), digest(f2)],
                                   scales=[b["codec"]["scale"] for b in state["device_path"][
                                       "buckets"] if b["codec"]] if compression == "terngrad"
                                   else [])
    record(out, "resume", rank, **result)
dist.destroy_process_group()
