"""A short Gluon job for the multi-process tests: train N steps, dump the weights per rank.

Run under the launcher; every role runs this file, servers stop at `import mxnet`.
    python -m slimgc_mx.launch -n 2 -s 2 python tests/dist_job.py --kvstore slimgc --out DIR
"""
import argparse
import hashlib
import json
import os

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import slimgc_mx


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--kvstore", default="slimgc", choices=["slimgc", "dist_sync"])
    p.add_argument("--compressor", default="none")
    p.add_argument("--comm-threshold", default="auto")
    p.add_argument("--no-backup", action="store_true")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--record-lanes", action="store_true",
                   help="save every compressed transfer's sent and summed lanes")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    kv = mx.kv.create(args.kvstore)
    rank = kv.rank
    lanes = {}
    if args.record_lanes:
        _record_lanes(kv, lanes)
    mx.random.seed(42)
    rng = np.random.RandomState(100 + rank)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(64, activation="relu"), gluon.nn.Dense(10))
    net.initialize(mx.init.Xavier())
    x = mx.nd.array(rng.randn(args.steps, 16, 32))
    y = mx.nd.array(rng.randint(0, 10, size=(args.steps, 16)))
    net(x[0])
    compression = None
    if args.kvstore == "slimgc":
        ct = args.comm_threshold
        compression = {"type": args.compressor, "backup": not args.no_backup,
                       "comm_threshold": ct if ct in ("auto", "off") else int(ct),
                       "warmup_steps": 4}
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": args.lr,
                                                          "momentum": args.momentum},
                            kvstore=kv, compression_params=compression)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for step in range(args.steps):
        with autograd.record():
            loss = loss_fn(net(x[step]), y[step])
        loss.backward()
        trainer.step(16)
    if args.kvstore == "slimgc":
        slimgc_mx.flush(trainer)
    weights = {name: p.data().asnumpy() for name, p in net.collect_params().items()}
    digest = hashlib.sha256(b"".join(w.tobytes() for _, w in sorted(weights.items())))
    os.makedirs(args.out, exist_ok=True)
    np.savez(os.path.join(args.out, "weights_rank%d.npz" % rank), **weights)
    info = {"rank": rank, "num_workers": kv.num_workers, "sha256": digest.hexdigest()}
    if args.kvstore == "slimgc":
        info["stats"] = trainer._kvstore.stats()
        info["lanes32"] = trainer._kvstore._agg.lanes32
        probe = [2.0 ** 52 - 1 - rank, -1.5e300, 0.1, float("nan")]  # not float32-exact
        got = trainer._kvstore._ensure_transport().allgather(probe)
        expected = [[2.0 ** 52 - 1 - r, -1.5e300, 0.1, float("nan")] for r in range(len(got))]
        info["allgather_exact"] = bool(np.array_equal(got, expected, equal_nan=True))
        info["bigarray_bound"] = trainer._kvstore._ensure_transport().bigarray_bound
    if lanes:
        np.savez(os.path.join(args.out, "lanes_rank%d.npz" % rank), **lanes)
    with open(os.path.join(args.out, "rank%d.json" % rank), "w") as f:
        json.dump(info, f)


def _record_lanes(kv, lanes):
    """Wrap the transport: keep a copy of each float64 push and of the sum pulled back."""
    transport = kv._ensure_transport()
    push_pull = transport.push_pull
    counts = {}

    def recording(wire_key, send, recv, priority=0, in_pieces=False):
        if send.nd.dtype != np.float64:
            return push_pull(wire_key, send, recv, priority, in_pieces)
        n = counts[wire_key] = counts.get(wire_key, -1) + 1
        name = "%d_%d" % (wire_key, n)
        if in_pieces:  # a streamed push: engine operators are writing its pieces; copy each
            # by an operator after its writer, so that each piece is still pushed when encoded
            copies = [piece.copy() for piece in send.pieces(transport.pieces(wire_key))]
        else:
            lanes["send_" + name] = send.for_read().copy()  # before the pull overwrites it
        handle = push_pull(wire_key, send, recv, priority, in_pieces)
        wait = handle.wait

        def waited():
            wait()
            if in_pieces:
                lanes["send_" + name] = np.concatenate([c.asnumpy() for c in copies])
            lanes["sum_" + name] = recv.for_read().copy()
        handle.wait = waited
        return handle
    transport.push_pull = recording


if __name__ == "__main__":
    main()
