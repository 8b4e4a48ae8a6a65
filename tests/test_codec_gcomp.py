"""gcomp: the codec contract with and without the optimizer's view, delta -> levels, the
Huffman table and its agreement, slot classes and their fallback, errors, and the
kvstore's gather route and optimizer hook over threads."""
import math

import numpy as np
import pytest

from codec_contract import (assert_same, check_error_feedback_identity,
                            check_kernel_equals_reference, check_state_round_trip,
                            check_sums_in_any_order_decode_alike, check_threads_bitwise_equal,
                            gradient, make, run_steps)
from slimgc_mx import codecs
from slimgc_mx.codecs import OptimizerView, gcomp
from slimgc_mx.codecs.gcomp import BLOCK, ESC, build_lengths, geometry, huffman_lengths


def views(kind="sgd", momentum=0.9, wd=1e-4):
    """views(step, rank, size): weights of magnitudes 1e-2..1e4 against unit gradients, so
    that delta spans every level; the same arrays for every step and worker."""
    cache = {}

    def view(step, rank, size):
        if size not in cache:
            rng = np.random.default_rng(size)
            w = (rng.choice([-1.0, 1.0], size) * 10 ** rng.uniform(-2, 4, size)).astype(
                np.float32)
            m = (0.01 * rng.standard_normal(size)).astype(np.float32)
            v = (rng.random(size) ** 2).astype(np.float32)
            cache[size] = (w, m, v if kind == "adam" else None)
        arrays = cache[size]
        return OptimizerView(kind, lambda: arrays, lr=0.1, wd=wd, rescale_grad=0.1,
                             momentum=momentum, t=step + 1)
    return view


OPTIONS = [{}, {"delta_slack": 6, "refresh": 1, "max_code_bits": 3}]


# ---------------------------------------------------------------- the contract
@pytest.mark.parametrize("n_workers", [1, 2, 3])
@pytest.mark.parametrize("size", [0, 1, 7, 4097, pytest.param(20001, marks=pytest.mark.slow)])
@pytest.mark.parametrize("options", OPTIONS)
def test_kernel_equals_reference(n_workers, size, options):
    check_kernel_equals_reference("gcomp", n_workers, size, options=options)


@pytest.mark.parametrize("kind", ["sgd", "nag", "adam"])
@pytest.mark.parametrize("options", OPTIONS)
def test_kernel_equals_reference_with_the_optimizer_view(kind, options):
    check_kernel_equals_reference("gcomp", 3, 9000, steps=3, options=options,
                                  views=views(kind))


@pytest.mark.slow
def test_kernel_equals_reference_many_workers():
    check_kernel_equals_reference("gcomp", 16, 5000, steps=2, views=views())


def test_threads_and_orders_and_error_feedback():
    check_threads_bitwise_equal("gcomp", views=views())
    check_threads_bitwise_equal("gcomp", size=70001, options={"delta_slack": 12})
    check_sums_in_any_order_decode_alike("gcomp")
    for options in OPTIONS:
        check_error_feedback_identity("gcomp", options=options)
        check_error_feedback_identity("gcomp", options=options, views=views("adam"))
    check_state_round_trip("gcomp", {"refresh": 1})


# ---------------------------------------------------------------- values
def test_level_zero_is_lossless_and_sums_in_worker_order():
    h = run_steps("gcomp", 3, 10000, 3, {})
    for step in h:
        g = step["grads"]
        expected = ((np.float32(0) + g[0]) + g[1]) + g[2]
        assert_same(step["decoded"][0], expected, "lossless sum")
        assert not any(r.any() for r in step["residuals"])


def test_levels_follow_delta():
    """Each value keeps 23 - 6*level mantissa bits, level = #{t: delta >= 2**(t+1-slack)},
    delta computed here in float64 (values within 0.1% of a threshold are skipped)."""
    size, slack = 50000, 4
    view = views("sgd", momentum=0.9, wd=1e-3)(0, 0, size)
    c = codecs.create("gcomp", delta_slack=slack)
    c.set_optimizer_view(view)
    g = gradient(np.random.default_rng(1), size)
    residual = np.zeros(size, np.float32)
    wire = c.encode(g, residual, 1)
    x = codecs.create("gcomp").decode(wire, size, 1)
    w, m, _ = view.arrays()
    num = np.abs((1 - 0.1 * 1e-3) * w.astype(np.float64) + 0.9 * m)
    with np.errstate(divide="ignore"):
        delta = num / (0.1 * 0.1 * np.abs(g.astype(np.float64)))
    level = sum((delta >= 2.0 ** (t + 1 - slack)).astype(int) for t in (6, 12, 18))
    near = np.zeros(size, bool)
    with np.errstate(divide="ignore"):
        for t in (6, 12, 18):
            near |= np.abs(np.log2(delta) - (t + 1 - slack)) < 1.5e-3
    keep = (g != 0) & ~near
    bits = g.view(np.uint32)
    mask = (np.uint32(0xFFFFFFFF) << (6 * level).astype(np.uint32))
    np.testing.assert_array_equal(x.view(np.uint32)[keep], (bits & mask)[keep])
    assert set(np.unique(level[keep])) == {0, 1, 2, 3}
    np.testing.assert_array_equal(residual, g - x)


def test_zeros_and_denormals_are_pruned_and_kept_in_the_residual():
    g = np.array([0.0, -0.0, 1e-40, -3e-42, 1.5, -2.25], np.float32)
    r = np.zeros_like(g)
    c = codecs.create("gcomp")
    x = codecs.create("gcomp").decode(c.encode(g, r, 1), g.size, 1)
    assert_same(x, np.array([0, 0, 0, 0, 1.5, -2.25], np.float32))
    assert_same(r, np.array([0.0, 0.0, 1e-40, -3e-42, 0, 0], np.float32))  # c = -0 + 0 = +0


def test_escapes_carry_rare_exponents_raw():
    """With 2-bit codes most exponents go behind the escape; values stay exact."""
    h = run_steps("gcomp", 2, 30000, 3, {"max_code_bits": 2, "refresh": 1})
    lengths = np.array(h[-1]["state"]["code_lengths"])
    assert lengths.max() <= 2 and lengths[ESC] >= 1
    assert (lengths[:255] > 0).sum() <= 3
    expected = (np.float32(0) + h[2]["grads"][0]) + h[2]["grads"][1]
    assert_same(h[2]["decoded"][0], expected, "escaped")


# ---------------------------------------------------------------- the table
def test_huffman_lengths_are_optimal_and_deterministic():
    w = {3: 5, 1: 1, 2: 1, 7: 10, 9: 2}
    n = huffman_lengths(w)
    assert sum(2.0 ** -v for v in n.values()) == 1.0
    assert n[7] == 1 and n[1] == n[2] == 4
    assert huffman_lengths(dict(reversed(list(w.items())))) == n
    assert huffman_lengths({ESC: 1}) == {ESC: 0}


@pytest.mark.parametrize("max_bits", [1, 2, 5, 12, 16])
def test_table_is_complete_limited_and_has_an_escape(max_bits):
    rng = np.random.default_rng(max_bits)
    hist = np.zeros(256, np.int64)
    hist[:255] = (1e6 * 2.0 ** -np.abs(rng.standard_normal(255) * 12)).astype(np.int64)
    lengths = build_lengths(hist, max_bits)
    used = lengths[lengths > 0]
    assert lengths[ESC] >= 1 and used.max() <= max_bits
    assert sum(2.0 ** -int(v) for v in used) == 1.0
    # the exponents with codes are the most frequent ones
    coded = np.flatnonzero(lengths[:255])
    assert hist[coded].min() >= np.delete(hist[:255], coded).max()
    gcomp.check_lengths(lengths, max_bits)
    assert not build_lengths(np.zeros(256, np.int64), max_bits).any()


def test_table_is_rebuilt_every_refresh_from_all_workers_exponents():
    k = 3
    h = run_steps("gcomp", 3, 6000, 2 * k + 2, {"refresh": k})
    tables = [tuple(s["state"]["code_lengths"]) for s in h]
    # rebuilt after pushes 0, k, 2k: from push 0's exponents, then pushes 1..k, ...
    assert len({tables[0], tables[1]}) == 1 and tables[k] != tables[k - 1]

    def expected(pushes):
        hist = np.zeros(256, np.int64)
        for p in pushes:
            for g in h[p]["grads"]:
                hist += np.bincount(((g.view(np.uint32) >> 23) & 0xFF).astype(np.int64),
                                    minlength=256)
        return tuple(build_lengths(hist, 12))
    assert tables[0] == expected([0])
    assert tables[k] == expected(range(1, k + 1))
    assert sum(h[-1]["state"]["histogram"]) == 3 * 6000  # push 2k+1 since the rebuild


def test_a_foreign_table_is_refused():
    cs = make("gcomp", 2, False, {})
    g = gradient(np.random.default_rng(0), 5000)
    wire = np.concatenate([c.encode(g, np.zeros_like(g), 2, rank=j) for j, c in enumerate(cs)])
    cs[0].decode(wire, 5000, 2)  # cs[0] now holds the table built from push 0
    wire = np.concatenate([cs[1].encode(g, np.zeros_like(g), 2, rank=0),
                           cs[1].encode(g, np.zeros_like(g), 2, rank=1)])
    with pytest.raises(ValueError, match="coded with table"):
        cs[0].decode(wire, 5000, 2)


# ---------------------------------------------------------------- slot classes
def test_slot_classes_follow_the_payload():
    size = 100000
    blocks, header, cols, rows = geometry(size, 2 ** 0.25)
    assert cols == 1024 and rows[0] * cols >= header + size * 34 / 24
    assert all(a > b for a, b in zip(rows, rows[1:]))
    assert rows[-1] * cols >= header + size * 2 / 24
    h = run_steps("gcomp", 2, size, 3, {"delta_slack": 12}, views=views())
    c = codecs.create("gcomp", delta_slack=12)
    c.load_state_dict(h[1]["state"])
    need = max(gcomp_wanted(w) for w in h[1]["wires"])
    assert c.lane_count(size, 2) >= need + math.ceil(need * 0.02)
    target = need + math.ceil(need * 0.02)
    assert c.wire_class == len(rows) - 1 or rows[c.wire_class + 1] * cols < target
    assert len(h[2]["wires"][0]) == c.lane_count(size, 2) < len(h[0]["wires"][0])


def gcomp_wanted(wire):
    return int(wire[4]) + int(wire[5]) * (1 << 24)


@pytest.mark.parametrize("reference", [False, True])
def test_blocks_beyond_the_slot_stay_in_the_residual(reference):
    size = 10 * BLOCK + 5
    c = codecs.create("gcomp", reference=reference)
    _, _, _, rows = geometry(size, c.class_ratio)
    c.wire_class = 4  # 17 bits per element for a 34-bit payload: half the blocks fit
    g = gradient(np.random.default_rng(2), size)
    r = np.zeros(size, np.float32)
    wire = c.encode(g, r, 1)
    sent = int(wire[1])
    assert 0 < sent < 11
    d = codecs.create("gcomp")
    d.wire_class = c.wire_class
    x = d.decode(wire, size, 1)
    lo = sent * BLOCK
    assert_same(x[:lo], np.float32(0) + g[:lo], "sent blocks")
    assert not x[lo:].any()
    assert_same(r[lo:], np.float32(0) + g[lo:], "unsent blocks keep all of c")
    assert d.wire_class < c.wire_class  # the next slot holds what was wanted


# ---------------------------------------------------------------- errors
def test_nonfinite_gradient_leaves_everything_untouched():
    c = codecs.create("gcomp")
    g = np.ones(5000, np.float32)
    g[77] = np.nan
    r = np.full(5000, 0.5, np.float32)
    with pytest.raises(codecs.NonFiniteGradientError, match="grad\\[77\\]"):
        c.encode(g, r, 2)
    assert (r == 0.5).all()


def test_corrupted_slots_are_refused():
    c = codecs.create("gcomp")
    g = gradient(np.random.default_rng(0), 9000)
    wire = c.encode(g, np.zeros_like(g), 1)
    for lane, value, what in ((1, 0.5, "not integers"), (8, 3.0, "inconsistent"),
                              (20, 0.5, "do not decode")):
        bad = wire.copy()
        bad[lane] = value
        for reference in (False, True):
            with pytest.raises(ValueError, match=what):
                codecs.create("gcomp", reference=reference).decode(bad, 9000, 1)
    with pytest.raises(ValueError, match="slots must have"):
        codecs.create("gcomp").decode(wire[:-1], 9000, 1)


def test_bad_views_and_state_name_the_problem():
    c = codecs.create("gcomp")
    g = np.ones(10, np.float32)
    with pytest.raises(TypeError, match="OptimizerView or None"):
        c.set_optimizer_view({"lr": 1})
    c.set_optimizer_view(OptimizerView("rmsprop", lambda: (g, None, None), lr=0.1))
    with pytest.raises(ValueError, match="kind 'rmsprop' has no delta"):
        c.encode(g, np.zeros_like(g), 1)
    c.set_optimizer_view(OptimizerView("sgd", lambda: (g[:5], None, None), lr=0.1))
    with pytest.raises(ValueError, match="optimizer weight must have 10 elements"):
        c.encode(g, np.zeros_like(g), 1)
    state = c.state_dict()
    with pytest.raises(ValueError, match="complete prefix code"):
        c.load_state_dict(dict(state, code_lengths=[1] * 256))
    with pytest.raises(ValueError, match="histogram"):
        c.load_state_dict(dict(state, histogram=[-1] * 256))
    c.load_state_dict(dict(state, wire_class=99))
    with pytest.raises(ValueError, match="slot class 99 does not exist"):
        c.lane_count(10, 1)


@pytest.mark.parametrize("option, bad", [("refresh", 0), ("max_code_bits", 17),
                                         ("delta_slack", -1), ("default_level", 4),
                                         ("class_ratio", 1.0), ("headroom", "lots")])
def test_bad_options_name_the_option(option, bad):
    with pytest.raises(ValueError, match="codec 'gcomp': option %s=" % option):
        codecs.create("gcomp", **{option: bad})


# ---------------------------------------------------------------- the kvstore


@pytest.mark.slow
@pytest.mark.parametrize("offload", [True, False])
def test_allreduce_over_threads_gathers_and_decodes_like_the_reference(offload):
    pytest.importorskip("mxnet")
    import training_helpers as th
    from slimgc_mx.codecs.rng import key_seed
    n, size, steps = 3, 30000, 4
    grads = np.random.RandomState(7).randn(steps, n, size).astype(np.float32)
    results = th.pushpull_workers(grads, compressor="gcomp", comm_threshold="off",
                                  backup=False, offload=offload,
                                  codec_options={"delta_slack": 9, "refresh": 2})
    ref = [codecs.create("gcomp", reference=True, delta_slack=9, refresh=2) for _ in range(n)]
    residuals = [np.zeros(size, np.float32) for _ in range(n)]
    pushed = 0
    for s in range(steps):
        for c in ref:
            c.seed = key_seed(0, 0)
        slots = np.concatenate([c.encode(grads[s, r], residuals[r], n, rank=r)
                                for r, c in enumerate(ref)])
        pushed += 4 * slots.size // n
        expected = [c.decode(slots, size, n) for c in ref][0]
        for r in range(n):
            np.testing.assert_array_equal(results[r][0][s], expected)
    stats = results[0][1]
    assert stats["bytes_pushed"] == pushed and stats["bytes_pulled"] == n * pushed


def test_training_hands_the_optimizer_view_to_the_codec(monkeypatch):
    """SGD with momentum over threads: workers end bitwise equal; every encode saw a view
    of w_i and the momentum (the weights before the step's update)."""
    pytest.importorskip("mxnet")
    import training_helpers as th
    seen = []
    encode = gcomp.GComp.encode

    def spy(self, grad, residual, num_workers, **kw):
        view = self.optimizer_view
        w, m, _ = view.arrays()
        seen.append((view.kind, w.shape == grad.shape, m is not None, view.lr))
        return encode(self, grad, residual, num_workers, **kw)

    monkeypatch.setattr(gcomp.GComp, "encode", spy)
    (w0, s0), (w1, s1) = th.slimgc_workers(2, lambda: th.dense_net((256, 4), 0),
                                           th.batches(12), compressor="gcomp",
                                           comm_threshold="off",
                                           codec_options={"delta_slack": 10})
    for a, b in zip(w0, w1):
        np.testing.assert_array_equal(a, b)
    assert seen and all(s == ("sgd", True, True, 0.1) for s in seen)
    assert s0["bytes_pulled"] == 2 * s0["bytes_pushed"]


@pytest.mark.parametrize("name", ["sgd", "nag"])
def test_the_view_names_mxnets_update(name):
    """E*w + B*m is the update without this gradient, D*g the part the gradient adds
    (what delta divides), for MXNet's SGD and NAG with momentum and weight decay."""
    mx = pytest.importorskip("mxnet")
    from slimgc_mx.mxnet.update import optimizer_view
    rng = np.random.default_rng(3)
    w = rng.standard_normal(100).astype(np.float32)
    m = rng.standard_normal(100).astype(np.float32)
    g = rng.standard_normal(100).astype(np.float32)
    opt = mx.optimizer.create(name, learning_rate=0.05, momentum=0.9, wd=0.01,
                              rescale_grad=0.25)
    view = optimizer_view(opt, 0, lambda: (w, m, None))
    c = codecs.create("gcomp")
    c.set_optimizer_view(view)
    _, _, _, (E, B, D), _, _ = c._level_args(100)

    def step(grad):
        weight, state = mx.nd.array(w), mx.nd.array(m)
        opt.update(0, weight, mx.nd.array(grad), state)
        return weight.asnumpy().astype(np.float64)
    still = step(np.zeros(100, np.float32))
    np.testing.assert_allclose(still, E * w + B * m, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(still - step(g), D * g, rtol=1e-3, atol=1e-6)
    assert math.isclose(view.lr, 0.05) and view.momentum == 0.9


@pytest.mark.multiprocess
@pytest.mark.parametrize("bound", [None, 64])
def test_the_gather_route_on_mxnet_servers(tmp_path, bound):
    """2 workers and 2 stock servers (bound 64: every slot split over both): slots change
    size from push to push, each class its own row_sparse key; a stale or shifted row would
    fail decode's checks. Workers end bitwise equal; each pulls both slots."""
    pytest.importorskip("mxnet")
    import json
    import sys
    from test_distributed import _launch
    out = tmp_path / "gcomp"
    options = [] if bound is None else ["--env", "MXNET_KVSTORE_BIGARRAY_BOUND:%d" % bound]
    _launch(2, 2, [sys.executable, "tests/dist_job.py", "--out", str(out), "--compressor",
                   "gcomp", "--comm-threshold", "off", "--steps", "12"], 240, options)
    info = [json.loads((out / ("rank%d.json" % r)).read_text()) for r in range(2)]
    assert info[0]["sha256"] == info[1]["sha256"]
    stats = info[0]["stats"]
    assert stats["compressed_transfers"] == 4 * 12
    assert stats["bytes_pulled"] == 2 * stats["bytes_pushed"]
    # this job's random gradients hardly compress; the slots stay within the top class
    top = codecs.create("gcomp").wire_bits_per_element(2) / 32
    assert 0 < stats["bytes_pushed"] <= top * stats["bytes_fp32"] * 1.01
