"""The codec benchmark and the bench dispatcher: runs, keys of the JSON report, errors."""
import json

import pytest

from slimgc_mx import bench, codecs
from slimgc_mx.bench import codecs as bench_codecs


@pytest.mark.slow
def test_codecs_bench_writes_the_documented_keys(tmp_path, capsys):
    out = tmp_path / "codecs.json"
    rc = bench.main(["codecs", "--size", "5000", "--repeat", "1", "--reference-repeat", "1",
                     "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["memcpy_elems_per_s"] > 0
    assert sorted(report["codecs"]) == codecs.available()
    assert report["params"]["shapes"]["2bit"] == [5000]
    assert report["params"]["shapes"]["powersgd"] == [50, 100]  # matrices only
    for name, r in report["codecs"].items():
        for key in ("encode_elems_per_s", "decode_elems_per_s", "encode_1thread_elems_per_s",
                    "decode_1thread_elems_per_s", "reference_encode_elems_per_s",
                    "reference_decode_elems_per_s"):
            assert r[key] > 0, (name, key)
        assert r["encode_vs_memcpy"] == pytest.approx(
            r["encode_elems_per_s"] / report["memcpy_elems_per_s"])
        assert set(report["wire_bits"][name]) == {"1", "2", "4", "8", "16", "32", "64"}
    assert report["wire_bits"]["2bit"]["1"] == pytest.approx(64 / 33)
    assert report["wire_bits"]["powersgd"]["32"] == pytest.approx(32 * 4 * 150 / 5000)
    # a gathering codec's pull grows with N
    assert report["wire_route"] == {name: "gather" if name in ("topk", "dgc", "gcomp") else "sum"
                                    for name in codecs.available()}
    topk_bits = report["wire_bits"]["topk"]
    assert topk_bits["32"] == pytest.approx(32 * topk_bits["1"])
    table = capsys.readouterr().out
    assert "memcpy" in table and "2bit" in table and "wire bits" in table


def test_bench_dispatcher_help_and_errors(capsys):
    assert bench.main(["--help"]) == 0
    assert "codecs" in capsys.readouterr().out
    assert bench.main([]) == 2
    assert bench.main(["nope"]) == 2
    assert "unknown subcommand" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        bench_codecs.main(["--codecs", "3bit"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        bench_codecs.main(["--size", "0"])


def test_a_codec_option_sets_what_is_timed_and_is_recorded(tmp_path):
    out = tmp_path / "codecs.json"
    rc = bench.main(["codecs", "--size", "5000", "--repeat", "1", "--reference-repeat", "1",
                     "--codecs", "randomk,topk", "--codec-option", "ratio=0.01",
                     "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["params"]["codec_options"] == {"ratio": "0.01"}
    assert report["wire_bits"]["randomk"]["2"] == pytest.approx(32 * 50 / 5000)
    assert report["wire_bits"]["topk"]["1"] == pytest.approx(
        codecs.create("topk", ratio=0.01).wire_bits_per_element(1))


@pytest.mark.parametrize("argv, said", [
    (["--codecs", "randomk", "--codec-option", "ratio=2"], "option ratio="),
    (["--codecs", "2bit", "--codec-option", "levels=4"], "levels"),
])
def test_a_bad_codec_option_is_a_usage_error_naming_it(capsys, argv, said):
    with pytest.raises(SystemExit) as exc:
        bench_codecs.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--codec-option" in err and said in err
