"""dgc: the codec contract, momentum correction and factor masking, the sampled threshold,
local clipping, the warm-up schedule and its gather keys, options and errors."""
import math

import numpy as np
import pytest

from codec_contract import (assert_same, check_error_feedback_identity,
                            check_kernel_equals_reference, check_state_round_trip,
                            check_sums_in_any_order_decode_alike, check_threads_bitwise_equal,
                            gradient, run_steps)
from slimgc_mx import codecs
from slimgc_mx.codecs import NonFiniteGradientError, dgc, topk

WARM = {"ratio": 0.01, "warmup_stage_steps": 1}


@pytest.mark.parametrize("n_workers", [1, 2, 3, 16])
@pytest.mark.parametrize("size", [1, 7, 4097, pytest.param(70001, marks=pytest.mark.slow)])
@pytest.mark.parametrize("options", [{}, {"ratio": 0.05, "clip_norm": 5.0, "sample_ratio": 0.001},
                                     WARM])
def test_kernel_equals_reference(n_workers, size, options):
    check_kernel_equals_reference("dgc", n_workers, size, steps=6, options=options)


def test_threads_and_orders_and_error_feedback():
    check_threads_bitwise_equal("dgc", options={"ratio": 0.01, "clip_norm": 100.0})
    check_threads_bitwise_equal("dgc", options=WARM)
    check_sums_in_any_order_decode_alike("dgc", options=WARM)
    # without momentum the memory's first half is a plain error-feedback residual
    check_error_feedback_identity("dgc", options={"momentum": 0.0, "ratio": 0.05})
    check_state_round_trip("dgc", WARM)


def test_momentum_correction_and_factor_masking():
    # One worker: an element accumulates u = m u + g into v until it is sent; then both
    # are zeroed, and the decoded value is the whole of v.
    m, size = 0.9, 20_000
    h = run_steps("dgc", 1, size, 5, {"momentum": m, "ratio": 0.001}, seed=5)
    u = np.zeros(size, np.float32)
    v = np.zeros(size, np.float32)
    for step in h:
        u = np.float32(m) * u + np.float32(1.0) * step["grads"][0]
        v = v + u
        sent = step["decoded"][0] != 0
        np.testing.assert_array_equal(step["decoded"][0][sent], v[sent])
        u[sent] = 0
        v[sent] = 0
        memory = step["residuals"][0]
        assert_same(memory[:size], v, "v")
        assert_same(memory[size:], u, "u")
    assert 0 < np.count_nonzero(h[-1]["decoded"][0]) <= math.ceil(0.001 * size)


def test_an_element_sent_every_step_loses_its_momentum():
    # Factor masking zeroes u where v is sent: at ratio 1 every element goes every step,
    # so each push sends the gradients themselves, whatever the momentum: plain SGD's update.
    h = run_steps("dgc", 2, 5_000, 4, {"momentum": 0.9, "ratio": 1.0}, seed=3)
    for step in h:
        np.testing.assert_array_equal(step["decoded"][0], step["grads"][0] + step["grads"][1])
        for memory in step["residuals"]:
            assert not memory.any(), "v and u must be zero after everything is sent"


def test_the_sampled_threshold_sends_a_top_set_of_at_most_k():
    size = 400_000
    c = codecs.create("dgc", ratio=0.01, momentum=0.0)
    k = c.capacity(size)
    for seed in range(4):
        g = gradient(np.random.default_rng(seed), size)
        memory = np.zeros(2 * size, np.float32)
        slot = c.encode(g, memory, 1)
        sent = int(slot[0])
        idx = slot[1 + k:1 + k + sent].astype(np.int64)
        assert 0.6 * k < sent <= k  # a 1 % sample estimates the threshold within this
        unsent = np.delete(np.abs(g), idx)
        assert unsent.max() <= np.abs(slot[1:1 + sent]).min()
        c.decode(slot, size, 1)


def test_local_clipping_scales_the_gradient_by_the_norm_over_sqrt_n():
    size, n = 5000, 4
    g = gradient(np.random.default_rng(4), size)
    norm = float(np.sqrt((g.astype(np.float64) ** 2).sum()))
    for clip_norm, scale in [(norm, 1 / math.sqrt(n)), (10 * norm, 1.0)]:  # never scales up
        for reference in (False, True):
            c = codecs.create("dgc", reference=reference, clip_norm=clip_norm, ratio=0.001)
            memory = np.zeros(2 * size, np.float32)
            c.encode(g, memory, n)
            u = memory[size:]
            unsent = u != 0  # the first velocity is s * g, zeroed where sent
            assert unsent.sum() >= size - c.capacity(size) - np.count_nonzero(g == 0)
            np.testing.assert_allclose(u[unsent], np.float32(scale) * g[unsent], rtol=1e-6)


def test_warmup_stages_raise_the_sparsity_and_each_slot_size_has_its_key():
    size = 100_000
    c = codecs.create("dgc", ratio=0.001, warmup_stage_steps=2)
    rounds = c.wire_rounds(size, (size,), 3)
    assert len(rounds) == 5 and all(r[0] == "gather" for r in rounds)
    densities, plans = [], []
    for push in range(10):
        densities.append(c.density())
        plans.append(c.push_rounds(size, 3))
        lanes = c.lane_count(size, 3)
        rows, cols = rounds[plans[-1][0]][1]
        assert lanes == rows * cols >= 1 + 2 * c.capacity(size)
        c.pushes += 1
    assert densities == [0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625, 0.004, 0.004,
                         0.001, 0.001]
    assert plans == [(0,), (0,), (1,), (1,), (2,), (2,), (3,), (3,), (4,), (4,)]
    # a stage is never sparser than the target; equal slot sizes share a key
    c = codecs.create("dgc", ratio=0.01, warmup_stage_steps=1)
    densities = []
    for push in range(6):
        c.pushes = push
        densities.append(c.density())
    assert densities == [0.25, 0.0625, 0.015625, 0.01, 0.01, 0.01]
    assert len(c.wire_rounds(size, (size,), 2)) == 4
    assert codecs.create("dgc").wire_rounds(size, (size,), 2) == [
        ("gather", (1, 201), (2, 201), np.dtype(np.float32))]


def test_wire_bits_and_memory():
    c = codecs.create("dgc")
    assert c.wire_bits_per_element(1) == pytest.approx(0.064)
    assert c.wire_bits_per_element(16) == pytest.approx(16 * 0.064)
    assert c.memory_size(1000) == 2000
    assert c.traits.owns_momentum and not codecs.create("topk").traits.owns_momentum


@pytest.mark.parametrize("reference", [False, True])
def test_nonfinite_gradients_raise_before_anything_is_written(reference):
    c = codecs.create("dgc", reference=reference, clip_norm=1.0)
    g = gradient(np.random.default_rng(3), 5000)
    g[77] = np.inf
    memory = np.full(10_000, 0.5, np.float32)
    with pytest.raises(NonFiniteGradientError, match="grad\\[77\\]"):
        c.encode(g, memory, 2, grad_checked=True)  # clipping reads the gradient anyway
    assert (memory == 0.5).all()


def test_bad_options_name_the_option():
    for name, bad in [("momentum", 1.0), ("momentum", -0.1), ("ratio", 0.0),
                      ("warmup_stage_steps", -1), ("warmup_stage_steps", 1.5),
                      ("clip_norm", -1.0), ("clip_norm", math.inf), ("sample_ratio", 2.0)]:
        with pytest.raises(ValueError, match="codec 'dgc': option %s=" % name):
            codecs.create("dgc", **{name: bad})
    with pytest.raises(ValueError, match="memory must have|residual must have 20 elements"):
        codecs.create("dgc").encode(np.zeros(10, np.float32), np.zeros(10, np.float32), 1)
    assert dgc.STAGES == (0.25, 0.0625, 0.015625, 0.004) and topk.INDEX_BITS == 24
