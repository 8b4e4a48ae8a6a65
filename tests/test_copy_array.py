"""buffers.copy_array: the engine copy on the hot path, MKLDNN layouts included."""
import ctypes

import mxnet as mx
import numpy as np
import pytest
from mxnet.base import _LIB, check_call

from slimgc_mx.bench.models import get_model
from slimgc_mx.mxnet import buffers
from slimgc_mx.mxnet.buffers import Buffer, copy_array


@pytest.fixture(params=["copy operator", "copyto"])
def path(request, monkeypatch):
    """Run a test through each of copy_array's two paths (the test arrays are small)."""
    if request.param == "copy operator":
        monkeypatch.setattr(buffers, "COPY_OP_MIN_SIZE", 1)
    return request.param


def _raw_view(arr):
    """The array's memory as float32, whatever layout MXNet keeps it in later."""
    arr.wait_to_read()
    ptr = ctypes.c_void_p()
    check_call(_LIB.MXNDArrayGetData(arr.handle, ctypes.byref(ptr)))
    return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                 shape=(arr.size,))


def _net_after_inference(seed=0):
    """A hybridized conv net after an inference forward: MKLDNN reorders conv weights in place."""
    mx.random.seed(seed)
    net = get_model("cnn1d", 10, (40,))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    x = mx.nd.array(np.random.default_rng(seed).standard_normal((4, 40)))
    net(x).wait_to_read()
    params = list(net.collect_params().values())
    views = [_raw_view(p.data()) for p in params]  # taken while still in the default layout
    net(x).wait_to_read()
    mx.nd.waitall()
    return net, x, params, views


def test_reads_mkldnn_layout_weights_in_the_default_layout(path):
    _, _, params, views = _net_after_inference()
    raws = [v.copy() for v in views]
    bufs = []
    for p in params:
        b = Buffer(p.data().shape, np.float32)
        copy_array(p.data(), b.nd)
        bufs.append(b)
    logical = [p.data().asnumpy().ravel() for p in params]
    relaid = [not np.array_equal(r, l) for r, l in zip(raws, logical)]
    assert any(relaid), "no weight changed layout: the test would not test the MKLDNN path"
    for b, values in zip(bufs, logical):
        np.testing.assert_array_equal(b.for_read(), values)


def test_writes_into_mkldnn_layout_weights_like_copyto(path):
    net, x, params, _ = _net_after_inference()
    ref, _, ref_params, _ = _net_after_inference()
    for i, (p, q) in enumerate(zip(params, ref_params)):
        src = Buffer(p.data().shape, np.float32)
        src.for_write()[:] = (np.arange(p.data().size, dtype=np.float32) % 13 - 6) * 0.01 * (i + 1)
        copy_array(src.nd, p.data())
        src.nd.copyto(q.data())
        np.testing.assert_array_equal(p.data().asnumpy().ravel(), src.for_read())
    np.testing.assert_array_equal(net(x).asnumpy(), ref(x).asnumpy())


def test_waits_for_the_source_in_the_engine(path):
    a = mx.nd.arange(1000)
    dst = Buffer((1000,), np.float32)
    copy_array(a * 2 + 1, dst.nd)
    np.testing.assert_array_equal(dst.for_read(), np.arange(1000, dtype=np.float32) * 2 + 1)


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_casts_through_copyto(dtype):
    src = mx.nd.array(np.linspace(-2, 2, 64), dtype=dtype)
    dst = Buffer((64,), np.float32)
    copy_array(src, dst.nd)
    np.testing.assert_array_equal(dst.for_read(), src.asnumpy().astype(np.float32))


def test_large_arrays_take_the_copy_operator(monkeypatch):
    calls = []
    monkeypatch.setattr(buffers.mx.nd, "identity", lambda *a, **k: calls.append(a))
    src = mx.nd.ones(buffers.COPY_OP_MIN_SIZE)
    copy_array(src, mx.nd.zeros(buffers.COPY_OP_MIN_SIZE))
    copy_array(src[:10], mx.nd.zeros(10))
    assert len(calls) == 1 and calls[0][0].size == buffers.COPY_OP_MIN_SIZE


def test_array_in_place_views_default_layout_and_refuses_mkldnn():
    """ArrayInPlace.held() is the array's own memory in the default layout, and refuses
    (LayoutError, no wait, no reorder) an array that MKLDNN has relaid."""
    from slimgc_mx.mxnet.buffers import ArrayInPlace, LayoutError

    a = mx.nd.array(np.arange(12, dtype=np.float32).reshape(3, 4))
    held = ArrayInPlace(a).for_read()
    held[5] = -1.0  # the same memory, not a copy
    assert a.asnumpy()[1, 1] == -1.0
    assert not ArrayInPlace.supports(a.astype(np.float64))
    _, _, params, views = _net_after_inference()
    relaid = [p for p, v in zip(params, views)
              if not np.array_equal(v, p.data().asnumpy().ravel())]
    assert relaid, "no weight changed layout: the test would not test the MKLDNN path"
    for p in relaid:
        with pytest.raises(LayoutError, match="MKLDNN's layout"):
            ArrayInPlace(p.data()).for_read()
