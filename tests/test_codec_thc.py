"""thc: the codec contract with and without the rotation, the range agreed through the
gathered trailer, the grid, the rotation itself, options and errors."""
import numpy as np
import pytest

from codec_contract import (assert_same, check_error_feedback_identity,
                            check_kernel_equals_reference, check_state_round_trip,
                            check_sums_in_any_order_decode_alike, check_threads_bitwise_equal,
                            check_unbiased, make, run_steps)
from slimgc_mx import codecs
from slimgc_mx.codecs import thc
from slimgc_mx.codecs.base import NonFiniteGradientError, kernels

ROTATED = {"hadamard": True}


@pytest.mark.parametrize("n_workers", [1, 2, 3, 16])
@pytest.mark.parametrize("size", [1, 7, 4097, pytest.param(70001, marks=pytest.mark.slow)])
@pytest.mark.parametrize("options", [{}, {"granularity": 2, "allow_unbiased_feedback": True},
                                     {"granularity": 5, **ROTATED}])
def test_kernel_equals_reference(n_workers, size, options):
    check_kernel_equals_reference("thc", n_workers, size, options=options)


@pytest.mark.parametrize("options", [{}, ROTATED])
def test_threads_and_orders_and_error_feedback(options):
    check_threads_bitwise_equal("thc", options=options)
    check_sums_in_any_order_decode_alike("thc", options=options)
    check_error_feedback_identity("thc", options=options)
    check_state_round_trip("thc", options)


def test_unbiased_when_the_range_covers_the_gradient():
    state = codecs.create("thc").state_dict()
    state["scale"] = 4.0  # M above every |g|: nothing is clamped
    step = 2 * 4.0 / 15
    check_unbiased("thc", state, variance=lambda g: np.full_like(g, step * step / 4))


def test_unbiased_with_the_rotation():
    state = codecs.create("thc", **ROTATED).state_dict()
    state["scale"] = 8.0  # the rotated values of the test gradient lie far below 8
    step = 2 * 8.0 / 15
    check_unbiased("thc", state, variance=lambda g: np.full_like(g, step * step / 4),
                   options=ROTATED)


@pytest.mark.parametrize("options", [{}, ROTATED])
def test_the_range_is_the_max_over_workers_of_the_last_push(options):
    h = run_steps("thc", 3, 5000, 2, options, seed=1)
    if options:
        c = codecs.create("thc", reference=True, **options)
        c.seed = make("thc", 1, True, options)[0].seed
        first = max(float(np.abs(c._rotate(g, 8192)).max()) for g in h[0]["grads"])
    else:
        first = max(float(np.abs(g).max()) for g in h[0]["grads"])
    assert h[0]["state"]["scale"] == float(np.float32(first))
    assert not h[0]["decoded"][0].any()  # the first push sends zeros: M = 0


def test_levels_lie_on_the_uniform_grid():
    (c,) = make("thc", 1, False, {"granularity": 5})
    c.scale = 2.0  # grid -2, -1, 0, 1, 2
    g = np.array([-3, -2, -1.5, 0, 0.25, 1, 2, 5], np.float32)
    r = np.zeros(8, np.float32)
    values = c.decode(c.encode(g, r, 1), 8, 1)
    assert set(values.tolist()) <= {-2.0, -1.0, 0.0, 1.0, 2.0}
    assert values[0] == -2.0 and values[-1] == 2.0 and values[3] == 0.0 and values[5] == 1.0
    assert r[0] == -1.0 and r[-1] == 3.0  # what the clamp cuts off stays in the residual


def test_workers_levels_add_on_the_grid():
    h = run_steps("thc", 4, 3000, 2, {"granularity": 16}, seed=3)
    step = np.float32(2 * h[0]["state"]["scale"] / 15)
    units = h[1]["decoded"][0] / step  # sum of 4 workers' (q - 7.5): multiples of 0.5 ... of 1
    assert np.allclose(units, np.round(units), atol=1e-3)
    assert np.abs(units).max() <= 4 * 7.5 + 1e-3


def test_decodes_by_table_only_without_the_rotation():
    assert codecs.create("thc").traits.decodes_by_table
    assert not codecs.create("thc", **ROTATED).traits.decodes_by_table
    assert not codecs.create("thc", reference=True).traits.decodes_by_table


def test_the_rotation_pads_to_a_power_of_two():
    c = codecs.create("thc", **ROTATED)
    _, k = c.geometry(2)
    assert c.lane_count(5000, 2) == -(-8192 // k) + 2
    assert codecs.create("thc").lane_count(5000, 2) == -(-5000 // k) + 2
    assert [thc.padded_size(n) for n in (0, 1, 2, 3, 4096, 4097)] == [0, 1, 2, 4, 4096, 8192]


@pytest.mark.parametrize("p", [1, 2, 8, 64, 4096, 8192, 1 << 16])
def test_rotation_kernels_equal_the_reference_and_invert(p):
    rng = np.random.default_rng(p)
    n = max(1, p - p // 3)
    g = rng.standard_normal(n).astype(np.float32)
    r = rng.standard_normal(n).astype(np.float32)
    ref = codecs.create("thc", reference=True, **ROTATED)
    f = ref._factor(p)
    y = np.empty(p, np.float32)
    for threads in (1, 3):
        assert kernels().thc_rotate(g, r, y, ref._sign_seed(), f, threads) == 0
        assert_same(y, ref._rotate(g + r, p), "rotation")
    back = np.empty(n, np.float32)
    kernels().thc_unrotate(y.copy(), back, None, None, ref._sign_seed(), f, 2)
    assert_same(back, ref._unrotate(y, n), "rotation back")
    np.testing.assert_allclose(back, g + r, atol=1e-5)
    res = r.copy()
    kernels().thc_unrotate(y.copy(), None, g, res, ref._sign_seed(), f, 2)
    assert_same(res, (g + r) - back, "residual")


def test_rotation_overflow_is_a_clear_error():
    g = np.full(4, 3e38, np.float32)
    for ref in (False, True):
        c = codecs.create("thc", reference=ref, **ROTATED)
        r = np.zeros(4, np.float32)
        with pytest.raises(NonFiniteGradientError, match="rotation .* overflows float32"):
            c.encode(g, r, 1)
        assert not r.any()


def test_nan_is_refused_before_anything_is_written():
    g = np.ones(100, np.float32)
    g[7] = np.nan
    for options in ({}, ROTATED):
        c = codecs.create("thc", **options)
        r = np.zeros(100, np.float32)
        with pytest.raises(NonFiniteGradientError, match="grad\\[7\\]"):
            c.encode(g, r, 2)
        assert not r.any()


@pytest.mark.parametrize("bad", [1, 0, 65537, "x", 2.5])
def test_bad_granularity_names_the_rule(bad):
    with pytest.raises(ValueError, match="codec 'thc': option granularity=.*2..65536"):
        codecs.create("thc", granularity=bad)


def test_options():
    c = codecs.create("thc", granularity="8", hadamard="true")
    assert (c.levels, c.hadamard) == (8, True)
    assert c.geometry(3)[0] == 3 * 7 + 1
    with pytest.raises(ValueError, match="codec 'thc': option hadamard=1"):
        codecs.create("thc", hadamard=1)
    with pytest.raises(ValueError, match="codec 'thc' has no option levels"):
        codecs.create("thc", levels=4)


def test_bad_state_and_sums_are_refused():
    c = codecs.create("thc")
    for bad in (-1.0, float("inf"), 0.1):  # 0.1 is no float32 value
        with pytest.raises(ValueError, match="thc scale"):
            c.load_state_dict(dict(c.state_dict(), scale=bad))
    lanes = c.encode(np.ones(8, np.float32), np.zeros(8, np.float32), 1)
    lanes[-1] = -1.0
    with pytest.raises(ValueError, match="negative"):
        c.decode(lanes, 8, 1)


def test_a_tiny_range_counts_as_zero():
    c = codecs.create("thc")
    c._agree(np.array([[1e-44]]))
    assert c.scale == 0.0


# ---------------------------------------------------------------- through the kvstore
# (pushpull against the reference: tests/test_kvstore.py, every codec)
@pytest.mark.parametrize("options", [{}, ROTATED])
def test_workers_train_to_the_same_weights(options):
    """Without the rotation the SGD kernel decodes inside its update (the table)."""
    import training_helpers as th  # imports MXNet: only the kvstore tests need it
    th.check_workers_train_to_the_same_weights("thc", **options)


def test_the_sgd_kernel_decodes_thc_by_its_table():
    rng = np.random.default_rng(2)
    c = codecs.create("thc")
    c.scale = 1.5
    g = rng.standard_normal(3000).astype(np.float32)
    lanes = c.encode(g, np.zeros(3000, np.float32), 2)
    lanes = lanes + lanes  # two workers that sent the same
    state = c.state_dict()
    expected = c.decode(lanes, 3000, 2)
    c.load_state_dict(state)
    k, m, rows = c.decode_table(lanes, 3000, 2)
    w = np.zeros(3000, np.float32)
    kernels().decode_sgd_step(lanes, rows, k, m, w, None, 1.0, 0.0, 1.0, 0.0, -1.0, 2)
    assert_same(w, np.float32(0) - expected, "weights")
    assert c.state_dict() == dict(state, scale=c.scale, pushes=state["pushes"] + 1)
