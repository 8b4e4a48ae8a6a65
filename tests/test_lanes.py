"""Lane geometry from first principles: radix, digits per lane, exact sums, wire bits."""
import math

import numpy as np
import pytest

from slimgc_mx import codecs
from slimgc_mx.codecs import base, layout
from slimgc_mx.codecs import lanes as lane_codecs


@pytest.mark.parametrize("levels", [2, 3, 181])
@pytest.mark.parametrize("n_workers", [1, 2, 3, 7, 16, 63, 64, 1000, 2 ** 20])
def test_geometry_is_the_largest_exact_packing(levels, n_workers):
    radix, k = codecs.lane_geometry(levels, n_workers)
    assert radix == n_workers * (levels - 1) + 1
    assert radix ** k <= 2 ** 53 < radix ** (k + 1)


@pytest.mark.parametrize("levels", [2, 3, 181])
@pytest.mark.parametrize("n_workers", [1, 2, 5, 64])
def test_worst_case_sum_of_lanes_is_exact_in_float64(levels, n_workers):
    # Every worker sends the top level in every digit: the largest possible sum.
    radix, k = codecs.lane_geometry(levels, n_workers)
    lane = sum((levels - 1) * radix ** j for j in range(k))
    assert float(lane) == lane
    total = np.zeros(1)
    for _ in range(n_workers):
        total += float(lane)
    assert int(total[0]) == n_workers * lane < 2 ** 53
    digits = [(int(total[0]) // radix ** j) % radix for j in range(k)]
    assert digits == [n_workers * (levels - 1)] * k


# docs/codecs.md and the design notes quote these (bits per element, each direction).
@pytest.mark.parametrize("name,expected", [
    ("1bit", {1: 1.21, 2: 1.94, 4: 2.91, 8: 4.00, 16: 5.33}),
    ("2bit", {1: 1.94, 2: 2.91, 4: 4.00, 8: 5.33, 16: 6.40}),
])
def test_wire_bits_match_the_design_table(name, expected):
    c = codecs.create(name, num_threads=1)
    for n_workers, bits in expected.items():
        assert round(c.wire_bits_per_element(n_workers), 2) == bits


def test_lane_count_adds_trailer_lanes():
    for name, trailer in [("none", 0), ("1bit", 1), ("2bit", 0), ("4bit", 1)]:
        c = codecs.create(name, num_threads=1)
        _, k = c.geometry(4)
        for size in (0, 1, k, k + 1, 10 ** 6 + 3):
            assert c.lane_count(size, 4) == math.ceil(size / k) + trailer
    assert codecs.create("none").wire_bits_per_element(1000) == 32.0


@pytest.mark.parametrize("name", ["1bit", "2bit", "4bit"])
def test_too_many_workers_is_a_clear_error(name):
    c = codecs.create(name, num_threads=1)
    levels = c.levels
    limit = (2 ** 53 - 1) // (levels - 1)   # largest N with radix <= 2**53
    assert c.geometry(limit)[1] == 1
    with pytest.raises(ValueError, match="workers"):
        c.lane_count(10, limit + 1)
    g = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="fewer workers"):
        c.encode(g, np.zeros(3, np.float32), limit + 1)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", None])
def test_num_workers_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="num_workers"):
        codecs.create("2bit").lane_count(8, bad)


def test_kernel_constants_match_the_python_side():
    k = base.kernels()
    assert k.chunk_lanes == layout.CHUNK_LANES
    assert k.row_width == layout.ROW


def test_chunk_sum_is_sequential_within_and_across_chunks():
    rng = np.random.default_rng(3)
    k = 2
    v = rng.random(layout.CHUNK_LANES * k * 2 + 5) * 10.0 ** rng.integers(-8, 8, 4101)
    expected = 0.0
    block = layout.CHUNK_LANES * k
    for start in range(0, v.size, block):
        s = 0.0
        for x in v[start:start + block].tolist():
            s += x
        expected += s
    assert lane_codecs.chunk_sum(v, k) == expected


@pytest.mark.parametrize("radix", [2, 3, 5, 9, 13, 181])
def test_decoder_division_is_exact_up_to_the_largest_lane(radix):
    # The decoder divides lanes by R**m with a multiply by a rounded-up reciprocal; with a
    # table whose rows hold the digits themselves, its output is the lanes' digits, so
    # any off-by-one quotient shows. Lanes: 0, the largest (R**k - 1), the values on
    # both sides of multiples of R**m near the top, and random ones.
    k = int(math.floor(53 / math.log2(radix)))
    while radix ** (k + 1) <= 2 ** 53:
        k += 1
    while radix ** k > 2 ** 53:
        k -= 1
    rng = np.random.default_rng(radix)
    top = radix ** k
    for m in range(1, min(layout.ROW, k) + 1):
        rm = radix ** m
        if rm > lane_codecs.MAX_ROWS:
            break
        s = np.arange(rm)
        rows = np.zeros((rm, layout.ROW), np.float32)
        rows[:, :m] = (s[:, None] // radix ** np.arange(m)[None, :]) % radix
        q_top = (top - 1) // rm
        lanes = [0, 1, top - 1, top - 2, rm - 1, rm]
        lanes += [q * rm + d for q in (q_top, q_top - 1, q_top // 2) for d in (-1, 0, 1)]
        lanes += [int(x) for x in rng.integers(0, top, 200, dtype=np.uint64)]
        lanes = [x for x in lanes if 0 <= x < top]
        out = np.zeros(len(lanes) * k, np.float32)
        base.kernels().decode_lanes(np.array(lanes, np.float64), out, rows.ravel(), k, m, 1)
        expected = [(x // radix ** j) % radix for x in lanes for j in range(k)]
        assert out.astype(np.int64).tolist() == expected, (radix, m)
