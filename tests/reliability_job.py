"""A small SlimGC job for the reliability tests: every role runs this file.

Servers and the scheduler enter MXNet's server loop at `import mxnet` and never
return; workers train an MLP on synthetic data that depends only on (rank, step),
so a run resumed from a checkpoint sees the same batches as an uninterrupted one.

Before importing MXNet every process writes its pid to OUT/pids/ROLE-INDEX.pid
(INDEX: SLIMGC_LAUNCH_INDEX), so a test knows which pid is which process.

    python -m slimgc_mx.launch -n 2 -s 2 python tests/reliability_job.py --out DIR --steps 100
"""
import os
import sys


def _diagnostics():
    """SIGUSR1 dumps every thread's Python stack to stderr (to see where a process hangs)."""
    import faulthandler
    import signal
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def _write_pid():
    out = None
    for i, a in enumerate(sys.argv):
        if a == "--out" and i + 1 < len(sys.argv):
            out = sys.argv[i + 1]
        elif a.startswith("--out="):
            out = a.split("=", 1)[1]
    if out is None:
        return
    pids = os.path.join(out, "pids")
    os.makedirs(pids, exist_ok=True)
    name = "%s-%s.pid" % (os.environ.get("DMLC_ROLE", "none"),
                          os.environ.get("SLIMGC_LAUNCH_INDEX", "0"))
    with open(os.path.join(pids, name + ".tmp"), "w") as f:
        f.write("%d\n" % os.getpid())
    os.replace(os.path.join(pids, name + ".tmp"), os.path.join(pids, name))


_diagnostics()
_write_pid()

import mxnet as mx  # noqa: E402  (servers and the scheduler stop here)

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import numpy as np  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import slimgc_mx  # noqa: E402


_KEEP = []


def batch(rank, step, batch_size=16, features=32, classes=10):
    """The batch of `rank` at global step `step`: fixed, whatever run computes it."""
    rng = np.random.RandomState(1000003 * (rank + 1) + step)
    x = rng.randn(batch_size, features).astype(np.float32)
    y = rng.randint(0, classes, size=batch_size).astype(np.float32)
    return mx.nd.array(x), mx.nd.array(y)


def checksum(net):
    h = hashlib.sha256()
    for name, p in sorted(net.collect_params().items()):
        h.update(p.data().asnumpy().tobytes())
    return h.hexdigest()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=20, help="global step to stop at")
    p.add_argument("--start", type=int, default=0,
                   help="global step to start at (a resumed run: load --load-dir first)")
    p.add_argument("--compressor", default="2bit")
    p.add_argument("--threshold", type=float, default=0.05)
    p.add_argument("--comm-threshold", default="off")
    p.add_argument("--no-backup", action="store_true")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--save-at", type=int, default=None,
                   help="after this many global steps: flush, save states and params")
    p.add_argument("--save-dir", default=None)
    p.add_argument("--load-dir", default=None)
    p.add_argument("--print-every", type=int, default=10)
    p.add_argument("--sleep", type=float, default=0.0, help="seconds per step (pacing)")
    p.add_argument("--on-error", choices=("exit", "skip-finalize", "os-exit"), default="exit",
                   help="after a training error: exit normally (MXNet finalizes the dist "
                        "kvstore), keep MXNet's kvstore alive so it is never finalized, or "
                        "os._exit at once")
    p.add_argument("--error-wait-peers", type=float, default=0.0,
                   help="after a training error, wait up to this many seconds for every "
                        "worker's rankN.json before exiting (so a test sees all of them)")
    p.add_argument("--nan-at", type=int, default=None,
                   help="rank 1 multiplies its loss by NaN at this global step")
    args = p.parse_args()

    kv = mx.kv.create("slimgc")
    rank = kv.rank
    mx.random.seed(7)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(64, activation="relu"), gluon.nn.Dense(10))
    net.initialize(mx.init.Xavier())
    net(batch(rank, 0)[0])
    ct = args.comm_threshold
    compression = {"type": args.compressor, "threshold": args.threshold,
                   "backup": not args.no_backup, "warmup_steps": 4,
                   "comm_threshold": ct if ct in ("auto", "off") else int(ct)}
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": args.lr,
                                                          "momentum": 0.9},
                            kvstore=kv, compression_params=compression)
    if args.load_dir:
        net.load_parameters(os.path.join(args.load_dir, "rank%d.params" % rank))
        trainer.load_states(os.path.join(args.load_dir, "rank%d.states" % rank))
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    info = {"rank": rank, "launch_index": os.environ.get("SLIMGC_LAUNCH_INDEX"),
            "pid": os.getpid(), "losses": []}
    print("rank %d ready pid %d" % (rank, os.getpid()), flush=True)
    step = args.start
    try:
        for step in range(args.start, args.steps):
            x, y = batch(rank, step)
            with autograd.record():
                loss = loss_fn(net(x), y)
                if args.nan_at == step and rank == 1:
                    loss = loss * float("nan")
            loss.backward()
            trainer.step(x.shape[0])
            if args.print_every and (step + 1) % args.print_every == 0:
                info["losses"].append(float(loss.mean().asscalar()))
                print("rank %d step %d" % (rank, step + 1), flush=True)
            if args.save_at is not None and step + 1 == args.save_at:
                slimgc_mx.flush(trainer)
                os.makedirs(args.save_dir, exist_ok=True)
                trainer.save_states(os.path.join(args.save_dir, "rank%d.states" % rank))
                net.save_parameters(os.path.join(args.save_dir, "rank%d.params" % rank))
            if args.sleep:
                time.sleep(args.sleep)
        slimgc_mx.flush(trainer)
    except Exception as exc:  # the test reads what the training thread raised
        info.update(error_type=type(exc).__name__, error=str(exc), error_step=step,
                    error_cause=type(exc.__cause__).__name__ if exc.__cause__ else None,
                    t_error=time.time())
        info.update(_global_state(trainer._kvstore))
        print("TRAINING-ERROR rank %d step %d %s: %s" % (rank, step, type(exc).__name__, exc),
              flush=True)
        traceback.print_exc()
        _dump(args.out, rank, info)
        deadline = time.time() + args.error_wait_peers
        while time.time() < deadline and not all(
                os.path.exists(os.path.join(args.out, "rank%d.json" % r))
                for r in range(kv.num_workers)):
            time.sleep(0.05)
        print("rank %d exiting after the error (%s)" % (rank, args.on_error), flush=True)
        if args.on_error == "os-exit":
            sys.stderr.flush()
            os._exit(3)
        if args.on_error == "skip-finalize":
            # What a kvstore-side fix could do: never free MXNet's dist kvstore handle
            # (its destructor waits in ps-lite's finalize barrier for the dead peer).
            _KEEP.append(getattr(trainer._kvstore._transport, "_kv", None))
        sys.exit(3)
    weights = {name: p.data().asnumpy() for name, p in net.collect_params().items()}
    np.savez(os.path.join(args.out, "weights_rank%d.npz" % rank), **weights)
    info.update(sha256=checksum(net), steps=args.steps)
    _dump(args.out, rank, info)
    print("rank %d done sha256 %s" % (rank, info["sha256"]), flush=True)


def _global_state(kv):
    """Versions and checksum of the global weights (glo_buf) as they are after an error."""
    agg = getattr(kv, "_agg", None)
    if agg is None:
        return {}
    backup = agg.backup
    h = hashlib.sha256()
    finite = True
    versions = []
    for key in sorted(agg.planner.keys):
        w = backup.glo_buf(key).asnumpy()
        finite = finite and bool(np.isfinite(w).all())
        h.update(w.tobytes())
        versions.append(backup.version(key))
    return {"glo_versions": versions, "glo_sha256": h.hexdigest(), "glo_finite": finite}


def _dump(out, rank, info):
    # Written whole, then renamed: a peer polls for this file and exits once it exists, and the
    # launcher's SIGTERM that follows must not find it half written.
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "rank%d.json" % rank)
    with open(path + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
