"""CTTab: routing in each phase, the table built from samples, and the BestCT rule."""
import json
import math

import pytest

from slimgc_mx.threshold import CTTab, NEVER, format_bytes


def _row(size, t_c, t_q, tensors=1):
    return {"size": size, "tensors": tensors, "t_c": t_c, "t_c_q": t_q, "t_p_q": 0.0,
            "t_q": t_q, "ratio": t_c / t_q}


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
    assert CTTab.choose(rows) == 2_200_000


def test_choose_ignores_one_noisy_small_tensor():
    rows = [_row(100, 1.0, 2.0), _row(200, 1.1, 1.0), _row(300, 1.0, 2.0, tensors=5),
            _row(10_000, 5.0, 2.0), _row(20_000, 9.0, 3.0)]
    # First ratio > 1 is at 200 B, but compressing 200..300 costs more than it saves.
    assert CTTab.choose(rows) == 10_000


def test_choose_extremes():
    assert CTTab.choose([]) == NEVER
    assert CTTab.choose([_row(10, 1.0, 2.0), _row(20, 1.0, 3.0)]) == NEVER
    assert CTTab.choose([_row(10, 3.0, 2.0), _row(20, 5.0, 3.0)]) == 10


def test_build_uses_medians_and_groups_equal_sizes():
    tab = CTTab("auto", warmup_steps=6)
    for t in (1.0, 1.0, 50.0):  # one outlier
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


def test_adopt_switches_routing_and_outputs(tmp_path):
    tab = CTTab("auto", warmup_steps=2)
    for key, size, tc, tq in (("s", 40, 1.0, 2.0), ("l", 4_000_000, 9.0, 2.0)):
        tab.record(key, size, False, tc)
        tab.record(key, size, True, tq, 0.0)
    best = CTTab.choose(tab.build())
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
    assert again.phase == "trained" and again.best_ct == best


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(2048) == "2.0 KB"
    assert format_bytes(3 << 20) == "3.0 MB"
    assert format_bytes(math.inf) == "never"
