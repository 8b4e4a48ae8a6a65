#!/usr/bin/env python
"""Soak test: a long SlimGC job through the launcher, watching memory, threads and determinism.

Runs W workers and S servers on this machine (2 and 2 by default) twice: a long run
(--steps) and a short one (--compare-steps), MLP on MNIST-1D, kvstore slimgc with
model backup and CPU offload on. Every --sample-every steps each worker records its
resident memory (VmRSS) and thread count from /proc/self/status, the loss, and a
checksum of the global weights (pulled from the kvstore, which leaves training
untouched). The report gives, per worker, RSS after warm-up versus at the end,
the RSS slope, the thread-count range, and whether the first --compare-steps steps
of the long run equal the short run bit for bit (losses and weight checksums).

    python scripts/soak.py --steps 2000 --compare-steps 200

Exit status: 0 when both runs succeeded and the trajectories match (and RSS growth
is within --max-rss-growth-mb when given), 1 otherwise.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=2000, help="steps of the long run")
    p.add_argument("--compare-steps", type=int, default=200,
                   help="steps of the short run, compared with the long run's first steps")
    p.add_argument("--sample-every", type=int, default=50,
                   help="steps between samples of RSS, threads, loss and weight checksum")
    p.add_argument("--warmup", type=int, default=200,
                   help="RSS 'after warm-up' is the first sample at or after this step")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--compressor", default="2bit")
    p.add_argument("--threshold", type=float, default=0.5)
    p.add_argument("--comm-threshold", default="4000",
                   help="bytes, or off; a fixed value keeps both runs on the same routes "
                        "('auto' decides from timings, which differ between runs)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-rss-growth-mb", type=float, default=None,
                   help="fail when a worker's RSS grows more than this after warm-up")
    p.add_argument("--out", default=None,
                   help="directory for the per-run JSON files and soak.json "
                        "(default: a new temporary directory)")
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)  # a launched process
    return p


# ---------------------------------------------------------------- the launched job

def proc_status():
    """(VmRSS in MB, thread count) of this process."""
    rss = threads = None
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024.0
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    return rss, threads


def run_job(args):
    import mxnet as mx  # servers and the scheduler enter their loop here and exit

    import hashlib

    import numpy as np
    from mxnet import autograd, gluon

    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import slimgc_mx
    from slimgc_mx.bench import datasets, models

    kv = mx.kv.create("slimgc")
    rank, nw = kv.rank, kv.num_workers
    data = datasets.load("mnist1d", rank=rank, num_workers=nw, seed=args.seed)
    mx.random.seed(args.seed)
    net = models.get_model("mlp", data.num_classes, data.input_shape)
    net.initialize(mx.init.Xavier())
    net.hybridize()
    with autograd.train_mode():
        net(mx.nd.zeros((2,) + tuple(data.input_shape))).wait_to_read()
    ct = args.comm_threshold
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": args.lr,
                                                          "momentum": 0.9},
                            kvstore=kv, compression_params={
                                "type": args.compressor, "threshold": args.threshold,
                                "comm_threshold": ct if ct in ("auto", "off") else int(ct),
                                "backup": True, "offload": True})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    params = trainer._params  # kvstore key i is the trainer's i-th parameter
    pulled = [mx.nd.zeros(p.shape) for p in params]
    n = len(data.y_train)
    per_epoch = data.steps_per_epoch(args.batch_size)

    def batches():
        epoch = 0
        while True:
            order = np.random.RandomState(args.seed * 7919 + epoch * 31 + rank).permutation(n)
            for i in range(per_epoch):
                idx = order[i * args.batch_size:(i + 1) * args.batch_size]
                yield mx.nd.array(data.x_train[idx]), mx.nd.array(data.y_train[idx])
            epoch += 1

    def global_checksum():
        h = hashlib.sha256()
        for i, buf in enumerate(pulled):
            trainer._kvstore.pull(i, out=buf)
            h.update(buf.asnumpy().tobytes())
        return h.hexdigest()

    samples = []
    t0 = time.perf_counter()
    feed = batches()
    for step in range(args.steps):
        x, y = next(feed)
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(x.shape[0])
        if (step + 1) % args.sample_every == 0 or step + 1 == args.steps:
            rss, threads = proc_status()
            samples.append({"step": step + 1, "rss_mb": rss, "threads": threads,
                            "loss": float(loss.mean().asscalar()),
                            "weights_sha256": global_checksum(),
                            "t": time.perf_counter() - t0})
    slimgc_mx.flush(trainer)
    result = {"rank": rank, "num_workers": nw, "steps": args.steps, "samples": samples,
              "wall_s": time.perf_counter() - t0, "kvstore_stats": trainer._kvstore.stats()}
    result["kvstore_stats"].pop("cttab", None)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "rank%d.json" % rank), "w") as f:
        json.dump(result, f, indent=1)
    print("rank %d: %d steps in %.1f s" % (rank, args.steps, result["wall_s"]), flush=True)


# ---------------------------------------------------------------- the driver

def launch(args, steps, out):
    """Run the job through the launcher; returns (exit status, seconds)."""
    job = [sys.executable, os.path.abspath(__file__), "--job", "--steps", str(steps),
           "--out", out]
    for name in ("sample_every", "compressor", "threshold", "comm_threshold", "batch_size",
                 "lr", "seed"):
        job += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    argv = [sys.executable, "-m", "slimgc_mx.launch", "-n", str(args.workers),
            "-s", str(args.servers), "--launcher", "local", "--"] + job
    t0 = time.perf_counter()
    code = subprocess.call(argv, cwd=ROOT)
    return code, time.perf_counter() - t0


def summarize(run, warmup):
    s = run["samples"]
    warm = next((x for x in s if x["step"] >= warmup), s[0])
    end = s[-1]
    after = [x for x in s if x["step"] >= warm["step"]]
    slope = 0.0
    if len(after) >= 2:
        xs = [x["step"] for x in after]
        ys = [x["rss_mb"] for x in after]
        mx_, my = sum(xs) / len(xs), sum(ys) / len(ys)
        den = sum((a - mx_) ** 2 for a in xs)
        slope = 1000.0 * sum((a - mx_) * (b - my) for a, b in zip(xs, ys)) / den if den else 0.0
    threads = [x["threads"] for x in s]
    return {"rank": run["rank"], "steps": run["steps"], "wall_s": round(run["wall_s"], 1),
            "rss_warm_step": warm["step"], "rss_warm_mb": round(warm["rss_mb"], 1),
            "rss_end_mb": round(end["rss_mb"], 1),
            "rss_growth_mb": round(end["rss_mb"] - warm["rss_mb"], 1),
            "rss_slope_mb_per_1000_steps": round(slope, 2),
            "rss_max_mb": round(max(x["rss_mb"] for x in s), 1),
            "threads_min": min(threads), "threads_max": max(threads),
            "loss_first": s[0]["loss"], "loss_last": end["loss"]}


def compare(long_run, short_run):
    """Samples up to the short run's end must be equal: loss and global-weight checksum."""
    limit = short_run["steps"]
    a = [(x["step"], x["loss"], x["weights_sha256"]) for x in long_run["samples"]
         if x["step"] <= limit]
    b = [(x["step"], x["loss"], x["weights_sha256"]) for x in short_run["samples"]]
    return {"compared_samples": len(b), "equal": a == b and len(b) > 0,
            "first_difference": next((str((x, y)) for x, y in zip(a, b) if x != y), None)}


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.job:
        return run_job(args)
    if args.compare_steps % args.sample_every or args.compare_steps > args.steps:
        sys.exit("--compare-steps must be a multiple of --sample-every and at most --steps")
    out = os.path.abspath(args.out or tempfile.mkdtemp(prefix="slimgc-soak-"))
    os.makedirs(out, exist_ok=True)
    report = {"command": " ".join(["python", "scripts/soak.py"] + (argv or sys.argv[1:])),
              "settings": {k: v for k, v in vars(args).items() if k not in ("job", "out")}}
    ok = True
    runs = {}
    for name, steps in (("long", args.steps), ("short", args.compare_steps)):
        code, seconds = launch(args, steps, os.path.join(out, name))
        report[name + "_exit"], report[name + "_seconds"] = code, round(seconds, 1)
        if code != 0:
            print("soak: the %s run failed with exit status %d" % (name, code), file=sys.stderr)
            ok = False
            continue
        runs[name] = [json.load(open(os.path.join(out, name, "rank%d.json" % r)))
                      for r in range(args.workers)]
    if "long" in runs:
        report["workers"] = [summarize(r, args.warmup) for r in runs["long"]]
        for w in report["workers"]:
            if args.max_rss_growth_mb is not None and w["rss_growth_mb"] > args.max_rss_growth_mb:
                ok = False
        shas = {r["samples"][-1]["weights_sha256"] for r in runs["long"]}
        report["workers_agree"] = len(shas) == 1
        ok = ok and report["workers_agree"]
    if "long" in runs and "short" in runs:
        report["trajectory"] = [compare(a, b) for a, b in zip(runs["long"], runs["short"])]
        ok = ok and all(c["equal"] for c in report["trajectory"])
    report["ok"] = ok
    with open(os.path.join(out, "soak.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))
    print("soak: %s; report in %s" % ("ok" if ok else "FAILED", os.path.join(out, "soak.json")))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
