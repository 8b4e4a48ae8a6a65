#!/usr/bin/env python
"""Shared scales from the last push or from the same step: the effect on accuracy.

terngrad, qsgd and thc quantize with a scale every worker must share (a max or per-bucket
norms). The codecs agree on it through the previous push's gathered statistics: no extra
round trip, but the scale lags one step and what it clamps waits in the residual. This
simulation trains one model data-parallel on N workers in one process (NumPy only, hand-
written gradients) and compares, per codec, that last-push scale with the exact same-step
scale (the maximum over the workers of this step's statistic, which a simulation that sees
every worker can set before encoding), and with full precision:

    python scripts/simulate_agreement.py                      # mnist1d, MLP, 4 workers
    python scripts/simulate_agreement.py --dataset digits --epochs 10 --seeds 1

The table gives the final test accuracy (mean and spread over seeds) and the mean
relative error of the aggregated gradient against the exact mean gradient.
"""
import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from slimgc_mx import codecs  # noqa: E402
from slimgc_mx.bench import datasets  # noqa: E402
from slimgc_mx.codecs import NonFiniteGradientError  # noqa: E402
from slimgc_mx.codecs.rng import key_seed  # noqa: E402

VARIANTS = ("last push", "same step")


# ---------------------------------------------------------------- the model
def init_mlp(sizes, seed):
    """float32 [W1, b1, W2, b2, ...]: He-normal weights, zero biases."""
    rng = np.random.default_rng(seed)
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        params.append((rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in))
                      .astype(np.float32))
        params.append(np.zeros(fan_out, np.float32))
    return params


def forward(params, x):
    """Logits, and the hidden activations the backward pass needs."""
    acts = [x]
    h = x
    for i in range(0, len(params) - 2, 2):
        h = np.maximum(h @ params[i] + params[i + 1], 0)
        acts.append(h)
    return h @ params[-2] + params[-1], acts


def gradients(params, x, y):
    """(mean softmax cross-entropy, its gradients) on a batch."""
    logits, acts = forward(params, x)
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    loss = -np.mean(np.log(p[np.arange(len(y)), y] + 1e-12))
    d = p
    d[np.arange(len(y)), y] -= 1
    d /= len(y)
    grads = [None] * len(params)
    for i in range(len(params) - 2, -1, -2):
        grads[i] = (acts[i // 2].T @ d).astype(np.float32)
        grads[i + 1] = d.sum(axis=0).astype(np.float32)
        if i:
            d = (d @ params[i].T) * (acts[i // 2] > 0)
    return loss, grads


def accuracy(params, x, y):
    return float(np.mean(forward(params, x)[0].argmax(axis=1) == y))


# ---------------------------------------------------------------- aggregation
class Aggregator:
    """Averages N workers' gradients of one tensor through a codec, as the kvstore does:
    one residual per worker, the wires summed as the servers sum them, one decode (the
    codec's shared state is the same on every worker, so one instance serves them all)."""

    def __init__(self, spec, key, size, num_workers, job_seed, same_step):
        name, options = spec
        self.codec = codecs.create(name, num_threads=1, **options)
        self.codec.seed = key_seed(job_seed, key)
        self.size, self.n = size, num_workers
        self.same_step = same_step
        self.residuals = [np.zeros(size, np.float32) for _ in range(num_workers)]
        self.wires = [np.empty(self.codec.lane_count(size, num_workers)) for _ in
                      range(num_workers)]

    def _gathered(self, wires):
        """(N, t): every worker's own gathered statistic, from its slot of its wire."""
        t = self.codec.gathered_count(self.size)
        return np.stack([w[len(w) - self.n * t:].reshape(self.n, t)[j]
                         for j, w in enumerate(wires)])

    def mean(self, grads):
        c, n = self.codec, self.n
        if self.same_step:
            # Encode on copies to learn this step's statistics, then agree on them before
            # the real encode: the scale a same-step agreement would use.
            dry = [c.encode(g, r.copy(), n, rank=j)
                   for j, (g, r) in enumerate(zip(grads, self.residuals))]
            c._agree(self._gathered(dry))
        for j, (g, r, w) in enumerate(zip(grads, self.residuals, self.wires)):
            c.encode(g, r, n, out=w, rank=j)
        total = np.zeros_like(self.wires[0])
        for w in self.wires:
            total += w
        return c.decode(total, self.size, n) / np.float32(n)


# ---------------------------------------------------------------- one training run
def train(spec, same_step, shards, test, args, seed):
    """(final test accuracy, mean relative gradient error, the step at which training
    diverged or None) of one run; a diverged run's accuracy is NaN."""
    n = args.workers
    sizes = [shards[0][0].shape[1]] + [args.hidden] * args.layers + [10]
    params = init_mlp(sizes, seed)
    moms = [np.zeros_like(p) for p in params]
    aggs = None if spec is None else [
        Aggregator(spec, k, p.size, n, seed, same_step) for k, p in enumerate(params)]
    rng = np.random.default_rng(seed + 1)
    steps = min(len(x) for x, _ in shards) // args.batch
    errors = []
    try:
        with np.errstate(over="ignore", invalid="ignore"):
            _train_epochs(params, moms, aggs, shards, steps, rng, errors, args)
    except NonFiniteGradientError:
        return float("nan"), _mean(errors), len(errors) // len(params)
    return accuracy(params, *test), _mean(errors), None


def _mean(errors):
    """Mean of the finite relative errors (0 for full precision)."""
    finite = [e for e in errors if np.isfinite(e)]
    return float(np.mean(finite)) if finite else 0.0


def _train_epochs(params, moms, aggs, shards, steps, rng, errors, args):
    """Momentum SGD with a cosine learning rate; raises NonFiniteGradientError when a
    gradient stops being finite (the codecs refuse it)."""
    for epoch in range(args.epochs):
        orders = [rng.permutation(len(x)) for x, _ in shards]
        lr = args.lr * 0.5 * (1 + np.cos(np.pi * epoch / args.epochs))  # cosine
        for s in range(steps):
            per_worker = []
            for (x, y), order in zip(shards, orders):
                idx = order[s * args.batch:(s + 1) * args.batch]
                per_worker.append(gradients(params, x[idx], y[idx])[1])
            for k in range(len(params)):
                grads = [pw[k].ravel() for pw in per_worker]
                if not all(np.isfinite(g).all() for g in grads):
                    raise NonFiniteGradientError("a gradient of tensor %d is not finite" % k)
                exact = np.mean(grads, axis=0)
                g = exact if aggs is None else aggs[k].mean(grads)
                norm = np.linalg.norm(exact)
                if aggs is not None and norm > 0:
                    errors.append(np.linalg.norm(g - exact) / norm)
                moms[k] = args.momentum * moms[k] - lr * g.reshape(params[k].shape)
                params[k] += moms[k]


def parse_spec(text):
    """'thc' or 'thc:hadamard=true:granularity=8' -> (name, {option: value})."""
    name, *pairs = text.split(":")
    options = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if not key or not value:
            raise SystemExit("--codecs: %r: options are key=value after the name" % text)
        options[key] = value
    codecs.create(name, **options)  # the codec's own errors, before any training
    return name, options


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", choices=("mnist1d", "digits"), default="mnist1d")
    p.add_argument("--codecs", default="terngrad,qsgd,thc",
                   help="comma-separated codecs, each NAME[:OPTION=VALUE...] "
                        "(default: %(default)s)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seeds", type=int, default=3, help="runs per variant (seeds 0..)")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch", type=int, default=32, help="samples per worker and step")
    p.add_argument("--hidden", type=int, default=256, help="units per hidden layer")
    p.add_argument("--layers", type=int, default=2, help="hidden layers")
    p.add_argument("--lr", type=float, default=0.05, help="peak learning rate (cosine)")
    p.add_argument("--momentum", type=float, default=0.9)
    args = p.parse_args(argv)
    for name in ("workers", "seeds", "epochs", "batch", "hidden"):
        if getattr(args, name) < 1:
            p.error("--%s must be >= 1" % name)
    if args.layers < 0:
        p.error("--layers must be >= 0")
    args.specs = [parse_spec(s.strip()) for s in args.codecs.split(",") if s.strip()]
    return args


def run(args, out=sys.stdout):
    """Every variant over every seed; returns {(label, variant): [(accuracy, error)]}."""
    results = {}
    t0 = time.perf_counter()
    runs = [("fp32", None, None)] + [(spec_label(spec), spec, v) for spec in args.specs
                                     for v in VARIANTS]
    for seed in range(args.seeds):
        parts = [datasets.load(args.dataset, rank=r, num_workers=args.workers, seed=seed)
                 for r in range(args.workers)]
        shards = [(d.x_train.reshape(len(d.x_train), -1), d.y_train) for d in parts]
        test = (parts[0].x_test.reshape(len(parts[0].x_test), -1), parts[0].y_test)
        for label, spec, variant in runs:
            acc, err, diverged = train(spec, variant == "same step", shards, test, args, seed)
            results.setdefault((label, variant), []).append((acc, err))
            print("seed %d  %-24s %-9s  accuracy %.4f  gradient error %.3g%s  (%.0f s)"
                  % (seed, label, variant or "", acc, err,
                     "" if diverged is None else "  diverged at step %d" % diverged,
                     time.perf_counter() - t0), file=out, flush=True)
    return results


def spec_label(spec):
    name, options = spec
    return name + "".join(":%s=%s" % kv for kv in sorted(options.items()))


def table(results, args):
    """The results as a Markdown table: accuracy over the runs that finished."""
    lines = ["| codec | scale agreed | test accuracy, mean of %d seeds (min..max) | "
             "gradient error (mean) |" % args.seeds, "|---|---|---|---|"]
    for (label, variant), runs in results.items():
        acc = np.array([a for a, _ in runs])
        done = acc[np.isfinite(acc)]
        err = np.mean([e for _, e in runs])
        text = "%.4f (%.4f..%.4f)" % (done.mean(), done.min(), done.max()) if done.size else ""
        if done.size < acc.size:
            text += "%sdiverged in %d of %d" % ("; " if text else "", acc.size - done.size,
                                                acc.size)
        lines.append("| %s | %s | %s | %s |" % (label, variant or "-", text,
                                                "-" if variant is None else "%.3g" % err))
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    print("%s, %d workers, MLP %d x %d, batch %d per worker, %d epochs, momentum SGD "
          "lr %g (cosine), %d seeds" % (args.dataset, args.workers, args.layers, args.hidden,
                                        args.batch, args.epochs, args.lr, args.seeds))
    results = run(args)
    print()
    print(table(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
