#!/usr/bin/env python
"""Train a Gluon model data-parallel through the SlimGC kvstore, stock dist_sync, or locally.

Each worker trains on its own shard of the training set and evaluates on the full
test set; rank 0 prints per-epoch lines and a summary and writes the JSON result.
Distributed runs need the DMLC_* environment of a parameter-server job, e.g.

    python -m slimgc_mx.launch -n 2 -s 2 --launcher local \\
        python scripts/train.py --kvstore slimgc --compressor 2bit --model cnn1d --dataset mnist1d
"""
import os
import sys


def _framework(argv):
    """--framework's value in argv (the last one, as argparse takes it; 'mxnet' when absent),
    read before anything is imported."""
    found = "mxnet"
    for i, word in enumerate(argv):
        if word == "--framework" and i + 1 < len(argv):
            found = argv[i + 1]
        elif word.startswith("--framework="):
            found = word.split("=", 1)[1]
    return found


if __name__ == "__main__" and _framework(sys.argv[1:]) == "torch":
    # the PyTorch job imports no MXNet (a server would start its loop in `import mxnet`)
    import runpy
    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_torch.py"),
                   run_name="__main__")
    sys.exit(0)

# Scheduler and server processes of a dist job enter their loop inside `import mxnet`
# and exit there, so for them it comes before anything heavy. A worker imports MXNet after
# its flags are parsed (below build_parser), so that a bad one is refused without it.
if os.environ.get("DMLC_ROLE") in ("scheduler", "server"):
    __import__("mxnet")  # does not return

import argparse  # noqa: E402
import hashlib  # noqa: E402
import logging  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import slimgc_mx  # noqa: E402  (registers the kvstore once MXNet is imported)
import slimgc_mx.resume  # noqa: E402
from slimgc_mx import codecs  # noqa: E402
from slimgc_mx.bench import datasets  # noqa: E402
from slimgc_mx.bench.jobtools import (MODELS, codec_options, comm_threshold,  # noqa: E402
                                      load_shard, positive_int, progress_bar, summary_line,
                                      write_results)

KVSTORES = ("slimgc", "dist_sync", "horovod", "local")
COMPRESSORS = tuple(codecs.available()) + ("fp16",)


def build_parser():
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Learning rate semantics: gradients are averaged over the global batch "
               "(batch-size x workers), as in synchronous SGD.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--framework", choices=("mxnet", "torch"), default="mxnet",
                   help="torch: the same job through PyTorch (scripts/train_torch.py: DDP, "
                        "its hooks or SlimGC's DistributedOptimizer; `--framework torch "
                        "--help` lists its options)")
    g = p.add_argument_group("communication")
    g.add_argument("--kvstore", choices=KVSTORES, default="slimgc",
                   help="slimgc: the SlimGC plugin; dist_sync: stock MXNet parameter server; "
                        "horovod: Horovod's DistributedTrainer (ring allreduce over Gloo; a "
                        "benchmark baseline: bash scripts/run.sh horovod installs it); "
                        "local: one process, no communication")
    g.add_argument("--compressor", choices=COMPRESSORS, default=None,
                   help="gradient codec; default for slimgc: SLIMGC_COMPRESSOR, else 2bit; "
                        "none otherwise "
                        "(dist_sync hands it to MXNet's own gradient compression; horovod "
                        "takes none or fp16, Horovod's own compression)")
    g.add_argument("--threshold", type=float, default=None,
                   help="compressor threshold (quantization level scale); default: "
                        "SLIMGC_THRESHOLD, else the library's 0.5")
    g.add_argument("--codec-option", action="append", default=[], metavar="NAME=VALUE",
                   help="slimgc: an option of the codec (docs/codecs.md), e.g. ratio=0.1 for "
                        "topk; repeatable")
    g.add_argument("--comm-threshold", type=comm_threshold, default=None,
                   metavar="auto|BYTES|off|FILE",
                   help="slimgc: tensors smaller than this go uncompressed; auto = measured "
                        "during warm-up (CTTab), off = compress every tensor, FILE = replay the "
                        "decision saved in FILE (the .cttab.json beside an earlier --json); "
                        "default: SLIMGC_COMM_THRESHOLD, else auto")
    g.add_argument("--no-backup", action="store_true",
                   help="slimgc: disable model backup (the next forward pass waits for the "
                        "global weights)")
    g.add_argument("--no-offload", action="store_true",
                   help="slimgc: encode on the gradient's device instead of CPU threads")
    g.add_argument("--no-fuse", action="store_true",
                   help="slimgc: send full-precision tensors one by one instead of one fused "
                        "buffer per server")
    g.add_argument("--fuse-compressed", default=None, metavar="auto|off|BYTES",
                   help="slimgc: compressed tensors below this size share one compressed "
                        "bucket (Cupcake; docs/configuration.md; default: the library's, off)")
    g = p.add_argument_group("model and data")
    g.add_argument("--model", choices=sorted(MODELS), default="cnn1d",
                   help="mlp, fc: any inputs, flattened; cnn1d: 1-D signals; resnet20, vgg: "
                        "(3,32,32) images")
    g.add_argument("--dataset", choices=sorted(datasets.DATASETS), default="mnist1d",
                   help="mnist1d, digits: real; synthetic-*: random images for throughput "
                        "(synthetic-imagenet is (3,224,224), 1000 classes)")
    g.add_argument("--num-train", type=positive_int, default=None,
                   help="synthetic datasets: training samples over all workers")
    g.add_argument("--image-size", type=positive_int, default=None,
                   help="synthetic datasets: image height/width (synthetic-imagenet: 224)")
    g = p.add_argument_group("optimization")
    g.add_argument("--epochs", type=positive_int, default=10, help="passes over the shard")
    g.add_argument("--batch-size", type=positive_int, default=32, help="per worker")
    g.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    g.add_argument("--momentum", type=float, default=0.9,
                   help="SGD momentum (a codec that applies momentum itself, dgc, takes it "
                   "and the optimizer gets 0)")
    g.add_argument("--wd", type=float, default=0.0, help="weight decay")
    g.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                   help="cosine: decay to 0 over all steps (steadier final accuracy)")
    g.add_argument("--seed", type=int, default=0,
                   help="initial weights (same on all workers), shards and shuffling")
    g.add_argument("--steps", type=positive_int, default=None,
                   help="cap on steps per epoch (throughput runs)")
    g = p.add_argument_group("checkpoints")
    g.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="write checkpoints here and, on start, resume from the newest "
                        "complete one (each rank writes its part; the last two are kept); "
                        "one directory every worker sees")
    g.add_argument("--checkpoint-every", type=positive_int, default=100, metavar="STEPS",
                   help="with --checkpoint-dir: a checkpoint every this many steps")
    g = p.add_argument_group("output")
    g.add_argument("--warmup-steps", type=int, default=10,
                   help="steps left out of the median per-step throughput")
    g.add_argument("--json", metavar="FILE", default=None,
                   help="write the result here (rank 0); with several workers every rank "
                        "also writes FILE-stem.rankN.json")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--log-every", type=positive_int, default=None, metavar="STEPS",
                   help="rank 0 prints a line every this many steps (step, epoch, loss): "
                        "progress in logs, where the bar is not shown")
    g.add_argument("--no-hybridize", action="store_true", help="run the model imperatively")
    return p


def check_checkpoint_dir(parser, path):
    """A usage error when --checkpoint-dir, or a folder above it, is a file."""
    here = os.path.abspath(path)
    while not os.path.exists(here) and os.path.dirname(here) != here:
        here = os.path.dirname(here)
    if not os.path.isdir(here):
        parser.error("--checkpoint-dir %s: %s is a file, not a directory; give a directory "
                     "(created if missing), or move the file away" % (path, here))


def parse_args(argv=None):
    """The command line's flags, a bad one (or a --checkpoint-dir that is a file) refused
    with a usage error; needs no MXNet."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.checkpoint_dir:
        check_checkpoint_dir(parser, args.checkpoint_dir)
    return args


if __name__ == "__main__":  # a bad flag, or --help, exits here, before MXNet's import
    parse_args()

import mxnet as mx  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402

from slimgc_mx.bench import models  # noqa: E402


def import_horovod():
    """horovod.mxnet, initialized; a clear exit when it is not installed."""
    try:
        import horovod.mxnet as hvd
    except ImportError as exc:
        sys.exit("--kvstore horovod needs Horovod with MXNet support (%s); install it with: "
                 "bash scripts/run.sh horovod" % exc)
    hvd.init()
    return hvd


def make_kvstore(args):
    """The kvstore object for --kvstore (None for local and horovod) and its
    compression_params."""
    if (args.compressor == "fp16") != (args.kvstore == "horovod" and args.compressor != "none"):
        sys.exit("--compressor %s does not go with --kvstore %s: horovod takes none or fp16, "
                 "fp16 is horovod's only" % (args.compressor, args.kvstore))
    if args.kvstore == "horovod":
        return None, None
    if args.kvstore == "local":
        if args.compressor != "none":
            warnings.warn("--kvstore local does not communicate; --compressor is ignored")
        return None, None
    if args.kvstore == "dist_sync":
        if "DMLC_ROLE" not in os.environ:
            sys.exit("--kvstore dist_sync needs a parameter-server job (DMLC_* environment); "
                     "start it with: python -m slimgc_mx.launch -n N -s N --launcher local ...")
        kv = mx.kv.create("dist_sync")
        params = None
        if args.compressor != "none":
            params = {"type": args.compressor,
                      "threshold": 0.5 if args.threshold is None else args.threshold}
        return kv, params
    # Only what this command line sets: the rest comes from SLIMGC_* or the defaults, by the
    # library's one rule (docs/configuration.md, "Where a setting comes from").
    given = {"type": args.compressor, "threshold": args.threshold,
             "comm_threshold": args.comm_threshold, "fuse_compressed": args.fuse_compressed,
             "backup": False if args.no_backup else None,
             "offload": False if args.no_offload else None,
             "fuse": False if args.no_fuse else None}
    params = {k: v for k, v in given.items() if v is not None}
    params.update(codec_options(args.codec_option))
    kv = mx.kv.create("slimgc")
    try:  # Trainer sets the same again; resolved here for main
        kv.set_gradient_compression(params)
    except ValueError as exc:  # a bad setting: the message names it and what it takes
        sys.stderr.write("train.py: error: %s\n" % exc)
        sys.exit(2)
    args.compressor = kv.config.compressor
    return kv, params


class PushThenPullTrainer(gluon.Trainer):
    """Trainer for stock dist_sync with gradient compression, which rejects pushpull.

    Same semantics as Trainer's own reduction: push the gradient, pull the weights
    (optimizer on the servers) or the summed gradient.
    """

    def _allreduce_grads(self):
        if not self._kvstore:
            return
        for i, param in enumerate(self._params):
            if param.grad_req == "null":
                continue
            self._kvstore.push(i, param.list_grad(), priority=-i)
            out = param.list_data() if self._update_on_kvstore else param.list_grad()
            self._kvstore.pull(i, out, priority=-i)


class Evaluator:
    """Top-1 accuracy on a twin of the trained net, refreshed from its parameters each call.

    An inference forward makes MKLDNN reorder conv weights in place into a blocked
    layout that kvstore writes cannot handle; evaluating on a twin keeps the trained
    parameters in the default layout.
    """

    def __init__(self, make_net, input_shape, ctx, hybridize=True, batch_size=256):
        self.net, self.ctx, self.batch_size = make_net(), ctx, batch_size
        self.net.initialize(ctx=ctx)
        if hybridize:
            self.net.hybridize()
        # Shape the twin's parameters without an inference forward (which would reorder them).
        with mx.autograd.train_mode():
            self.net(mx.nd.zeros((1,) + tuple(input_shape), ctx=ctx)).wait_to_read()

    def __call__(self, trained, x, y):
        src = list(trained.collect_params().values())
        dst = list(self.net.collect_params().values())
        for a, b in zip(src, dst):
            a.data(self.ctx).copyto(b.data(self.ctx))
        correct = 0
        for i in range(0, len(y), self.batch_size):
            out = self.net(mx.nd.array(x[i:i + self.batch_size], ctx=self.ctx))
            pred = out.argmax(axis=1).asnumpy().astype(np.int64)
            correct += int((pred == y[i:i + self.batch_size]).sum())
        return correct / float(len(y))


def main(argv=None, on_step=None):
    """Train as the command line says; returns the result dict (rank 0 also prints it).

    on_step(trainer), when given, runs before every trainer.step (the cluster harness
    timestamps steps with it).
    """
    if _framework(sys.argv[1:] if argv is None else argv) == "torch":
        return _torch_main(argv, on_step)  # (MXNet is imported already, unused)
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.compressor is None and args.kvstore != "slimgc":
        args.compressor = "none"
    if args.kvstore != "slimgc" and (args.no_backup or args.no_offload or args.no_fuse
                                     or args.comm_threshold is not None
                                     or args.fuse_compressed is not None):
        warnings.warn("--comm-threshold/--no-backup/--no-offload/--no-fuse/--fuse-compressed "
                      "apply to --kvstore slimgc only")
    t_start = time.perf_counter()
    random.seed(args.seed)
    np.random.seed(args.seed)
    mx.random.seed(args.seed)
    ctx = mx.cpu()

    kv, compression_params = make_kvstore(args)
    hvd = import_horovod() if args.kvstore == "horovod" else None
    rank = kv.rank if kv is not None else hvd.rank() if hvd else 0
    num_workers = kv.num_workers if kv is not None else hvd.size() if hvd else 1
    is_root = rank == 0

    data, steps = load_shard(args, rank, num_workers)

    # Same initial weights everywhere: seeded init, materialized by one forward pass.
    net = models.get_model(args.model, data.num_classes, data.input_shape)
    net.initialize(mx.init.Xavier(rnd_type="gaussian", factor_type="in", magnitude=2), ctx=ctx)
    if not args.no_hybridize:
        net.hybridize()
    with autograd.train_mode():  # no inference forward on the trained net (see Evaluator)
        net(mx.nd.zeros((2,) + tuple(data.input_shape), ctx=ctx)).wait_to_read()
    num_params, num_tensors = models.count_params(net)
    evaluate = Evaluator(lambda: models.get_model(args.model, data.num_classes, data.input_shape),
                         data.input_shape, ctx, hybridize=not args.no_hybridize)
    mx.random.seed(args.seed * 1000 + rank)  # dropout masks differ between workers

    native_compression = args.kvstore == "dist_sync" and compression_params is not None
    trainer_cls = PushThenPullTrainer if native_compression else gluon.Trainer
    momentum = args.momentum
    if compression_params is not None and args.kvstore == "slimgc" and codecs.create(
            kv.config.compressor, **kv.config.codec_options).traits.owns_momentum:
        # the codec applies momentum itself (dgc's momentum correction): it takes --momentum
        compression_params.setdefault("momentum", momentum)
        momentum = 0.0
        if is_root:
            print("codec %s applies momentum %s itself; the optimizer's momentum is 0"
                  % (args.compressor, compression_params["momentum"]), flush=True)
    opt_params = {"learning_rate": args.lr, "momentum": momentum, "wd": args.wd}
    if args.lr_schedule == "cosine":
        opt_params["lr_scheduler"] = mx.lr_scheduler.CosineScheduler(
            max_update=steps * args.epochs, base_lr=args.lr, final_lr=0.0)
    if hvd is not None:  # averages over workers itself: step() takes the per-worker batch
        trainer = hvd.DistributedTrainer(
            net.collect_params(), "sgd", opt_params,
            compression=hvd.Compression.fp16 if args.compressor == "fp16"
            else hvd.Compression.none)
        hvd.broadcast_parameters(net.collect_params(), root_rank=0)
    else:
        trainer = trainer_cls(net.collect_params(), "sgd", opt_params,
                              kvstore=kv if kv is not None else "local",
                              compression_params=compression_params)
    # trainer.step(n) divides the summed gradient by n: the mean over the global batch.
    # Horovod's trainer divides by the worker count itself.
    step_batch = args.batch_size if hvd is not None else args.batch_size * num_workers
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    global_batch = args.batch_size * num_workers
    show_bar = is_root and not args.no_progress and (
        sys.stderr.isatty() or bool(os.environ.get("SLIMGC_TERMINAL")))

    if is_root:
        print("%s on %s | kvstore %s (%d worker%s) | compressor %s | %d params in %d tensors | "
              "%d steps/epoch x %d, batch %d/worker"
              % (args.model, args.dataset, args.kvstore, num_workers, "" if num_workers == 1 else "s",
                 args.compressor if args.kvstore != "local" else "n/a", num_params, num_tensors,
                 steps, args.epochs, args.batch_size), flush=True)

    history, step_times = [], []
    train_time = 0.0
    start_epoch, start_step, global_step, loss_sum = 1, 0, 0, 0.0
    ckpt = None
    if args.checkpoint_dir:
        ckpt = slimgc_mx.resume.JobCheckpoints(args.checkpoint_dir, rank, num_workers)
        position = ckpt.restore(trainer, net)
        if position is not None:
            start_epoch, start_step = position["epoch"], position["next_step"]
            global_step, loss_sum = position["step"], position["loss_sum"]
            history = position["history"]
            if is_root:
                print("resumed from %s: epoch %d, step %d of %d (%d steps done)"
                      % (position["path"], start_epoch, start_step, steps, global_step),
                      flush=True)
    for epoch in range(start_epoch, args.epochs + 1):
        rng = np.random.default_rng([args.seed, rank, epoch])
        order = rng.permutation(len(data.y_train))
        first = start_step if epoch == start_epoch else 0
        bar = progress_bar(steps - first, "epoch %d/%d" % (epoch, args.epochs), show_bar)
        loss_sum = loss_sum if epoch == start_epoch else 0.0
        t0 = prev = time.perf_counter()
        for s in range(first, steps):
            if ckpt is not None:  # dropout masks depend on the step alone: a resumed job
                mx.random.seed(args.seed * 1000003 + rank * 1009 + global_step)  # draws alike
            idx = order[s * args.batch_size:(s + 1) * args.batch_size]
            xb = mx.nd.array(data.x_train[idx], ctx=ctx)
            yb = mx.nd.array(data.y_train[idx], ctx=ctx)
            with autograd.record():
                loss = loss_fn(net(xb), yb)
            loss.backward()
            if on_step is not None:
                on_step(trainer)
            trainer.step(step_batch)  # mean gradient over all workers' samples
            lval = float(loss.mean().asscalar())  # sync point: this step's forward is done
            if not np.isfinite(lval):
                sys.exit("loss became %r at epoch %d step %d" % (lval, epoch, s + 1))
            loss_sum += lval
            global_step += 1
            if is_root and args.log_every and global_step % args.log_every == 0:
                print("step %d  epoch %d  loss %.4f" % (global_step, epoch, lval), flush=True)
            if ckpt is not None and global_step % args.checkpoint_every == 0:
                path = ckpt.save(global_step, trainer, net, {"epoch": epoch, "next_step": s + 1,
                                                             "loss_sum": loss_sum,
                                                             "history": history})
                if is_root and bar is None:
                    print("checkpoint %s written" % path, flush=True)
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
        slimgc_mx.flush(trainer)  # evaluate the global weights (with backup on, the
        acc = evaluate(net, data.x_test, data.y_test)  # parameters hold this worker's loc_buf)
        rec = {"epoch": epoch, "train_loss": loss_sum / steps, "test_acc": acc,
               "samples_per_s": (steps - first) * global_batch / max(epoch_time, 1e-9),
               "time_s": epoch_time,
               "steps": steps}
        history.append(rec)
        if is_root:
            print("epoch %3d  train loss %.4f  test acc %.4f  %9.1f samples/s  %6.1f s"
                  % (epoch, rec["train_loss"], acc, rec["samples_per_s"], epoch_time), flush=True)

    kvobj = getattr(trainer, "_kvstore", None) or kv
    slimgc_mx.flush(trainer)
    final_acc = evaluate(net, data.x_test, data.y_test)
    digest = hashlib.sha256()
    for name, param in sorted(net.collect_params().items()):
        digest.update(param.data(ctx).asnumpy().tobytes())
    stats_fn = getattr(kvobj, "stats", None)
    stats = stats_fn() if callable(stats_fn) else None

    skip = min(max(args.warmup_steps, 0), len(step_times) // 2)
    med_step = float(np.median(step_times[skip:])) if step_times else float("nan")
    total_steps = len(step_times)
    result = {
        "args": vars(args),
        "rank": rank,
        "num_workers": num_workers,
        "kvstore_type": getattr(kvobj, "type", None) if kvobj is not None else "local",
        "model": {"name": args.model, "num_params": num_params, "num_tensors": num_tensors},
        "dataset": {"name": args.dataset, "input_shape": list(data.input_shape),
                    "num_classes": data.num_classes, "num_train_total": data.num_train_total,
                    "shard_size": int(len(data.y_train)), "num_test": int(len(data.y_test))},
        "steps_per_epoch": steps,
        "global_batch": global_batch,
        "history": history,
        "final_test_acc": final_acc,
        # The final global weights: equal on every worker, and equal between runs that
        # trained alike (a resumed run and an uninterrupted one included).
        "weights_sha256": digest.hexdigest(),
        # Global samples (all workers) per second, measured on this rank.
        "samples_per_s": {"median_step": global_batch / med_step if med_step > 0 else None,
                          "overall": total_steps * global_batch / train_time if train_time else None,
                          "per_worker_overall": (total_steps * args.batch_size / train_time
                                                 if train_time else None),
                          "warmup_steps_skipped": skip},
        "train_time_s": train_time,
        "wall_time_s": time.perf_counter() - t_start,
        "kvstore_stats": stats,
    }
    if is_root:
        print(summary_line(result, args.compressor), flush=True)
    cttab = getattr(kvobj, "cttab", None)
    if args.json and is_root and cttab is not None and cttab.rows:
        cttab.save(os.path.splitext(args.json)[0] + ".cttab")  # the paper's Fig. 6 table
    if args.json:
        write_results(result, args.json, is_root, num_workers)
    return result


def _torch_main(argv, on_step):
    """main() of scripts/train_torch.py, for a caller that gave --framework torch here."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "slimgc_train_torch", os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                           "train_torch.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv, on_step=on_step)


if __name__ == "__main__":
    main()
