"""The NumPy backend (numpy_backend.py): the whole engine — CTTab warm-up and routing,
offload, backup, every codec — on plain host arrays, with no framework loaded, giving
MXNet's adapter's weights bit for bit on the same inputs (docs/backend.md)."""
import numpy as np
import pytest

import numpy_engine
from thread_workers import frameworks_loaded_by
from slimgc_mx import codecs

OPT = (0.05, 0.9, 1e-4, 0.5)  # learning_rate, momentum, wd, rescale_grad


def _same(a, b, what):
    for step, (wa, wb) in enumerate(zip(a, b)):
        for k, (x, y) in enumerate(zip(wa, wb)):
            assert np.array_equal(x.view(np.uint32), y.view(np.uint32)), \
                "%s: key %d differs at step %d" % (what, k, step)


@pytest.mark.parametrize("backup", [True, False])
@pytest.mark.parametrize("name", codecs.available())
def test_numpy_backend_gives_the_mxnet_adapters_weights(name, backup):
    """Two workers; tensors from 256 bytes compressed, the rest fused in full precision."""
    pytest.importorskip("mxnet")
    w0, grads = numpy_engine.problem(2, 4, seed=3)
    config = dict(compressor=name, comm_threshold=256, backup=backup, threshold=0.05)
    opt = OPT
    if codecs.create(name).traits.owns_momentum:  # dgc applies momentum itself
        opt, config["codec_options"] = OPT[:1] + (0.0,) + OPT[2:], {"momentum": 0.9}
        # MXNet updates a fused bucket with its multi-tensor op, whose rule without
        # momentum rounds differently from sgd_update's (the kernel's) in the last bit
        config["fuse"] = False
    got = numpy_engine.run("numpy", w0, grads, opt, config)
    want = numpy_engine.run("mxnet", w0, grads, opt, config)
    keys = len(w0)
    for rank in range(2):
        _same(got[rank][0], want[rank][0], "%s rank %d" % (name, rank))
        _same([h[keys:] for h in got[rank][0]], [h[keys:] for h in got[0][0]],
              "%s global weights across ranks" % name)
    if name != "none":
        assert got[0][1]["compressed_transfers"] > 0


def test_the_cttab_warm_up_decides_on_the_numpy_backend():
    w0, grads = numpy_engine.problem(2, 8, seed=4)
    config = dict(compressor="2bit", warmup_steps=4, threshold=0.05)
    results = numpy_engine.run("numpy", w0, grads, OPT, config)
    keys = len(w0)
    _same([h[keys:] for h in results[0][0]], [h[keys:] for h in results[1][0]], "global weights")
    assert results[0][1]["transfers"] > 0


@pytest.mark.slow
def test_the_numpy_backend_loads_no_framework():
    code = ("import numpy_engine\n"
            "w0, g = numpy_engine.problem(2, 3)\n"
            "r = numpy_engine.run('numpy', w0, g, (0.1, 0.9, 0.0, 1.0),"
            " dict(compressor='2bit', comm_threshold=256))\n"
            "assert r[0][0][-1][1].shape == (16, 12)\n")
    assert frameworks_loaded_by(code) == []
