"""MXNet's classic KVStore calls (init, push, pull, pushpull, row_sparse_pull), with and
without an optimizer, on whichever kvstore is named; every rank dumps what it pulled.

    python -m slimgc_mx.launch -n 2 -s 2 python tests/classic_job.py --kvstore dist_sync --out DIR
"""
import mxnet as mx  # servers and the scheduler enter their loop here

import argparse
import os

import numpy as np

import slimgc_mx  # noqa: F401  (registers the kvstore names)

SHAPE = (6, 5)
ROUNDS = 25  # more than the CTTab's warm-up of 20 steps


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--kvstore", default="dist_sync")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    kv = mx.kv.create(args.kvstore)
    rank, n = kv.rank, kv.num_workers
    got = {}

    # plain sums: one key, a list of keys, per-device values, priorities
    kv.init(3, mx.nd.ones(SHAPE))
    kv.init([1, 2], [mx.nd.zeros(SHAPE), mx.nd.zeros((1000,))])  # MXNet: one key type
    out = mx.nd.zeros(SHAPE)
    kv.pull(3, out=out)
    got["initial"] = out.asnumpy()
    for r in range(ROUNDS):
        value = (rank + 1) * (r + 1) * 37.0 + np.arange(30).reshape(SHAPE) / 7.0
        kv.push(3, mx.nd.array(value), priority=r % 3)
        devices = [mx.nd.full(SHAPE, 0.25 * (rank + d)) for d in range(2)]
        kv.push([1, 2], [devices, mx.nd.arange(1000) * (rank + 1) / 3.0])
        kv.pull(3, out=out)
        got["sum_%d" % r] = out.asnumpy()
        outs = [mx.nd.zeros(SHAPE), mx.nd.zeros((1000,))]
        kv.pull([1, 2], out=outs)
        got["devices_%d" % r], got["list_%d" % r] = outs[0].asnumpy(), outs[1].asnumpy()
        both = mx.nd.full(SHAPE, 1.0 + rank)
        kv.pushpull(1, both, out=both)
        got["pushpull_%d" % r] = both.asnumpy()

    # rows of a value (a row_sparse key on dist_sync, a dense one on slimgc)
    init = mx.nd.array(np.arange(30).reshape(SHAPE))
    kv.init(9, init.tostype("row_sparse") if args.kvstore == "dist_sync" else init)
    grad = mx.nd.array(np.ones(SHAPE) * (rank + 1))
    kv.push(9, grad.tostype("row_sparse") if args.kvstore == "dist_sync" else grad)
    rows = mx.nd.sparse.zeros("row_sparse", SHAPE)
    kv.row_sparse_pull(9, out=rows, row_ids=mx.nd.array([1, 4]))
    got["rows"] = rows.asnumpy()

    # with an optimizer: the value is the weights
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=1e-3,
                                      rescale_grad=1.0 / n))
    kv.init(5, mx.nd.ones(SHAPE) * 0.5)
    weights = mx.nd.zeros(SHAPE)
    for r in range(ROUNDS):
        kv.push(5, mx.nd.array(np.sin(np.arange(30) + r + rank).reshape(SHAPE)))
        kv.pull(5, out=weights)
        got["weights_%d" % r] = weights.asnumpy()
    os.makedirs(args.out, exist_ok=True)
    np.savez(os.path.join(args.out, "rank%d.npz" % rank), **got)


if __name__ == "__main__":
    main()
