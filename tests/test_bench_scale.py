"""The scale model (bench/scale.py): its formulas on hand-computed cases, the CTTab's choice,
the tabulation's command line, validation against a harness summary, and bad input."""
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest

from slimgc_mx import codecs
from slimgc_mx.bench import cluster, scale, shapes
from slimgc_mx.engine.cttab import NEVER, CTTab

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MB = 1e6
GBIT = 1e9 / 8  # bytes per second


def _link(bandwidth_Bps=GBIT, latency_s=1e-3):
    return scale.Link(latency_s, bandwidth_Bps, "test")


def _setup(workers=4, **kw):
    kw.setdefault("link", _link())
    kw.setdefault("compute_s", 0.1)
    return scale.Setup(workers, **kw)


def _fp32(elements):
    return scale.TensorCost(4 * elements, 4 * elements, ((4 * elements, 4 * elements),))


# ---------------------------------------------------------------- formulas

def test_ring_allreduce_of_fp32_is_2_n_minus_1_over_n_of_the_bytes():
    # 1M float32 on 4 workers, 1 Gbit/s, 1 ms: 2*3 latencies + 2*3/4 * 4 MB / 125 MB/s
    t = scale.ring_seconds([_fp32(1 << 20)], _setup(4))
    assert t == pytest.approx(6e-3 + 1.5 * 4 * (1 << 20) / GBIT)


def test_ring_allgather_moves_n_minus_1_slots():
    slot = scale.TensorCost(1000.0, 8000.0, ((1000.0, 8000.0),), gather=True)
    assert scale.ring_seconds([slot], _setup(8)) == pytest.approx(7 * (1e-3 + 1000.0 / GBIT))


def test_ps_key_sent_whole_pushes_then_pulls():
    # one key of 1M float32: push 32 ms, one latency, pull 32 ms
    one = 4 * (1 << 20) / GBIT
    assert scale.ps_seconds([_fp32(1 << 20)], _setup(4), pieces=False) == \
        pytest.approx(2 * one + 1e-3)


def test_ps_servers_fan_in_scales_both_directions():
    # 4 workers on 2 servers: each server carries 2 workers' bytes
    one = 4 * (1 << 20) / GBIT
    t = scale.ps_seconds([_fp32(1 << 20)], _setup(4, servers=2), pieces=False)
    assert t == pytest.approx(2 * 2 * one + 1e-3)


def test_ps_pieces_overlap_push_and_pull():
    # 4 pieces of 1 MiB: the last pull ends one piece after the last push
    piece = (1 << 20) / GBIT
    t = scale.ps_seconds([_fp32(1 << 20)], _setup(4), pieces=True)
    assert t == pytest.approx(4 * piece + 1e-3 + piece)


def test_a_half_duplex_link_takes_pushes_and_pulls_in_turn():
    one = 4 * (1 << 20) / GBIT
    keys = [_fp32(1 << 20), _fp32(1 << 20)]
    # full duplex: the second push overlaps the first pull
    assert scale.ps_seconds(keys, _setup(4), pieces=False) == pytest.approx(3 * one + 1e-3)
    half = _setup(4, link=replace(_link(), duplex="half"))
    assert scale.ps_seconds(keys, half, pieces=False) == pytest.approx(4 * one + 2e-3)
    # a ring's send and receive take turns too: its byte term doubles
    ring, ring_half = replace(_setup(4), backend="ring"), replace(half, backend="ring")
    fp32 = [_fp32(1 << 20)]
    latency = 2 * 3 * 1e-3
    assert scale.ring_seconds(fp32, ring_half) - latency == pytest.approx(
        2 * (scale.ring_seconds(fp32, ring) - latency))


def test_ps_second_round_waits_for_the_first_sum():
    two = scale.TensorCost(2e6, 2e6, ((1e6, 1e6), (1e6, 1e6)))
    step = 1e6 / GBIT
    assert scale.ps_seconds([two], _setup(4), pieces=False) == \
        pytest.approx(2 * (2 * step + 1e-3))


def test_gather_pull_doubles_with_n_and_its_push_does_not():
    scheme = scale.parse_scheme("topk-alone")
    shape = (1 << 22,)
    at = {n: scale.tensor_cost(scheme, shape, n, True, scale.DEFAULT_CODEC_RATES)
          for n in (16, 32, 64)}
    assert at[32].pull == 2 * at[16].pull and at[64].pull == 2 * at[32].pull
    assert at[16].push == at[64].push and at[16].gather
    bits = codecs.create("topk").wire_bits_per_element(64)  # 64 * ratio * N
    assert at[64].pull * 8 / shape[0] == pytest.approx(bits, rel=0.01)


def test_lane_codec_sums_move_its_wire_bits_each_way():
    cost = scale.tensor_cost(scale.parse_scheme("2bit-alone"), (1 << 22,), 64, True,
                             scale.DEFAULT_CODEC_RATES)
    assert cost.push == cost.pull and not cost.gather
    assert cost.push * 8 / (1 << 22) == pytest.approx(
        codecs.create("2bit").wire_bits_per_element(64), rel=1e-4)


def test_codec_time_is_encode_plus_decode_plus_the_extra_pull_at_memcpy():
    rates = scale.CodecRates({"topk": 1e9}, {"topk": 2e9}, 1e9, 2, "test")
    # 1e6 elements; 4e6 bytes pulled beyond those at N = 2: one memcpy of 1e6 elements
    assert rates.seconds("topk", 1e6, 5e6, 1e6) == pytest.approx(1e-3 + 0.5e-3 + 1e-3)


def test_step_adds_without_backup_and_overlaps_with_it():
    assert scale.step_seconds(0.3, 0.2, 0.1, 0.01, False, "accelerator") == \
        pytest.approx(0.61)
    assert scale.step_seconds(0.3, 0.2, 0.05, 0.01, True, "accelerator") == \
        pytest.approx(0.31)
    assert scale.step_seconds(0.3, 0.4, 0.1, 0.01, True, "accelerator") == \
        pytest.approx(0.51)
    # on a CPU the codec shares the compute's cores
    assert scale.step_seconds(0.3, 0.2, 0.1, 0.01, True, "cpu") == pytest.approx(0.41)
    # and no step is shorter than its CPU work over the worker's cores
    assert scale.step_seconds(0.3, 0.2, 0.1, 0.01, True, "cpu", 0.5) == pytest.approx(0.5)


def test_the_cpu_floor_is_the_workers_cpu_seconds_over_its_cores():
    setup = _setup(device="cpu", cores_per_worker=0.5, compute_cpu_s=0.2)
    assert scale.cpu_floor(setup, 0.05, 0.01) == pytest.approx((0.2 + 0.05 + 0.01) / 0.5)
    # an accelerator, or cores not given: no floor
    assert scale.cpu_floor(replace(setup, device="accelerator"), 0.05, 0.01) == 0
    assert scale.cpu_floor(replace(setup, cores_per_worker=None), 0.05, 0.01) == 0
    model = shapes.get("fc")
    p = scale.predict(model, scale.parse_scheme("2bit-full"), replace(setup, compute_s=0.2))
    assert p.cpu_floor_s == pytest.approx(
        scale.cpu_floor(setup, p.codec_s, p.keys_s)) and p.step_s >= p.cpu_floor_s


def test_alone_keys_pay_the_inline_cost_and_strategies_the_offloaded_one():
    model, setup = shapes.get("resnet20"), _setup(per_key_inline_s=1e-3, per_key_s=0.4e-3)
    alone = scale.predict(model, scale.parse_scheme("2bit-alone"), setup)
    assert alone.keys_s == pytest.approx(len(model.tensors) * 1e-3)
    offload = scale.predict(model, scale.parse_scheme("2bit-offload"), setup)
    assert offload.keys_s < alone.keys_s


def test_a_one_thread_run_is_charged_the_one_thread_rates():
    rates = scale.CodecRates({"2bit": 2e9}, {"2bit": 4e9}, 1e9, 2, "t", {"2bit": 1e9},
                             {"2bit": 2e9})
    assert rates.for_threads(1).encode == {"2bit": 1e9}
    assert rates.for_threads(1).decode == {"2bit": 2e9}
    assert rates.for_threads(2) is rates and rates.for_threads(None) is rates
    # rates without one-thread numbers stay as they are
    assert scale.DEFAULT_CODEC_RATES.for_threads(1) is scale.DEFAULT_CODEC_RATES


def test_topk_stops_paying_between_40_and_64_workers():
    """The issue's bit counts: topk pulls 0.64 N bits per element, fp32 32, so N = 50.
    Wire alone (ResNet-50's many keys), and the default tabulation's VGG-16 at 10 Gbit/s."""
    free = scale.CodecRates({k: 1e18 for k in scale.DEFAULT_RATES},
                            {k: 1e18 for k in scale.DEFAULT_RATES}, 1e18, 2, "free")
    topk = scale.parse_scheme("topk-alone")
    model = shapes.get("resnet50")
    setup = scale.Setup(8, scale.parse_link("10gbit"), scale.default_compute_s(model, 32),
                        per_key_s=0, per_key_inline_s=0)
    wire_only = scale.stops_paying(model, topk, setup, free)
    assert 40 < wire_only <= 64
    vgg = shapes.get("vgg16")
    default = scale.stops_paying(vgg, topk, replace(
        setup, compute_s=scale.default_compute_s(vgg, 32), per_key_s=scale.PER_KEY_S,
        per_key_inline_s=scale.PER_KEY_INLINE_S), scale.DEFAULT_CODEC_RATES)
    assert 40 < default <= 64
    # the codec's CPU time makes it stop paying sooner than its bytes alone
    assert scale.stops_paying(model, topk, replace(setup, per_key_s=scale.PER_KEY_S),
                              scale.DEFAULT_CODEC_RATES) < wire_only
    # and its work per tensor on the training thread sooner still
    assert scale.stops_paying(model, topk, replace(setup, per_key_inline_s=scale.PER_KEY_INLINE_S),
                              free) < wire_only


def test_a_sum_codec_still_pays_where_a_gather_has_stopped():
    model = shapes.get("vgg16")
    setup = scale.Setup(256, scale.parse_link("10gbit"), scale.default_compute_s(model, 32))
    fp32 = scale.predict(model, scale.parse_scheme("fp32"), setup)
    two = scale.predict(model, scale.parse_scheme("2bit-alone"), setup)
    topk = scale.predict(model, scale.parse_scheme("topk-alone"), setup)
    assert two.step_s < fp32.step_s < topk.step_s
    assert topk.bytes_pulled > fp32.bytes_pulled > two.bytes_pulled


# ---------------------------------------------------------------- the CTTab

def test_cttab_choice_is_ctab_choose_on_model_rows(monkeypatch):
    seen = {}
    real = CTTab.choose

    def spy(rows, rule="fit", margin=0.0):
        seen.update(rows=rows, rule=rule, margin=margin)
        return real(rows, rule, margin)
    monkeypatch.setattr(CTTab, "choose", staticmethod(spy))
    model = shapes.get("fc")
    scale.cttab_choice(model, scale.parse_scheme("2bit-full"), _setup(2), scale.DEFAULT_CODEC_RATES)
    assert seen["rule"] == "measured" and seen["margin"] == 0.5
    assert [r["size"] for r in seen["rows"]] == sorted({4 * math.prod(s)
                                                        for _, s in model.tensors})


def test_cttab_keeps_small_tensors_exact_and_gives_up_on_a_fast_link():
    model = shapes.get("fc")
    scheme = scale.parse_scheme("2bit-full")
    # the harness's fc at 1 Gbit/s with a 2 ms fitted latency: the weights from 160 KB
    slow = scale.cttab_choice(model, scheme, _setup(2, link=_link(GBIT, 2e-3)),
                              scale.DEFAULT_CODEC_RATES)
    assert slow == 4 * 10 * 4096
    fast = scale.cttab_choice(model, scheme, _setup(2, link=_link(1000 * GBIT, 2e-3)),
                              scale.DEFAULT_CODEC_RATES)
    assert fast == NEVER
    p = scale.predict(model, scheme, _setup(2, link=_link(1000 * GBIT, 2e-3)))
    assert p.compressed_share == 0 and p.bytes_pushed == 4 * model.elements


def test_margin_decides_a_tensor_whose_benefit_is_below_it():
    model = shapes.get("fc")
    scheme = scale.parse_scheme("2bit-full")
    setup = _setup(2, link=_link(20 * GBIT, 2e-3))
    assert scale.cttab_choice(model, scheme, replace(setup, margin=0.0),
                              scale.DEFAULT_CODEC_RATES) != NEVER
    assert scale.cttab_choice(model, scheme, replace(setup, margin=5.0),
                              scale.DEFAULT_CODEC_RATES) == NEVER


def test_powersgd_sends_vectors_in_full_precision():
    model = shapes.get("resnet20")
    p = scale.predict(model, scale.parse_scheme("powersgd-alone"), _setup(4))
    vectors = sum(math.prod(s) for _, s in model.tensors if len(s) == 1)
    assert p.compressed_share == pytest.approx(1 - vectors / model.elements)


# ---------------------------------------------------------------- shapes

def test_tabulated_models_have_their_published_sizes():
    assert shapes.get("vgg16").elements == 138357544
    assert len(shapes.get("resnet50").tensors) == 161
    assert shapes.get("resnet50").elements == 25557032
    # BERT-base's 109482240 less the pooler (768 x 768 + 768), plus the span head
    assert shapes.get("bert-base").elements == 109482240 - 590592 + 2 * 768 + 2
    assert shapes.get("resnet50").forward_flops == pytest.approx(8.2e9, rel=0.01)


@pytest.mark.slow
def test_harness_models_match_the_gluon_models():
    pytest.importorskip("mxnet")
    r = subprocess.run([sys.executable, "-c", """
import mxnet as mx
from slimgc_mx.bench import models, shapes
for name in ("fc", "vgg", "resnet20"):
    net = models.get_model(name, 10, (3, 32, 32))
    net.initialize()
    net(mx.nd.zeros((1, 3, 32, 32)))
    got = [tuple(p.shape) for p in net.collect_params().values() if p.grad_req != "null"]
    assert got == [s for _, s in shapes.get(name).tensors], name
print("ok")
"""], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


# ---------------------------------------------------------------- the command line

def _run(argv, capsys):
    code = scale.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_writes_the_table_json_and_figure(tmp_path, capsys):
    code, out, err = _run(["--models", "resnet50", "--links", "10gbit@50us",
                           "--workers", "8,64", "--schemes", "2bit-full,topk-alone",
                           "--out", str(tmp_path), "--figure", str(tmp_path / "f.png")],
                          capsys)
    assert code == 0
    assert "stops paying" in out and "N=64" in out and "topk-alone" in out
    assert "fp32" in out  # the baseline is always there
    png = tmp_path / "scale_speedup.png"
    assert png.stat().st_size > 10000
    assert (tmp_path / "f.png").read_bytes() == png.read_bytes()
    report = json.loads((tmp_path / "scale.json").read_text())
    table = report["tables"][0]
    assert table["model"] == "resnet50" and table["link"]["latency_s"] == pytest.approx(50e-6)
    assert [p["workers"] for p in table["rows"]["topk-alone"]] == [8, 64]
    assert set(table["stops_paying"]) == {"2bit-full", "topk-alone"}


@pytest.mark.slow
def test_cli_help_runs_as_a_subcommand():
    r = subprocess.run([sys.executable, "-m", "slimgc_mx.bench", "scale", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0 and "--validate" in r.stdout and "--paper" in r.stdout


@pytest.mark.parametrize("argv, words", [
    (["--schemes", "foo-alone"], ["unknown codec 'foo'", "valid"]),
    (["--schemes", "2bit-sideways"], ["unknown scheme", "alone, offload, full"]),
    (["--schemes", "topk[ratio=2]-alone"], ["ratio", "(0, 1]"]),
    (["--workers", "1,8"], ["at least 2"]),
    (["--workers", "eight"], ["comma list of integers"]),
    (["--links", "10gbps"], ["bits per second", "write 'bit'"]),
    (["--links", "10gbit@soon"], ["latency", "50us"]),
    (["--models", "alexnet"], ["unknown model", "vgg16"]),
    (["--backend", "ring", "--schemes", "mxnet-2bit"], ["parameter servers only"]),
    (["--per-key-inline-us", "-1"], ["--per-key-inline-us", ">= 0"]),
])
def test_bad_input_exits_2_with_the_problem_named(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        scale.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for w in words:
        assert w in err


# ---------------------------------------------------------------- rates and links from files

@pytest.mark.slow
def test_rates_come_from_a_bench_codecs_json(tmp_path, capsys):
    path = tmp_path / "codecs.json"
    r = subprocess.run([sys.executable, "-m", "slimgc_mx.bench", "codecs", "--size", "4096",
                        "--repeat", "1", "--reference-repeat", "1", "--codecs", "2bit,topk",
                        "--workers", "4", "--json", str(path)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr
    rates = scale.load_rates(str(path))
    measured = json.loads(path.read_text())
    assert rates.workers == 4
    assert rates.encode["2bit"] == measured["codecs"]["2bit"]["encode_elems_per_s"]
    assert rates.for_threads(1).encode["topk"] == \
        measured["codecs"]["topk"]["encode_1thread_elems_per_s"]
    code, out, _ = _run(["--rates", str(path), "--models", "fc", "--links", "10gbit",
                         "--workers", "8", "--schemes", "2bit-alone"], capsys)
    assert code == 0 and str(path) in out
    with pytest.raises(SystemExit) as e:
        scale.main(["--rates", str(path), "--schemes", "thc-alone"])
    assert e.value.code == 2 and "no rates for codec 'thc'" in capsys.readouterr().err


def test_a_file_that_is_not_a_rates_file_is_named(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text('{"codecs": 3}')
    with pytest.raises(SystemExit) as e:
        scale.main(["--rates", str(bad)])
    assert e.value.code == 2 and "bench codecs" in capsys.readouterr().err


def test_link_from_a_saved_cttab_decision(tmp_path):
    tab = CTTab("auto", warmup_steps=2)
    for step in range(4):
        for key, n in ((0, 4000), (1, 400000)):
            tab.record(key, n, step % 2 == 0, 1e-3 + (n / 10 if step % 2 == 0 else n) / 1e8,
                       1e-4, n // 10)
    tab.adopt(tab.decide())
    tab.save(str(tmp_path / "tab"))
    link = scale.link_from_cttab(str(tmp_path / "tab.json"))
    assert link.latency_s == pytest.approx(1e-3) and link.bandwidth_Bps == pytest.approx(1e8)


# ---------------------------------------------------------------- validation

def _harness_summary(tmp_path):
    """A throughput summary.json built by the harness's own summarize and add_derived from
    probe files as its workers write them: fc, 2 workers + 2 servers at 1 Gbit/s."""
    opts = SimpleNamespace(workers=2, mode="throughput", batch_size=32)
    measured = {"fp32": 1.683, "mxnet-2bit": 1.220, "slimgc-2bit-full": 0.203,
                "slimgc-2bit-classic": 3.1, "no-comm": 0.106}
    results = []
    for name, step in measured.items():
        probe_dir = tmp_path / (name + ".probe")
        probe_dir.mkdir()
        slimgc = name.startswith("slimgc")
        for rank in range(2):
            probe = {"window_steps": 30, "first_step": 11, "calls": 41, "iface": "eth0",
                     "complete": True, "step_s": {"median": step, "mean": step,
                                                  "all": [step] * 30},
                     "cpu_s_per_step": 0.1, "wire": {"rx_bytes": 10.8e6, "tx_bytes": 10.9e6},
                     "kv_per_step": {k: 1.0 for k in cluster._Probe.STAT_KEYS},
                     "rank": rank, "launch_index": rank, "final_test_acc": None,
                     "history": [], "model": {"name": "fc", "num_params": 29409290,
                                              "num_tensors": 6},
                     "cttab": None, "comm_threshold_bytes": 163840 if slimgc else None,
                     "cttab_link": {"latency_s": 2e-3, "bandwidth_Bps": 5e7}
                     if slimgc else None, "comm_threshold_phase": None}
            (probe_dir / ("worker%d.json" % rank)).write_text(json.dumps(probe))
        results.append(cluster.summarize(name, opts, str(probe_dir), 0, 60.0, True, 0))
    summary = {"command": ["cluster"], "mode": "throughput", "model": "fc",
               "dataset": "synthetic-cifar", "workers": 2, "servers": 2, "bandwidth": "1gbit",
               "delay": None, "netns": True, "steps": 30, "warmup": 10, "batch_size": 32,
               "results": results}
    cluster.add_derived(summary)
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary, default=str))
    return path


def test_validate_sets_predictions_beside_a_harness_summary(tmp_path, capsys):
    path = _harness_summary(tmp_path)
    v = scale.validate(str(path), scale.DEFAULT_CODEC_RATES)
    rows = {r["config"]: r for r in v["rows"]}
    assert set(rows) == {"fp32", "mxnet-2bit", "slimgc-2bit-full"}
    assert v["compute_s"] == 0.106  # the no-comm step
    setup = scale.Setup(2, scale.Link(2e-3, GBIT), 0.106, 32, servers=2, device="cpu")
    for name, r in rows.items():
        p = scale.predict(shapes.get("fc"), scale.parse_scheme(name), setup)
        assert r["predicted"] == pytest.approx(p.samples_per_s)
        assert r["measured"] == pytest.approx(32 / {"fp32": 1.683, "mxnet-2bit": 1.220,
                                                    "slimgc-2bit-full": 0.203}[name])
        assert r["error"] == pytest.approx(r["predicted"] / r["measured"] - 1)
        assert r["measured_wire_bytes"] == pytest.approx(21.7e6)
    assert rows["slimgc-2bit-full"]["predicted_best_ct"] == 163840 == \
        rows["slimgc-2bit-full"]["measured_best_ct"]
    assert any("classic" in s for s in v["skipped"])
    code, out, _ = _run(["--validate", str(path)], capsys)
    assert code == 0 and "slimgc-2bit-full" in out and "error" in out and "skipped" in out
    # on the harness's shared host: no-comm's CPU-seconds over usable CPUs / N cores
    data = json.loads(path.read_text())
    data["machine"] = {"usable_cpus": 2}
    path.write_text(json.dumps(data))
    v = scale.validate(str(path), scale.DEFAULT_CODEC_RATES)
    assert v["cores"] == 2 and v["compute_cpu_s"] == pytest.approx(0.1)
    floored = replace(setup, cores_per_worker=1.0, compute_cpu_s=0.1)
    for r in v["rows"]:
        p = scale.predict(shapes.get("fc"), scale.parse_scheme(r["config"]), floored)
        assert r["parts_s"]["cpu_floor"] == pytest.approx(p.cpu_floor_s)
        assert p.cpu_floor_s > 0
    code, out, _ = _run(["--validate", str(path), "--half-duplex"], capsys)
    assert code == 0 and "half duplex" in out
    half = scale.validate(str(path), scale.DEFAULT_CODEC_RATES, duplex="half")
    assert {r["config"]: r["predicted"] for r in half["rows"]}["fp32"] < \
        {r["config"]: r["predicted"] for r in v["rows"]}["fp32"]


def test_validate_names_what_is_wrong_with_its_file(tmp_path, capsys):
    path = _harness_summary(tmp_path)
    data = json.loads(path.read_text())
    data["results"] = [r for r in data["results"] if r["config"] != "no-comm"]
    path.write_text(json.dumps(data))
    code, _, err = _run(["--validate", str(path)], capsys)
    assert code == 2 and "--compute-ms" in err and "Traceback" not in err
    code, out, _ = _run(["--validate", str(path), "--compute-ms", "106"], capsys)
    assert code == 0 and "fp32" in out
    other = tmp_path / "other.json"
    other.write_text("[1, 2]")
    code, _, err = _run(["--validate", str(other)], capsys)
    assert code == 2 and "not a summary.json" in err


def test_paper_comparison_covers_table_3_and_fig_12(capsys):
    code, out, _ = _run(["--paper"], capsys)
    assert code == 0
    for model, table in scale.PAPER_TABLE3.items():
        for label, value in table.items():
            assert label in out and ("%.1f" % value) in out
    assert "2bit-full / 1bit-alone" in out
