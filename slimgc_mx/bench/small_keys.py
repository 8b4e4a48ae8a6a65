"""Many small parameters: SlimGC's step against DDP's, measured side by side in the same ranks.

`python -m slimgc_mx.bench small-keys` runs a model of `--params` tensors of 4 elements on
2 CPU ranks (Gloo), DDP first and then SlimGC with `--options`, `--steps` steps each, and
reports SlimGC's time over DDP's: the total of all steps, the median step (the first left
out) and, where the run passes the CTTab's warm-up, the median step inside and after it.
With `--build LABEL=DIR` each round also runs another checkout's slimgc_mx, rounds
interleaved, and the table gives this checkout's ratio over that one's per round. A
round's ranks are fresh processes; the job is `small_keys_rank.py`, run by path, so that
`slimgc_mx` comes from the checkout under test.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from ..launch.plan import free_port

DESCRIPTION = "many tiny parameters: SlimGC's step over DDP's in the same ranks (CPU, 2 ranks)"
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
DEFAULT_OPTIONS = '{"backup": false, "compression": "2bit"}'


def parse_args(argv, prog):
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=int, default=500, help="tiny parameters (default 500)")
    p.add_argument("--steps", type=int, default=14, help="steps of each (default 14)")
    p.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    p.add_argument("--options", default=DEFAULT_OPTIONS,
                   help="DistributedOptimizer options, JSON (default %s)" % DEFAULT_OPTIONS)
    p.add_argument("--build", action="append", default=[], metavar="LABEL=DIR",
                   help="also run another checkout of this project each round, e.g. "
                        "--build before=../old-checkout (default: none)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per run (default 300)")
    p.add_argument("--out", default=None, help="folder for results.json (default: none)")
    args = p.parse_args(argv)
    if args.params < 1 or args.steps < 2 or args.rounds < 1:
        p.error("--params must be >= 1, --steps >= 2 and --rounds >= 1")
    try:
        args.options_dict = json.loads(args.options)
    except ValueError as exc:
        p.error("--options is not JSON (%s): e.g. --options '%s'" % (exc, DEFAULT_OPTIONS))
    if not isinstance(args.options_dict, dict):
        p.error("--options must be a JSON object, e.g. '%s'" % DEFAULT_OPTIONS)
    args.builds = [("this checkout", ROOT)]
    for item in args.build:
        label, _, path = item.partition("=")
        if not label or not os.path.isdir(os.path.join(path, "slimgc_mx")):
            p.error("--build %r: expected LABEL=DIR with DIR a checkout of this project" % item)
        args.builds.append((label, os.path.abspath(path)))
    return args


def run_once(root, args, folder):
    """One run of the job with `root`'s slimgc_mx: rank 0's result, or raise RuntimeError
    with the ranks' output."""
    spec = os.path.join(folder, "spec.json")
    with open(spec, "w") as f:
        json.dump({"params": args.params, "steps": args.steps,
                   "options": args.options_dict}, f)
    port = free_port()
    procs, logs = [], []
    for rank in range(2):
        env = dict(os.environ)
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE="2", LOCAL_RANK=str(rank), PYTHONPATH=root,
                   OMP_NUM_THREADS="1")
        log = open(os.path.join(folder, "rank%d.log" % rank), "w+")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(HERE, "small_keys_rank.py"), spec,
             os.path.join(folder, "rank%d.json" % rank)],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root))
    deadline = time.time() + args.timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        pass
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError("the job exited with %s:\n%s" % (
            [p.returncode for p in procs], "\n".join(t[-1500:] for t in texts)))
    with open(os.path.join(folder, "rank0.json")) as f:
        return json.load(f)


def ratios(result, warmup):
    """SlimGC's time over DDP's: total, median step (first left out) and, where the run
    passes the warm-up, the median step inside it and after it."""
    ddp, mine = result["ddp"]["seconds"], result["slimgc"]["seconds"]
    med = statistics.median(ddp[1:])
    out = {"total": sum(mine) / sum(ddp), "median_step": statistics.median(mine[1:]) / med}
    if len(mine) > warmup + 1:
        out["warmup_step"] = statistics.median(mine[1:warmup]) / med
        out["after_step"] = statistics.median(mine[warmup:]) / med
    transfers = result["slimgc"]["transfers"]
    out["transfers_last_step"] = transfers[-1] - (transfers[-2] if len(transfers) > 1 else 0)
    out["best_ct"] = result["slimgc"].get("best_ct")
    return out


def main(argv, prog):
    args = parse_args(argv, prog)
    warmup = int(args.options_dict.get("warmup_steps", 20))
    runs = {label: [] for label, _ in args.builds}
    print("small keys: %d tensors of 4 elements, 2 ranks, %d steps, options %s; %d rounds "
          "of %s" % (args.params, args.steps, args.options, args.rounds,
                     ", ".join(label for label, _ in args.builds)), flush=True)
    for r in range(args.rounds):
        for label, root in args.builds:
            # the ranks' spec, logs and results: read (a failure quotes the logs), then removed
            with tempfile.TemporaryDirectory(prefix="small-keys-r%d-" % r,
                                             ignore_cleanup_errors=True) as folder:
                try:
                    got = ratios(run_once(root, args, folder), warmup)
                except (RuntimeError, OSError, ValueError, KeyError) as exc:
                    print("round %d, %s: failed: %s" % (r + 1, label, exc), file=sys.stderr)
                    return 1
            runs[label].append(got)
            print("round %d, %-14s total %.2fx DDP, median step %.2fx%s, BestCT %s" % (
                r + 1, label, got["total"], got["median_step"],
                "" if "after_step" not in got else " (warm-up %.2fx, after %.2fx)" % (
                    got["warmup_step"], got["after_step"]),
                got["best_ct"] if got["best_ct"] is not None else "- (in the warm-up)"),
                flush=True)
    summary = {}
    for label, rs in runs.items():
        summary[label] = {k: statistics.median(x[k] for x in rs)
                          for k in ("total", "median_step", "warmup_step", "after_step")
                          if all(k in x for x in rs)}
        print("%-14s median of %d rounds: %s" % (label, len(rs), ", ".join(
            "%s %.2fx" % (k, v) for k, v in summary[label].items())))
    mine = runs["this checkout"]
    for label, rs in list(runs.items())[1:]:
        per = [a["total"] / b["total"] for a, b in zip(mine, rs)]
        print("total time, this checkout / %s per round: %s (median %.2f)" % (
            label, ", ".join("%.2f" % x for x in per), statistics.median(per)))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"params": args.params, "steps": args.steps, "options": args.options_dict,
                       "builds": dict(args.builds), "runs": runs, "summary": summary}, f,
                      indent=1)
    return 0
