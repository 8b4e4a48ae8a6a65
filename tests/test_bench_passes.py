"""python -m slimgc_mx.bench passes: the plan's memory traffic against the floor."""
import json

import pytest

from slimgc_mx import bench, codecs
from slimgc_mx.bench import passes


def test_the_passes_of_a_compressed_tensor_add_up():
    c = passes.compressed_passes(wire_bits=8.0, fused_encode=False)
    assert [p.name.split(" ")[0] for p in c] == ["gradient", "local", "loc_buf", "encode",
                                                 "sum", "decode"]
    # 8 + 16 + 8 + (12 + 1) + 1 + (1 + 16): above the floor of 24 + 1 + 16 + 1
    assert sum(p.total for p in c) == pytest.approx(63.0)
    # The local update encoding in its pass reads MXNet's gradient once, in place: no copy
    # into grad_buf and no second read, 12 bytes fewer.
    fused = passes.compressed_passes(wire_bits=8.0)
    assert [p.name.split(" ")[0] for p in fused] == ["local", "loc_buf", "sum", "decode"]
    assert sum(p.total for p in fused) == pytest.approx(51.0)
    assert passes.floor_bytes(8.0) == pytest.approx(42.0)
    assert passes.no_comm_bytes() == 20.0
    off = passes.compressed_passes(wire_bits=8.0, backup=False, fused_decode=False)
    names = [p.name for p in off]
    assert "NaN/Inf pre-check" in names and "glo_buf into the parameters" in names
    assert "decode into the aggregate" in names and "local update" not in " ".join(names)
    # Without the decoding kernel the NaN check writes a bool per lane (NumPy's isfinite).
    check = next(p for p in off if p.name.startswith("sum checked"))
    assert (check.read, check.write) == (1.0, 0.125)


def test_the_threshold_splits_the_model():
    sizes = [1000, 50_000, 10]
    r = passes.plan(sizes, codecs.create("2bit"), 2, comm_threshold=4 * 1000)
    assert r["compressed_elements"] == 51_000 and r["elements"] == 51_010
    assert r["decode_in_update"] is True  # 2bit decodes by table inside the SGD kernel
    per_c = sum(p["total"] for p in r["compressed_passes"])
    per_f = sum(p["total"] for p in r["full_precision_passes"])
    assert r["bytes_per_step"] == pytest.approx(51_000 * per_c + 10 * per_f)
    assert r["encode_in_local_update"] is True
    assert not passes.plan(sizes, codecs.create("qsgd"), 2, 0)["decode_in_update"]
    for name, options in (("thc", {"hadamard": True}), ("topk", {})):
        assert not passes.plan(sizes, codecs.create(name, **options), 2,
                               0)["encode_in_local_update"]
    assert not passes.plan(sizes, codecs.create("2bit"), 2, 0,
                           backup=False)["encode_in_local_update"]


def test_cli_reports_a_model(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert bench.main(["passes", "--model", "mlp", "--dataset", "digits", "--json",
                       str(out)]) == 0
    text = capsys.readouterr().out
    assert "floor" in text and "no-comm" in text and "copies" in text
    report = json.loads(out.read_text())
    assert report["elements"] > 0
    assert report["bytes_per_element"] > report["floor_bytes_per_element"] > 20.0
