#!/usr/bin/env python
"""Train a model data-parallel through PyTorch: SlimGC's DistributedOptimizer, DDP (fp32, or
its fp16 or PowerSGD hook) over Gloo, or locally; scripts/train.py's job in PyTorch.

The same models (bench/torch_models.py), shards, shuffling and output as train.py; rank 0
prints the per-epoch lines and the summary and writes the JSON result. Distributed runs
need torch.distributed's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), as
torchrun or the launcher's --framework torch sets them, e.g.

    python -m slimgc_mx.launch -n 2 --framework torch --launcher local \\
        python scripts/train.py --framework torch --kvstore slimgc --compressor 2bit
"""
import argparse
import gc
import hashlib
import logging
import os
import random
import sys
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from slimgc_mx import codecs  # noqa: E402
from slimgc_mx.bench import datasets, torch_models  # noqa: E402
from slimgc_mx.bench.jobtools import (codec_options, comm_threshold, load_shard,  # noqa: E402
                                      positive_int, progress_bar, summary_line,
                                      write_results)

KVSTORES = ("slimgc", "ddp", "local")
#: What DDP takes as --compressor: plain fp32 allreduce, or one of its communication hooks.
DDP_HOOKS = ("none", "fp16", "powersgd")
COMPRESSORS = tuple(codecs.available()) + ("fp16",)
#: train.py's options that this job does not have, and why.
MXNET_ONLY = {"--checkpoint-dir": "checkpoints are train.py's (MXNet) only",
              "--checkpoint-every": "checkpoints are train.py's (MXNet) only",
              "--no-hybridize": "hybridizing is MXNet's"}
#: DDP's bucket size with the PowerSGD hook: one bucket for every model here. With several
#: buckets the hook deadlocks over Gloo at its first compressed step (torch 2.13, CPU).
POWERSGD_BUCKET_MB = 256


def build_parser():
    p = argparse.ArgumentParser(
        prog="train.py --framework torch",
        description=__doc__.split("\n\n")[0],
        epilog="Learning rate semantics as train.py's: each rank's loss is the sum over its "
               "batch (the gradient a codec sees is a batch sum, as on MXNet), and SGD runs "
               "with lr / batch-size and weight decay x batch-size: the update is the mean "
               "gradient over the global batch (batch-size x workers).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--framework", choices=("torch",), default="torch",
                   help="this job is PyTorch's (scripts/train.py runs the MXNet one)")
    g = p.add_argument_group("communication")
    g.add_argument("--kvstore", choices=KVSTORES, default="slimgc",
                   help="slimgc: SlimGC's DistributedOptimizer; ddp: PyTorch's "
                        "DistributedDataParallel (allreduce over Gloo; --compressor picks its "
                        "hook); local: one process, no communication")
    g.add_argument("--compressor", choices=COMPRESSORS, default=None,
                   help="slimgc: the gradient codec (default: SLIMGC_COMPRESSOR, else 2bit); "
                        "ddp: none (fp32), fp16 (fp16_compress_hook) or powersgd (PyTorch's "
                        "PowerSGD hook, not SlimGC's codec); default none")
    g.add_argument("--threshold", type=float, default=None,
                   help="slimgc: compressor threshold; default: SLIMGC_THRESHOLD, else the "
                        "library's 0.5")
    g.add_argument("--codec-option", action="append", default=[], metavar="NAME=VALUE",
                   help="slimgc: an option of the codec (docs/codecs.md), e.g. ratio=0.1 for "
                        "topk; repeatable")
    g.add_argument("--comm-threshold", type=comm_threshold, default=None,
                   metavar="auto|BYTES|off|FILE",
                   help="slimgc: tensors smaller than this go uncompressed (as train.py's)")
    g.add_argument("--no-backup", action="store_true", help="slimgc: disable model backup")
    g.add_argument("--no-offload", action="store_true",
                   help="slimgc: encode on the training thread instead of CPU threads")
    g.add_argument("--no-fuse", action="store_true",
                   help="slimgc: send full-precision tensors one by one")
    g.add_argument("--fuse-compressed", default=None, metavar="auto|off|BYTES",
                   help="slimgc: compressed tensors below this size share one bucket")
    g.add_argument("--powersgd-rank", type=positive_int, default=4,
                   help="ddp powersgd: the hook's matrix_approximation_rank")
    g.add_argument("--powersgd-start-iter", type=int, default=2,
                   help="ddp powersgd: the hook's start_powerSGD_iter, plain allreduce before "
                        "(PyTorch's default is 1000; 2 is the least it takes)")
    g.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="ddp: DDP's bucket_cap_mb (default: DDP's 25, and %d with the PowerSGD "
                        "hook, one bucket: with several it deadlocks over Gloo)"
                        % POWERSGD_BUCKET_MB)
    g = p.add_argument_group("model and data")
    g.add_argument("--model", choices=sorted(torch_models.MODELS), default="cnn1d",
                   help="as train.py's: mlp, fc, cnn1d, resnet20, vgg")
    g.add_argument("--dataset", choices=sorted(datasets.DATASETS), default="mnist1d",
                   help="as train.py's")
    g.add_argument("--num-train", type=positive_int, default=None,
                   help="synthetic datasets: training samples over all workers")
    g.add_argument("--image-size", type=positive_int, default=None,
                   help="synthetic datasets: image height/width")
    g = p.add_argument_group("optimization")
    g.add_argument("--epochs", type=positive_int, default=10, help="passes over the shard")
    g.add_argument("--batch-size", type=positive_int, default=32, help="per worker")
    g.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    g.add_argument("--momentum", type=float, default=0.9,
                   help="SGD momentum (dgc applies it itself and the optimizer gets 0)")
    g.add_argument("--wd", type=float, default=0.0, help="weight decay")
    g.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                   help="cosine: decay to 0 over all steps")
    g.add_argument("--seed", type=int, default=0,
                   help="initial weights (same on all workers), shards and shuffling")
    g.add_argument("--steps", type=positive_int, default=None,
                   help="cap on steps per epoch (throughput runs)")
    g = p.add_argument_group("output")
    g.add_argument("--warmup-steps", type=int, default=10,
                   help="steps left out of the median per-step throughput")
    g.add_argument("--json", metavar="FILE", default=None,
                   help="write the result here (rank 0); with several workers every rank "
                        "also writes FILE-stem.rankN.json")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--log-every", type=positive_int, default=None, metavar="STEPS",
                   help="rank 0 prints a line every this many steps (step, epoch, loss)")
    return p


def parse_args(argv=None):
    """The options, checked against each other; a usage error (exit 2) names the fix."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    for word in unknown:
        name = word.split("=", 1)[0]
        if name in MXNET_ONLY:
            parser.error("%s: %s; leave it out with --framework torch" % (name, MXNET_ONLY[name]))
    if unknown:
        parser.error("unrecognized arguments: %s" % " ".join(unknown))
    if args.compressor is None:
        args.compressor = ((os.environ.get("SLIMGC_COMPRESSOR") or "2bit")
                           if args.kvstore == "slimgc" else "none")
    if args.kvstore == "ddp" and args.compressor not in DDP_HOOKS:
        parser.error("--kvstore ddp takes --compressor none, fp16 or powersgd (DDP's hooks), "
                     "not %s: SlimGC's codecs go with --kvstore slimgc" % args.compressor)
    if args.kvstore == "slimgc" and args.compressor == "fp16":
        parser.error("--compressor fp16 is DDP's hook: use --kvstore ddp --compressor fp16")
    if args.powersgd_start_iter < 2:
        parser.error("--powersgd-start-iter must be at least 2 (PyTorch's PowerSGD hook with "
                     "error feedback refuses less)")
    if args.kvstore == "local" and args.compressor != "none":
        warnings.warn("--kvstore local does not communicate; --compressor is ignored")
    if args.kvstore != "slimgc" and (args.no_backup or args.no_offload or args.no_fuse
                                     or args.comm_threshold is not None or args.codec_option
                                     or args.fuse_compressed is not None
                                     or args.threshold is not None):
        warnings.warn("--threshold/--codec-option/--comm-threshold/--no-backup/--no-offload/"
                      "--no-fuse/--fuse-compressed apply to --kvstore slimgc only")
    if args.kvstore != "ddp" and args.bucket_cap_mb is not None:
        warnings.warn("--bucket-cap-mb applies to --kvstore ddp only")
    return args


def init_distributed(args):
    """(rank, workers): torch.distributed over Gloo from the launcher's variables, or (0, 1)."""
    if args.kvstore == "local":
        return 0, 1
    if "WORLD_SIZE" not in os.environ:
        if args.kvstore == "ddp":
            sys.exit("--kvstore ddp needs torch.distributed's variables (RANK, WORLD_SIZE, "
                     "MASTER_ADDR, MASTER_PORT); start it with: python -m slimgc_mx.launch -n N "
                     "--framework torch --launcher local python scripts/train.py --framework "
                     "torch ... (or torchrun)")
        return 0, 1  # slimgc alone: one process, the engine in-process
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def make_optimizer(args, net, rank):
    """(the module to run forward on, the optimizer to step, the SlimGC optimizer or None)."""
    momentum = args.momentum
    owns_momentum = (args.kvstore == "slimgc"
                     and codecs.create(args.compressor).traits.owns_momentum)
    if owns_momentum:
        momentum = 0.0
        if rank == 0:
            print("codec %s applies momentum %s itself; the optimizer's momentum is 0"
                  % (args.compressor, args.momentum), flush=True)
    # Batch-sum gradients (as MXNet's Gluon pushes them): lr / B and wd x B give the update
    # of the mean gradient over the global batch, momentum included.
    base = torch.optim.SGD(net.parameters(), lr=args.lr / args.batch_size, momentum=momentum,
                           weight_decay=args.wd * args.batch_size)
    if args.kvstore == "slimgc":
        import slimgc_mx.torch as slimgc
        given = {"threshold": args.threshold, "comm_threshold": args.comm_threshold,
                 "fuse_compressed": args.fuse_compressed,
                 "backup": False if args.no_backup else None,
                 "offload": False if args.no_offload else None,
                 "fuse": False if args.no_fuse else None}
        options = {k: v for k, v in given.items() if v is not None}
        options.update(codec_options(args.codec_option))
        if owns_momentum:
            options.setdefault("momentum", args.momentum)
        try:
            opt = slimgc.DistributedOptimizer(base, net, compression=args.compressor, **options)
        except (ValueError, TypeError) as exc:  # a bad setting: the message names it
            sys.stderr.write("train.py --framework torch: error: %s\n" % exc)
            sys.exit(2)
        return net, opt, opt
    if args.kvstore == "ddp":
        return ddp(args, net, rank), base, None
    return net, base, None


def ddp(args, net, rank):
    """net in DistributedDataParallel with the --compressor's hook."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    bucket = args.bucket_cap_mb
    if args.compressor == "powersgd":
        bucket = POWERSGD_BUCKET_MB if bucket is None else bucket
        if rank == 0:
            print("PyTorch's PowerSGD hook: rank %d, compressing from step %d, bucket_cap_mb=%g%s"
                  % (args.powersgd_rank, args.powersgd_start_iter, bucket,
                     " (one bucket: with several the hook deadlocks over Gloo at its first "
                     "compressed step)" if bucket >= POWERSGD_BUCKET_MB else ""), flush=True)
    model = torch.nn.parallel.DistributedDataParallel(
        net, **({} if bucket is None else {"bucket_cap_mb": bucket}))
    if args.compressor == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif args.compressor == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=args.powersgd_rank,
            start_powerSGD_iter=args.powersgd_start_iter)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return model


def evaluate(net, x, y, batch_size=256):
    """Top-1 accuracy of `net` on (x, y), in eval mode (BatchNorm's running statistics)."""
    net.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(y), batch_size):
            pred = net(torch.from_numpy(np.ascontiguousarray(x[i:i + batch_size]))).argmax(1)
            correct += int((pred.numpy() == y[i:i + batch_size]).sum())
    net.train()
    return correct / float(len(y))


def main(argv=None, on_step=None):
    """Train as the command line says; returns the result dict (rank 0 also prints it).

    on_step(optimizer), when given, runs before every optimizer.step (the cluster harness
    timestamps steps with it and reads SlimGC's stats() through it).
    """
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    t_start = time.perf_counter()
    random.seed(args.seed)
    np.random.seed(args.seed)
    rank, num_workers = init_distributed(args)
    is_root = rank == 0

    data, steps = load_shard(args, rank, num_workers)

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    net = torch_models.get_model(args.model, data.num_classes, data.input_shape)
    num_params, num_tensors = torch_models.count_params(net)
    run, opt, slim = make_optimizer(args, net, rank)
    sched = None
    if args.lr_schedule == "cosine":
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps * args.epochs,
                                                           eta_min=0.0)
    torch.manual_seed(args.seed * 1000 + rank)  # dropout masks differ between workers
    global_batch = args.batch_size * num_workers
    show_bar = is_root and not args.no_progress and (
        sys.stderr.isatty() or bool(os.environ.get("SLIMGC_TERMINAL")))
    if is_root:
        print("%s on %s | kvstore %s (%d worker%s, PyTorch) | compressor %s | %d params in %d "
              "tensors | %d steps/epoch x %d, batch %d/worker"
              % (args.model, args.dataset, args.kvstore, num_workers,
                 "" if num_workers == 1 else "s",
                 args.compressor if args.kvstore != "local" else "n/a", num_params, num_tensors,
                 steps, args.epochs, args.batch_size), flush=True)

    history, step_times = [], []
    train_time = 0.0
    global_step = 0
    for epoch in range(1, args.epochs + 1):
        rng = np.random.default_rng([args.seed, rank, epoch])
        order = rng.permutation(len(data.y_train))
        bar = progress_bar(steps, "epoch %d/%d" % (epoch, args.epochs), show_bar)
        loss_sum = 0.0
        t0 = prev = time.perf_counter()
        for s in range(steps):
            idx = order[s * args.batch_size:(s + 1) * args.batch_size]
            xb = torch.from_numpy(data.x_train[idx])
            yb = torch.from_numpy(data.y_train[idx].astype(np.int64))
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(run(xb), yb, reduction="sum")
            loss.backward()
            if on_step is not None:
                on_step(opt)
            opt.step()
            if sched is not None:
                sched.step()
            lval = loss.item() / len(idx)
            if not np.isfinite(lval):
                sys.exit("loss became %r at epoch %d step %d" % (lval, epoch, s + 1))
            loss_sum += lval
            global_step += 1
            if is_root and args.log_every and global_step % args.log_every == 0:
                print("step %d  epoch %d  loss %.4f" % (global_step, epoch, lval), flush=True)
            now = time.perf_counter()
            step_times.append(now - prev)
            prev = now
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss="%.4f" % lval, refresh=False)
        epoch_time = time.perf_counter() - t0
        train_time += epoch_time
        if bar is not None:
            bar.close()
        if slim is not None:
            slim.flush()  # evaluate the global weights (with backup the model holds loc_buf)
        acc = evaluate(net, data.x_test, data.y_test)
        rec = {"epoch": epoch, "train_loss": loss_sum / steps, "test_acc": acc,
               "samples_per_s": steps * global_batch / max(epoch_time, 1e-9),
               "time_s": epoch_time, "steps": steps}
        history.append(rec)
        if is_root:
            print("epoch %3d  train loss %.4f  test acc %.4f  %9.1f samples/s  %6.1f s"
                  % (epoch, rec["train_loss"], acc, rec["samples_per_s"], epoch_time), flush=True)

    stats = None
    if slim is not None:
        slim.flush()
        stats = slim.stats()
    final_acc = evaluate(net, data.x_test, data.y_test)
    digest = hashlib.sha256()
    for name, param in sorted(net.named_parameters()):
        digest.update(param.detach().numpy().tobytes())
    if slim is not None:
        slim.close()
    if dist.is_initialized():
        # DDP and its hook's state let go of their tensors while the group lives, and every
        # rank is done with its exchanges before any tears the group down: Gloo's threads
        # abort a process (SIGABRT) whose peer closed mid-exchange or whose tensors are
        # freed at interpreter exit (seen once with the PowerSGD hook under load)
        del run
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()

    skip = min(max(args.warmup_steps, 0), len(step_times) // 2)
    med_step = float(np.median(step_times[skip:])) if step_times else float("nan")
    total_steps = len(step_times)
    result = {
        "args": vars(args),
        "framework": "torch",
        "torch_version": torch.__version__,
        "rank": rank,
        "num_workers": num_workers,
        "kvstore_type": args.kvstore,
        "model": {"name": args.model, "num_params": num_params, "num_tensors": num_tensors},
        "dataset": {"name": args.dataset, "input_shape": list(data.input_shape),
                    "num_classes": data.num_classes, "num_train_total": data.num_train_total,
                    "shard_size": int(len(data.y_train)), "num_test": int(len(data.y_test))},
        "steps_per_epoch": steps,
        "global_batch": global_batch,
        "history": history,
        "final_test_acc": final_acc,
        "weights_sha256": digest.hexdigest(),
        "samples_per_s": {"median_step": global_batch / med_step if med_step > 0 else None,
                          "overall": (total_steps * global_batch / train_time
                                      if train_time else None),
                          "per_worker_overall": (total_steps * args.batch_size / train_time
                                                 if train_time else None),
                          "warmup_steps_skipped": skip},
        "train_time_s": train_time,
        "wall_time_s": time.perf_counter() - t_start,
        "kvstore_stats": stats,
    }
    if is_root:
        print(summary_line(result, args.compressor), flush=True)
    if args.json:
        write_results(result, args.json, is_root, num_workers)
    return result


if __name__ == "__main__":
    main()
