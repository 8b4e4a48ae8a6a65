"""The residual watch (slimgc_mx/engine/residual_watch.py): an error-feedback residual that keeps
growing is found and told once per process; a healthy one, or one that rightly fills up,
is not. From series of norms, through the engine on the NumPy backend, and in a real job."""
import importlib.util
import math
import os
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest

from slimgc_mx import codecs
from slimgc_mx.engine import residual_watch as rw
from slimgc_mx.codecs.base import kernels
from slimgc_mx.engine.grad_buf import FusedEncode, GradCheck, KeyBuffers, stream_pieces
from slimgc_mx.engine.offload import Pipeline
from slimgc_mx.engine.push_plan import BUCKET, ENCODER, LOCAL_UPDATE
from slimgc_mx.transport import HostBuffer, piece_bounds

HERE = os.path.dirname(os.path.abspath(__file__))


def _first_found(series, norms):
    """Feed (||grad||, ||residual||) of pushes EVERY, 2*EVERY, ...; [(push, Growth)] found."""
    found = []
    for i, (g, r) in enumerate(norms, 1):
        f = series.record(i * rw.EVERY, g, r)
        if f is not None:
            found.append((i * rw.EVERY, f))
    return found


def _pushes(count=30):
    return [i * rw.EVERY for i in range(1, count + 1)]


# -- series of norms ------------------------------------------------------------------------

def test_a_residual_that_keeps_outgrowing_its_gradient_is_found_once():
    """A saturated quantizer whose excess accumulates faster and faster: rho grows as p**2."""
    found = _first_found(rw.Series(), [(1.0, 1e-3 * p ** 2) for p in _pushes()])
    assert len(found) == 1, found
    push, growth = found[0]
    assert push == 90  # rho >= FLOOR from push 70, then three samples in a row
    assert (growth.push, growth.since) == (90, 45)  # against push 45, between 40 and 50
    assert growth.rho == pytest.approx(8.1) and growth.rho_then == pytest.approx(2.05)


def test_a_residual_growing_with_a_runaway_gradient_is_found():
    """rho steady at 5, but gradient and residual both grow 5 % per push: the weights run away."""
    found = _first_found(rw.Series(), [(1.05 ** p, 5 * 1.05 ** p) for p in _pushes()])
    assert [push for push, _ in found] == [60]


@pytest.mark.parametrize("name, norms", [
    ("quantizer at rest", [(1.0 + 0.3 * math.sin(p), 0.8 + 0.2 * math.cos(p)) for p in _pushes()]),
    ("gradient shrinking to zero", [(10.0 / p, 5.0) for p in _pushes()]),
    ("dead zone filling at a steady rate", [(1.0, 0.1 * p) for p in _pushes()]),
    ("random walk", [(1.0, 0.9 * math.sqrt(p)) for p in _pushes()]),
    ("growth below FLOOR", [(1.0, 1e-5 * p ** 2) for p in _pushes()]),
    ("no gradient", [(0.0, p) for p in _pushes()]),
    ("NaN", [(float("nan"), p ** 2) for p in _pushes()]),
])
def test_a_healthy_series_stays_silent(name, norms):
    assert _first_found(rw.Series(), norms) == [], name


def test_a_sparsifiers_residual_may_fill_up_for_its_fill_pushes():
    """topk at ratio 0.01 sends an element about once per 100 pushes: until then its residual
    rightly grows like a saturated quantizer's, so no reference before push 100."""
    codec = codecs.create("topk")
    assert codec.residual_fill(1000) == 100
    growing = [(1.0, 1e-3 * p ** 2) for p in _pushes(40)]
    assert [p for p, _ in _first_found(rw.Series(codec.residual_fill(1000)), growing)] == [220]
    assert [p for p, _ in _first_found(rw.Series(), growing)] == [90]
    assert codecs.create("randomk", ratio=0.1).residual_fill(1000) == 10
    assert codecs.create("2bit").residual_fill(1000) == 0


def test_history_is_bounded():
    s = rw.Series()
    _first_found(s, [(1.0, 1.0)] * (3 * rw.HISTORY))
    assert len(s.samples) <= rw.HISTORY


def test_add_sums_squares_over_pieces_and_reads_the_residual_only():
    rng = np.random.default_rng(0)
    grad = rng.standard_normal(1000).astype(np.float32)
    memory = rng.standard_normal(2000).astype(np.float32)  # residual, then further state
    whole, pieced = rw.Series(), rw.Series()
    whole.add(grad, memory)
    for lo in range(0, 1000, 300):
        pieced.add(grad[lo:lo + 300], memory[lo:lo + 300])
    whole.close(), pieced.close()
    for s in (whole, pieced):
        push, g, r = s.samples[-1]
        assert push == rw.EVERY
        assert g == pytest.approx(np.linalg.norm(grad), rel=1e-5)
        assert r == pytest.approx(np.linalg.norm(memory[:1000]), rel=1e-5)


def test_due_every_EVERY_pushes_of_the_codec():
    codec = codecs.create("2bit")
    due = []
    for pushes in range(31):
        codec.pushes = pushes
        due.append(rw.due(codec))
    assert [p for p, d in enumerate(due) if d] == [10, 20, 30]


# -- what the user is told ------------------------------------------------------------------

def test_the_message_names_the_key_the_codec_and_the_fixes():
    text = rw.message("dense0_bias", codecs.create("2bit"), rw.Growth(90, 13.8, 40, 3.1))
    assert text.startswith("codec '2bit' is likely wrecking training: the error-feedback "
                           "residual of dense0_bias keeps growing (13.8 times")
    for fix in ("comm_threshold='auto'", "15360 bytes", "less optimizer momentum",
                "other codec settings than threshold=0.5"):
        assert fix in text
    assert "ratio=0.1" in rw.message("w", codecs.create("randomk", ratio=0.1),
                                     rw.Growth(60, 6.0, 30, 2.0))
    assert "or another codec" in rw.message("w", codecs.create("1bit"),
                                            rw.Growth(60, 6.0, 30, 2.0))


def test_the_warning_is_given_once_per_process(monkeypatch):
    monkeypatch.setattr(rw, "_told", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert rw.warn("first") is True
        assert rw.warn("second") is False
    said = [w for w in caught if issubclass(w.category, rw.ResidualGrowthWarning)]
    assert [str(w.message) for w in said] == ["first"]
    assert issubclass(rw.ResidualGrowthWarning, UserWarning)


# -- through the engine ---------------------------------------------------------------------

class PiecedBuffer(HostBuffer):
    """A host buffer that lends an array per piece, as MXNet's Buffer does."""

    def pieces(self, bounds):
        return [self.view(lo, (hi - lo,)) for lo, hi in bounds]


def test_a_streamed_push_is_measured_piece_by_piece():
    """FusedEncode with measure adds every piece's norms: the sample is the whole key's."""
    size, workers = 5000, 2
    rng = np.random.RandomState(0)
    grad, weight, mom = (rng.randn(size).astype(np.float32) for _ in range(3))
    b = KeyBuffers(0, (size,), codecs.create("2bit", threshold=0.3), workers, PiecedBuffer)
    before = (rng.randn(size) * 0.1).astype(np.float32)
    b.residual.for_write()[:] = before
    send = b.rounds[0].send
    pieces = stream_pieces(b.codec, size, send, piece_bounds(send.nbytes // 8, 8, 64), workers)
    assert len(pieces) > 1
    encoder = FusedEncode(b, send, workers, 0, GradCheck(), pieces, measure=True)
    g = HostBuffer((size,))
    g.for_write()[:] = grad
    out = np.empty(size, np.float32)
    for piece in pieces:
        part = slice(piece.lo, piece.hi)
        encoder(g, kernels().LocalSGD(weight[part], mom[part], out[part], 0.05, 0.0, 1.0,
                                      0.9, -1.0), piece)
    b.watch.close()
    _, g_norm, r_norm = b.watch.samples[-1]
    assert g_norm == pytest.approx(np.linalg.norm(grad), rel=1e-5)
    assert r_norm == pytest.approx(np.linalg.norm(before), rel=1e-5)  # before encoding


def _engine(rank, transport, config, grad_of, steps=80):
    """One worker of the NumPy engine: keys 0 (600 elements) and 1, 2 (60 each) pushed
    `steps` times with grad_of(step, rank, size); the aggregator's residual_growth."""
    from slimgc_mx.engine.aggregator import Aggregator
    from slimgc_mx.engine.config import SlimGCConfig
    from slimgc_mx.engine.numpy_backend import SGD, NumpyFramework
    agg = Aggregator(SlimGCConfig(**config), transport, framework=NumpyFramework())
    agg.set_optimizer(SGD(learning_rate=0.01, momentum=0.9))
    sizes = (600, 60, 60)
    for k, n in enumerate(sizes):
        agg.add_key(k, np.zeros(n, np.float32))
    params = [[np.zeros(n, np.float32)] for n in sizes]
    for step in range(steps):
        for k, n in enumerate(sizes):
            agg.push(k, [grad_of(step, rank, n)], params[k])
        agg.flush()
    found = agg.residual_growth
    agg.close(join=True)
    return found


def _saturating(step, rank, n):
    """Gradients 5 % larger every push, far above 2bit's threshold: the residual runs away."""
    return np.full(n, 1.05 ** step * (1 + rank), np.float32)


def _healthy(step, rank, n):
    return np.random.default_rng(1000 * step + rank).normal(0, 0.1, n).astype(np.float32)


@pytest.mark.parametrize("config, site", [
    (dict(compressor="2bit", backup=True), LOCAL_UPDATE),
    (dict(compressor="2bit", backup=False), ENCODER),
    (dict(compressor="randomk", codec_options={"ratio": 0.05}), ENCODER),  # no fused encode
    (dict(compressor="2bit", fuse_compressed=10000), BUCKET),  # every key in one bucket
], ids=["local-update", "encoder", "randomk", "bucket"])
def test_the_engine_finds_a_runaway_residual_and_not_a_healthy_one(monkeypatch, config, site):
    from thread_workers import in_threads
    monkeypatch.setattr(rw, "_told", True)  # what is found, not the warning (tested above)
    sites, submit = set(), Pipeline.submit

    def recording(self, transfer):
        if transfer.plan.measure:
            sites.add(BUCKET if transfer.plan.route == BUCKET else transfer.plan.encode)
        return submit(self, transfer)

    monkeypatch.setattr(Pipeline, "submit", recording)
    config = dict(config, comm_threshold="off")
    grown = in_threads(2, lambda rank, t: _engine(rank, t, config, _saturating))
    healthy = in_threads(2, lambda rank, t: _engine(rank, t, config, _healthy))
    assert site in sites, sites
    for text in grown:
        assert text is not None and "is likely wrecking training" in text
        assert ("(fused)" in text) == (site == BUCKET), text
    assert healthy == [None, None]


# -- a real job (PyTorch, one process) ------------------------------------------------------

def _first_hour():
    spec = importlib.util.spec_from_file_location(
        "first_hour", os.path.join(HERE, "torch_jobs", "first_hour.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("data_path", ["host", "device"])
def test_a_job_that_diverges_is_told_and_one_that_trains_is_not(monkeypatch, data_path):
    """The first-hour job, every tensor randomk at ratio 0.1: with momentum 0.9 the loss rises
    and the user is warned once, naming the parameter and the fixes; with momentum 0 it
    trains, and the watch is silent. On the host path the engine samples the norms where it
    encodes; on the device path (here on CPU tensors) they ride in the step's tail."""
    pytest.importorskip("torch")
    job = _first_hour().job
    monkeypatch.setattr(rw, "_told", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before, after, growth = job("randomk", momentum=0.9, ratio=0.1, data_path=data_path)
        quiet = job("randomk", momentum=0.0, ratio=0.1, data_path=data_path)
    said = [str(w.message) for w in caught if issubclass(w.category, rw.ResidualGrowthWarning)]
    assert after > 2 * before, (before, after)
    assert growth is not None and said == [growth]
    assert growth.startswith("codec 'randomk' is likely wrecking training: the "
                             "error-feedback residual of 1.")  # the BatchNorm's parameters
    assert "comm_threshold='auto'" in growth and "ratio=0.1" in growth
    assert quiet[1] < 0.5 * quiet[0] and quiet[2] is None, quiet


def test_two_ranks_on_the_device_path_find_the_same_growth_at_the_same_push():
    """Under torchrun the device path sums the sampled norms over the ranks in the step's
    tail: both ranks warn, with the same numbers (their own residuals would differ)."""
    pytest.importorskip("torch")
    import torch_launch
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(torch_launch.free_port()),
           os.path.join(HERE, "torch_jobs", "first_hour.py"), "--codec", "randomk",
           "--momentum", "0.9", "--option", "ratio=0.1", "--option", 'data_path="device"']
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLIMGC_")}
    env.update(PYTHONPATH=torch_launch.ROOT, OMP_NUM_THREADS="1", SLIMGC_TIMEOUT="60")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    text = r.stdout + r.stderr
    assert r.returncode == 0, text[-3000:]
    assert text.count("residual watch: WARNED") == 2, text[-3000:]
    said = re.findall(r"ResidualGrowthWarning: (codec 'randomk' is likely wrecking training"
                      r"[^\n]*)", text)
    assert len(said) == 2 and said[0] == said[1], said
