"""Device codec (NDArray ops) against the Cython codecs: bitwise equal lanes, residuals and
decoded sums over several steps of N simulated workers, shared-state updates, NaN policy,
2-D gradients, input errors."""
import mxnet as mx
import numpy as np
import pytest

from slimgc_mx import codecs
from slimgc_mx.codecs import fourbit
from slimgc_mx.mxnet.device import DeviceCodec

LANE_CODECS = ["1bit", "2bit", "4bit"]
#: Gradient magnitude per step: 4bit crosses groups 3 -> 1 -> 2 -> 3 (Table 1).
STEP_SCALES = [0.02, 0.3, 2.0, 0.05]


def bits(a):
    """Bit pattern: equality that tells -0.0 from 0.0."""
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint64)


def assert_same(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    bad = np.flatnonzero(bits(a) != bits(b))
    assert bad.size == 0, "%s differs at %d places, first %d: %r vs %r" % (
        what, bad.size, bad[0], a[bad[0]], b[bad[0]])


def gradient(rng, n, scale, codec):
    """float32 gradient: normal values, zeros, -0.0 and values right at the codec's thresholds."""
    g = (scale * rng.standard_normal(n)).astype(np.float32)
    special = [0.0, -0.0]
    if codec.name == "2bit":
        t = np.float32(codec.threshold)
        special += [t, -t, np.nextafter(t, np.float32(0)), -np.nextafter(t, np.float32(0))]
    elif codec.name == "4bit":
        for x in fourbit.group_thresholds(codec.group):
            special += [x, -x, np.nextafter(x, np.float32(0))]
    pick = rng.random(n) < 0.1
    g[pick] = rng.choice(np.array(special, dtype=np.float32), int(pick.sum()))
    return g


def sizes_for(codec, n_workers):
    _, k = codec.geometry(n_workers)
    return sorted({1, 7, max(1, k - 1), k, k + 1, 4097, 100003})


def run_workers(name, size, n_workers, steps, rng, shape=None):
    """Encode every worker's gradient with both paths, sum lanes in float64, decode; compare."""
    cy = codecs.create(name, num_threads=1)
    dev = DeviceCodec(codecs.create(name))
    res_cy = [np.zeros(size, np.float32) for _ in range(n_workers)]
    res_dev = [mx.nd.zeros((size,), dtype=np.float32) for _ in range(n_workers)]
    for step in range(steps):
        n_lanes = cy.lane_count(size, n_workers)  # 4bit's follows the group agreed so far
        body = n_lanes - cy.trailer_lanes
        scale = STEP_SCALES[step % len(STEP_SCALES)]
        total = np.zeros(n_lanes, np.float64)
        for w in range(n_workers):
            g = gradient(rng, size, scale, cy)
            lanes = cy.encode(g, res_cy[w], n_workers)
            out = mx.nd.full((n_lanes,), np.nan, dtype=np.float64)
            g_nd = mx.nd.array(g, dtype=np.float32)
            if shape is not None:
                g_nd = g_nd.reshape(shape)
            dev.encode(g_nd, res_dev[w], n_workers, out)
            got = out.asnumpy()
            what = "%s N=%d size=%d step=%d worker=%d" % (name, n_workers, size, step, w)
            assert_same(got[:body], lanes[:body], "lanes " + what)
            if cy.trailer_lanes:
                np.testing.assert_allclose(got[body:], lanes[body:], rtol=1e-12, atol=0)
            assert_same(res_dev[w].asnumpy(), res_cy[w], "residual " + what)
            total += lanes
        decoded = cy.decode(total, size, n_workers)
        out = mx.nd.full(shape or (size,), np.nan, dtype=np.float32)
        dev.decode(mx.nd.array(total, dtype=np.float64), size, n_workers, out)
        assert_same(out.asnumpy().ravel(), decoded, "decoded %s N=%d size=%d step=%d"
                    % (name, n_workers, size, step))
        assert dev.codec.state_dict() == cy.state_dict()
    return cy, dev


@pytest.mark.parametrize("n_workers", [1, 2, 5])
@pytest.mark.parametrize("name", LANE_CODECS)
def test_bitwise_equal_to_cython(name, n_workers):
    rng = np.random.default_rng(hash((name, n_workers)) % 2 ** 32)
    for size in sizes_for(codecs.create(name), n_workers):
        steps = 2 if size > 10000 else 4
        run_workers(name, size, n_workers, steps, rng)


def test_shared_state_follows_decode():
    """1bit scale and 4bit group come from the trailer lane, as in Codec.decode()."""
    rng = np.random.default_rng(1)
    cy, dev = run_workers("1bit", 5000, 3, 2, rng)
    assert dev.codec.scale > 0 and dev.codec.scale == cy.scale
    cy, dev = run_workers("4bit", 5000, 2, 3, rng)
    assert dev.codec.group == cy.group == fourbit.group_for_mean(1.6)  # step 2: scale 2.0


def test_two_dimensional_gradient():
    rng = np.random.default_rng(2)
    for name in LANE_CODECS:
        run_workers(name, 37 * 41, 2, 3, rng, shape=(37, 41))


@pytest.mark.parametrize("name", LANE_CODECS)
@pytest.mark.parametrize("bad", ["nan", "inf", "sum"])
def test_nonfinite_raises_before_touching(name, bad):
    dev = DeviceCodec(codecs.create(name))
    g = np.linspace(-1, 1, 1000).astype(np.float32)
    r = np.full(1000, 0.25, np.float32)
    if bad == "nan":
        g[17] = np.nan
    elif bad == "inf":
        g[999] = -np.inf
    else:  # finite alone, but grad + residual overflows float32
        g[3], r[3] = 3e38, 3e38
    residual = mx.nd.array(r, dtype=np.float32)
    n_lanes = dev.codec.lane_count(1000, 2)
    out = mx.nd.full((n_lanes,), 7.0, dtype=np.float64)
    with pytest.raises(codecs.NonFiniteGradientError):
        dev.encode(mx.nd.array(g, dtype=np.float32), residual, 2, out)
    assert_same(residual.asnumpy(), r, "residual")
    assert (out.asnumpy() == 7.0).all()


def test_empty_gradient():
    for name in LANE_CODECS:
        cy, dev = codecs.create(name), DeviceCodec(codecs.create(name))
        out = mx.nd.full((cy.lane_count(0, 2),), 7.0, dtype=np.float64)
        empty = np.zeros(0, np.float32)
        dev.encode(mx.nd.array(empty), mx.nd.array(empty), 2, out)
        np.testing.assert_array_equal(out.asnumpy(), cy.encode(empty, empty.copy(), 2))
        dev.decode(out, 0, 2, mx.nd.array(empty))


def test_input_errors():
    with pytest.raises(ValueError, match="lane codecs"):
        DeviceCodec(codecs.create("none"))
    dev = DeviceCodec(codecs.create("2bit"))
    g, r = mx.nd.zeros((10,)), mx.nd.zeros((10,))
    n_lanes = dev.codec.lane_count(10, 2)
    with pytest.raises(TypeError, match="float64"):
        dev.encode(g, r, 2, mx.nd.zeros((n_lanes,)))
    with pytest.raises(TypeError, match="float32"):
        dev.encode(g.astype(np.float64), r, 2, mx.nd.zeros((n_lanes,), dtype=np.float64))
    with pytest.raises(ValueError, match="elements"):
        dev.encode(g, mx.nd.zeros((9,)), 2, mx.nd.zeros((n_lanes,), dtype=np.float64))
    with pytest.raises(TypeError, match="NDArray"):
        dev.encode(g.asnumpy(), r, 2, mx.nd.zeros((n_lanes,), dtype=np.float64))
    with pytest.raises(ValueError, match="num_workers"):
        dev.encode(g, r, 0, mx.nd.zeros((n_lanes,), dtype=np.float64))
    one = DeviceCodec(codecs.create("1bit"))
    n_lanes = one.codec.lane_count(10, 2)
    lanes = mx.nd.zeros((n_lanes,), dtype=np.float64)
    lanes[n_lanes - 1] = -1.0
    with pytest.raises(ValueError, match="trailer"):
        one.decode(lanes, 10, 2, mx.nd.zeros((10,)))
    assert one.codec.scale == 0.0


@pytest.mark.parametrize("name", LANE_CODECS)
def test_decode_extreme_lanes(name):
    """Digit sums at 0 and R-1 everywhere (lanes up to R**k - 1 <= 2**53) decode exactly."""
    rng = np.random.default_rng(3)
    for n_workers in (1, 2, 5, 64):
        cy, dev = codecs.create(name), DeviceCodec(codecs.create(name))
        if name == "1bit":
            cy.scale = dev.codec.scale = 0.37  # a scale 0 would decode everything to 0
        radix, k = cy.geometry(n_workers)
        size = 50 * k - 3
        body = -(-size // k)
        digits = rng.integers(0, radix, (body, k))
        digits[0], digits[1] = radix - 1, 0
        digits[2, :] = 0
        digits[2, -1] = radix - 1
        digits[3, :-1] = radix - 1
        digits[-1, k - 3:] = 0  # the partial last lane packs no digits past the end
        powers = [radix ** j for j in range(k)]
        lanes = [float(sum(int(d) * p for d, p in zip(row, powers))) for row in digits]
        lanes += [0.7 * n_workers] * cy.trailer_lanes
        lanes = np.array(lanes, dtype=np.float64)
        assert lanes[:body].max() <= 2.0 ** 53
        out = mx.nd.zeros((size,))
        dev.decode(mx.nd.array(lanes, dtype=np.float64), size, n_workers, out)
        assert_same(out.asnumpy(), cy.decode(lanes, size, n_workers), "%s N=%d" % (name, n_workers))


def test_huge_finite_values_are_not_rejected():
    """c . c overflows for |c| > 1.8e19: the exact element check must then let it through."""
    rng = np.random.default_rng(4)
    for name in LANE_CODECS:
        cy, dev = codecs.create(name), DeviceCodec(codecs.create(name))
        g = rng.standard_normal(999).astype(np.float32)
        g[::7] = 3e38
        r = np.zeros(999, np.float32)
        lanes = cy.encode(g, r, 2)
        out = mx.nd.zeros((lanes.shape[0],), dtype=np.float64)
        residual = mx.nd.zeros((999,))
        dev.encode(mx.nd.array(g), residual, 2, out)
        body = lanes.shape[0] - cy.trailer_lanes
        assert_same(out.asnumpy()[:body], lanes[:body], name)
        assert_same(residual.asnumpy(), r, name)
