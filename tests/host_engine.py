"""The engine's host side alone: planner, grad_buf/bit_buf, pipeline and codecs over a
thread Collective on plain NumPy host arrays (backend.py), N workers as threads.

    run("2bit", {}, (4097,), num_workers=2, grads=...) -> per step, each worker's decoded sum

Imports no framework, so a test can run it in an interpreter where MXNet is never loaded.
"""
from slimgc_mx import codecs
from slimgc_mx.engine.config import SlimGCConfig
from slimgc_mx.engine.grad_buf import Push
from slimgc_mx.engine.offload import Pipeline
from slimgc_mx.engine.planner import Planner
from slimgc_mx.engine.cttab import CTTab
from slimgc_mx.transport import HostBuffer, HostReadiness
from thread_workers import in_threads


def run(name, options, shape, num_workers, grads):
    """grads[step][rank]: flat float32 gradients of a tensor of `shape`; returns
    sums[step][rank], the sum each worker decoded."""
    per_rank = in_threads(num_workers, lambda rank, transport: _worker(
        name, options, shape, transport, [g[rank] for g in grads]))
    return [[per_rank[r][step] for r in range(num_workers)] for step in range(len(grads))]


def make_planner(name, options, transport):
    """A worker's Planner for codec `name` (one thread) on NumPy host buffers, every key on
    the codec's route (no CTTab)."""
    cfg = SlimGCConfig(compressor=name, codec_options=dict(options), comm_threshold="off")
    codec = codecs.create(name, num_threads=1, **options)
    return Planner(cfg, transport, codec, CTTab("off"), HostBuffer, None,
                   lambda key, step: None, lambda key: None)


def _worker(name, options, shape, transport, grads):
    """One worker: the sum it decoded at each step of its `grads`."""
    planner = make_planner(name, options, transport)
    done, errors = {}, []
    pipeline = Pipeline(transport, lambda t: done.__setitem__(
        t.step, t.buffers.agg.for_read().copy()), on_error=errors.append,
        notifier=HostReadiness())
    b = planner.add("w", shape)
    sums = []
    for step, grad in enumerate(grads):
        b.grad_buf.for_write()[:] = grad
        pipeline.submit(planner.transfer(Push("w", b, step, local=False), None, None))
        pipeline.wait_idle(60)
        if errors:
            raise errors[0]
        planner.steps["w"] = step + 1
        sums.append(done[step])
    pipeline.close()
    return sums
