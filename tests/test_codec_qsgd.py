"""qsgd: the codec contract, per-bucket norms agreed through the gathered trailer, the bucket
rule, options and errors."""
import numpy as np
import pytest

from codec_contract import (assert_same, check_error_feedback_identity,
                            check_kernel_equals_reference, check_state_round_trip,
                            check_sums_in_any_order_decode_alike, check_threads_bitwise_equal,
                            check_unbiased, make, run_steps)
from slimgc_mx import codecs
from slimgc_mx.codecs.base import kernels


@pytest.mark.parametrize("n_workers", [1, 2, 3, 16])
@pytest.mark.parametrize("size", [1, 7, 4097, pytest.param(70001, marks=pytest.mark.slow)])
@pytest.mark.parametrize("options", [{}, {"levels": 1, "bucket_size": 4},
                                     {"levels": 3, "bucket_size": 1024}])
def test_kernel_equals_reference(n_workers, size, options):
    check_kernel_equals_reference("qsgd", n_workers, size, options=options)


@pytest.mark.parametrize("options", [{}, {"levels": 7, "bucket_size": 16}])
def test_threads_and_orders_and_error_feedback(options):
    check_threads_bitwise_equal("qsgd", options=options)
    check_sums_in_any_order_decode_alike("qsgd", options=options)
    check_error_feedback_identity("qsgd", options=dict(options, error_feedback=True,
                                                           allow_unbiased_feedback=True))
    check_state_round_trip("qsgd", options)


def test_unbiased_when_the_norms_cover_the_gradient():
    state = codecs.create("qsgd", bucket_size=64).state_dict()
    state["norms"] = [4.0] * 32  # 2000 elements, 32 buckets; every |g| lies below 4
    # rounding to a grid of step norm / s (s = 16 by default): variance <= step * |g|
    check_unbiased("qsgd", state, variance=lambda g: (4.0 / 16) * np.abs(g),
                   options={"bucket_size": 64})


def test_the_norms_are_the_max_over_workers_of_the_last_push():
    size, bucket = 5000, 256
    h = run_steps("qsgd", 3, size, 2, {"bucket_size": bucket}, seed=1)
    nb = -(-size // bucket)
    expected = np.zeros(nb)
    for g in h[0]["grads"]:  # the first push: residual 0, so c = g
        padded = np.zeros(nb * bucket)
        padded[:size] = g
        expected = np.maximum(expected, np.sqrt((padded.reshape(nb, bucket) ** 2).sum(axis=1)))
    got = np.array(h[0]["state"]["norms"])
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert not h[0]["decoded"][0].any()  # the first push sends zeros: norms 0
    # the second push: each element is a multiple of its bucket's norm / s, |sum| <= 3 norms
    per_element = np.repeat(got, bucket)[:size]
    s = codecs.create("qsgd").s  # the default levels per sign
    units = h[1]["decoded"][0] / per_element * s
    assert np.allclose(units, np.round(units), atol=1e-3)
    assert np.abs(units).max() <= 3 * s + 1e-3


def test_the_norms_of_a_push_are_the_l2_norms_of_c():
    c = codecs.create("qsgd", bucket_size=8, reference=True)
    g = np.arange(1, 17, dtype=np.float32)
    wire = c.encode(g, np.zeros(16, np.float32), 1)
    np.testing.assert_allclose(wire[-2:], [np.sqrt((g[:8] ** 2).sum()),
                                           np.sqrt((g[8:] ** 2).sum())], rtol=1e-7)


def test_levels_one_is_ternary_with_norm_scale():
    (c,) = make("qsgd", 1, False, {"levels": 1, "bucket_size": 8})
    c.norms = np.array([2.0], np.float32)
    g = np.array([-3, -2, -1, 0, 0.5, 1, 2, 3], np.float32)
    r = np.zeros(8, np.float32)
    wire = c.encode(g, r, 1)
    values = c.decode(wire, 8, 1)
    assert set(values.tolist()) <= {-2.0, 0.0, 2.0}
    assert values[0] == -2.0 and values[-1] == 2.0 and values[3] == 0.0
    assert r[0] == -1.0 and r[-1] == 1.0  # what lies above the norm stays in the residual


def test_a_tensor_of_another_size_is_refused():
    c = codecs.create("qsgd", bucket_size=64)
    c.load_state_dict(dict(c.state_dict(), norms=[1.0] * 3))
    with pytest.raises(ValueError, match="holds the norms of 3 buckets"):
        c.encode(np.zeros(1000, np.float32), np.zeros(1000, np.float32), 2)


@pytest.mark.parametrize("bad", [0, 3, 48, 2048, "lots", 1.5, True])
def test_bad_bucket_sizes_name_the_rule(bad):
    with pytest.raises(ValueError, match="codec 'qsgd': option bucket_size=.*power of two in "
                                         "1..1024: a bucket must lie inside"):
        codecs.create("qsgd", bucket_size=bad)


@pytest.mark.parametrize("bad", [0, -1, 32768, "x"])
def test_bad_levels_name_the_rule(bad):
    with pytest.raises(ValueError, match="codec 'qsgd': option levels=.*1..32767"):
        codecs.create("qsgd", levels=bad)


def test_options_and_geometry():
    c = codecs.create("qsgd", levels="8", bucket_size="128")
    assert (c.s, c.levels, c.bucket) == (8, 17, 128)
    assert c.geometry(2)[0] == 2 * 16 + 1
    assert c.lane_count(1000, 2) == -(-1000 // c.geometry(2)[1]) + 2 * 8
    assert not c.traits.decodes_by_table
    with pytest.raises(ValueError, match="codec 'qsgd' has no option clip_sigma"):
        codecs.create("qsgd", clip_sigma=1.0)


def test_bad_state_is_refused():
    c = codecs.create("qsgd")
    with pytest.raises(ValueError, match="finite numbers >= 0"):
        c.load_state_dict(dict(c.state_dict(), norms=[1.0, -1.0]))
    with pytest.raises(ValueError, match="finite numbers >= 0"):
        c.load_state_dict(dict(c.state_dict(), norms=[float("nan")]))


def test_negative_gathered_norms_are_refused():
    c = codecs.create("qsgd", bucket_size=8)
    lanes = c.encode(np.ones(8, np.float32), np.zeros(8, np.float32), 1)
    lanes[-1] = -1.0
    with pytest.raises(ValueError, match="negative"):
        c.decode(lanes, 8, 1)


def test_kernel_decode_equals_reference_decode_with_norms():
    rng = np.random.default_rng(5)
    size, n = 10007, 3
    cs = [codecs.create("qsgd", bucket_size=32, reference=ref) for ref in (False, True)]
    norms = rng.random(-(-size // 32)).astype(np.float32) * 3
    for c in cs:
        c.norms = norms.copy()
    radix, k = cs[0].geometry(n)
    digits = rng.integers(0, radix, size)
    lanes = np.zeros(cs[0].lane_count(size, n))
    n_lanes = -(-size // k)
    padded = np.zeros(n_lanes * k, np.int64)
    padded[:size] = digits
    lanes[:n_lanes] = (padded.reshape(n_lanes, k) * radix ** np.arange(k)).sum(axis=1)
    a, b = (c.decode(lanes, size, n) for c in cs)
    assert_same(a, b, "decode")


@pytest.mark.parametrize("start, count", [(0, 1), (1, 1), (0, 64), (1, 64), (7, 3392),
                                          (10 ** 9 + 1, 100)])
def test_block_uniforms_equal_the_element_generator(start, count):
    """The level loops fill their uniforms a pair per hash; element by element and in NumPy
    the numbers are the same."""
    from slimgc_mx.codecs import rng
    seed = rng.mix64(99)
    block = kernels().uniforms(seed, start, count)
    np.testing.assert_array_equal(block, rng.uniform(seed, start, count))
    np.testing.assert_array_equal(block[:5], [kernels().uniform(seed, start + i)
                                              for i in range(min(5, count))])
    u = rng.uniform(seed, 0, 200_000)
    assert abs(u.mean() - 0.5) < 0.005 and abs(np.corrcoef(u[::2], u[1::2])[0, 1]) < 0.01


# ---------------------------------------------------------------- through the kvstore
# (pushpull against the reference: tests/test_kvstore.py, every codec)
def test_workers_train_to_the_same_weights():
    import training_helpers as th  # imports MXNet: only the kvstore tests need it
    th.check_workers_train_to_the_same_weights("qsgd", bucket_size=128)
