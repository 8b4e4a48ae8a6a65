"""A Module job driven the way MXNet's example/image-classification/common/fit.py drives it.

kvstore created by name, data sharded by kv.rank / kv.num_workers, an lr schedule whose
epoch size depends on 'dist' in the kvstore's name, Module.fit with eval data, a
Speedometer and do_checkpoint; then every rank dumps what Module hands back.
    python -m slimgc_mx.launch -n 2 -s 2 python tests/module_job.py --kv-store dist_sync_slimgc --out DIR
"""
import mxnet as mx  # servers and the scheduler enter their loop here

import argparse
import json
import logging
import os

import numpy as np

import slimgc_mx  # noqa: F401  (registers the kvstore names)


def network():
    data = mx.sym.Variable("data")
    h = mx.sym.FullyConnected(data, num_hidden=64, name="fc1")
    h = mx.sym.Activation(h, act_type="relu")
    h = mx.sym.FullyConnected(h, num_hidden=10, name="fc2")
    return mx.sym.SoftmaxOutput(h, name="softmax")


def data(args, rank, workers):
    rng = np.random.RandomState(7)
    x = rng.randn(args.num_examples, 40).astype(np.float32)
    y = (x[:, :10].argmax(axis=1)).astype(np.float32)
    part = slice(rank, None, workers)  # as fit.py's iterators: num_parts, part_index
    train = mx.io.NDArrayIter(x[part], y[part], args.batch_size, shuffle=False)
    val = mx.io.NDArrayIter(x[:200], y[:200], args.batch_size)
    return train, val


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--kv-store", default="dist_sync_slimgc")
    p.add_argument("--fit-kvstore", choices=["object", "name"], default="object",
                   help="hand Module.fit the kvstore object (as fit.py does) or its name")
    p.add_argument("--contexts", type=int, default=1)
    p.add_argument("--num-epochs", type=int, default=2)
    p.add_argument("--num-examples", type=int, default=1280)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    if args.fit_kvstore == "object":
        kv = mx.kvstore.create(args.kv_store)
        rank, workers = kv.rank, kv.num_workers
    else:  # Module creates the store; shard by the launch index meanwhile
        kv = None
        rank = int(os.environ.get("SLIMGC_LAUNCH_INDEX", "0"))
        workers = int(os.environ.get("DMLC_NUM_WORKER", "1"))
    logging.basicConfig(level=logging.INFO, format="Node[%d] %%(message)s" % rank)
    train, val = data(args, rank, workers)
    epoch_size = args.num_examples / args.batch_size
    if "dist" in args.kv_store:
        epoch_size /= workers
    scheduler = mx.lr_scheduler.MultiFactorScheduler(step=[int(epoch_size)], factor=0.5)
    mx.random.seed(11)
    devs = [mx.cpu(i) for i in range(args.contexts)]
    model = mx.mod.Module(context=devs, symbol=network())
    prefix = os.path.join(args.out, "model-%d" % rank)
    os.makedirs(args.out, exist_ok=True)
    model.fit(train, eval_data=val, eval_metric="accuracy",
              kvstore=kv if args.fit_kvstore == "object" else args.kv_store,
              optimizer="sgd",
              optimizer_params={"learning_rate": args.lr, "momentum": 0.9, "wd": 1e-4,
                                "lr_scheduler": scheduler},
              initializer=mx.init.Xavier(rnd_type="gaussian", factor_type="in", magnitude=2),
              num_epoch=args.num_epochs,
              batch_end_callback=mx.callback.Speedometer(args.batch_size, 10),
              epoch_end_callback=mx.callback.do_checkpoint(prefix))
    arg_params, _ = model.get_params()
    score = dict(model.score(val, "accuracy"))
    used = model._kvstore
    info = {"rank": used.rank, "num_workers": used.num_workers, "type": used.type,
            "kvstore_class": type(used).__name__,
            "rescale_grad": model._optimizer.rescale_grad, "accuracy": score["accuracy"],
            "checkpoint": "%s-%04d.params" % (prefix, args.num_epochs)}
    np.savez(os.path.join(args.out, "params_rank%d.npz" % used.rank),
             **{k: v.asnumpy() for k, v in arg_params.items()})
    with open(os.path.join(args.out, "rank%d.json" % used.rank), "w") as f:
        json.dump(info, f)


if __name__ == "__main__":
    main()
