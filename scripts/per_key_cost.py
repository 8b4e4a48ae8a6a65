#!/usr/bin/env python
"""CPU cost per key of the operations SlimGC runs for every key and step.

Many-small-tensor models (ResNet-20: 65 tensors) pay these per key, where
MXNet's own kvstore pays one C++ push and pull. All rows are measured side by
side in one run, on one small tensor, so the size of the work does not hide the
per-call cost:

    python scripts/per_key_cost.py --elements 64 --calls 2000
"""
import mxnet as mx  # noqa: E402  (first, like every script of this project)

import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from slimgc_mx import codecs  # noqa: E402
from slimgc_mx.mxnet.update import LocalUpdater, clone_optimizer  # noqa: E402
from slimgc_mx.mxnet.sgd import SGDKernel  # noqa: E402
from slimgc_mx.mxnet.buffers import Buffer  # noqa: E402
from slimgc_mx.mxnet.engine import EngineNotifier  # noqa: E402


def measure(fn, calls):
    """(CPU microseconds, wall microseconds) per call of `fn`, engine work included."""
    fn()
    mx.nd.waitall()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(calls):
        fn()
    mx.nd.waitall()
    return ((time.process_time() - cpu) / calls * 1e6, (time.perf_counter() - wall) / calls * 1e6)


FUSED_KEYS = 16  # keys per multi-tensor update in the fused row


def operations(n):
    """name -> (callable, keys it serves): each per-key operation on n-element tensors."""
    w, g, mom, out = mx.nd.ones(n), mx.nd.ones(n), mx.nd.zeros(n), mx.nd.zeros(n)
    opt = mx.optimizer.SGD(learning_rate=0.01, momentum=0.9, rescale_grad=1 / 32)
    updater = mx.optimizer.get_updater(clone_optimizer(opt))
    many = mx.optimizer.get_updater(clone_optimizer(opt))
    ws = [mx.nd.ones(n) for _ in range(FUSED_KEYS)]
    gs = [mx.nd.ones(n) for _ in range(FUSED_KEYS)]
    indices = list(range(FUSED_KEYS))
    engine = EngineNotifier()
    kernel_updater = mx.optimizer.get_updater(clone_optimizer(opt))
    kernel = SGDKernel(kernel_updater, num_threads=1)
    local = LocalUpdater(opt, 2, global_updater=kernel_updater, kernel=kernel, engine=engine)
    agg, glo, grad, loc = (Buffer((n,), np.float32) for _ in range(4))
    codec = codecs.create("2bit", num_threads=1)  # a compressed key: 2 workers' lanes summed
    lanes = Buffer((codec.lane_count(n, 2),), codec.wire_dtype)
    grad_values = np.random.RandomState(0).randn(n).astype(np.float32)  # varied levels
    codec.encode(grad_values, np.zeros(n, np.float32), 2, out=lanes.for_write())
    lanes.for_write()[:] *= 2

    def decode_then_update():
        codec.decode(lanes.for_read(), n, 2, out=agg.for_write())
        kernel.global_step([1], [agg], [glo])

    return {
        "global update (MXNet Updater)": (lambda: updater(0, g, w), 1),
        "global update, %d keys per call" % FUSED_KEYS: (lambda: many(indices, gs, ws),
                                                         FUSED_KEYS),
        "global update (SGD kernel)": (lambda: kernel.global_step([0], [agg], [glo]), 1),
        "2bit decode, then global update": (decode_then_update, 1),
        "2bit decode inside global update": (lambda: kernel.global_step_decoding(
            1, lanes, codec.decode_table(lanes.for_read(), n, 2), glo), 1),
        "sgd_mom_update op alone": (lambda: mx.nd.sgd_mom_update(
            w, g, mom, out=out, lr=0.01, wd=0.0, momentum=0.9, rescale_grad=1 / 32), 1),
        "local update (SGD kernel, engine)": (lambda: local(1, grad, glo, loc), 1),
        "NDArray copyto": (lambda: g.copyto(out), 1),
        "_copy operator (copy_array, large)": (lambda: mx.nd.identity(g, out=out), 1),
        "engine callback (when_readable)": (lambda: engine.when_readable(grad, lambda: None), 1),
        "finite check (numpy)": (lambda: np.isfinite(agg.for_read()).all(), 1),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--elements", type=int, default=64, help="tensor size in float32 elements")
    p.add_argument("--calls", type=int, default=2000, help="calls per operation")
    args = p.parse_args(argv)
    if args.elements < 1 or args.calls < 1:
        p.error("--elements and --calls must be at least 1")
    print("%-34s %14s %14s" % ("operation (%d elements)" % args.elements, "CPU us/key",
                               "wall us/key"))
    results = {}
    for name, (fn, keys) in operations(args.elements).items():
        cpu, wall = measure(fn, args.calls)
        results[name] = cpu, wall = cpu / keys, wall / keys
        print("%-34s %14.1f %14.1f" % (name, cpu, wall))
    return results


if __name__ == "__main__":
    main()
