"""CTTab: routing in each phase, the table built from samples, and the BestCT rule."""
import json
import math

import pytest

from slimgc_mx.engine.cttab import (CTTab, MIN_FIT_SPAN, NEVER, SAMPLES_PER_SIZE, fit_link,
                                    format_bytes)


def _row(size, t_c, t_q, tensors=1):
    return {"size": size, "tensors": tensors, "wire_q": None, "t_c": t_c, "t_c_q": t_q,
            "t_p_q": 0.0, "t_q": t_q, "ratio": t_c / t_q}


def test_warmup_alternates_compressed_and_full_precision():
    tab = CTTab("auto", warmup_steps=4)
    assert [tab.compressed(10, s) for s in range(4)] == [True, False, True, False]
    assert not tab.needs_decision(3)
    assert tab.needs_decision(4)


def test_forced_modes_route_without_warmup():
    off = CTTab("off", warmup_steps=4)
    assert off.phase == "trained" and off.compressed(1, 1) and off.compressed(10 ** 9, 0)
    fixed = CTTab(4096, warmup_steps=4)
    assert not fixed.needs_decision(100)
    assert not fixed.compressed(4095, 0) and fixed.compressed(4096, 1)
    never = CTTab(NEVER, warmup_steps=4)
    assert not never.compressed(10 ** 12, 0)


def test_choose_is_the_paper_rule_on_a_monotone_table():
    # The paper's example (Fig. 6): ratios 0.93, 0.96, 1.15, 1.65 -> BestCT = 2.2 MB.
    rows = [_row(1_000_000, 28.5, 30.6), _row(1_600_000, 30.5, 31.8),
            _row(2_200_000, 40.2, 35.1), _row(4_000_000, 75.5, 45.8)]
    assert CTTab.choose(rows, "measured") == 2_200_000


def test_choose_ignores_one_noisy_small_tensor():
    rows = [_row(100, 1.0, 2.0), _row(200, 1.1, 1.0), _row(300, 1.0, 2.0, tensors=5),
            _row(10_000, 5.0, 2.0), _row(20_000, 9.0, 3.0)]
    # First ratio > 1 is at 200 B, but compressing 200..300 costs more than it saves.
    assert CTTab.choose(rows, "measured") == 10_000


def test_choose_extremes():
    assert CTTab.choose([]) == NEVER
    assert CTTab.choose([_row(10, 1.0, 2.0), _row(20, 1.0, 3.0)], "measured") == NEVER
    assert CTTab.choose([_row(10, 3.0, 2.0), _row(20, 5.0, 3.0)], "measured") == 10
    with pytest.raises(ValueError, match="unknown CTTab rule 'paper'"):
        CTTab.choose([], "paper")


def _record_link(tab, sizes, latency, bandwidth, proc, noise=lambda key, step: 0.0, steps=4):
    """Warm-up samples of keys of `sizes` bytes on a link; 2bit-like lanes of 1/16 the bytes."""
    for step in range(steps):
        for key, size in enumerate(sizes):
            compressed = step % 2 == 0
            wire = size // 16 if compressed else size
            t = latency + wire / bandwidth + noise(key, step)
            tab.record(key, size, compressed, t, proc(size) if compressed else 0.0,
                       wire if compressed else None)


def test_fit_recovers_the_link_and_its_crossover():
    # 1 ms latency, 100 MB/s, codec 0.2 ms + 1 ns/byte: compression pays once
    # size * 15/16 / 100e6 > 0.2 ms + size * 1e-9, i.e. from about 22 KB.
    tab = CTTab("auto", warmup_steps=4)
    sizes = [1_000, 4_000, 16_000, 32_000, 128_000, 1_000_000]
    _record_link(tab, sizes, 1e-3, 100e6, lambda n: 2e-4 + n * 1e-9)
    rows = tab.build()
    assert tab.link["bandwidth_Bps"] == pytest.approx(100e6, rel=1e-6)
    assert tab.link["latency_s"] == pytest.approx(1e-3, rel=1e-6)
    assert [r["fit_t_c"] for r in rows] == pytest.approx([r["t_c"] for r in rows])
    assert tab.decide() == 32_000
    assert CTTab.choose(rows, "measured") == 32_000  # no noise: both rules agree


def test_fused_full_precision_keeps_small_tensors_uncompressed():
    # 5 ms of latency, 10 MB/s. Alone, a 16 KiB tensor pays the latency on both routes
    # and saves 1.5 ms of bytes compressed; fused, its full precision pays only its 1.6 ms
    # of bytes, less than the 5 ms a compressed transfer of its own pays. 4 MB tensors
    # pay compressed either way.
    sizes = [16384] * 10 + [4_000_000] * 2
    alone, fused = CTTab("auto", warmup_steps=4), CTTab("auto", warmup_steps=4, fused_fp=True)
    for tab in (alone, fused):
        _record_link(tab, sizes, 5e-3, 10e6, lambda n: 1e-4)
        tab.build()
    assert alone.decide() == 16384
    assert fused.decide() == 4_000_000
    assert fused.link == alone.link  # the same fitted link, only the route's cost differs
    row, row_alone = fused.rows[0], alone.rows[0]
    assert row["fit_t_c"] == pytest.approx(16384 / 10e6)
    assert row_alone["fit_t_c"] - row["fit_t_c"] == pytest.approx(5e-3)
    assert row["fit_t_q"] == row_alone["fit_t_q"]  # a compressed tensor pays its own
    assert "full precision fused" in fused.format_table()
    assert "full precision fused" not in alone.format_table()


def test_tiny_sizes_give_no_bandwidth_to_fit():
    # 500 tensors of 16 B whose full-precision transfers ran 0.6 ms slower by chance: the
    # two points (16 B and 1 B of lanes) would fit a 25 KB/s link on which compressing
    # each "saves"; 15 bytes cannot be told from noise, so no bandwidth is read.
    def noise(key, step):
        return 6e-4 if step % 2 == 1 else 0.0

    tab = CTTab("auto", warmup_steps=4)
    _record_link(tab, [16] * 500, 1e-3, 10e9, lambda n: 1e-5, noise)
    rows = tab.build()
    assert tab.link["bandwidth_Bps"] == NEVER
    assert tab.link["latency_s"] == pytest.approx(1.3e-3)
    assert tab.decide() == NEVER
    assert CTTab.choose(rows, "measured") == 16  # as measured, the noise decides


def test_a_warm_up_that_cannot_change_the_decision_is_not_run():
    """Every compressible tensor under MIN_FIT_SPAN: whatever the timings, the fit reads no
    bandwidth and never compresses, so the CTTab decides at step 0 and says why."""
    import random
    rng = random.Random(0)
    sizes = [16] * 50 + [MIN_FIT_SPAN - 4, 4096]
    for trial in range(200):  # the claim, on timings of any kind
        tab = CTTab("auto", warmup_steps=4, fused_fp=trial % 2 == 0)
        _record_link(tab, sizes, rng.uniform(0, 1e-2), rng.uniform(1e3, 1e11),
                     lambda n: rng.uniform(0, 1e-3), lambda key, step: rng.uniform(0, 1e-2))
        assert tab.decide() == NEVER, trial
    tab = CTTab("auto", warmup_steps=4)
    for key, size in enumerate(sizes):
        tab.declare(key, size)
    assert tab.needs_decision(0) and "there is no warm-up" in tab.foregone()
    assert tab.decide() == NEVER and tab.rows == []
    tab.adopt(NEVER)
    assert tab.phase == "trained" and "under 64.0 KiB" in tab.reason and not tab.foregone()
    # one tensor of MIN_FIT_SPAN bytes: a link may be read, so the warm-up runs; the
    # 'measured' rule reads its rows as measured, so it always runs
    for tab, size in ((CTTab("auto", warmup_steps=4), MIN_FIT_SPAN),
                      (CTTab("auto", warmup_steps=4, rule="measured"), 16)):
        tab.declare(0, 16)
        tab.declare(1, size)
        assert tab.foregone() is None and not tab.needs_decision(0)
    assert CTTab(4096).foregone() is None  # a fixed threshold has no warm-up at all


def test_fit_ignores_noisy_small_transfers_that_fool_the_measured_rule():
    # Contended host: the full-precision transfers of small tensors happened to run
    # 10 ms slower than their compressed ones; bytes cost almost nothing (10 GB/s).
    tab = CTTab("auto", warmup_steps=4)
    sizes = [64] * 14 + [256] * 14 + [147_456] * 5

    def noise(key, step):
        return 0.010 if sizes[key] < 1000 and step % 2 == 1 else 0.0

    _record_link(tab, sizes, 2e-3, 10e9, lambda n: 2e-4 + n * 4e-9, noise)
    rows = tab.build()
    assert CTTab.choose(rows, "measured") == 64  # noise decides: compress everything
    assert tab.decide() == NEVER  # the fit: 138 KB saved at 10 GB/s is 14 us < 0.8 ms codec


def test_fit_without_a_bandwidth_signal_never_compresses():
    rows = [_row(100, 5.0, 1.0), _row(10_000, 1.0, 1.0)]
    rows[0]["wire_q"], rows[1]["wire_q"] = 10, 1_000
    link = fit_link(rows)  # the larger transfers were faster: slope < 0
    assert link["bandwidth_Bps"] == NEVER
    assert fit_link([_row(100, 1.0, 1.0)]) == {"latency_s": 0.0, "bandwidth_Bps": NEVER}


def test_unknown_rule_is_rejected():
    with pytest.raises(ValueError, match="valid: fit, measured"):
        CTTab("auto", rule="fastest")


def test_build_keeps_each_keys_fastest_transfer_and_groups_equal_sizes():
    tab = CTTab("auto", warmup_steps=6)
    for t in (1.0, 1.5, 50.0):  # interference only adds time
        tab.record("a", 400, False, t)
        tab.record("a", 400, True, 0.5, 0.1)
    tab.record("b", 400, False, 3.0)
    tab.record("b", 400, True, 0.5, 0.1)
    tab.record("c", 800, False, 2.0)  # no compressed sample: not in the table
    rows = tab.build()
    assert len(rows) == 1
    r = rows[0]
    assert r["size"] == 400 and r["tensors"] == 2
    assert r["t_c"] == pytest.approx((1.0 + 3.0) / 2)
    assert r["t_q"] == pytest.approx(0.6)
    assert r["ratio"] == pytest.approx(2.0 / 0.6)


def test_the_warmup_times_a_few_keys_of_each_size_and_weighs_rows_by_all():
    tab = CTTab("auto", warmup_steps=4)
    for key in range(7):  # five tensors of 400 bytes, two of 800
        tab.declare(key, 400 if key < 5 else 800)
    timed = [k for k in range(7) if tab.timed(k)]
    assert timed == list(range(5))[-SAMPLES_PER_SIZE:] + [5, 6][-SAMPLES_PER_SIZE:]
    tab.declare(7, 400)  # declared once routing began: its size has its timed keys
    tab.declare(8, 1600)  # a new size: timed
    assert not tab.timed(7) and tab.timed(8)
    for key in timed:
        size = 400 if key < 5 else 800
        tab.record(key, size, False, 2.0)
        tab.record(key, size, True, 0.5, 0.1)
    rows = tab.build()
    assert [(r["size"], r["tensors"]) for r in rows] == [(400, 6), (800, 2)]
    assert rows[0]["t_c"] == pytest.approx(2.0) and rows[0]["t_q"] == pytest.approx(0.6)


def test_adopt_switches_routing_and_outputs(tmp_path):
    tab = CTTab("auto", warmup_steps=2)
    for key, size, tc, tq in (("s", 40, 1.0, 2.0), ("l", 4_000_000, 9.0, 2.0)):
        tab.record(key, size, False, tc)
        tab.record(key, size, True, tq, 0.1, size // 16)
    best = tab.decide()
    tab.adopt(best)
    assert best == 4_000_000 and tab.phase == "trained"
    assert not tab.compressed(40, 2) and tab.compressed(4_000_000, 3)
    tab.record("s", 40, False, 1.0)  # ignored after warm-up
    assert "<- BestCT" in tab.format_table()
    tab.save(str(tmp_path / "cttab"))
    data = json.loads((tmp_path / "cttab.json").read_text())
    assert data["best_ct"] == 4_000_000 and len(data["rows"]) == 2
    assert (tmp_path / "cttab.csv").read_text().splitlines()[0].startswith("size,")
    state = tab.state_dict()
    again = CTTab("auto", warmup_steps=2)
    again.load_state_dict(state)
    assert again.phase == "trained" and again.best_ct == best and again.link == tab.link
    assert "fitted link" in tab.format_table() and data["rule"] == "fit"


def test_format_bytes_in_binary_units():
    assert format_bytes(512) == "512 B"
    assert format_bytes(2048) == "2.0 KiB"
    assert format_bytes(3 << 20) == "3.0 MiB"
    assert format_bytes(5 << 30) == "5.0 GiB"
    assert format_bytes(math.inf) == "never"


def test_the_margin_keeps_a_benefit_near_1_in_full_precision():
    # ratios 0.93, 0.96, 1.15, 1.65: the paper's rule compresses from 2.2 MB; with a margin
    # of 0.25 a benefit of 1.15 counts as none, 1.65 still pays.
    rows = [_row(1_000_000, 28.5, 30.6), _row(1_600_000, 30.5, 31.8),
            _row(2_200_000, 40.2, 35.1), _row(4_000_000, 75.5, 45.8)]
    assert CTTab.choose(rows, "measured", margin=0.25) == 4_000_000
    assert CTTab.choose(rows, "measured", margin=0.7) == NEVER


def test_noise_around_a_benefit_of_1_gives_the_same_decision_every_time():
    """A link where compressing saves about what the codec costs (the largest tensor's
    benefit is about 1): timings jitter by 10 %, and with the margin no warm-up of 20
    seeds compresses anything; without it, some do and some do not."""
    import random
    sizes = [4_000, 64_000, 1_000_000]
    decisions = {0.0: set(), 0.25: set()}
    for seed in range(20):
        rng = random.Random(seed)
        for margin in decisions:
            tab = CTTab("auto", warmup_steps=8, margin=margin)
            _record_link(tab, sizes, 1e-3, 10e9, lambda n: 1e-4,
                         lambda key, step: rng.uniform(-1e-4, 1e-4), steps=8)
            decisions[margin].add(tab.decide())
    assert decisions[0.25] == {NEVER}
    assert len(decisions[0.0]) > 1


def test_the_decision_explains_itself_and_replays_from_its_file(tmp_path):
    tab = CTTab("auto", warmup_steps=4, margin=0.25)
    _record_link(tab, [1_000, 128_000, 1_000_000], 1e-3, 100e6, lambda n: 2e-4 + n * 1e-9)
    tab.adopt(tab.decide())
    assert tab.best_ct == 128_000
    assert tab.reason.startswith("125.0 KiB and every larger size compressed give the table's "
                                 "least total time, a compressed size counting 1.25 times its "
                                 "t^q (cttab_margin 0.25): the fitted benefit t_c / t^q is ")
    assert "the next smaller size, 1000 B, has 0.84, not above 1.25" in tab.reason
    tab.save(str(tmp_path / "decision"))
    again = CTTab(str(tmp_path / "decision.json"), warmup_steps=4)
    assert again.phase == "trained" and again.best_ct == 128_000
    assert again.reason.startswith("replayed from %s" % (tmp_path / "decision.json"))
    assert not again.compressed(1_000, 0) and again.compressed(128_000, 1)
    never = CTTab("auto", warmup_steps=4, margin=0.25)
    _record_link(never, [1_000, 16_000], 1e-3, math.inf, lambda n: 2e-4)
    never.adopt(never.decide())
    assert never.best_ct == NEVER and "compression does not pay on this link" in never.reason
    never.save(str(tmp_path / "never"))
    assert CTTab(str(tmp_path / "never.json")).best_ct == NEVER
    assert "no cost per byte measured" in never.format_table()


@pytest.mark.parametrize("content, message", [
    (None, "cannot read the saved CTTab decision"),
    ("not json", "not a JSON file"),
    ('{"rows": []}', "no best_ct in it"),
])
def test_a_bad_saved_decision_is_a_clear_error(tmp_path, content, message):
    path = tmp_path / "decision.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message):
        CTTab(str(path))
