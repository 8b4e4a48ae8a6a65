"""Smoke test of the emulated cluster: namespaces, rate-limited links, measured wire bytes.

Needs root, iproute2 (ip, tc) and network namespaces; skipped with the reason otherwise.
"""
import json
import os
import subprocess
import sys

import pytest

from slimgc_mx import launch
from slimgc_mx.bench import cluster
from slimgc_mx.launch import netns

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_config_names_map_to_train_options():
    classic = cluster.config_args("slimgc-2bit-classic")
    assert "--comm-threshold" in classic and classic[classic.index("--comm-threshold") + 1] == "off"
    assert "--no-backup" in classic and "--no-offload" in classic
    full = cluster.config_args("slimgc-4bit-full")
    assert "--no-backup" not in full and "4bit" in full and "--no-fuse" not in full
    assert cluster.config_args("slimgc-4bit-full-nofuse") == full + ["--no-fuse"]
    assert cluster.config_args("slimgc-4bit-full-cupcake") == full + ["--fuse-compressed",
                                                                      "auto"]
    assert cluster.parse_configs("slimgc-1bit,fp32", ["1bit"]) == [
        "slimgc-1bit-classic", "slimgc-1bit-cgopt", "slimgc-1bit-offload", "slimgc-1bit-full",
        "fp32"]
    with pytest.raises(ValueError):
        cluster.config_args("slimgc-3bit-full")
    assert netns.rate_bits("1gbit") == 1e9 and netns.rate_bits("125mbps") == 1e9


def test_only_slimgc_servers_get_the_zero_filled_heap():
    def servers(stock):
        plan = cluster.build_tasks(None, 2, 2, ["true"], comm=True, stock_servers=stock)
        return [t.env for t in plan if t.role == "server"]
    assert all(env["MALLOC_PERTURB_"] == "255" for env in servers(False))
    assert not any("MALLOC_PERTURB_" in env or "GLIBC_TUNABLES" in env for env in servers(True))


def test_every_process_gets_the_same_openmp_threads(monkeypatch):
    argv = ["--model", "fc", "--workers", "4", "--configs", "fp32"]
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cluster.parse_args(argv, "x").threads == launch.omp_threads(4)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cluster.parse_args(argv, "x").threads == 3
    assert cluster.parse_args(argv + ["--threads", "2"], "x").threads == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "many")
    with pytest.raises(SystemExit):
        cluster.parse_args(argv, "x")


def test_every_worker_gets_the_launchers_engine_threads(monkeypatch):
    monkeypatch.delenv(cluster.ENGINE_THREADS, raising=False)
    argv = ["--model", "fc", "--workers", "2", "--configs", "fp32"]
    assert cluster.parse_args(argv, "x").engine_threads == launch.WORKER_ENGINE_THREADS
    for comm in (True, False):  # the baselines, SlimGC and no-comm alike
        plan = cluster.build_tasks(None, 2, 2, ["true"], comm)
        assert {t.env.get(cluster.ENGINE_THREADS) for t in plan if t.role == "worker"} == {
            str(launch.WORKER_ENGINE_THREADS)}
    monkeypatch.setenv(cluster.ENGINE_THREADS, "3")  # the caller's value reaches every process
    assert cluster.parse_args(argv, "x").engine_threads == 3
    assert not any(cluster.ENGINE_THREADS in t.env
                   for t in cluster.build_tasks(None, 2, 2, ["true"], False))
    monkeypatch.setenv(cluster.ENGINE_THREADS, "two")
    with pytest.raises(SystemExit):
        cluster.parse_args(argv, "x")


def test_time_composition_adds_up():
    rec = {"step_s": {"median": 1.0},
           "wire_bytes_per_step_per_worker": {"tx": 50e6, "rx": 25e6, "total": 75e6},
           "kvstore_per_step_per_worker": {"comm_s": 3.0, "compress_s": 0.25, "blocked_s": 0.1}}
    tc = cluster.time_composition(rec, 0.75, 1e9)
    assert tc["compute"] + tc["exposed"] == pytest.approx(1.0)
    assert tc["wire"] == pytest.approx(0.4)  # 50 MB at 1 Gbit/s
    assert tc["overlap"] == pytest.approx(0.4)  # 0.4 + 0.25 of work, 0.25 of it exposed


def test_repeats_keep_the_median_run_and_every_value():
    def rec(name, sps, ok=True):
        return {"config": name, "ok": ok, "samples_per_s_per_worker": sps, "wall": sps}
    runs = [rec("fp32", 10.0), rec("full", 30.0), rec("fp32", 12.0), rec("full", 20.0),
            rec("fp32", 11.0), rec("full", None, ok=False)]
    rows = cluster.merge_repeats(runs, ["fp32", "full"])
    assert [r["config"] for r in rows] == ["fp32", "full"]
    assert rows[0]["samples_per_s_per_worker"] == 11.0 and rows[0]["wall"] == 11.0
    assert sorted(rows[0]["samples_per_s_runs"]) == [10.0, 11.0, 12.0]
    assert rows[1]["samples_per_s_per_worker"] == 20.0  # lower median of the 2 good runs
    assert rows[1]["runs_ok"] == 2 and rows[1]["runs"] == 3
    assert cluster.merge_repeats([rec("x", None, ok=False)], ["x"])[0]["runs_ok"] == 0


def test_accuracy_table_has_every_seed_the_mean_and_the_threshold():
    from slimgc_mx.bench import plots

    def run(config, acc, ct=None, phase=None):
        return {"config": config, "ok": acc is not None, "comm_threshold_bytes": ct,
                "comm_threshold_phase": phase, "final_test_acc": {"0": acc, "1": acc}}
    summary = {"model": "cnn1d", "command": ["bench"], "results": [
        run("fp32", 0.9), run("slimgc-2bit-full", 0.8, ct=5120, phase="trained"),
        run("fp32", 0.7), run("slimgc-2bit-full", None), run("slimgc-2bit-full", 0.6,
                                                              phase="trained")]}
    lines = plots.accuracy_markdown(summary).splitlines()
    fp32 = next(line for line in lines if line.startswith("| fp32 "))
    assert "0.900 / 0.700" in fp32 and "| 0.800 |" in fp32 and "0.700-0.900" in fp32
    full = next(line for line in lines if line.startswith("| slimgc-2bit-full "))
    assert "0.800 / failed / 0.600" in full and "| 0.700 |" in full
    assert "5.0 KB /" in full and full.rstrip(" |").endswith("never")


def test_accuracy_summaries_of_one_setup_share_a_panel(tmp_path):
    from slimgc_mx.bench import plots

    def summary(name, model, configs):
        history = [{"epoch": 1, "test_acc": 0.5}, {"epoch": 2, "test_acc": 0.75}]
        return {"name": name, "model": model, "dataset": "mnist1d", "workers": 4,
                "results": [{"config": c, "ok": True, "history": history} for c in configs]}
    base = summary("cnn-base", "cnn1d", ["fp32"])
    rerun = summary("cnn-rerun", "cnn1d", ["slimgc-2bit-full"])
    mlp = summary("mlp", "mlp", ["fp32"])
    panels = plots.accuracy_panels([base, mlp, rerun])
    assert [[s["name"] for s in group] for group in panels] == [["cnn-base", "cnn-rerun"], ["mlp"]]
    path = tmp_path / "acc.png"
    assert plots.accuracy([base, mlp, rerun], str(path)) and path.stat().st_size > 0


def test_accuracy_rerun_replaces_the_runs_of_a_config(monkeypatch, tmp_path):
    from slimgc_mx.bench import plots
    drawn = {}

    class Axes:
        def plot(self, x, y, label):
            drawn[label] = y
            return (type("Line", (), {"get_color": lambda self: "k"})(),)

        def __getattr__(self, name):
            return lambda *a, **k: None

    class Figure:
        def tight_layout(self):
            pass

        def savefig(self, *a, **k):
            pass

    class Plt:
        def subplots(self, rows, cols, **k):
            return Figure(), [[Axes() for _ in range(cols)]]

        def close(self, fig):
            pass
    monkeypatch.setattr(plots, "_plt", lambda: Plt())

    def summary(name, acc_by_config):
        return {"name": name, "model": "cnn1d", "dataset": "mnist1d", "workers": 4,
                "results": [{"config": c, "ok": True, "history": [{"test_acc": a}]}
                            for c, accs in acc_by_config.items() for a in accs]}
    first = summary("first", {"fp32": [0.9, 0.8], "full": [0.1, 0.1]})
    rerun = summary("rerun", {"full": [0.6, 0.7, 0.8]})
    assert plots.accuracy([first, rerun], str(tmp_path / "x.png"))
    assert drawn["fp32 (2 seeds)"] == [pytest.approx(0.85)]
    assert drawn["full (3 seeds)"] == [pytest.approx(0.7)]
    assert not any(label.startswith("full (2") for label in drawn)


def _skip_reason():
    ok, why = netns.netns_available()
    return None if ok else why


@pytest.mark.multiprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="network namespaces need Linux")
def test_smoke_two_workers_on_rate_limited_namespaces(tmp_path, mnist1d_dir):
    pytest.importorskip("mxnet")
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "smoke"
    argv = [sys.executable, "-m", "slimgc_mx.bench", "cluster", "--model", "mlp",
            "--dataset", "mnist1d", "--workers", "2", "--bandwidth", "100mbit",
            "--steps", "4", "--warmup", "6", "--slimgc-warmup", "4",
            "--configs", "fp32,slimgc-2bit-full", "--linger", "3", "--out", str(out)]
    # An option in the caller's environment reaches the processes and the summary (the
    # default piece size: this model's buffers travel whole; test_distributed sends pieces)
    env = {**os.environ, "SLIMGC_PIECE_BYTES": "1048576",
           "SLIMGC_DATA_DIR": mnist1d_dir}  # generated once, not by each worker
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["netns"] is True and summary["bandwidth"] == "100mbit"
    assert summary["slimgc_environment"]["SLIMGC_PIECE_BYTES"] == "1048576"
    by = {r["config"]: r for r in summary["results"]}
    assert all(r["ok"] for r in by.values()), by
    # Bytes come from the interfaces: fp32 moves the gradient up and the weights down
    # (78,858 float32 each way for the MLP); SlimGC 2bit moves clearly less. MXNet sends
    # asynchronously, so a step's transfer can straddle the window's edge: allow 10%.
    params = by["fp32"]["model"]["num_params"]
    fp32_wire = by["fp32"]["wire_bytes_per_step_per_worker"]
    assert fp32_wire["tx"] >= 0.9 * 4 * params and fp32_wire["rx"] >= 0.9 * 4 * params
    slim_wire = by["slimgc-2bit-full"]["wire_bytes_per_step_per_worker"]["total"]
    assert slim_wire < fp32_wire["total"] / 2
    assert by["slimgc-2bit-full"]["cttab"], "threshold table missing"
    assert by["slimgc-2bit-full"]["cttab_link"]["latency_s"] >= 0  # the fit BestCT came from
    assert by["fp32"]["samples_per_s_per_worker"] > 0
    # Peak resident memory of every worker and server, in the summary and the table
    for r in by.values():
        rss = r["peak_rss_mb"]
        assert sorted(rss["workers"]) == ["0", "1"] and sorted(rss["servers"]) == ["0", "1"]
        assert rss["worker_max"] == max(rss["workers"].values()) > 50
        assert rss["server_max"] == max(rss["servers"].values()) > 20
    assert "RSS wkr" in stdout and "peak RSS worker" in stdout
    # Teardown: no namespace of this harness outlives the run.
    mine = "%s%d-" % (netns.NS_PREFIX, proc.pid)
    left = [ns for ns in netns.list_namespaces() if ns.startswith(mine)]
    assert left == []


def test_peak_memory_reads_every_worker_and_server(tmp_path):
    """Workers report in their probe; each server writes server<INDEX>.json at exit; the
    table shows the largest of each."""
    (tmp_path / "server0.json").write_text(json.dumps({"launch_index": 0, "peak_rss_mb": 80.5}))
    (tmp_path / "server1.json").write_text(json.dumps({"launch_index": 1, "peak_rss_mb": 95.0}))
    probes = [{"launch_index": 0, "peak_rss_mb": 700.0}, {"launch_index": 1,
                                                          "peak_rss_mb": 650.0}]
    rss = cluster.peak_memory(probes, str(tmp_path))
    assert rss == {"workers": {0: 700.0, 1: 650.0}, "servers": {0: 80.5, 1: 95.0},
                   "worker_max": 700.0, "server_max": 95.0}
    assert cluster.peak_memory([{"launch_index": 0}], str(tmp_path))["workers"] == {}
    table = cluster.format_table({"results": [{"config": "gcomp-alone", "ok": True,
                                               "samples_per_s_per_worker": 7.0,
                                               "peak_rss_mb": rss}]})
    head, row = table.splitlines()
    assert head.split()[-4:] == ["RSS", "wkr", "RSS", "srv"]
    assert row.split()[-2:] == ["700", "95"]
    assert 0 < cluster.peak_rss_mb()


def test_codec_configurations_cover_every_registered_codec():
    """CODEC-alone is how the paper ran its baselines; options ride in brackets."""
    from slimgc_mx import codecs
    for name in codecs.available():
        args = cluster.config_args("%s-alone" % name)
        assert args[args.index("--compressor") + 1] == name
        assert ["--comm-threshold", "off", "--no-offload", "--no-backup"] == args[-4:]
        assert cluster.uses_slimgc("%s-alone" % name)
    args = cluster.config_args("slimgc-terngrad[clip_sigma=2.5]-full")
    assert args[args.index("--codec-option") + 1] == "clip_sigma=2.5"
    assert not cluster.uses_slimgc("fp32") and not cluster.uses_slimgc("mxnet-2bit")
    with pytest.raises(ValueError, match="slimgc-CODEC-STEP and CODEC-alone"):
        cluster.config_args("slimgc-9bit-full")


def test_horovod_configurations_and_worker_environment():
    from slimgc_mx.bench import horovod
    assert cluster.config_args("horovod-fp16") == ["--kvstore", "horovod", "--compressor", "fp16"]
    assert not cluster.uses_slimgc("horovod-fp32")
    rz = horovod.Rendezvous(["worker-0", "worker-1", "worker-1"], "eth0", ("ns", "10.0.0.1"))
    rz.port = 1234
    plan = cluster.build_tasks(None, 3, 2, ["true"], comm=False, rendezvous=rz)
    assert [t.role for t in plan] == ["worker"] * 3  # no scheduler, no servers
    env = [t.env for t in plan]
    assert [e["HOROVOD_RANK"] for e in env] == ["0", "1", "2"]
    assert [e["HOROVOD_LOCAL_RANK"] for e in env] == ["0", "0", "1"]
    assert [e["HOROVOD_CROSS_RANK"] for e in env] == ["0", "1", "1"]
    assert env[2]["HOROVOD_LOCAL_SIZE"] == "2" and env[0]["HOROVOD_CROSS_SIZE"] == "2"
    assert env[0]["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "10.0.0.1"
    assert env[0]["HOROVOD_GLOO_RENDEZVOUS_PORT"] == "1234"


def test_horovod_rows_are_skipped_with_a_note_when_it_is_not_installed(monkeypatch, tmp_path,
                                                                       capsys):
    from slimgc_mx.bench import horovod
    monkeypatch.setattr(horovod, "installed", lambda python=None: False)
    ran = []
    monkeypatch.setattr(cluster, "run_config", lambda name, *a, **k: ran.append(name) or {
        "ok": True, "status": 0, "samples_per_s_per_worker": 1.0, "step_s": {"median": 1.0},
        "wall_s": 0.0, "config": name})
    monkeypatch.setattr(cluster, "netns_available", lambda: (False, "test"))
    cluster.main(["--model", "mlp", "--dataset", "digits", "--workers", "2", "--configs",
                  "horovod-fp32,fp32", "--out", str(tmp_path), "--no-netns"])
    assert ran == ["fp32"]
    assert "Horovod is not installed; skipping horovod-fp32" in capsys.readouterr().err


@pytest.mark.parametrize("status, runs", [(128 + 9, 2), (128 + 2, 1), (128 + 15, 1)])
def test_a_killed_worker_fails_its_config_and_an_interrupt_stops_the_rest(monkeypatch, tmp_path,
                                                                           status, runs):
    # SIGKILL (the out-of-memory killer) fails one configuration; SIGINT / SIGTERM stop all.
    ran = []

    def run_config(name, opts, cluster_, outdir, seed=0, repeat=0, build=None):
        ran.append(name)
        return {"config": name, "ok": False, "status": status, "error": None, "log": "x.log"}
    monkeypatch.setattr(cluster, "run_config", run_config)
    code = cluster.main(["--no-netns", "--model", "fc", "--configs", "fp32,no-comm",
                         "--out", str(tmp_path)])
    assert ran == ["fp32", "no-comm"][:runs]
    assert code != 0
    assert json.loads((tmp_path / "summary.json").read_text())["results"][0]["status"] == status


def test_plots_draw_every_baseline_grey():
    from slimgc_mx.bench import plots

    for name in ("fp32", "mxnet-2bit", "no-comm", "horovod-fp32", "horovod-fp16"):
        assert plots.is_baseline(name), name
    for name in ("slimgc-2bit-full", "qsgd-alone", "slimgc-2bit-full@before"):
        assert not plots.is_baseline(name), name
