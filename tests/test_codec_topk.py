"""topk: the codec contract on the gather route, the exact top k with ties to the lower
index, the lowered threshold, two-lane indices, slots decode refuses, options and errors."""
import numpy as np
import pytest

from codec_contract import (assert_same, check_error_feedback_identity,
                            check_kernel_equals_reference, check_state_round_trip,
                            check_sums_in_any_order_decode_alike, check_threads_bitwise_equal,
                            gradient)
from slimgc_mx import codecs
from slimgc_mx.codecs import NonFiniteGradientError, topk


@pytest.mark.parametrize("n_workers", [1, 2, 3, 16])
@pytest.mark.parametrize("size", [1, 7, 4097, pytest.param(70001, marks=pytest.mark.slow)])
@pytest.mark.parametrize("options", [{}, {"ratio": 0.3}, {"ratio": 1.0}])
def test_kernel_equals_reference(n_workers, size, options):
    check_kernel_equals_reference("topk", n_workers, size, options=options)


def test_threads_and_orders_and_error_feedback():
    check_threads_bitwise_equal("topk")
    check_sums_in_any_order_decode_alike("topk")
    check_error_feedback_identity("topk")
    check_error_feedback_identity("topk", options={"ratio": 0.2})
    check_state_round_trip("topk", {"ratio": 0.05})


def _encode_pair(grad, options=None, index_bits=None, sample_plan=None, n_workers=1,
                 num_threads=2):
    """(slot, residual) of the kernel and of the reference for one push of `grad`."""
    out = []
    for reference in (False, True):
        c = codecs.create("topk", reference=reference, num_threads=num_threads,
                          **(options or {}))
        if index_bits is not None:
            c.index_bits = index_bits
        if sample_plan is not None:
            c._sample_plan = sample_plan
        residual = np.zeros(grad.size, np.float32)
        out.append((c.encode(grad, residual, n_workers), residual, c))
    (slot, res, c), (ref_slot, ref_res, _) = out
    assert_same(slot, ref_slot, "slot")
    assert_same(res, ref_res, "residual")
    return slot, res, c


def test_the_k_largest_magnitudes_are_sent_ties_to_the_lower_index():
    g = np.array([0.5, -2.0, 1.0, -1.0, 1.0, 3.0, -1.0, 0.0], np.float32)
    slot, residual, c = _encode_pair(g, {"ratio": 0.5})  # k = 4: 3.0, -2.0, then two of +-1
    k = c.capacity(g.size)
    assert k == 4 and slot[0] == 4
    np.testing.assert_array_equal(slot[1 + k:1 + 2 * k], [1, 2, 3, 5])
    np.testing.assert_array_equal(slot[1:1 + k], [-2.0, 1.0, -1.0, 3.0])
    np.testing.assert_array_equal(residual, [0.5, 0, 0, 0, 1.0, 0, -1.0, 0.0])
    decoded = c.decode(slot, g.size, 1)
    np.testing.assert_array_equal(decoded + residual, g)  # error feedback keeps the rest


def test_a_threshold_too_high_is_lowered_until_k_pass():
    # Sampling the largest value only (rank 1) lets too few through: the kernel lowers the
    # threshold (4x the rank, then 0) and must still send exactly the top k.
    g = gradient(np.random.default_rng(1), 100_000)
    slot, _, c = _encode_pair(g, sample_plan=lambda size, k: (topk.SAMPLES, 1))
    assert slot[0] == c.capacity(g.size)
    # a tensor with fewer non-zeros than k: every non-zero, then zeros from index 0 on
    g = np.zeros(50_000, np.float32)
    g[::1000] = np.arange(1, 51)
    slot, residual, c = _encode_pair(g, {"ratio": 0.002})  # k = 100
    k = c.capacity(g.size)
    idx = slot[1 + k:1 + 2 * k].astype(np.int64)
    assert set(range(0, 50_000, 1000)) <= set(idx.tolist()) and not residual.any()
    assert sorted(set(idx.tolist()) - set(range(0, 50_000, 1000))) == \
        [i for i in range(100) if i % 1000][:50]


def test_candidates_crowded_into_one_chunk_are_collected_again():
    # Each chunk of 65536 elements collects its candidates into room for 1.5 times its
    # share; when the largest values all sit in one chunk, that chunk is scanned again.
    g = gradient(np.random.default_rng(5), 300_000)
    g[140_000:150_000] *= 100
    slot, _, c = _encode_pair(g, {"ratio": 0.02})
    k = c.capacity(g.size)
    idx = slot[1 + k:1 + 2 * k].astype(np.int64)
    assert np.count_nonzero((idx >= 140_000) & (idx < 150_000)) > 5000


def test_indices_above_the_lane_bits_travel_in_two_lanes():
    # With 6-bit index lanes a tensor of 4000 elements needs two lanes per index, as one of
    # more than 2**24 does with 24-bit lanes.
    g = gradient(np.random.default_rng(2), 4000)
    slot, _, c = _encode_pair(g, {"ratio": 0.1}, index_bits=6)
    k = c.capacity(g.size)
    rows, cols = topk.slot_shape(g.size, k, 6)
    assert slot.size == rows * cols >= 1 + 3 * k
    lo, hi = slot[1 + k:1 + 2 * k], slot[1 + 2 * k:1 + 3 * k]
    assert lo.max() < 64 and hi.max() > 0
    idx = lo.astype(np.int64) + (hi.astype(np.int64) << 6)
    assert (np.diff(idx) > 0).all()
    for reference in (False, True):
        d = codecs.create("topk", reference=reference, ratio=0.1)
        d.index_bits = 6
        out = d.decode(np.concatenate([slot, slot]), g.size, 2)
        np.testing.assert_array_equal(out[idx], 2 * slot[1:1 + k])


@pytest.mark.slow
def test_a_tensor_above_2_to_the_24_elements_sends_two_index_lanes():
    size = (1 << 24) + 5
    g = np.zeros(size, np.float32)
    g[[3, 1 << 23, (1 << 24) + 4]] = [1.0, -2.0, 3.0]
    slot, _, c = _encode_pair(g, {"ratio": 1e-7})  # k = 2: indices 1 << 23 and 2**24 + 4
    k = c.capacity(size)
    assert slot.size == 1 + 3 * k
    np.testing.assert_array_equal(slot, [2, -2.0, 3.0, 1 << 23, 4, 0, 1])
    assert codecs.create("topk", ratio=1e-7).decode(slot, size, 1)[(1 << 24) + 4] == 3.0


def test_the_wire_is_a_gather_of_one_slot_per_worker():
    c = codecs.create("topk", ratio=0.01)
    size = 300_000
    k = c.capacity(size)
    assert k == 3000 and c.lane_count(size, 4) == 1024 * 6  # 1 + 2k lanes in rows of 1024
    assert c.wire_rounds(size, (size,), 4) == [("gather", (6, 1024), (24, 1024),
                                                np.dtype(np.float32))]
    assert c.wire_bits_per_element(1) == pytest.approx(0.64)
    assert c.wire_bits_per_element(8) == pytest.approx(8 * 0.64)  # the pull is N slots
    assert c.memory_size(size) == size and c.push_rounds(size, 4) == (0,)
    assert c.wire_rounds(3, (3,), 2) == [("gather", (1, 3), (2, 3), np.dtype(np.float32))]


@pytest.mark.parametrize("reference", [False, True])
def test_decode_refuses_slots_it_did_not_write(reference):
    size, n = 100, 2
    c = codecs.create("topk", reference=reference, ratio=0.05)
    k = c.capacity(size)
    good = np.concatenate([c.encode(gradient(np.random.default_rng(r), size),
                                    np.zeros(size, np.float32), n) for r in range(n)])
    lanes = good.size // n
    for lane, value, what in [(0, k + 1.0, "count is not an integer in \\[0, k\\]"),
                              (0, 2.5, "count"), (1 + k, 0.5, "index lane"),
                              (1 + k, -1.0, "index lane"), (1 + k + 1, 0.0, "do not increase"),
                              (1 + 2 * k - 1, size, "do not increase, or reach past"),
                              (2, np.inf, "value is not finite")]:
        bad = good.copy()
        bad[lanes + lane] = value
        with pytest.raises(ValueError, match="slot of worker 1 is not one this codec wrote: .*"
                                             + what):
            c.decode(bad, size, n)
    with pytest.raises(ValueError, match="gathered must have %d elements" % (n * lanes)):
        c.decode(good[:-1], size, n)
    assert c.pushes == 0
    c.decode(good, size, n)
    assert c.pushes == 1


@pytest.mark.parametrize("reference", [False, True])
def test_nonfinite_gradients_raise_before_anything_is_written(reference):
    c = codecs.create("topk", reference=reference)
    g = gradient(np.random.default_rng(3), 5000)
    g[1234] = np.nan
    residual = np.full(5000, 0.25, np.float32)
    out = np.full(c.lane_count(5000, 1), 7.0, np.float32)
    with pytest.raises(NonFiniteGradientError, match="grad\\[1234\\]"):
        c.encode(g, residual, 1, out=out)
    assert (residual == 0.25).all() and (out == 7.0).all()


def test_bad_options_and_inputs_name_the_problem():
    for bad in (0, 1.5, -0.1, "lots", True):
        with pytest.raises(ValueError, match="codec 'topk': option ratio="):
            codecs.create("topk", ratio=bad)
    with pytest.raises(ValueError, match="codec 'topk' has no option momentum"):
        codecs.create("topk", momentum=0.9)
    c = codecs.create("topk")
    with pytest.raises(ValueError, match="residual must have 10 elements"):
        c.encode(np.zeros(10, np.float32), np.zeros(9, np.float32), 1)
    with pytest.raises(ValueError, match="size must be an integer in \\[0, 2\\*\\*32\\)"):
        c.lane_count(1 << 32, 1)
    with pytest.raises(ValueError, match="num_workers"):
        c.lane_count(10, 0)
    empty = c.encode(np.zeros(0, np.float32), np.zeros(0, np.float32), 2)
    assert empty.tolist() == [0.0] and c.decode(np.zeros(2, np.float32), 0, 2).size == 0
