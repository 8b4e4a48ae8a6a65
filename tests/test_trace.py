"""The trace option: each worker's stage spans as a Chrome trace; merging ranks."""
import json

import pytest

from slimgc_mx import trace
from training_helpers import batches, dense_net, slimgc_workers


def _load(path):
    with open(path) as f:
        return json.load(f)["traceEvents"]


def test_two_workers_write_their_stages_and_merge(tmp_path):
    path = str(tmp_path / "run.json")
    results = slimgc_workers(2, lambda: dense_net([64, 10]), batches(8), compressor="2bit",
                             comm_threshold="off", warmup_steps=2, trace=path)
    assert len(results) == 2 and all(r[1]["compressed_transfers"] > 0 for r in results)
    files = [trace.rank_path(path, r) for r in range(2)]
    for rank, f in enumerate(files):
        spans = [e for e in _load(f) if e["ph"] == "X"]
        stages = {e["name"] for e in spans}
        # 2bit with momentum SGD decodes inside the global update: no decode span of its own
        assert {"local update", "encode", "transfer", "global update"} <= stages
        assert stages <= set(trace.STAGES)
        assert all(e["pid"] == rank and e["dur"] >= 0 and "step" in e["args"] for e in spans)
        # every step of every key went through encode, transfer and the global update
        for stage in ("encode", "transfer", "global update"):
            steps = {(e["args"]["key"], e["args"]["step"]) for e in spans if e["name"] == stage}
            assert len(steps) == len({(e["args"]["key"], e["args"]["step"]) for e in spans
                                      if e["name"] == "encode"})
        names = {e["args"]["name"] for e in _load(f) if e["name"] == "thread_name"}
        assert {"slimgc-encoder", "slimgc-finisher"} <= names
    out = tmp_path / "merged.json"
    assert trace.main(["merge", str(out)] + files) == 0
    merged = _load(out)
    assert {e["pid"] for e in merged} == {0, 1}
    assert len(merged) == sum(len(_load(f)) for f in files)


def test_no_trace_by_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    slimgc_workers(1, lambda: dense_net([8, 10]), batches(2), compressor="2bit")
    assert not list(tmp_path.iterdir())


def test_merge_refuses_other_json(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="not a slimgc trace"):
        trace.merge(str(tmp_path / "o.json"), [str(bad)])
    assert trace.main(["merge"]) == 2
    assert "usage" in capsys.readouterr().err
    not_json = tmp_path / "y.json"
    not_json.write_text("traceEvents")
    for args in (["cycles", str(bad)], ["cycles", str(not_json)],
                 ["merge", str(tmp_path / "o.json"), str(tmp_path / "missing.json")]):
        assert trace.main(args) == 2
        err = capsys.readouterr().err
        assert "error:" in err and ("not a slimgc trace" in err or "missing.json" in err)


def test_cycles_are_medians_from_the_local_update(tmp_path, capsys):
    t = trace.Trace(str(tmp_path / "t.json"))
    base = t._t0
    for step, (lu, tr0, tr1, gu1) in enumerate([(0, 1, 4, 5), (10, 12, 20, 21), (30, 30, 33, 40)]):
        ms = lambda x: base + x / 1e3  # noqa: E731
        t.span("local update", ms(lu), ms(lu + 0.5), key="w", step=step)
        t.span("encode", ms(lu), ms(tr0), key="w", step=step, thread="mxnet-engine", piece=0)
        t.span("encode", ms(lu), ms(tr0), key="w", step=step, thread="mxnet-engine", piece=1)
        t.span("transfer", ms(tr0), ms(tr1), key="w", step=step, round=0)
        t.span("global update", ms(tr1), ms(gu1), key="w", step=step)
    t.span("transfer", base, base + 1, key="w", step=3)  # no local update: left out
    path = t.write()
    (row,) = trace.cycles(path)
    assert (row.key, row.steps, row.pieces) == ("w", 3, 2)
    # sums back 4, 10, 3 -> 4; cycle 5, 11, 10 -> 10; transfer 3, 8, 3 -> 3
    assert (row.sums_back, row.cycle, row.transfer) == pytest.approx((4, 10, 3), abs=1e-6)
    assert [r.steps for r in trace.cycles(path, first_step=1)] == [2]
    assert trace.main(["cycles", path]) == 0
    assert "| t.rank0.json | w | 3 | 4 | 10 | 3 | 2 |" in capsys.readouterr().out


def test_cycles_say_which_steps_they_count_and_why_others_are_left_out(tmp_path, capsys):
    """A 40-step run printed '8 steps' per key with no word on why: the steps fused with
    other keys and those before --first-step are counted, by reason, in 'left out'."""
    t = trace.Trace(str(tmp_path / "t.json"))
    bucket = "parameters w, b (fused)"
    for step in range(8):
        s0 = t._t0 + step
        if step != 7:
            t.span("local update", s0, s0 + 1e-3, key="w", step=step)
        owner = bucket if step in (4, 5) else "w"
        if step != 6:  # step 6 never finished
            t.span("transfer", s0 + 1e-3, s0 + 2e-3, key=owner, step=step, round=0)
            t.span("global update", s0 + 2e-3, s0 + 3e-3, key=owner, step=step)
    path = t.write()
    (row,) = trace.cycles(path, first_step=2)
    assert row.steps == 2  # steps 2 and 3
    assert row.left_out == {"early": 2, "fused": 2, "unfinished": 1, "no local update": 1}
    assert trace.main(["cycles", "--first-step", "2", path]) == 0
    out = capsys.readouterr().out
    assert out.startswith("steps: the steps of a key measured, those from --first-step 2 on ")
    assert ("| 2 before --first-step, 2 fused, 1 without a local update, 1 unfinished |"
            in out)


def test_a_fused_run_shows_its_fused_steps(tmp_path, capsys):
    path = str(tmp_path / "run.json")
    slimgc_workers(2, lambda: dense_net([16, 4]), batches(6), compressor="2bit",
                   comm_threshold=10 ** 9, trace=path)  # all full precision: fused
    rows = trace.cycles(trace.rank_path(path, 0))
    assert rows and all(r.left_out.get("fused", 0) > 0 for r in rows)
    assert all(r.steps + sum(r.left_out.values()) == 6 for r in rows)
