"""4bit's wire in the group's own unit: L = 121 (group 1) or 19 (groups 2 and 3), the round
of the push picked from the agreed group, values as the 0.01-unit wire decoded them."""
import math

import numpy as np
import pytest

from slimgc_mx import codecs
from slimgc_mx.codecs import fourbit
from slimgc_mx.codecs.lanes import lane_geometry

LEVELS = {1: 121, 2: 19, 3: 19}


def _with_group(group, **kwargs):
    c = codecs.create("4bit", **kwargs)
    c.load_state_dict({"codec": "4bit", "threshold": None, "group": group})
    return c


def _digits(lanes, radix, k, n):
    x = lanes.astype(np.int64)
    powers = radix ** np.arange(k, dtype=np.int64)
    return ((x[:, None] // powers[None, :]) % radix).ravel()[:n]


def _oracle_sum(grads, residuals, group):
    """The decoded sum as the 0.01-unit wire gave it: float32(0.01 * S), S the workers'
    signed units summed; the residuals are updated as each worker's error feedback."""
    x = fourbit.group_thresholds(group)
    units = np.array((0,) + fourbit.GROUPS[group], dtype=np.int64)
    total = np.zeros(grads[0].shape[0], dtype=np.int64)
    for g, r in zip(grads, residuals):
        c = g + r
        u = units[(np.abs(c)[:, None] >= x[None, :]).sum(axis=1)]
        v = np.where(c < 0, -u, u)
        r[...] = c - (0.01 * v.astype(np.float64)).astype(np.float32)
        total += v
    return (0.01 * total.astype(np.float64)).astype(np.float32)


@pytest.mark.parametrize("reference", [False, True])
@pytest.mark.parametrize("group", [1, 2, 3])
def test_lanes_carry_the_groups_levels(reference, group):
    c = _with_group(group, num_threads=2, reference=reference)
    levels = LEVELS[group]
    assert c.levels == levels and c.geometry(1) == lane_geometry(levels, 1)
    for n in (1, 2, 64):
        k = lane_geometry(levels, n)[1]
        assert c.lane_count(1000, n) == math.ceil(1000 / k) + 1
    # every threshold, each sign, below X1 and past X7: levels 0 and L-1 are both reached
    x = fourbit.group_thresholds(group)
    g = np.concatenate([x, -x, [0.0, x[0] / 2, 5 * x[-1], -5 * x[-1]]]).astype(np.float32)
    radix, k = c.geometry(1)
    q = _digits(c.encode(g, np.zeros_like(g), 1), radix, k, g.shape[0])
    offset = (levels - 1) // 2
    unit = fourbit.GROUP_UNITS[group]
    expected = offset + np.round(np.concatenate([x, -x, [0, 0, x[-1], -x[-1]]]) * 100 / unit)
    np.testing.assert_array_equal(q, expected.astype(np.int64))
    assert q.min() == 0 and q.max() == levels - 1


def test_wire_bits_report_the_worst_group():
    c = codecs.create("4bit")
    for n in (1, 2, 4, 8, 16, 32, 64):
        bits = c.group_wire_bits(n)
        assert bits == {g: 64 / lane_geometry(LEVELS[g], n)[1] for g in (1, 2, 3)}
        assert c.wire_bits_per_element(n) == bits[1] >= bits[2] == bits[3]
    assert c.group_wire_bits(2)[3] == 6.4 < 64 / lane_geometry(181, 2)[1]


def test_wire_rounds_one_per_geometry_and_the_push_picks_the_groups():
    size, n = 1000, 2
    c = codecs.create("4bit")
    rounds = c.wire_rounds(size, (size,), n)
    assert [r[1] for r in rounds] == [(math.ceil(size / lane_geometry(levels, n)[1]) + 1,)
                                      for levels in (19, 121)]
    assert all(r[0] == "sum" for r in rounds)
    for group, index in ((3, 0), (1, 1), (2, 0)):
        c.load_state_dict({"codec": "4bit", "threshold": None, "group": group})
        assert c.push_rounds(size, n) == (index,)
        assert rounds[index][1] == (c.lane_count(size, n),)


@pytest.mark.parametrize("reference", [False, True])
def test_a_push_after_a_group_switch_decodes_exactly(reference):
    """The trailer is forced so that the group moves 3 -> 1 -> 2 -> 3; every push decodes
    bitwise to the 0.01-unit oracle and to the reference, in its own geometry."""
    n, size = 2, 3001
    rng = np.random.default_rng(5)
    workers = [codecs.create("4bit", num_threads=2, reference=reference) for _ in range(n)]
    refs = [codecs.create("4bit", reference=True) for _ in range(n)]
    res = [np.zeros(size, np.float32) for _ in range(n)]
    res_ref = [np.zeros(size, np.float32) for _ in range(n)]
    res_oracle = [np.zeros(size, np.float32) for _ in range(n)]
    for group, forced_mean in ((3, 0.3), (1, 0.8), (2, 0.01), (3, None)):
        assert {w.group for w in workers + refs} == {group}
        grads = [(rng.standard_normal(size) * 0.4).astype(np.float32) for _ in range(n)]
        lanes = [w.encode(g, r, n) for w, g, r in zip(workers, grads, res)]
        lanes_ref = [w.encode(g, r, n) for w, g, r in zip(refs, grads, res_ref)]
        total, total_ref = sum(lanes), sum(lanes_ref)
        assert total.shape == (math.ceil(size / lane_geometry(LEVELS[group], n)[1]) + 1,)
        np.testing.assert_array_equal(total[:-1], total_ref[:-1])
        if forced_mean is not None:
            total[-1] = total_ref[-1] = n * forced_mean
        expected = _oracle_sum(grads, res_oracle, group)
        for w in workers:
            np.testing.assert_array_equal(w.decode(total, size, n).view(np.uint32),
                                          expected.view(np.uint32))
        for w in refs:
            np.testing.assert_array_equal(w.decode(total_ref, size, n).view(np.uint32),
                                          expected.view(np.uint32))
        for r, ro in zip(res + res_ref, res_oracle + res_oracle):
            np.testing.assert_array_equal(r, ro)


def _old_wire_bytes(sizes, n):
    """Bytes the 0.01-unit wire (L = 181) pushed for tensors of `sizes`, one transfer each."""
    k = lane_geometry(181, n)[1]
    return sum(8 * (math.ceil(s / k) + 1) for s in sizes)


@pytest.mark.parametrize("mode", ["per_key", "offload_off", "bucket"])
def test_kvstore_trains_bitwise_equal_and_pushes_fewer_bytes(monkeypatch, mode):
    """Two worker threads; the group is steered through 1, 2, 3 by the agreed mean, so every
    geometry is exchanged. Weights are bitwise equal, bytes below the L = 181 wire's."""
    pytest.importorskip("mxnet")
    import training_helpers as th
    seen = []

    def cycle(mean):
        seen.append((1, 2, 3)[int(mean * 1e6) % 3])
        return seen[-1]

    monkeypatch.setattr(fourbit, "group_for_mean", cycle)
    options = dict(offload=mode != "offload_off",
                   fuse_compressed=100_000 if mode == "bucket" else "off")
    runs = th.slimgc_workers(2, lambda: th.dense_net((32, 4), 0), th.batches(12),
                             compressor="4bit", comm_threshold="off", backup=False,
                             timeout=60, **options)
    (w0, s0), (w1, s1) = runs
    for a, b in zip(w0, w1):
        np.testing.assert_array_equal(a, b)
    assert set(seen) == {1, 2, 3}
    sizes, steps = [32 * 12, 32, 4 * 32, 4], 12
    if mode == "bucket":  # the first step key by key, then one bucket of every key
        old = _old_wire_bytes(sizes, 2) + (steps - 1) * _old_wire_bytes([sum(sizes)], 2)
        assert s0["transfers"] == len(sizes) + steps - 1
    else:
        old = steps * _old_wire_bytes(sizes, 2)
        assert s0["transfers"] == steps * len(sizes)
    assert s0["compressed_transfers"] == s0["transfers"]
    assert s0["bytes_pushed"] == s1["bytes_pushed"] < old


def test_float32_lanes_carry_every_groups_geometry(monkeypatch):
    """lane_dtype float32: each declared round has the float32 layout of its own geometry,
    so pushes of every group join back exactly: the same weights as float64 lanes."""
    pytest.importorskip("mxnet")
    import training_helpers as th

    def cycle(mean):
        return (1, 2, 3)[int(mean * 1e6) % 3]

    monkeypatch.setattr(fourbit, "group_for_mean", cycle)
    runs = {dtype: th.slimgc_workers(2, lambda: th.dense_net((32, 4), 0), th.batches(12),
                                     compressor="4bit", comm_threshold="off", backup=False,
                                     timeout=60, lane_dtype=dtype)
            for dtype in ("float64", "float32")}
    for (w64, _), (w32, s32) in zip(runs["float64"], runs["float32"]):
        for a, b in zip(w64, w32):
            np.testing.assert_array_equal(a, b)
    assert s32["bytes_pushed"] > runs["float64"][0][1]["bytes_pushed"]
