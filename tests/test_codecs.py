"""Codecs: Cython kernels against the NumPy reference, exact aggregation, error feedback,
input errors, the NaN/Inf policy, shared-state agreement, clone/state_dict."""
import dataclasses
import os
import re
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slimgc_mx import codecs, env
from slimgc_mx.codecs import fourbit

LANE_CODECS = ["1bit", "2bit", "4bit"]
ALL_CODECS = ["none"] + LANE_CODECS
SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def bits(a):
    """Bit pattern of a float array: equality that tells -0.0 from 0.0 and NaNs apart."""
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint64)


def assert_same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(bits(a), bits(b))


def gradient(rng, n, lo=-8.0, hi=3.0):
    """float32 values with magnitudes spread over 10**lo .. 10**hi, random signs, some zeros."""
    g = rng.choice([-1.0, 1.0], n) * 10.0 ** rng.uniform(lo, hi, n)
    g[rng.random(n) < 0.05] = 0.0
    return g.astype(np.float32)


def make_pair(name, n_threads=1, threshold=None):
    return (codecs.create(name, threshold=threshold, num_threads=n_threads),
            codecs.create(name, threshold=threshold, reference=True))


def run_step(cy, ref, grads, residuals, n_workers):
    """All workers encode with both implementations (bitwise compared); returns the lanes."""
    lanes = []
    for g, r in zip(grads, residuals):
        r_ref = r.copy()
        out = cy.encode(g, r, n_workers)
        assert_same(out, ref.encode(g, r_ref, n_workers))
        assert_same(r, r_ref)
        lanes.append(out)
    return lanes


def sum_in_order(lanes, order):
    total = np.zeros_like(lanes[0])
    for i in order:
        total += lanes[i]
    return total


# ------------------------------------------------------------ Cython == reference, exact sums
@SETTINGS
@given(name=st.sampled_from(ALL_CODECS), n_workers=st.integers(1, 64),
       size=st.sampled_from([0, 1, 7, 4097]), seed=st.integers(0, 2 ** 32 - 1),
       n_threads=st.integers(1, 4), steps=st.integers(1, 3))
def test_kernels_equal_reference_and_sums_are_exact(name, n_workers, size, seed, n_threads,
                                                    steps):
    rng = np.random.default_rng(seed)
    cy, ref = make_pair(name, n_threads)
    residuals = [gradient(rng, size, -8, 0) for _ in range(n_workers)]
    for _ in range(steps):
        grads = [gradient(rng, size) for _ in range(n_workers)]
        before = [g + r for g, r in zip(grads, residuals)]
        levels = None
        if name != "none":
            levels = sum(ref._levels(c) for c in before)   # digit sums D, from the levels
        scale_state = ref.state_dict()
        lanes = run_step(cy, ref, grads, residuals, n_workers)
        total = sum_in_order(lanes, rng.permutation(n_workers))
        if name != "none":
            # Any summation order gives the very same digit lanes: no carry, no rounding.
            # (A trailer lane is a float statistic: its last bit may depend on the order,
            # but every worker receives the same server sum.)
            again = sum_in_order(lanes, rng.permutation(n_workers))
            n_digit_lanes = total.size - cy.trailer_lanes
            assert_same(total[:n_digit_lanes], again[:n_digit_lanes])
            np.testing.assert_allclose(total[n_digit_lanes:], again[n_digit_lanes:], rtol=1e-14)
        out_cy = cy.decode(total, size, n_workers)
        out_ref = ref.decode(total, size, n_workers)
        assert_same(out_cy, out_ref)
        assert cy.state_dict() == ref.state_dict()
        if name != "none":
            # Decode is the affine map of the exact level sums, with the scale of this push.
            check = codecs.create(name, reference=True)
            check.load_state_dict(scale_state)
            assert_same(out_cy, check._values(levels, n_workers))


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL_CODECS)
def test_large_array_and_thread_counts(name):
    rng = np.random.default_rng(11)
    n = 1_234_567
    n_workers = 3
    grads = [gradient(rng, n, -4, 1) for _ in range(n_workers)]
    residuals = [gradient(rng, n, -6, -1) for _ in range(n_workers)]
    results = []
    for n_threads in (1, 2, 5):
        cy = codecs.create(name, num_threads=n_threads)
        for _ in range(2):   # second step: 1bit scale / 4bit group set by the first
            res = [r.copy() for r in residuals]
            lanes = [cy.encode(g, r, n_workers) for g, r in zip(grads, res)]
            total = sum_in_order(lanes, range(n_workers))
            out = cy.decode(total, n, n_workers)
        results.append((lanes, res, out, cy.state_dict()))
    ref = codecs.create(name, reference=True)
    for _ in range(2):
        res = [r.copy() for r in residuals]
        lanes = [ref.encode(g, r, n_workers) for g, r in zip(grads, res)]
        out = ref.decode(sum_in_order(lanes, range(n_workers)), n, n_workers)
    for got in results:
        for a, b in zip(got[0] + got[1] + [got[2]], lanes + res + [out]):
            assert_same(a, b)
        assert got[3] == ref.state_dict()


# ------------------------------------------------------------ quantization rules
def encode_one(c, g, r=None):
    """Single worker: (decoded own values, residual after) for a fresh copy of c's state."""
    g = np.asarray(g, np.float32)
    r = np.zeros_like(g) if r is None else np.asarray(r, np.float32).copy()
    lanes = c.encode(g, r, 1)
    dec = c.clone()
    dec.load_state_dict(c.state_dict())
    return dec.decode(lanes, g.size, 1), r


@pytest.mark.parametrize("reference", [False, True])
def test_2bit_exact_threshold(reference):
    c = codecs.create("2bit", threshold=0.3, num_threads=2, reference=reference)
    t = np.float32(0.3)
    below = np.nextafter(t, np.float32(0))
    g = np.array([t, -t, below, -below, 2 * t, 0.0, -0.0, 7 * t, -7 * t], np.float32)
    dec, r = encode_one(c, g)
    assert_same(dec, np.array([t, -t, 0, 0, t, 0, 0, t, -t], np.float32))
    np.testing.assert_array_equal(r, [0, 0, below, -below, t, 0, 0, g[7] - t, g[8] + t])
    # The residual carries to the next push: 0.2 + 0.1 reaches t only through it.
    dec, r = encode_one(c, [np.float32(0.1)], [np.float32(0.2)])
    assert dec[0] == (t if np.float32(0.1) + np.float32(0.2) >= t else 0)


@pytest.mark.parametrize("reference", [False, True])
@pytest.mark.parametrize("group", [1, 2, 3])
def test_4bit_exact_thresholds_per_group(reference, group):
    c = codecs.create("4bit", num_threads=2, reference=reference)
    c.load_state_dict({"codec": "4bit", "threshold": None, "group": group})
    x = fourbit.group_thresholds(group)
    below = np.nextafter(x, np.float32(0))
    g = np.concatenate([x, -x, below[1:], [below[0], -below[0], 3 * x[-1], 0]]).astype(np.float32)
    dec, r = encode_one(c, g)
    expected = np.concatenate([x, -x, x[:-1], [0, 0, x[-1], 0]]).astype(np.float32)
    assert_same(dec, expected)
    np.testing.assert_array_equal(r[:14], 0)
    assert r[-2] == g[-2] - x[-1]


@pytest.mark.parametrize("reference", [False, True])
def test_1bit_sign_and_first_push(reference):
    c = codecs.create("1bit", num_threads=2, reference=reference)
    g = np.array([0.5, -0.25, 0.0, -0.0, 2.0], np.float32)
    dec, r = encode_one(c, g)
    assert_same(dec, np.zeros(5, np.float32) * np.array([1, -1, 1, 1, 1], np.float32))
    np.testing.assert_array_equal(r, g)          # scale 0: everything stays in the residual
    c.load_state_dict({"codec": "1bit", "threshold": None, "scale": 0.75})
    dec, r = encode_one(c, g)
    np.testing.assert_array_equal(dec, np.float32(0.75) * np.array([1, -1, 1, 1, 1]))
    np.testing.assert_array_equal(r, g - dec)


@SETTINGS
@given(name=st.sampled_from(ALL_CODECS), seed=st.integers(0, 2 ** 32 - 1),
       size=st.sampled_from([1, 7, 4097]), reference=st.booleans())
def test_error_feedback_identity(name, seed, size, reference):
    rng = np.random.default_rng(seed)
    c = codecs.create(name, reference=reference, num_threads=2)
    if name == "1bit":
        c.load_state_dict({"codec": "1bit", "threshold": None,
                           "scale": 10 ** rng.uniform(-3, 1)})
    if name == "4bit":
        c.load_state_dict({"codec": "4bit", "threshold": None,
                           "group": int(rng.integers(1, 4))})
    g, r0 = gradient(rng, size), gradient(rng, size, -8, 0)
    dec, r1 = encode_one(c, g, r0)
    # g + r_before == decoded + r_after, up to the two float32 roundings (c = g + r, c - x).
    lhs = g.astype(np.float64) + r0
    rhs = dec.astype(np.float64) + r1
    c32 = g + r0
    tol = np.spacing(np.abs(c32)) / 2 + np.spacing(np.abs(r1)) / 2
    assert np.all(np.abs(lhs - rhs) <= tol)
    # In float32 the split is exact whenever c - x is (Sterbenz: |x|/2 <= |c| <= 2|x|, same
    # sign), always so for 2bit and 4bit, whose |x| <= |c|, when |c| <= 2|x|.
    a, x = np.abs(c32), np.abs(dec)
    exact = ((x <= 2 * a) & (a <= 2 * x)) | (dec == 0)
    if name in ("2bit", "4bit"):
        assert np.all(x <= a)
    np.testing.assert_array_equal((dec + r1)[exact], c32[exact])


def test_2bit_error_feedback_is_exact_on_a_dyadic_grid():
    rng = np.random.default_rng(5)
    c = codecs.create("2bit", threshold=0.5, num_threads=2)
    r = np.zeros(4097, np.float32)
    for _ in range(20):
        g = (rng.integers(-4096, 4097, 4097) / 256.0).astype(np.float32)
        r0 = r.copy()
        dec, r = encode_one(c, g, r0)
        np.testing.assert_array_equal(g.astype(np.float64) + r0, dec.astype(np.float64) + r)


def test_none_is_a_passthrough():
    rng = np.random.default_rng(2)
    c = codecs.create("none", num_threads=2)
    g, r = gradient(rng, 1001), gradient(rng, 1001, -3, -1)
    expected = g + r
    lanes = c.encode(g, r, 4)
    assert lanes.dtype == np.float32 and c.wire_dtype == np.float32
    assert_same(lanes, expected)
    np.testing.assert_array_equal(r, 0)
    assert_same(c.decode(lanes * 2, 1001, 4), lanes * 2)


# ------------------------------------------------------------ agreement through decode()
def test_1bit_scale_is_agreed_through_decode():
    rng = np.random.default_rng(7)
    n_workers, n = 4, 5000
    workers = [codecs.create("1bit", num_threads=2) for _ in range(n_workers)]
    residuals = [np.zeros(n, np.float32) for _ in range(n_workers)]
    for step in range(3):
        grads = [gradient(rng, n, -3, 0) for _ in range(n_workers)]
        means = [np.abs(g + r).astype(np.float64).mean() for g, r in zip(grads, residuals)]
        scale = workers[0].scale
        lanes = [w.encode(g, r, n_workers) for w, g, r in zip(workers, grads, residuals)]
        total = sum_in_order(lanes, rng.permutation(n_workers))
        outs = [w.decode(total, n, n_workers) for w in workers]
        for o in outs[1:]:
            assert_same(o, outs[0])
        if step == 0:
            np.testing.assert_array_equal(outs[0], 0)
        else:
            assert scale > 0
            np.testing.assert_allclose(np.abs(outs[0]).max(), n_workers * scale, rtol=1e-6)
        assert len({w.scale for w in workers}) == 1
        assert workers[0].scale == pytest.approx(np.mean(means), rel=1e-9)


@pytest.mark.parametrize("magnitude,group", [(1.0, 2), (0.3, 1), (0.01, 3)])
def test_4bit_group_is_agreed_through_decode(magnitude, group):
    rng = np.random.default_rng(8)
    n_workers, n = 3, 2000
    workers = [codecs.create("4bit", num_threads=1) for _ in range(n_workers)]
    assert {w.group for w in workers} == {fourbit.INITIAL_GROUP}
    grads = [(magnitude * rng.choice([-1, 1], n)).astype(np.float32) for _ in range(n_workers)]
    lanes = [w.encode(g, np.zeros(n, np.float32), n_workers) for w, g in zip(workers, grads)]
    total = sum_in_order(lanes, range(n_workers))
    for w in workers:
        w.decode(total, n, n_workers)
    assert {w.group for w in workers} == {group}
    # The next push quantizes with the agreed group's thresholds.
    dec, _ = encode_one(workers[0], np.full(1, 0.45, np.float32))
    assert dec[0] == {1: np.float32(0.4), 2: np.float32(0.3), 3: np.float32(0.09)}[group]


def test_4bit_group_boundaries():
    assert [fourbit.group_for_mean(m) for m in (0.0, 0.0999, 0.1, 0.3, 0.5, 0.5000001, 9.0)] \
        == [3, 3, 1, 1, 1, 2, 2]


# ------------------------------------------------------------ clone and state
@pytest.mark.parametrize("name", ALL_CODECS)
def test_clone_and_state_dict(name):
    rng = np.random.default_rng(9)
    c = codecs.create(name, threshold=0.25, num_threads=3)
    n = 3000
    g = gradient(rng, n, -1, 0.5)
    c.decode(c.encode(g, np.zeros(n, np.float32), 1), n, 1)   # moves 1bit/4bit state
    fresh = c.clone()
    assert (type(fresh), fresh.threshold, fresh.num_threads) == (type(c), c.threshold, 3)
    assert fresh.state_dict() == codecs.create(name, threshold=0.25).state_dict()
    if name in ("1bit", "4bit"):
        assert fresh.state_dict() != c.state_dict()
    fresh.load_state_dict(c.state_dict())
    assert fresh.state_dict() == c.state_dict()
    r1, r2 = np.zeros(n, np.float32), np.zeros(n, np.float32)
    assert_same(c.encode(g, r1, 2), fresh.encode(g, r2, 2))
    other = "2bit" if name != "2bit" else "1bit"
    with pytest.raises(ValueError, match="cannot load"):
        fresh.load_state_dict(codecs.create(other).state_dict())
    if name == "2bit":
        assert c.threshold == float(np.float32(0.25))
        with pytest.raises(ValueError, match="threshold"):
            codecs.create("2bit", threshold=0.5).load_state_dict(c.state_dict())


# ------------------------------------------------------------ errors
def test_registry():
    # every codec file of the package registers its codec, and nothing else is registered
    import glob
    folder = os.path.dirname(codecs.__file__)
    declared = set()
    for path in glob.glob(os.path.join(folder, "*.py")):
        with open(path) as f:
            declared |= set(re.findall(r'^    name = "([^"]+)"$', f.read(), re.M))
    assert codecs.available() == sorted(declared)
    assert {"1bit", "2bit", "4bit", "none"} <= declared
    listed = ", ".join("'%s'" % n for n in sorted(declared))
    with pytest.raises(ValueError, match=re.escape("valid names: " + listed)):
        codecs.create("3bit")
    assert codecs.create("2bit", reference=True).traits.reference
    assert not codecs.create("2bit").traits.reference
    assert codecs.create("2bit").threshold == 0.5
    with pytest.raises(TypeError):
        codecs.register(int)


def test_traits_are_one_frozen_record_per_instance():
    from slimgc_mx.codecs.base import Traits
    for name in codecs.available():
        for reference in (False, True):
            t = codecs.create(name, reference=reference).traits
            assert isinstance(t, Traits) and t.reference == reference
            with pytest.raises(dataclasses.FrozenInstanceError):
                t.fuses_local_update = True
    # a reference decodes with NumPy and runs no fused pass, whatever its codec declares
    assert codecs.create("2bit").traits.decodes_by_table
    assert not codecs.create("2bit", reference=True).traits.decodes_by_table
    assert not codecs.create("2bit", reference=True).traits.fuses_local_update
    # traits that follow the options (thc's rotation reads the gradient in its own pass)
    assert codecs.create("thc").traits.fuses_local_update
    assert not codecs.create("thc", hadamard=True).traits.fuses_local_update


@pytest.mark.parametrize("attr, fix", [("fuses_local_update", "fuses_local_update="),
                                       ("is_reference", "reference=")])
def test_a_trait_as_a_bare_class_attribute_is_refused(attr, fix):
    # nothing reads a bare attribute: it would be ignored without a word
    with pytest.raises(TypeError, match=r"sets %s as class attributes.*TRAITS = Traits\(%s"
                       % (attr, re.escape(fix))):
        type("Old", (codecs.create("2bit").__class__,), {attr: True})


@pytest.mark.parametrize("bad", [0, -0.5, float("nan"), float("inf"), 1e-50, 1e39, "0.5", True])
def test_bad_threshold_names_the_fix(bad):
    for name in ALL_CODECS:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the error alone, no numpy warning before it
            with pytest.raises(ValueError, match="threshold=0.5"):
                codecs.create(name, threshold=bad)


def test_threads_setting(monkeypatch):
    monkeypatch.setenv(env.NUM_THREADS_VAR, "3")
    assert codecs.create("2bit").num_threads == 3
    monkeypatch.setenv(env.NUM_THREADS_VAR, "zero")
    with pytest.raises(ValueError, match=env.NUM_THREADS_VAR):
        codecs.create("2bit")
    monkeypatch.delenv(env.NUM_THREADS_VAR)
    c = codecs.create("2bit")
    assert c.num_threads == env.available_cpus()
    c.num_threads = 2
    assert c.num_threads == 2
    for bad in (0, -1, 1.5, "2"):
        with pytest.raises(ValueError, match="num_threads"):
            c.num_threads = bad


@pytest.mark.parametrize("reference", [False, True])
@pytest.mark.parametrize("name", ALL_CODECS)
def test_bad_inputs(name, reference):
    c = codecs.create(name, num_threads=2, reference=reference)
    g, r = np.ones(10, np.float32), np.zeros(10, np.float32)
    n_lanes = c.lane_count(10, 2)
    cases = [
        (TypeError, "dtype float32", lambda: c.encode(g.astype(np.float64), r, 2)),
        (TypeError, "dtype float32", lambda: c.encode(g, r.astype(np.float16), 2)),
        (TypeError, "ndarray", lambda: c.encode(list(g), r, 2)),
        (ValueError, "1-D", lambda: c.encode(g.reshape(2, 5), r.reshape(2, 5), 2)),
        (ValueError, "contiguous", lambda: c.encode(np.ones(20, np.float32)[::2], r, 2)),
        (ValueError, "as many elements", lambda: c.encode(g, r[:9].copy(), 2)),
        (ValueError, "writeable", lambda: c.encode(g, read_only_zeros(10), 2)),
        (ValueError, "overlap", lambda: c.encode(g, g, 2)),
        (ValueError, "elements", lambda: c.encode(g, r, 2, out=np.empty(n_lanes + 1,
                                                                        c.wire_dtype))),
        (TypeError, "dtype", lambda: c.encode(g, r, 2, out=np.empty(n_lanes, np.int64))),
        (ValueError, "num_workers", lambda: c.encode(g, r, 0)),
        (ValueError, "elements", lambda: c.decode(np.zeros(n_lanes + 1, c.wire_dtype), 10, 2)),
        (TypeError, "dtype", lambda: c.decode(np.zeros(n_lanes, np.int32), 10, 2)),
        (ValueError, "elements", lambda: c.decode(np.zeros(n_lanes, c.wire_dtype), 10, 2,
                                                  out=np.empty(9, np.float32))),
        (ValueError, "size", lambda: c.decode(np.zeros(n_lanes, c.wire_dtype), -1, 2)),
    ]
    for exc, match, call in cases:
        with pytest.raises(exc, match=match):
            call()
    np.testing.assert_array_equal(r, 0)


@pytest.mark.parametrize("reference", [False, True])
@pytest.mark.parametrize("name", LANE_CODECS)
@pytest.mark.parametrize("lane", [np.nan, -1.0, 2.0 ** 53, np.inf])
def test_decode_refuses_lanes_out_of_range(name, reference, lane):
    c = codecs.create(name, num_threads=2, reference=reference)
    total = np.zeros(c.lane_count(100, 2))
    total[1] = lane
    with pytest.raises(ValueError, match="outside"):
        c.decode(total, 100, 2)


def read_only_zeros(n):
    a = np.zeros(n, np.float32)
    a.setflags(write=False)
    return a


@pytest.mark.parametrize("reference", [False, True])
@pytest.mark.parametrize("name", ALL_CODECS)
@pytest.mark.parametrize("poison", ["nan", "inf", "-inf"])
def test_non_finite_grad_leaves_residual_and_out_untouched(name, reference, poison):
    rng = np.random.default_rng(4)
    n = 5 * 65536 + 3   # several pre-check chunks
    g, r = gradient(rng, n, -3, 0), gradient(rng, n, -3, -1)
    for n_threads in (1, 2, 7):
        c = codecs.create(name, num_threads=n_threads, reference=reference)
        for i in (0, n - 1, int(rng.integers(n))):   # first, last, any chunk
            g2, r2 = g.copy(), r.copy()
            g2[i] = float(poison)
            out = np.full(c.lane_count(n, 2), 7, c.wire_dtype)
            with pytest.raises(codecs.NonFiniteGradientError, match=r"grad\[%d\]" % i):
                c.encode(g2, r2, 2, out=out)
            assert_same(r2, r)
            np.testing.assert_array_equal(out, 7)
    assert issubclass(codecs.NonFiniteGradientError, ValueError)


@pytest.mark.parametrize("reference", [False, True])
@pytest.mark.parametrize("name", ALL_CODECS)
@pytest.mark.parametrize("poison", ["overflow", "residual"])
def test_non_finite_compensated_sum_raises(name, reference, poison):
    # grad is finite, grad + residual is not: the kernels find it while encoding (the
    # reference before); either way the error names the index.
    rng = np.random.default_rng(6)
    n = 3 * 65536 + 1
    c = codecs.create(name, num_threads=2, reference=reference)
    for i in (0, n - 1, int(rng.integers(n))):
        g, r = gradient(rng, n, -3, 0), gradient(rng, n, -3, -1)
        if poison == "overflow":
            g[i], r[i] = 3e38, 3e38
        else:
            r[i] = np.nan
        r_before = r.copy()
        with pytest.raises(codecs.NonFiniteGradientError, match="index %d " % i) as exc:
            c.encode(g, r, 2)
        if reference:
            assert_same(r, r_before)
        else:
            assert "reset the residual" in str(exc.value)


@pytest.mark.parametrize("name", ALL_CODECS)
def test_grad_checked_skips_only_the_pre_check(name):
    # The kvstore's local update counts NaN/Inf in the gradient; the encoder then skips
    # its read-only pass. Finite gradients give the same lanes and residual; a NaN the
    # caller missed is still found, while encoding, and the message says so.
    rng = np.random.default_rng(8)
    n = 3 * 65536 + 5
    g, r = gradient(rng, n, -3, 0), gradient(rng, n, -3, -1)
    a, b = codecs.create(name, num_threads=2), codecs.create(name, num_threads=2)
    r1, r2 = r.copy(), r.copy()
    assert_same(a.encode(g, r1, 2), b.encode(g, r2, 2, grad_checked=True))
    assert_same(r1, r2)
    g[n // 2] = np.nan
    with pytest.raises(codecs.NonFiniteGradientError,
                       match=r"grad\[%d\].*grad_checked=True.*reset the residual" % (n // 2)):
        b.encode(g, r2, 2, grad_checked=True)


@pytest.mark.parametrize("name, bad", [("1bit", -1.0), ("1bit", float("inf")),
                                       ("terngrad", float("nan")), ("terngrad", -0.5),
                                       ("thc", float("inf")), ("thc", 0.1)])
def test_a_checkpointed_scale_outside_the_codecs_rule_is_refused(name, bad):
    c = codecs.create(name)
    state = dict(c.state_dict(), scale=bad)
    with pytest.raises(ValueError, match="%s scale must be %s, got" % (name, re.escape(
            type(c).scale_rule))):
        c.load_state_dict(state)
    good = dict(c.state_dict(), scale=0.5)
    c.load_state_dict(good)
    assert c.scale == 0.5 and c.state_dict()["scale"] == 0.5
