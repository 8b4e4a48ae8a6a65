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
