"""The aggregator driven directly, N workers as threads on a ThreadGroup: with the NumPy
backend (numpy_backend.NumpyFramework) or MXNet's adapter, from the same weights and
gradients, so tests can compare the two and run the engine without MXNet.

Gradients are fixed per (step, rank, key) rather than computed from the weights: the
test is of the engine, not of a model.
"""
import numpy as np

from slimgc_mx.engine.aggregator import Aggregator
from slimgc_mx.engine.config import SlimGCConfig
from thread_workers import in_threads

SHAPES = [(3,), (16, 12), (40, 50), (7,), (64, 33)]


def problem(num_workers, steps, seed=0, shapes=SHAPES):
    """(initial weights per key, gradients[step][rank][key]) as float32 arrays."""
    rng = np.random.default_rng(seed)
    w0 = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[[rng.standard_normal(s).astype(np.float32) for s in shapes]
              for _ in range(num_workers)] for _ in range(steps)]
    return w0, grads


def run(framework, w0, grads, optimizer, config, clip=None):
    """Per worker: (per step the parameters after its pushes, then the global weights after
    it, each a list over keys; the aggregator's transfer stats).

    framework: 'numpy' or 'mxnet'; optimizer: (learning_rate, momentum, wd, rescale_grad);
    clip: (max_norm, norm_type) clips every step (Aggregator.clip_step), and the stats
    get the mean gradient's norm of each step as "clip_norms"."""
    return in_threads(len(grads[0]), lambda rank, transport: _worker(
        framework, transport, w0, grads, rank, optimizer, config, clip))


def _worker(framework, transport, w0, grads, rank, optimizer, config, clip=None):
    lr, momentum, wd, rescale = optimizer
    cfg = SlimGCConfig(**config)
    if framework == "numpy":
        from slimgc_mx.engine.numpy_backend import SGD, NumpyFramework
        agg = Aggregator(cfg, transport, framework=NumpyFramework())
        agg.set_optimizer(SGD(learning_rate=lr, momentum=momentum, wd=wd, rescale_grad=rescale))
        array, out = (lambda a: a.copy()), (lambda a: np.zeros_like(a))
        read = np.array
    else:
        import mxnet as mx
        from slimgc_mx.mxnet.framework import MXNetFramework
        agg = Aggregator(cfg, transport, MXNetFramework())
        agg.set_optimizer(mx.optimizer.SGD(learning_rate=lr, momentum=momentum, wd=wd,
                                           rescale_grad=rescale))
        array, out = mx.nd.array, (lambda a: mx.nd.zeros(a.shape))
        read = (lambda nd: nd.asnumpy())
    for k, w in enumerate(w0):
        agg.add_key(k, array(w))
    params = [[out(w)] for w in w0]
    history, norms = [], []
    for step_grads in grads:
        if clip is not None:
            agg.clip_step(*clip)
        for k, g in enumerate(step_grads[rank]):
            agg.push(k, [array(g)], params[k])
        if clip is not None:
            agg.end_step()
        local = [read(p[0]).copy() for p in params]  # loc_buf with backup, else w_{i+1}
        agg.flush()
        history.append(local + [read(agg.backup.glo_buf(k)).copy() for k in range(len(w0))])
        if clip is not None:
            norms.append(agg.clip.last.total_norm)
    stats = dict(agg.stats.__dict__, clip_norms=norms)
    agg.close(join=True)
    return history, stats
