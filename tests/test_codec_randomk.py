"""randomk: the codec contract, the shared stratified draw, the wire, NaN/Inf, options."""
import numpy as np
import pytest

from codec_contract import (check_error_feedback_identity, check_kernel_equals_reference,
                            check_state_round_trip, check_threads_bitwise_equal,
                            check_workers_agree_in_any_order, make, run_steps)
from slimgc_mx import codecs
from slimgc_mx.codecs import NonFiniteGradientError, rng
from slimgc_mx.codecs.randomk import strata_indices


@pytest.mark.parametrize("n_workers", [1, 2, 3, 16])
@pytest.mark.parametrize("size", [1, 7, 4097, pytest.param(200_003, marks=pytest.mark.slow)])
@pytest.mark.parametrize("options", [{}, {"ratio": 0.3}, {"ratio": 1.0}])
def test_kernel_equals_reference(n_workers, size, options):
    check_kernel_equals_reference("randomk", n_workers, size, options=options)


def test_threads_orders_error_feedback_and_state():
    check_threads_bitwise_equal("randomk")
    check_threads_bitwise_equal("randomk", size=65536 * 3 + 5, options={"ratio": 1e-5})
    check_workers_agree_in_any_order("randomk")
    check_error_feedback_identity("randomk")
    check_error_feedback_identity("randomk", options={"ratio": 0.5})
    check_state_round_trip("randomk", {"ratio": 0.05})


@pytest.mark.parametrize("n, k", [(1, 1), (10, 3), (1000, 10), (1000, 999), (12345, 1),
                                  (200_003, 2000)])
def test_k_distinct_indices_one_per_stratum(n, k):
    idx = strata_indices(rng.mix64(7), n, k)
    assert idx.shape == (k,) and len(np.unique(idx)) == k
    s = np.arange(k)
    assert ((s * n // k <= idx) & (idx < (s + 1) * n // k)).all()
    if n >= 2 * k:  # strata wide enough that another seed draws other indices
        assert not np.array_equal(idx, strata_indices(rng.mix64(8), n, k))


def test_the_kernel_sends_exactly_the_drawn_indices_and_keeps_the_rest():
    n = 70_001
    c = codecs.create("randomk", ratio=0.02)
    c.seed = rng.key_seed(3, 5)
    k = c.count(n)
    assert k == round(0.02 * n)
    g = (np.random.default_rng(0).standard_normal(n) + 3).astype(np.float32)  # no zeros
    r = np.full(n, 0.25, np.float32)
    out = c.encode(g, r, 4)
    idx = strata_indices(c.push_seed(), n, k)
    np.testing.assert_array_equal(out, (g + np.float32(0.25))[idx])
    assert np.flatnonzero(r == 0).tolist() == sorted(idx.tolist())
    total = out * 4
    dec = c.decode(total, n, 4)
    assert np.flatnonzero(dec).tolist() == sorted(idx.tolist())
    np.testing.assert_array_equal(dec[idx], total)
    assert c.pushes == 1  # the next push draws other indices
    assert not np.array_equal(strata_indices(c.push_seed(), n, k), idx)


def test_every_worker_draws_the_same_indices_and_other_keys_others():
    h = run_steps("randomk", 3, 5000, 2, {"ratio": 0.1}, seed=1)
    for step, record in enumerate(h):
        idx = strata_indices(rng.mix64(rng.key_seed(0, 0) + step), 5000, 500)
        for r in record["residuals"]:
            assert (r[idx] == 0).all()  # every worker sent these
        assert np.isin(np.flatnonzero(record["decoded"][0]), idx).all()
    a, b = make("randomk", 1, False, {}, key=0)[0], make("randomk", 1, False, {}, key=1)[0]
    assert not np.array_equal(strata_indices(a.push_seed(), 5000, 50),
                              strata_indices(b.push_seed(), 5000, 50))


def test_every_element_is_drawn_about_equally_often():
    n, k, pushes = 1000, 10, 20000
    c = codecs.create("randomk", ratio=k / n)
    counts = np.zeros(n)
    for push in range(pushes):
        c.pushes = push
        counts[strata_indices(c.push_seed(), n, k)] += 1
    expected = pushes * k / n  # 200 per element; sd ~ 14
    assert abs(counts.mean() - expected) < 1e-9
    assert counts.min() > expected - 6 * np.sqrt(expected)
    assert counts.max() < expected + 6 * np.sqrt(expected)


def test_wire_is_one_sum_round_of_k_float32_whatever_n():
    c = codecs.create("randomk", ratio=0.01)
    for workers in (1, 2, 7, 64, 1000):
        assert c.wire_rounds(1 << 20, (1024, 1024), workers) == [
            ("sum", (10486,), (10486,), np.dtype(np.float32))]
        assert c.wire_bits_per_element(workers) == pytest.approx(0.32)
    assert c.lane_count(10, 2) == 1 and c.lane_count(0, 2) == 0
    assert codecs.create("randomk", ratio=1.0).lane_count(7, 3) == 7
    with pytest.raises(ValueError, match="at most 2\\*\\*31 - 1"):
        c.count(1 << 31)


def test_nonfinite_gradients_raise_before_anything_is_written():
    for reference in (False, True):
        c = codecs.create("randomk", ratio=0.5, reference=reference)
        g = np.ones(300_000, np.float32)
        g[123_456] = np.nan
        r = np.full(300_000, 0.5, np.float32)
        out = np.full(c.count(g.size), 7.0, np.float32)
        with pytest.raises(NonFiniteGradientError, match="grad\\[123456\\]"):
            c.encode(g, r, 2, out=out)
        assert (r == 0.5).all() and (out == 7.0).all()
        g[123_456] = 1.0
        g[5] = r[5] = np.float32(3e38)  # g + r overflows
        with pytest.raises(NonFiniteGradientError, match="grad \\+ residual is not"):
            c.encode(g, r, 2, out=out)


def test_the_default_ratio_is_a_half():
    assert codecs.create("randomk").count(1000) == 500


def test_bad_arguments_name_the_problem():
    c = codecs.create("randomk", ratio=0.01)
    with pytest.raises(ValueError, match="out must have 10 elements"):
        c.encode(np.ones(1000, np.float32), np.zeros(1000, np.float32), 2,
                 out=np.zeros(9, np.float32))
    with pytest.raises(ValueError, match="wire_sum must have 10 elements"):
        c.decode(np.zeros(11, np.float32), 1000, 2)
    with pytest.raises(TypeError, match="dtype float32"):
        c.decode(np.zeros(10, np.float64), 1000, 2)


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.5, float("nan"), float("inf"), "lots", True])
def test_bad_options_name_the_option(bad):
    with pytest.raises(ValueError, match="codec 'randomk': option ratio="):
        codecs.create("randomk", ratio=bad)
    with pytest.raises(ValueError, match="codec 'randomk' has no option rank"):
        codecs.create("randomk", rank=4)
    assert codecs.create("randomk", ratio="0.25").ratio == 0.25


@pytest.mark.parametrize("ratio, momentum, advised", [
    (0.1, 0.9, True), (0.25, 0.5, True), (0.01, 0.9, True),
    (0.5, 0.9, False), (1.0, 0.99, False), (0.1, 0.0, False)])
def test_momentum_advice_below_half_with_momentum(ratio, momentum, advised):
    for reference in (False, True):
        text = codecs.create("randomk", ratio=ratio, reference=reference).momentum_advice(momentum)
        assert (text is not None) == advised
        if advised:
            assert "ratio=%g" % ratio in text and "momentum %g" % momentum in text
            assert "use ratio >= 0.5 or momentum 0" in text


def test_the_engine_warns_once_per_process(monkeypatch):
    import warnings
    from slimgc_mx.engine import planner
    monkeypatch.setattr(planner, "_ADVISED", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            planner.check_momentum(codecs.create("randomk", ratio=0.1), 0.9, "%r %r")
        planner.check_momentum(codecs.create("randomk"), 0.9, "%r %r")
        planner.check_momentum(codecs.create("randomk", ratio=0.1), 0.0, "%r %r")
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(said) == 1 and "codec 'randomk': ratio=0.1" in said[0]
