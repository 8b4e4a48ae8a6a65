#!/usr/bin/env python
"""Bytes against fp32 and final accuracy of gcomp over whole MNIST-1D CNN training runs.

N workers are simulated in one process: each step every worker computes the gradient of
its own batch at the same global weights; per parameter, fp32 sums the gradients, gcomp
encodes each worker's with its own residual, puts the N slots side by side (what the
gather route returns) and decodes the sum; MXNet's SGD then updates the weights. The
codec gets the optimizer's view (w_i, the momentum, lr, wd, rescale) before each encode,
as the kvstore gives it. Runs of one seed share initial weights, shards and batch order.

    python scripts/gcomp_traffic.py --workers 4 --epochs 30 --seeds 0,1,2 \\
        --configs fp32,gcomp,gcomp:delta_slack=8 --json results/gcomp/traffic.json
"""
import mxnet as mx  # noqa: E402  (first, as in train.py)

import argparse
import json
import os
import sys
import time

import numpy as np
from mxnet import autograd, gluon

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "scripts")):
    if path not in sys.path:
        sys.path.insert(0, path)

from slimgc_mx import codecs  # noqa: E402
from slimgc_mx.bench import datasets, models  # noqa: E402
from slimgc_mx.mxnet.update import optimizer_view, state_arrays  # noqa: E402
from train import Evaluator  # noqa: E402

#: Bytes of MXNet's row_sparse bookkeeping per row and direction (int64 row id plus
#: framing; measured, /work notes on the gather route): added to the gather's bytes.
ROW_BYTES = 12


def parse_config(text):
    """'fp32', 'gcomp' or 'gcomp:name=value,name=value' -> (label, codec options or None)."""
    name, _, rest = text.partition(":")
    if name == "fp32":
        return text, None
    if name != "gcomp":
        raise argparse.ArgumentTypeError("configs are fp32 or gcomp[:option=value,...], got %r"
                                         % text)
    options = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        options[key] = value
    codecs.create("gcomp", **options)  # a bad option fails here, naming it
    return text, options


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4, help="simulated workers N")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--wd", type=float, default=0.0)
    p.add_argument("--lr-schedule", choices=("constant", "cosine"), default="cosine")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    p.add_argument("--configs", default="fp32,gcomp",
                   help="comma-separated: fp32, gcomp, gcomp:option=value (options joined by "
                        "'+', e.g. gcomp:delta_slack=8+refresh=25)")
    p.add_argument("--model", default="cnn1d", choices=sorted(models.MODELS))
    p.add_argument("--json", metavar="FILE", help="write every run's record here")
    return p


def run(config, options, seed, args):
    """One training run; its record: final accuracy and byte counts."""
    mx.random.seed(seed)
    np.random.seed(seed)
    n_workers = args.workers
    shards = [datasets.load("mnist1d", rank=r, num_workers=n_workers, seed=seed)
              for r in range(n_workers)]
    data = shards[0]
    steps = data.steps_per_epoch(args.batch_size)
    net = models.get_model(args.model, data.num_classes, data.input_shape)
    net.initialize(mx.init.Xavier(rnd_type="gaussian", factor_type="in", magnitude=2))
    net.hybridize()
    with autograd.train_mode():
        net(mx.nd.zeros((2,) + tuple(data.input_shape))).wait_to_read()
    evaluate = Evaluator(lambda: models.get_model(args.model, data.num_classes,
                                                  data.input_shape), data.input_shape,
                         mx.cpu())
    params = [p for p in net.collect_params().values() if p.grad_req != "null"]
    opt_params = {"learning_rate": args.lr, "momentum": args.momentum, "wd": args.wd}
    if args.lr_schedule == "cosine":
        opt_params["lr_scheduler"] = mx.lr_scheduler.CosineScheduler(
            max_update=steps * args.epochs, base_lr=args.lr, final_lr=0.0)
    trainer = gluon.Trainer(params, "sgd", opt_params, kvstore=None)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    global_batch = args.batch_size * n_workers
    sizes = [int(np.prod(p.shape)) for p in params]
    coders = residuals = None
    if options is not None:
        coders = [codecs.create("gcomp", num_threads=1, **options) for _ in params]
        residuals = [[np.zeros(n, np.float32) for _ in range(n_workers)] for n in sizes]
    totals = {"fp32": 0, "payload": 0, "slot": 0, "rows": 0, "deferred_blocks": 0,
              "blocks": 0}
    history = []
    t0 = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        before = dict(totals)
        orders = [np.random.default_rng([seed, r, epoch]).permutation(len(s.y_train))
                  for r, s in enumerate(shards)]
        for s in range(steps):
            grads = []
            for r, shard in enumerate(shards):
                idx = orders[r][s * args.batch_size:(s + 1) * args.batch_size]
                x, y = mx.nd.array(shard.x_train[idx]), mx.nd.array(shard.y_train[idx])
                with autograd.record():
                    loss = loss_fn(net(x), y)
                loss.backward()
                grads.append([p.grad().asnumpy().ravel().copy() for p in params])
            updater = trainer._updaters[0]
            opt = trainer._optimizer
            for i, p in enumerate(params):
                n = sizes[i]
                totals["fp32"] += 4 * n * n_workers
                if coders is None:
                    total = grads[0][i].copy()
                    for r in range(1, n_workers):
                        total += grads[r][i]
                else:
                    c = coders[i]
                    weight = p.data().asnumpy().ravel()
                    s1, s2 = state_arrays(updater.states.get(i))
                    c.set_optimizer_view(optimizer_view(opt, i, lambda: (weight, s1, s2)))
                    slots = [c.encode(grads[r][i], residuals[i][r], n_workers, rank=r)
                             for r in range(n_workers)]
                    total = c.decode(np.concatenate(slots), n, n_workers)
                    stats = c.stats["decode"]
                    blocks = -(-n // 4096)
                    totals["payload"] += 4 * sum(stats["sent_lanes"])
                    totals["slot"] += 4 * stats["slot_lanes"] * n_workers
                    totals["rows"] += n_workers * stats["slot_lanes"] // c._geometry(n)[2]
                    totals["blocks"] += blocks * n_workers
                    totals["deferred_blocks"] += sum(int(w[1]) < blocks for w in slots)
                p.grad()[:] = mx.nd.array(total.reshape(p.shape))
            trainer.step(global_batch)
        rec = {"epoch": epoch}
        if coders is not None:  # this epoch's bytes against fp32
            fp32 = totals["fp32"] - before["fp32"]
            rec["payload_vs_fp32"] = (totals["payload"] - before["payload"]) / fp32
            rec["push_vs_fp32"] = (totals["slot"] - before["slot"]) / fp32
        if epoch % 5 == 0 or epoch == args.epochs:
            rec["test_acc"] = evaluate(net, data.x_test, data.y_test)
            print("  %s seed %d epoch %d: test acc %.4f (%.0f s)" % (
                config, seed, epoch, rec["test_acc"], time.perf_counter() - t0), flush=True)
        history.append(rec)
    record = {"config": config, "options": options, "seed": seed, "workers": n_workers,
              "steps": steps * args.epochs, "final_test_acc": history[-1]["test_acc"],
              "history": history, "params": sum(sizes), "tensors": len(sizes),
              "bytes": totals, "seconds": time.perf_counter() - t0}
    if coders is not None:
        fp32, slot = totals["fp32"], totals["slot"]
        record["ratios"] = {
            "payload_vs_fp32": totals["payload"] / fp32,
            "push_vs_fp32": slot / fp32,
            "push_with_rows_vs_fp32": (slot + ROW_BYTES * totals["rows"]) / fp32,
            "pull_vs_fp32": n_workers * slot / fp32,
            "push_plus_pull_vs_fp32": (1 + n_workers) * slot / (2 * fp32),
            "deferred_block_fraction": totals["deferred_blocks"] / max(1, totals["blocks"])}
    return record


def summarize(records):
    """Per config: mean final accuracy over seeds and the byte ratios."""
    out = {}
    for config in dict.fromkeys(r["config"] for r in records):
        rs = [r for r in records if r["config"] == config]
        acc = [r["final_test_acc"] for r in rs]
        entry = {"seeds": [r["seed"] for r in rs], "final_test_acc": acc,
                 "mean_acc": float(np.mean(acc))}
        if "ratios" in rs[0]:
            for key in rs[0]["ratios"]:
                entry[key] = float(np.mean([r["ratios"][key] for r in rs]))
        out[config] = entry
    return out


def main(argv=None):
    args = build_parser().parse_args(argv)
    configs = [parse_config(c.replace("+", ",")) for c in args.configs.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    records = []
    for seed in seeds:
        for config, options in configs:
            records.append(run(config, options, seed, args))
    summary = summarize(records)
    print("\n%d workers, %d epochs (%s), batch %d/worker, lr %g, momentum %g; seeds %s"
          % (args.workers, args.epochs, args.lr_schedule, args.batch_size, args.lr,
             args.momentum, args.seeds))
    print("| config | final test acc per seed | mean | payload / fp32 | pushed / fp32 | "
          "pulled / fp32 | deferred blocks |")
    print("|---|---|---|---|---|---|---|")
    for config, e in summary.items():
        accs = " / ".join("%.3f" % a for a in e["final_test_acc"])
        if "push_vs_fp32" in e:
            extra = "%.3f | %.3f | %.3f | %.2f%%" % (
                e["payload_vs_fp32"], e["push_vs_fp32"], e["pull_vs_fp32"],
                100 * e["deferred_block_fraction"])
        else:
            extra = "1 | 1 | 1 | -"
        print("| %s | %s | %.4f | %s |" % (config, accs, e["mean_acc"], extra))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summary": summary, "runs": records}, f, indent=2)
        print("wrote %s" % args.json)
    return summary


if __name__ == "__main__":
    main()
