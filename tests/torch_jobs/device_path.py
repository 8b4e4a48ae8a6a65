"""The device path (data_path='device') on CPU tensors, 2 ranks, against the host path, DDP
and itself resumed; each rank records what it found.

    device_path.py OUT match [CASES]
                                  every codec it serves x backup on/off x SGD/Adam: the
                                  flushed weights of both paths (and DDP's, full precision)
    device_path.py OUT powersgd   powersgd (two rounds, one matrix bucket) x backup on/off x
                                  SGD/Adam against the host path, its products made by
                                  torch and by NumPy (the host codec's: the rest bitwise)
    device_path.py OUT pieces     pieces of 64 elements (device.PIECE_ELEMENTS):
                                  2bit's encode (each piece's sum started once it is
                                  encoded) and decode, 4bit's decode and powersgd's outer
                                  products run piece by piece; Adam, against the host path
    device_path.py OUT state_on   glo_buf, the optimizer's state and the residuals
                                  offloaded (state_on='host') against kept on the device:
                                  SGD/Adam x backup on/off x none/2bit/powersgd, clipped,
                                  a checkpoint through torch.save; what each step stages,
                                  and where the state is between passes
    device_path.py OUT nan        rank 1's input, so its gradient, is NaN at step 3: the error
    device_path.py OUT settings   rank 1 changes its lr at step 4: the error
    device_path.py OUT changed    rank 1 scales its gradient after backward at step 3, when
                                  buckets start in backward: the error
    device_path.py OUT overlap    buckets started in backward against in step() (backup on
                                  and off, none and 2bit), and with accumulation
    device_path.py OUT resume     state_dict at step 5, resumed in a new optimizer: the
                                  weights at step 10 of both runs (2bit, terngrad, powersgd),
                                  the state through torch.save and torch.load(weights_only)
    device_path.py OUT cttab      comm_threshold='auto' (the CTTab's warm-up of 4 steps):
                                  the routes each rank adopts with its own timings, with
                                  timings injected that differ between the ranks, forced to
                                  full precision against DDP from the warm-up's weights on,
                                  and resumed mid-warm-up and after the decision
"""
import contextlib
import io
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import slimgc_mx.torch as slimgc
from slimgc_mx.torch import device as device_ops
from slimgc_mx.torch.lowrank import TorchPowerSGD
from slimgc_mx.engine.bucket_cttab import FULL, BucketRoutes
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


def resumable(opt, net, stop, save_at, state=None, at_step=None):
    """Train steps 0..stop-1, saving the state at step `save_at`; or, given `state` (saved
    there by such a run), load it and train steps save_at..stop-1. at_step: (step,
    fn(opt, net)) run before that step. The state saved, or None."""
    start, saved = 0, None
    if state is not None:
        opt.load_state_dict(state)
        start = save_at
    for step in range(start, stop):
        if step == save_at and state is None:
            saved = opt.state_dict()
        if at_step is not None and step == at_step[0]:
            at_step[1](opt, net)
        opt.zero_grad()
        x, y = batch(step, rank)
        F.cross_entropy(net(x), y).backward()
        opt.step()
    return saved


@contextlib.contextmanager
def numpy_products():
    """powersgd's matrix products on the device made by NumPy's np.matmul of the same
    operands, as the host codec makes them, while the block runs."""
    def products(a, b, out):
        out.copy_(torch.from_numpy(np.matmul(a.numpy(), b.numpy())))
    kept = TorchPowerSGD.matmul
    TorchPowerSGD.matmul = staticmethod(products)
    try:
        yield
    finally:
        TorchPowerSGD.matmul = kept


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

elif mode == "powersgd":
    result = {}
    for backup in (True, False):
        for optimizer in ("sgd", "adam"):
            host, _ = train("host", "powersgd", backup, optimizer)
            for products in ("torch", "numpy"):
                with numpy_products() if products == "numpy" else contextlib.nullcontext():
                    device, stats = train("device", "powersgd", backup, optimizer)
                case = "%s-%s-%s" % (products, "backup" if backup else "nobackup", optimizer)
                result[case] = {"host": digest(host), "device": digest(device),
                                "max_diff": float((host - device).abs().max()),
                                "largest": float(host.abs().max()),
                                "data_path": stats["data_path"], "buckets": stats["buckets"],
                                "compressed_buckets": stats["compressed_buckets"],
                                "transfers": stats["transfers"], "steps": stats["steps"],
                                "bytes_pushed": stats["bytes_pushed"],
                                "bytes_fp32": stats["bytes_fp32"]}
    record(out, "powersgd", rank, **result)

elif mode == "pieces":
    result = {}
    whole_piece = device_ops.PIECE_ELEMENTS
    for compression, backup in (("2bit", True), ("2bit", False), ("4bit", True),
                                ("powersgd", True)):
        host, _ = train("host", compression, backup, "adam")
        device_ops.PIECE_ELEMENTS = 64
        try:
            with numpy_products():
                device, stats = train("device", compression, backup, "adam")
        finally:
            device_ops.PIECE_ELEMENTS = whole_piece
        _, whole = train("device", compression, backup, "adam")  # pieces as large as usual
        result["%s-%s" % (compression, backup)] = {
            "host": digest(host), "device": digest(device),
            "compressed_buckets": stats["compressed_buckets"],
            "transfers": stats["transfers"], "whole_transfers": whole["transfers"]}
    record(out, "pieces", rank, **result)

elif mode == "state_on":
    def offload_run(state_on, optimizer, backup, compression, steps=8, clip=None,
                    threshold=1024):
        net = model()
        opt = slimgc.DistributedOptimizer(make_opt(net, optimizer), net, compression=compression,
                                          backup=backup, data_path="device",
                                          comm_threshold=threshold, bucket_cap_mb=0.01,
                                          state_on=state_on, warmup_steps=3)
        path, moved = opt._device, []
        for step in range(steps):
            before = (path.counts.h2d_bytes, path.counts.d2h_bytes)
            opt.zero_grad()
            x, y = batch(step, rank)
            F.cross_entropy(net(x), y).backward()
            if clip is not None:  # every mean decoded first, then each bucket's update staged
                slimgc.clip_grad_norm_(opt, clip)
            opt.step()
            moved.append([path.counts.h2d_bytes - before[0], path.counts.d2h_bytes - before[1]])
            if step == 4:  # through torch.save and torch.load(weights_only=True)
                saved = io.BytesIO()
                torch.save(opt.state_dict(), saved)
                saved.seek(0)
                opt.load_state_dict(torch.load(saved, weights_only=True))
        homes = [b.home for b in path.buckets if b.home is not None]
        # between passes: nothing staged, the state in the home's own (host) tensors
        at_home = all(h.staged is None and all(
            h.bucket.shadow.state[h.bucket.glo_views[i]][k] is t for (i, k), t in h.state.items())
            for h in homes)
        state_bytes = sum(t.numel() * t.element_size() for h in homes for t in h.state.values())
        residual_bytes = sum(h.residual.numel() * h.residual.element_size() for h in homes
                             if h.residual is not None)
        at_home = at_home and all(h.bucket.residual is h.residual for h in homes)
        glo_bytes = sum(h.glo.numel() * h.glo.element_size() for h in homes)
        opt.flush()
        stats = opt.stats()
        opt.close()
        return {"weights": digest(weights(net).clone()), "moved": moved,
                "routes": stats["routes"],
                "glo_bytes": glo_bytes, "state_bytes": state_bytes, "homes": len(homes),
                "residual_bytes": residual_bytes,
                "at_home": at_home, "buckets": stats["buckets"]}
    result = {}
    for optimizer in ("sgd", "adam"):
        for backup in (True, False):
            for compression in ("none", "2bit", "powersgd"):
                case = "%s-%s-%s" % (optimizer, backup, compression)
                result[case] = {"device": offload_run("device", optimizer, backup, compression),
                                "host": offload_run("host", optimizer, backup, compression)}
    for backup in (True, False):  # slimgc.clip_grad_norm_: the norm over every bucket's mean
        result["sgd-%s-2bit-clip" % backup] = {
            "device": offload_run("device", "sgd", backup, "2bit", clip=0.05),
            "host": offload_run("host", "sgd", backup, "2bit", clip=0.05)}
    # the CTTab's warm-up (3 steps; timings injected so that the host codec wins): its
    # decision reads the samples the last warm-up step's decodes complete
    original = BucketRoutes.record
    BucketRoutes.record = lambda self, j, route, seconds, step: original(
        self, j, route, 0.5 if route == "compressed on the host" else 4.0, step)
    try:
        for backup in (True, False):
            result["sgd-%s-2bit-cttab" % backup] = {
                "device": offload_run("device", "sgd", backup, "2bit", threshold="auto"),
                "host": offload_run("host", "sgd", backup, "2bit", threshold="auto")}
    finally:
        BucketRoutes.record = original
    record(out, "state_on", rank, **result)

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
        saved = resumable(opt, net, stop, 5, state)
        params = weights(net).clone()
        opt.flush()
        flushed = weights(net).clone()
        opt.close()
        return params, flushed, saved
    result = {}
    for compression in ("2bit", "terngrad", "powersgd"):  # terngrad's scale and powersgd's
        p1, f1, state = run(10, compression=compression)  # Q kept on the device
        saved = io.BytesIO()  # as a user keeps it: torch.save, then torch.load of tensors only
        torch.save(state, saved)
        saved.seek(0)
        state = torch.load(saved, weights_only=True)
        p2, f2, _ = run(10, state, compression=compression)
        codec_states = [b["codec"] for b in state["device_path"]["buckets"] if b["codec"]]
        result[compression] = dict(params=[digest(p1), digest(p2)],
                                   flushed=[digest(f1), digest(f2)],
                                   scales=[c["scale"] for c in codec_states]
                                   if compression == "terngrad" else [],
                                   q_columns=[c["q"]["shape"][1] for c in codec_states]
                                   if compression == "powersgd" else [])
    record(out, "resume", rank, **result)
elif mode == "cttab":
    WARMUP = 4

    def auto_run(compression, backup, steps=10, save_at=None, state=None, at_warmup=None,
                 warmup=WARMUP):
        """SGD with momentum under comm_threshold='auto' with `warmup` steps; resumed from
        `state` (taken at step `save_at` of an earlier run) where given; at_warmup(opt, net)
        runs once the warm-up's steps are done. The flushed weights, the stats and the
        state saved."""
        net = model()
        opt = slimgc.DistributedOptimizer(make_opt(net, "sgd"), net, compression=compression,
                                          backup=backup, data_path="device",
                                          warmup_steps=warmup)
        saved = resumable(opt, net, steps, save_at, state,
                          None if at_warmup is None else (warmup, at_warmup))
        params = weights(net).clone()
        opt.flush()
        stats = opt.stats()
        glo = torch.cat([b.glo.detach().reshape(-1) for b in opt._device.buckets])
        opt.close()
        return {"params": digest(params), "flushed": digest(weights(net).clone()),
                "glo_buf": digest(glo.clone()), "routes": stats["routes"],
                "phase": stats["cttab_phase"], "reason": stats["cttab_reason"],
                "steps": stats["steps"]}, weights(net).clone(), saved

    def injected(times, by_route=False):
        """BucketRoutes.record with each sample's seconds replaced by times(j, compressed,
        step) (by_route: times(j, route, step)) (every BucketRoutes of this process), until
        restored."""
        original = BucketRoutes.record
        BucketRoutes.record = lambda self, j, route, seconds, step: original(
            self, j, route, times(j, route if by_route else route != FULL, step), step)
        return original

    result = {}
    # the ranks' own timings (1bit: a bucket per tensor): whatever they choose, alike
    moved = {}

    def keep(opt, net):
        moved["at_warmup"] = weights(net).clone()
    result["measured"], final, _ = auto_run("1bit", True, at_warmup=keep)
    result["measured"]["moved_after"] = float((final - moved["at_warmup"]).abs().max())

    # timings that differ between the ranks: rank 0 compresses the even buckets, rank 1
    # would compress the odd ones; both adopt rank 0's
    original = injected(lambda j, compressed, step: 1.0 if compressed else
                        (2.0 if (j + rank) % 2 == 0 else 1.0))
    try:
        result["disagree"], _, _ = auto_run("1bit", True)
    finally:
        BucketRoutes.record = original

    # forced to full precision (the full-precision route timed faster), backup off: from
    # the warm-up's weights and momentum on, the step is DDP's (2bit's warm-up cycles the
    # device codec, the host codec and full precision: 3 steps end on full precision,
    # which flushes the residual inside the warm-up)
    FULL_WARMUP = 3
    taken = {}

    def take(opt, net):
        taken["weights"] = {n: p.detach().clone() for n, p in net.named_parameters()}
        taken["device_path"] = opt.state_dict()["device_path"]
    original = injected(lambda j, compressed, step: 2.0 if compressed else 1.0)
    try:
        result["full"], device_w, _ = auto_run("2bit", False, at_warmup=take,
                                                warmup=FULL_WARMUP)
    finally:
        BucketRoutes.record = original
    net = model()
    with torch.no_grad():
        for n, p in net.named_parameters():
            p.copy_(taken["weights"][n])
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    opt = make_opt(net, "sgd")
    by_name = dict(net.named_parameters())
    for b in taken["device_path"]["buckets"]:
        for k, name in enumerate(b["names"]):
            opt.state[by_name[name]] = {"momentum_buffer":
                                        b["optimizer"]["state"][k]["momentum_buffer"].clone()}
    for step in range(FULL_WARMUP, 10):
        opt.zero_grad()
        x, y = batch(step, rank)
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    result["full"]["ddp_diff"] = float((weights(net) - device_w).abs().max())
    result["full"]["moved_after"] = float(
        (weights(net) - torch.cat([taken["weights"][n].reshape(-1)
                                   for n, _ in net.named_parameters()])).abs().max())

    # 2bit's host route (the Cython codec) timed fastest, then the device codec: the same
    # lanes from either place, so the same weights
    for fastest in ("compressed on the host", "compressed"):
        original = injected(lambda j, route, step: 0.5 if route == fastest else
                            (1.0 if route != FULL else 4.0), by_route=True)
        try:
            result["host" if fastest != "compressed" else "device"], _, _ = auto_run("2bit",
                                                                                     True)
        finally:
            BucketRoutes.record = original

    # resumed mid-warm-up (step 2) and after the decision (step 6): timings injected so
    # that the compressed route of the even buckets wins by its samples of steps 0 and 1
    # only (a run that lost them would send those buckets in full precision)
    original = injected(lambda j, compressed, step: (1.0 if step < 2 else 5.0) if compressed
                        else (3.0 if j % 2 == 0 else 1.2))
    try:
        whole, _, _ = auto_run("1bit", True)
        result["resume"] = {"whole": whole}
        for at in (2, 6):
            _, _, state = auto_run("1bit", True, save_at=at)
            result["resume"][str(at)], _, _ = auto_run("1bit", True, save_at=at,
                                                        state=state)
            result["resume"][str(at)]["saved_phase"] = state["device_path"]["routes"]["phase"]
    finally:
        BucketRoutes.record = original
    record(out, "cttab", rank, **result)
dist.destroy_process_group()
