"""terngrad: the codec contract, its scale agreed through the gathered trailer, clipping,
the RNG, options and errors."""
import numpy as np
import pytest

from codec_contract import (check_error_feedback_identity, check_kernel_equals_reference,
                            check_state_round_trip, check_sums_in_any_order_decode_alike,
                            check_threads_bitwise_equal, check_unbiased, run_steps)
from slimgc_mx import codecs
from slimgc_mx.codecs import rng
from slimgc_mx.codecs.base import kernels


@pytest.mark.parametrize("n_workers", [1, 2, 3, 16])
@pytest.mark.parametrize("size", [1, 7, 4097, pytest.param(70001, marks=pytest.mark.slow)])
@pytest.mark.parametrize("options", [{}, {"clip_sigma": 0.0}])
def test_kernel_equals_reference(n_workers, size, options):
    check_kernel_equals_reference("terngrad", n_workers, size, options=options)


def test_threads_and_orders_and_error_feedback():
    check_threads_bitwise_equal("terngrad")
    check_sums_in_any_order_decode_alike("terngrad")
    check_error_feedback_identity("terngrad", options={"error_feedback": True,
                                                       "allow_unbiased_feedback": True})
    check_state_round_trip("terngrad", {"clip_sigma": 2.5})


def test_unbiased_when_the_scale_covers_the_gradient():
    state = codecs.create("terngrad").state_dict()
    state["scale"] = 4.0  # above every |g| of the test gradient
    check_unbiased("terngrad", state, variance=lambda g: 4.0 * np.abs(g))


def test_the_scale_is_the_max_over_workers_of_the_last_push():
    h = run_steps("terngrad", 3, 5000, 2, {"clip_sigma": 0.0}, seed=1)
    first = max(float(np.abs(g).max()) for g in h[0]["grads"])
    assert h[0]["state"]["scale"] == float(np.float32(first))
    assert not h[0]["decoded"][0].any()  # the first push sends zeros: scale 0
    levels = np.unique(h[1]["decoded"][0] / h[0]["state"]["scale"])
    assert set(np.round(levels).astype(int)) <= set(range(-3, 4))  # 3 workers' {-1, 0, 1}


def test_clipping_lowers_the_scale_to_a_multiple_of_the_spread():
    assert codecs.create("terngrad").clip_sigma == 2.5  # the paper's, by default
    h = run_steps("terngrad", 2, 20000, 1, {}, seed=2)
    spread = max(2.5 * float(g.astype(np.float64).std()) for g in h[0]["grads"])
    assert h[0]["state"]["scale"] <= spread * 1.01


def test_rng_kernels_and_numpy_draw_the_same():
    for seed in (0, 1, 2 ** 64 - 1, rng.mix64(12345)):
        expected = rng.uniform(seed, 10 ** 9, 64)
        got = np.array([kernels().uniform(seed, 10 ** 9 + i) for i in range(64)], np.float32)
        np.testing.assert_array_equal(got, expected)
        assert (expected >= 0).all() and (expected < 1).all()


@pytest.mark.parametrize("bad", [-1.0, float("nan"), "lots", True])
def test_bad_options_name_the_option(bad):
    with pytest.raises(ValueError, match="codec 'terngrad': option clip_sigma="):
        codecs.create("terngrad", clip_sigma=bad)
    with pytest.raises(ValueError, match="codec 'terngrad' has no option levels"):
        codecs.create("terngrad", levels=4)


@pytest.mark.parametrize("name", ["terngrad", "qsgd"])
@pytest.mark.parametrize("reference", [False, True])
def test_unbiased_codecs_keep_only_the_clipped_part_unless_asked(name, reference):
    # the rounding noise would pile up; what the lagged scale cut off is kept either way
    rng = np.random.default_rng(3)
    g = rng.standard_normal(3000).astype(np.float32)
    for feedback in (False, True):
        c = codecs.create(name, reference=reference, error_feedback=feedback,
                          allow_unbiased_feedback=feedback, num_threads=2)
        c.load_state_dict(dict(c.state_dict(), **({"scale": 1.0} if name == "terngrad"
                                                  else {"norms": [1.0] * 6})))
        residual = np.full(3000, 0.25, np.float32)
        compensated = g + np.float32(0.25)
        sent = c.decode(c.encode(g, residual, 1), 3000, 1)
        if feedback:
            np.testing.assert_allclose(residual, compensated - sent, atol=1e-6)
        else:
            np.testing.assert_array_equal(residual, compensated - np.clip(compensated, -1, 1))
            assert (residual != 0).sum() > 100  # |c| > 1 happens
    with pytest.raises(ValueError, match="error_feedback"):
        codecs.create(name, error_feedback="maybe")
