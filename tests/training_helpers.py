"""Shared by the in-process kvstore tests: small seeded nets, batches, a training loop, and
workers as threads on a ThreadGroup transport."""
import threading

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import slimgc_mx
from slimgc_mx.mxnet.kvstore import SlimGC
from slimgc_mx.mxnet.buffers import Buffer
from thread_workers import in_threads  # noqa: F401  (tests call th.in_threads)

_INIT_LOCK = threading.Lock()  # worker threads must not share MXNet's RNG while seeding


def dense_net(units, seed=0, prefix=None):
    """Dense layers of `units` (ReLU between them) on 12 inputs, with seeded weights.

    With `prefix` the parameter names, hence gluon.Trainer's key order (sorted
    names), are the same for every net built, as a checkpoint needs.
    """
    with _INIT_LOCK:
        mx.random.seed(seed)
        net = gluon.nn.HybridSequential(prefix=prefix)
        with net.name_scope():
            for i, n in enumerate(units):
                net.add(gluon.nn.Dense(n, activation="relu" if i + 1 < len(units) else None))
        net.initialize(mx.init.Xavier())
        net(mx.nd.zeros((1, 12)))
        mx.nd.waitall()
    return net


def batches(steps, seed=1):
    rng = np.random.RandomState(seed)
    return [(mx.nd.array(rng.randn(8, 12)), mx.nd.array(rng.randint(0, 4, 8)))
            for _ in range(steps)]


def train(trainer, net, data):
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for x, y in data:
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        loss.asnumpy()  # waits for this forward pass, which reads the last step's weights
        trainer.step(x.shape[0])


def weights(net):
    return [p.data().asnumpy().copy() for p in net.collect_params().values()]


def slimgc_workers(num_workers, make_net, data, sgd_class=mx.optimizer.SGD, momentum=0.9,
                   piece_bytes=0, **options):
    """Train make_net() on num_workers threads through SlimGC(**options) and SGD (lr 0.1,
    `momentum`), worker r on data[r::num_workers] twice; [(weights, stats)] per rank.
    piece_bytes: the thread group's (buffers larger than this travel as pieces)."""
    def worker(rank, transport):
        net = make_net()
        kv = SlimGC(transport=transport, **options)
        trainer = gluon.Trainer(net.collect_params(),
                                sgd_class(learning_rate=0.1, momentum=momentum), kvstore=kv)
        train(trainer, net, data[rank::num_workers] * 2)
        slimgc_mx.flush(trainer)
        stats = kv.stats()
        kv.close()
        return weights(net), stats

    return in_threads(num_workers, worker, piece_bytes)


def compressed_sgd_store(transport, size):
    """(kv, w): a 2bit store with backup that compresses every key, MXNet's SGD (lr 0.1,
    momentum 0.9), and key 0 broadcast into w = ones(size)."""
    kv = SlimGC(transport=transport, compressor="2bit", comm_threshold="off",
                backup=True, timeout=30)
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9))
    w = mx.nd.ones(size)
    kv.broadcast(0, w, out=w)
    return kv, w


def buffer_of(values):
    """A CPU Buffer holding `values` (flattened to float32)."""
    buf = Buffer(values.shape, np.float32)
    buf.for_write()[:] = values.reshape(-1)
    return buf


def sgd_with_everything(momentum):
    """An SGD with lr_mult, wd_mult, weight decay, clipping and an lr schedule on index 0."""
    params = {0: mx.gluon.Parameter("w", shape=(50,), lr_mult=0.5, wd_mult=2.0)}
    return mx.optimizer.SGD(learning_rate=0.1, momentum=momentum, wd=1e-3, rescale_grad=0.25,
                            clip_gradient=2.0, param_dict=params,
                            lr_scheduler=mx.lr_scheduler.FactorScheduler(step=2, factor=0.5))


def check_workers_train_to_the_same_weights(compressor, **options):
    """Two worker threads train with `compressor` (some keys compressed after a short
    warm-up) and end with bitwise-equal, finite weights."""
    runs = slimgc_workers(2, lambda: dense_net((32, 4), 0), batches(12), compressor=compressor,
                          comm_threshold=256, warmup_steps=2, **options)
    assert runs[0][1]["compressed_transfers"] > 0
    for a, b in zip(runs[0][0], runs[1][0]):
        np.testing.assert_array_equal(a, b)
        assert np.isfinite(a).all()


def pushpull_workers(grads, shape=None, **options):
    """grads (steps, N, size): N worker threads each pushpull their gradient of every step
    through one key (of `shape`, default flat) of a SlimGC(**options) store without an
    optimizer; per rank ([the flat value returned at each step], the store's stats)."""
    steps, n, size = grads.shape
    shape = (size,) if shape is None else tuple(shape)

    def worker(rank, transport):
        kv = SlimGC(transport=transport, **options)
        kv.init(0, mx.nd.zeros(shape))
        outs = []
        for s in range(steps):
            out = mx.nd.zeros(shape)
            kv.pushpull(0, mx.nd.array(grads[s, rank].reshape(shape)), out=out)
            outs.append(out.asnumpy().ravel())
        stats = kv.stats()
        kv.close()
        return outs, stats

    return in_threads(n, worker)
