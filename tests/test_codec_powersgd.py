"""powersgd: the codec contract over matrix shapes, the rounds, P_hat, the warm start,
which shapes it compresses, NaN/Inf, state and options."""
import math

import numpy as np
import pytest

from codec_contract import (check_error_feedback_identity, check_kernel_equals_reference,
                            check_state_round_trip, check_threads_bitwise_equal,
                            check_workers_agree_in_any_order, make, push, run_steps)
from slimgc_mx import codecs
from slimgc_mx.codecs import NonFiniteGradientError
from slimgc_mx.codecs.powersgd import orthonormalize

SHAPES = [(6, 20), (33, 7, 3), (200, 301), (5, 4097)]


@pytest.mark.parametrize("n_workers", [1, 2, 3, 16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("options", [{}, {"rank": 1}, {"rank": 3}])
def test_kernel_equals_reference(n_workers, shape, options):
    check_kernel_equals_reference("powersgd", n_workers, int(np.prod(shape)), options=options,
                                  shape=shape)


def test_threads_orders_error_feedback_and_state():
    check_threads_bitwise_equal("powersgd", size=300 * 1001, shape=(300, 1001))
    check_threads_bitwise_equal("powersgd", size=3 * 70001, shape=(3, 70001), options={"rank": 2})
    check_workers_agree_in_any_order("powersgd", size=64 * 64, shape=(64, 8, 8))
    check_error_feedback_identity("powersgd", size=40 * 100, shape=(40, 100))
    check_error_feedback_identity("powersgd", size=7 * 9, shape=(7, 9), options={"rank": 1})
    check_state_round_trip("powersgd", {"rank": 2}, shape=(20, 50))


def test_p_hat_is_orthonormal_and_every_worker_gets_the_same_one():
    rng = np.random.default_rng(0)
    p = rng.standard_normal((500, 4)).astype(np.float32)
    h = orthonormalize(p)
    assert h.dtype == np.float32 and h.flags.c_contiguous
    np.testing.assert_allclose(h.T.astype(np.float64) @ h, np.eye(4), atol=1e-6)
    np.testing.assert_array_equal(orthonormalize(p.copy()), h)
    # the span is P's: P = P_hat (P_hat^T P)
    np.testing.assert_allclose(h @ (h.T @ p), p, atol=1e-4)
    # a dependent or zero column becomes zeros, the others stay orthonormal
    p[:, 2] = 0
    h = orthonormalize(p)
    assert not h[:, 2].any()
    np.testing.assert_allclose(np.linalg.norm(h[:, [0, 1, 3]], axis=0), 1, atol=1e-6)


def test_low_rank_sums_are_exact_and_error_feedback_sends_the_rest():
    """A rank-2 sum is found in one step at rank 2. At rank 1, a rank-3 gradient is sent
    over the steps: the mean of the decoded sums converges to it, the residual stays
    bounded."""
    rng = np.random.default_rng(1)
    u, _ = np.linalg.qr(rng.standard_normal((40, 3)))
    v, _ = np.linalg.qr(rng.standard_normal((60, 3)))
    for rank, spectrum, steps in ((2, [3.0, 2.0, 0.0], 3), (1, [3.0, 2.0, 1.0], 60)):
        g = (u @ np.diag(spectrum) @ v.T).astype(np.float32).ravel()
        grads = [g, (0.5 * g).astype(np.float32)]
        cs = make("powersgd", 2, False, {"rank": rank}, size=2400, shape=(40, 60))
        residuals = [np.zeros(2400, np.float32) for _ in cs]
        total, errors = np.zeros(2400), []
        for step in range(steps):
            _, decoded = push(cs, grads, residuals, 2400, (40, 60))
            total += decoded[0]
            errors.append(np.linalg.norm(total / (step + 1) - 1.5 * g) / np.linalg.norm(1.5 * g))
            assert np.linalg.norm(residuals[0]) < 4 * np.linalg.norm(g)
        if rank == 2:
            assert max(errors) < 1e-5, errors
        else:
            assert errors[0] > 0.5 and errors[-1] < 0.05, errors


def test_rounds_and_wire_bits_follow_the_matrix_view():
    c = codecs.create("powersgd", rank=4)
    assert math.isnan(c.wire_bits_per_element(2))  # no shape yet
    assert c.wire_rounds(64 * 3 * 3 * 32, (64, 3, 3, 32), 8) == [
        ("sum", (256,), (256,), np.dtype(np.float32)),
        ("sum", (1152,), (1152,), np.dtype(np.float32))]
    assert c.matrix == (64, 288) and c.lane_count(64 * 288, 2) == 4 * (64 + 288)
    for workers in (1, 2, 16, 1000):
        assert c.wire_bits_per_element(workers) == pytest.approx(32 * 4 * 352 / (64 * 288))
    assert c.wire_bits_per_element(2, shape=(100,)) == 32.0
    with pytest.raises(ValueError, match="one powersgd instance serves one key"):
        c.wire_rounds(100 * 100, (100, 100), 2)
    assert c.clone().matrix is None


def test_vectors_and_matrices_whose_factors_are_no_smaller_go_full_precision():
    c = codecs.create("powersgd", rank=4)
    assert not c.compresses((1000,)) and not c.compresses(()) and not c.compresses((0, 5))
    assert not c.compresses((4, 32))  # 4 * (4 + 32) >= 128
    assert not c.compresses((3, 1000))  # rank 3 = n: no smaller
    assert c.compresses((32, 12)) and c.compresses((64, 3, 3, 3))
    assert codecs.create("powersgd", rank=1).compresses((4, 32))
    assert all(codecs.create(name).compresses((10,)) for name in ("2bit", "randomk"))
    with pytest.raises(ValueError, match="in full precision"):
        c.wire_rounds(1000, (1000,), 2)
    with pytest.raises(ValueError, match="call wire_rounds"):
        c.encode(np.ones(12, np.float32), np.zeros(12, np.float32), 2)


def test_the_first_q_comes_from_the_keys_seed_and_zero_columns_are_drawn_again():
    first = [cs[0] for cs in (make("powersgd", 1, False, {}, key=k, size=600, shape=(20, 30))
                              for k in (0, 0, 1))]
    for c in first:
        c.encode(np.ones(600, np.float32), np.zeros(600, np.float32), 1)
    np.testing.assert_array_equal(first[0].q, first[1].q)
    assert not np.array_equal(first[0].q, first[2].q)
    assert (np.abs(first[0].q) <= 0.5).all() and first[0].q.std() > 0.2
    # A zero gradient sums to zero Q columns: they are drawn again, not kept at zero.
    h = run_steps("powersgd", 2, 600, 1, {}, shape=(20, 30))
    c = make("powersgd", 1, False, {}, size=600, shape=(20, 30))[0]
    residual = np.zeros(600, np.float32)
    _, decoded = push([c], [np.zeros(600, np.float32)], [residual], 600, (20, 30))
    assert not decoded[0].any() and not residual.any()
    assert c.q.any(axis=0).all() and c.pushes == 1
    assert h[0]["state"]["q"].any(axis=0).all()


def test_steps_must_come_in_order():
    c = make("powersgd", 1, False, {}, size=600, shape=(20, 30))[0]
    with pytest.raises(ValueError, match="next_round\\(0, ...\\) follows encode"):
        c.next_round(0, np.zeros(80, np.float32), np.zeros(120, np.float32), 1)
    p = c.encode(np.ones(600, np.float32), np.zeros(600, np.float32), 1)
    with pytest.raises(ValueError, match="decode needs the step's P round"):
        c.decode(np.zeros(120, np.float32), 600, 1)
    with pytest.raises(ValueError, match="result must have 80 elements"):
        c.next_round(0, p[:-1].copy(), np.zeros(120, np.float32), 1)


def test_nonfinite_gradients_and_sums_raise():
    for reference in (False, True):
        c = make("powersgd", 1, reference, {}, size=300 * 1000, shape=(300, 1000))[0]
        g = np.ones(300_000, np.float32)
        g[123_456] = np.inf
        r = np.full(300_000, 0.5, np.float32)
        out = np.full(1200, 7.0, np.float32)
        with pytest.raises(NonFiniteGradientError, match="grad\\[123456\\]"):
            c.encode(g, r, 2, out=out)
        assert (r == 0.5).all() and (out == 7.0).all()
        g[123_456] = 1.0
        p = c.encode(g, r, 2, out=out)
        p[3] = np.nan
        with pytest.raises(NonFiniteGradientError, match="summed P holds NaN"):
            c.next_round(0, p, np.empty(4000, np.float32), 2)


def test_loading_state_checks_the_matrix_and_q():
    h = run_steps("powersgd", 1, 600, 1, {}, shape=(20, 30))
    state = h[0]["state"]
    assert state["matrix"] == [20, 30] and state["q"].shape == (30, 4)
    other = make("powersgd", 1, False, {}, size=600, shape=(30, 20))[0]
    with pytest.raises(ValueError, match="20x30 matrix cannot load into a 30x20"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="q must be a finite float32 array of shape"):
        codecs.create("powersgd").load_state_dict(dict(state, q=state["q"][:, :2]))
    with pytest.raises(ValueError, match="options"):
        codecs.create("powersgd", rank=2).load_state_dict(state)


@pytest.mark.parametrize("bad", [0, -1, 1025, 2.5, "lots", True])
def test_bad_options_name_the_option(bad):
    with pytest.raises(ValueError, match="codec 'powersgd': option rank="):
        codecs.create("powersgd", rank=bad)
    with pytest.raises(ValueError, match="codec 'powersgd' has no option ratio"):
        codecs.create("powersgd", ratio=0.1)
    assert codecs.create("powersgd", rank="8").rank == 8
