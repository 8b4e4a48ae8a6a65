"""The engine's host side alone: planner, grad_buf/bit_buf, pipeline and codecs over a
thread Collective on plain NumPy host arrays (backend.py), N workers as threads.

    run("2bit", {}, (4097,), num_workers=2, grads=...) -> per step, each worker's decoded sum

Imports no framework, so a test can run it in an interpreter where MXNet is never loaded.
"""
import threading

from slimgc_mx import codecs
from slimgc_mx.config import SlimGCConfig
from slimgc_mx.grad_buf import Push
from slimgc_mx.pipeline import Pipeline
from slimgc_mx.planner import Planner
from slimgc_mx.threshold import CTTab
from slimgc_mx.transport import HostBuffer, HostReadiness, ThreadGroup


def run(name, options, shape, num_workers, grads):
    """grads[step][rank]: flat float32 gradients of a tensor of `shape`; returns
    sums[step][rank], the sum each worker decoded."""
    steps = len(grads)
    group = ThreadGroup(num_workers)
    sums = [[None] * num_workers for _ in range(steps)]
    errors = []

    def worker(rank):
        try:
            transport = group.transport(rank)
            cfg = SlimGCConfig(compressor=name, codec_options=dict(options),
                               comm_threshold="off")
            codec = codecs.create(name, num_threads=1, **options)
            planner = Planner(cfg, transport, codec, CTTab("off"), HostBuffer, None,
                              lambda key, step: None, lambda key: None)
            done = {}
            pipeline = Pipeline(transport, lambda t: done.__setitem__(
                t.step, t.buffers.agg.for_read().copy()), on_error=errors.append,
                notifier=HostReadiness())
            b = planner.add("w", shape)
            for step in range(steps):
                b.grad_buf.for_write()[:] = grads[step][rank]
                transfer = planner.transfer(Push("w", b, step, local=False), None, None)
                pipeline.submit(transfer)
                pipeline.wait_idle(60)
                planner.steps["w"] = step + 1
                sums[step][rank] = done[step]
            pipeline.close()
        except BaseException as exc:  # re-raised on the calling thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(num_workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return sums
