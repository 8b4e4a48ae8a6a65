#!/usr/bin/env python
"""Does a codec at its defaults train? Every tensor compressed, loss before and after, per rank.

A plain gluon.Trainer trains a small MLP with BatchNorm (64-128-64-10) on sklearn's digits,
each worker on its own shard, through the SlimGC kvstore with comm_threshold='off' (SGD,
lr 0.01, momentum 0.9; dgc's own momentum instead), and prints each rank's loss on its
shard before and after training. Under the launcher (one worker per process, MXNet's
servers):

    python -m slimgc_mx.launch -n 2 -s 2 python scripts/defaults_check.py --codec qsgd

or with --threads N, N workers as threads of this process (no servers; what the tests run).
--option NAME=VALUE sets a codec option; --dataset, --hidden, --batch, --lr, --momentum and
--steps change the job, and --comm-threshold BYTES sends smaller tensors in full precision.
Each rank's line also says whether the residual watch warned that compression is wrecking
training (slimgc_mx/engine/residual_watch.py). The exit status is 1 when some rank's final loss
is not below --fraction of its initial loss. docs/codecs.md, "Defaults that train" and
"Compression that wrecks training", has the results.
"""
import os
import sys

# Scheduler and server processes of a dist job enter their loop inside `import mxnet`
# and exit there, so for them it comes before anything heavy. A worker (or --threads) parses
# its flags first, so that a bad one is refused without importing MXNet (_import_mxnet).
if os.environ.get("DMLC_ROLE") in ("scheduler", "server"):
    __import__("mxnet")  # does not return

import argparse  # noqa: E402
import threading  # noqa: E402
from collections import namedtuple  # noqa: E402

import numpy as np  # noqa: E402

#: MXNet and its modules, once _import_mxnet() has run.
mx = autograd = gluon = None

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import slimgc_mx  # noqa: E402
from slimgc_mx import codecs  # noqa: E402
from slimgc_mx.bench import datasets, jobtools  # noqa: E402

#: The job's fixed settings: not tuned per codec.
BATCH, LR, MOMENTUM, STEPS, FRACTION = 32, 0.01, 0.9, 100, 0.5
DATASET, HIDDEN = "digits", (128, 64)
_INIT_LOCK = threading.Lock()  # worker threads must not share a global RNG while seeding
#: One rank's result: loss on its shard before and after, and the residual watch's message
#: (the kvstore's stats()["residual_growth"]), None when it stayed silent.
Outcome = namedtuple("Outcome", "before after residual_growth")


def _import_mxnet():
    """Import MXNet (and register SlimGC's kvstore with it) into this module's names."""
    global mx, autograd, gluon
    import mxnet as mx
    from mxnet import autograd, gluon


def make_net(inputs, hidden=HIDDEN, seed=0):
    """inputs-hidden...-10 with BatchNorm after each hidden Dense."""
    with _INIT_LOCK:
        mx.random.seed(seed)
        net = gluon.nn.HybridSequential(prefix="check_")
        with net.name_scope():
            for width in hidden:
                net.add(gluon.nn.Dense(width), gluon.nn.BatchNorm(), gluon.nn.Activation("relu"))
            net.add(gluon.nn.Dense(10))
        net.initialize(mx.init.Xavier())
        net(mx.nd.zeros((1, inputs)))
        mx.nd.waitall()
    return net


def shard_loss(net, x, y):
    """Mean softmax cross-entropy over the shard (inference mode: BatchNorm's running stats)."""
    loss = gluon.loss.SoftmaxCrossEntropyLoss()(net(mx.nd.array(x)), mx.nd.array(y))
    return float(loss.mean().asscalar())


def train_rank(kv, codec, options=None, steps=STEPS, lr=LR, momentum=MOMENTUM, dataset=DATASET,
               hidden=HIDDEN, batch=BATCH, comm_threshold="off"):
    """Train on this rank's shard through `kv` with `codec` (its defaults updated by
    `options`), compressing tensors of at least `comm_threshold` bytes ('off': all); an
    Outcome. dgc applies momentum itself, so its optimizer's is 0 and the codec's default
    stands in for it."""
    rank, workers = kv.rank, kv.num_workers
    with _INIT_LOCK:  # mnist1d's generator reseeds NumPy's global RNG: one thread at a time
        data = datasets.load(dataset, rank=rank, num_workers=workers)
    x, y = data.x_train.reshape(len(data.y_train), -1), data.y_train
    net = make_net(x.shape[1], hidden)
    before = shard_loss(net, x, y)
    params = dict({"type": codec, "comm_threshold": comm_threshold}, **(options or {}))
    opt_momentum = 0.0 if codecs.create(codec, reference=True).traits.owns_momentum else momentum
    trainer = gluon.Trainer(net.collect_params(), "sgd",
                            {"learning_rate": lr, "momentum": opt_momentum},
                            kvstore=kv, compression_params=params)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    order = np.random.RandomState(rank).permutation(len(y))
    for step in range(steps):
        idx = order[np.arange(step * batch, (step + 1) * batch) % len(y)]
        with autograd.record():
            loss = loss_fn(net(mx.nd.array(x[idx])), mx.nd.array(y[idx]))
        loss.backward()
        trainer.step(batch * workers)
    slimgc_mx.flush(trainer)
    return Outcome(before, shard_loss(net, x, y), kv.stats()["residual_growth"])


def in_threads(workers, codec, options=None, **job):
    """train_rank(**job) on `workers` threads sharing a ThreadGroup transport; an Outcome
    per rank."""
    _import_mxnet()
    from slimgc_mx.mxnet.kvstore import SlimGC
    from slimgc_mx.transport import ThreadGroup
    group = ThreadGroup(workers)
    results, errors = [None] * workers, []

    def run(rank):
        try:
            kv = SlimGC(transport=group.transport(rank), timeout=120)
            results[rank] = train_rank(kv, codec, options, **job)
            kv.close()
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def option(text):
    """--option NAME=VALUE: one codec option (parsed and checked by the codec)."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError("expected NAME=VALUE, e.g. levels=16, got %r" % text)
    return name, value


def widths(text):
    """--hidden 128,64: the hidden layers' widths."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("expected widths >= 1 separated by commas, e.g. "
                                         "128,64, got %r" % text)
    return values


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--codec", required=True, choices=codecs.available())
    p.add_argument("--option", type=option, action="append", default=[], metavar="NAME=VALUE",
                   help="a codec option over its default (repeatable)")
    p.add_argument("--steps", type=int, default=STEPS, help="steps per worker (%(default)s)")
    p.add_argument("--batch", type=int, default=BATCH, help="samples per worker and step "
                   "(%(default)s)")
    p.add_argument("--lr", type=float, default=LR, help="SGD learning rate (%(default)s)")
    p.add_argument("--momentum", type=float, default=MOMENTUM,
                   help="SGD momentum (%(default)s; dgc's optimizer always has 0)")
    p.add_argument("--dataset", default=DATASET, choices=("digits", "mnist1d"),
                   help="training set (%(default)s)")
    p.add_argument("--hidden", type=widths, default=HIDDEN, metavar="W,W,...",
                   help="hidden widths (%s)" % ",".join(map(str, HIDDEN)))
    p.add_argument("--comm-threshold", type=jobtools.comm_threshold, default="off",
                   metavar="BYTES", help="compress tensors of at least BYTES; 'off' (the "
                   "default): every tensor, the check's setting (as for scripts/train.py)")
    p.add_argument("--fraction", type=float, default=FRACTION,
                   help="final loss must be below this fraction of the initial (%(default)s)")
    p.add_argument("--threads", type=int, default=0, metavar="N",
                   help="run N workers as threads of this process instead of under the "
                        "launcher")
    args = p.parse_args(argv)
    options = dict(args.option)
    try:
        codecs.create(args.codec, reference=True, **options)
    except ValueError as exc:
        p.error(str(exc))
    job = dict(steps=args.steps, lr=args.lr, momentum=args.momentum, dataset=args.dataset,
               hidden=args.hidden, batch=args.batch, comm_threshold=args.comm_threshold)
    if args.threads:
        runs = list(enumerate(in_threads(args.threads, args.codec, options, **job)))
    else:
        _import_mxnet()
        kv = mx.kv.create("slimgc")
        runs = [(kv.rank, train_rank(kv, args.codec, options, **job))]
    ok = True
    for rank, (before, after, growth) in runs:
        trained = after < args.fraction * before
        ok = ok and trained
        print("rank %d: %s %s: loss %.3f -> %.3f after %d steps%s; residual watch: %s"
              % (rank, args.codec, options or "defaults", before, after, args.steps,
                 "" if trained else " (NOT TRAINED)", "WARNED" if growth else "silent"),
              flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
