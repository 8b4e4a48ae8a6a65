"""The SGD kernel: bitwise MXNet's sgd_update / sgd_mom_update, and the momentum kept in the Updater."""
import mxnet as mx
import numpy as np
import pytest

import training_helpers as th
from slimgc_mx import codecs
from slimgc_mx.mxnet import sgd
from slimgc_mx.mxnet.update import clone_optimizer
from slimgc_mx.codecs.base import kernels
from slimgc_mx.mxnet.sgd import SGDKernel


@pytest.mark.parametrize("clip", [-1.0, 0.7])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_step_is_bitwise_mxnet_op(momentum, clip):
    n = 200003  # several chunks, the last one partial
    rng = np.random.RandomState(1)
    w, g, m = (rng.randn(n).astype(np.float32) for _ in range(3))
    lr, wd, rescale = 0.05, 1e-3, 1.0 / 48  # not a power of 2: rounding order matters
    W, G, M = mx.nd.array(w), mx.nd.array(g) * 50, mx.nd.array(m)
    kwargs = dict(lr=lr, wd=wd, rescale_grad=rescale)
    if clip > 0:
        kwargs["clip_gradient"] = clip
    if momentum:
        mx.nd.sgd_mom_update(W, G, M, out=W, momentum=momentum, **kwargs)
    else:
        mx.nd.sgd_update(W, G, out=W, **kwargs)
    for threads in (1, 3):
        w2, m2 = w.copy(), m.copy()
        mom = m2 if momentum else None
        kernels().sgd_step(w2, G.asnumpy(), mom, mom, w2, lr, wd, rescale, momentum, clip, threads)
        np.testing.assert_array_equal(w2, W.asnumpy())
        np.testing.assert_array_equal(m2, M.asnumpy() if momentum else m)
        # Out of place, momentum only read: the same weights, nothing else written.
        out, m3 = np.zeros_like(w), m.copy()
        kernels().sgd_step(w, G.asnumpy(), m3 if momentum else None, None, out, lr, wd, rescale,
                           momentum, clip, threads)
        np.testing.assert_array_equal(out, W.asnumpy())
        np.testing.assert_array_equal(m3, m)


def test_sgd_step_counts_non_finite_gradient_elements():
    n = 200003  # several chunks, the last one partial
    rng = np.random.RandomState(2)
    w, g, m = (rng.randn(n).astype(np.float32) for _ in range(3))
    bad = [0, 65535, 65536, 131000, n - 1]
    for i, v in zip(bad, [np.nan, np.inf, -np.inf, np.nan, np.inf]):
        g[i] = v
    for threads in (1, 3):
        out, counted = np.zeros_like(w), np.zeros_like(w)
        assert kernels().sgd_step(w, g, m, None, out, 0.1, 0.0, 1.0, 0.9, -1.0, threads) == 0
        assert kernels().sgd_step(w, g, m, None, counted, 0.1, 0.0, 1.0, 0.9, -1.0, threads,
                                  True) == len(bad)
        np.testing.assert_array_equal(counted, out)  # counting changes nothing else
    clean = np.ones(n, np.float32)
    assert kernels().sgd_step(w, clean, None, None, out, 0.1, 0.0, 1.0, 0.0, -1.0, 2, True) == 0


def test_sgd_step_rejects_mismatched_buffers():
    a, b = np.zeros(4, np.float32), np.zeros(5, np.float32)
    with pytest.raises(ValueError, match="differ"):
        kernels().sgd_step(a, b, None, None, a, 0.1, 0.0, 1.0, 0.0, -1.0, 1)
    with pytest.raises(ValueError, match="momentum buffers"):
        kernels().sgd_step(a, a, b, None, a, 0.1, 0.0, 1.0, 0.9, -1.0, 1)
    with pytest.raises(ValueError, match="mom_out needs mom_in"):
        kernels().sgd_step(a, a, None, a, a, 0.1, 0.0, 1.0, 0.9, -1.0, 1)


@pytest.mark.parametrize("name", ["1bit", "2bit", "4bit"])
@pytest.mark.parametrize("momentum,clip", [(0.9, -1.0), (0.0, 0.7)])
def test_decoding_step_is_bitwise_decode_then_step(name, momentum, clip):
    """decode_sgd_step = decode_lanes + sgd_step bit for bit, and decode_table advances
    the codec's shared state (1bit scale, 4bit group) as decode does."""
    n_workers, n = 3, 200003  # several chunks and tiles, the last lane partial
    rng = np.random.RandomState(2)
    workers = [codecs.create(name, num_threads=2) for _ in range(n_workers)]
    residuals = [np.zeros(n, np.float32) for _ in range(n_workers)]
    plain, fused = codecs.create(name), codecs.create(name)
    w = rng.randn(n).astype(np.float32)
    m = rng.randn(n).astype(np.float32) if momentum else None
    lr, wd, rescale = 0.05, 1e-3, 1.0 / 48
    for step in range(3):  # later steps decode with the state the earlier ones agreed
        grads = [rng.randn(n).astype(np.float32) * 0.3 for _ in range(n_workers)]
        total = sum(c.encode(g, r, n_workers) for c, g, r in zip(workers, grads, residuals))
        for c in workers:
            c.decode(total, n, n_workers)
        agg = plain.decode(total, n, n_workers)
        k, digits, rows = fused.decode_table(total, n, n_workers)
        assert plain.state_dict() == fused.state_dict()
        results = []
        for threads in (1, 3):
            w2, m2 = w.copy(), m.copy() if momentum else None
            kernels().decode_sgd_step(total, rows, k, digits, w2, m2, lr, wd, rescale, momentum,
                                      clip, threads)
            results.append((w2, m2))
        kernels().sgd_step(w, agg, m, m, w, lr, wd, rescale, momentum, clip, 1)
        for w2, m2 in results:
            np.testing.assert_array_equal(w2, w)
            if momentum:
                np.testing.assert_array_equal(m2, m)


def test_count_lanes_outside_counts_what_the_decoder_cannot_divide():
    lanes = np.arange(1000, dtype=np.float64) * 1e12
    lanes[-1] = 2.0 ** 53 - 1  # the largest lane the decoder takes
    assert kernels().count_lanes_outside(lanes) == 0
    assert kernels().count_lanes_outside(lanes[:0]) == 0
    for i, bad in enumerate((-1.0, 2.0 ** 53, np.nan, np.inf, -np.inf)):
        lanes[100 * i + 7] = bad
    assert kernels().count_lanes_outside(lanes) == 5


def test_decoding_step_checked_by_the_caller_gives_the_same_weights():
    """checked=True skips the kernel's own range pass: same weights bit for bit."""
    codec = codecs.create("2bit")
    n = 70000
    rng = np.random.default_rng(3)
    lanes = sum(codec.encode(rng.standard_normal(n).astype(np.float32),
                             np.zeros(n, np.float32), 2) for _ in range(2))
    k, digits, rows = codec.decode_table(lanes, n, 2)
    assert kernels().count_lanes_outside(lanes[:codec.body_lanes(n, 2)]) == 0
    out = []
    for checked in (False, True):
        w = np.linspace(-1, 1, n).astype(np.float32)
        m = np.full(n, 0.25, np.float32)
        kernels().decode_sgd_step(lanes, rows, k, digits, w, m, 0.1, 1e-4, 0.5, 0.9, -1.0, 2,
                                  checked)
        out.append((w, m))
    for a, b in zip(out[0], out[1]):
        np.testing.assert_array_equal(a, b)


def test_decoding_step_refuses_bad_lanes_before_writing():
    codec = codecs.create("2bit")
    n = 5000
    lanes = codec.encode(np.ones(n, np.float32), np.zeros(n, np.float32), 2) * 2
    k, digits, rows = codec.decode_table(lanes, n, 2)
    w = np.ones(n, np.float32)
    for bad in (-1.0, 2.0 ** 53):
        poisoned = lanes.copy()
        poisoned[-1] = bad
        with pytest.raises(ValueError, match="no weight was written"):
            kernels().decode_sgd_step(poisoned, rows, k, digits, w, None, 0.1, 0.0, 1.0, 0.0,
                                      -1.0, 2)
        np.testing.assert_array_equal(w, 1)
    with pytest.raises(ValueError, match="mom has 3 elements"):
        kernels().decode_sgd_step(lanes, rows, k, digits, w, np.zeros(3, np.float32), 0.1, 0.0,
                                  1.0, 0.9, -1.0, 1)
    with pytest.raises(ValueError, match="lanes has"):
        kernels().decode_sgd_step(lanes[:10], rows, k, digits, w, None, 0.1, 0.0, 1.0, 0.0,
                                  -1.0, 1)
    with pytest.raises(TypeError, match="call decode"):
        codecs.create("2bit", reference=True).decode_table(lanes, n, 2)


def test_only_mxnet_sgd_itself_is_supported():
    class MySGD(mx.optimizer.SGD):
        pass
    assert sgd.supports(mx.optimizer.SGD())
    assert not sgd.supports(MySGD())
    assert not sgd.supports(mx.optimizer.Adam())


def test_sgd_kernel_takes_a_loaded_momentum():
    """After set_states (a checkpoint) the kernel continues from the loaded momentum."""
    opt = th.sgd_with_everything(0.9)
    agg = th.buffer_of(np.full(50, 0.5, np.float32))
    updater = mx.optimizer.get_updater(clone_optimizer(opt))
    kernel = SGDKernel(updater, num_threads=1)
    glo = th.buffer_of(np.ones(50, np.float32))
    kernel.global_step([0], [agg], [glo])
    saved, after_one = updater.get_states(dump_optimizer=True), glo.for_read().copy()
    kernel.global_step([0], [agg], [glo])  # the uninterrupted second step

    other = mx.optimizer.get_updater(clone_optimizer(opt))
    other.set_states(saved)
    resumed, weights = SGDKernel(other, num_threads=1), th.buffer_of(after_one)
    resumed.global_step([0], [agg], [weights])
    np.testing.assert_array_equal(weights.for_read(), glo.for_read())
    other.states[1] = mx.nd.zeros(3)
    with pytest.raises(ValueError, match="shape"):
        resumed.momentum(1, (50,))
