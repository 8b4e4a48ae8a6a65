"""PyTorch in the cluster harness and the launcher: the torch configurations, their workers'
torch.distributed environment, the ratios issue 31 asks for, and a tiny run of each."""
import json
import os
import subprocess
import sys

import pytest

from slimgc_mx import launch
from slimgc_mx.bench import cluster
from slimgc_mx.launch import netns

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_torch_configurations_map_to_train_torch_options():
    assert cluster.config_args("torch-ddp") == ["--framework", "torch", "--kvstore", "ddp",
                                                "--compressor", "none"]
    assert cluster.config_args("torch-fp16")[-1] == "fp16"
    powersgd = cluster.config_args("torch-powersgd")
    assert powersgd[powersgd.index("--powersgd-rank") + 1] == "4"
    assert powersgd[powersgd.index("--bucket-cap-mb") + 1] == "256"  # one bucket
    assert cluster.config_args("torch-no-comm") == ["--framework", "torch", "--kvstore", "local"]
    # SlimGC's adapter: the MXNet configuration's options behind --framework torch
    for step in cluster.ABLATIONS:
        mine = cluster.config_args("slimgc-torch-4bit-%s" % step)
        assert mine == ["--framework", "torch"] + cluster.config_args("slimgc-4bit-%s" % step)
    topk = cluster.config_args("slimgc-torch-topk[ratio=0.1]-full-nofuse")
    assert topk[topk.index("--codec-option") + 1] == "ratio=0.1" and topk[-1] == "--no-fuse"
    for name in cluster.TORCH_CONFIGS:
        assert cluster.uses_torch(name), name
    assert not any(cluster.uses_torch(n) for n in cluster.all_configs())
    assert cluster.uses_slimgc("slimgc-torch-2bit-full")
    assert not cluster.uses_slimgc("torch-powersgd")
    with pytest.raises(ValueError, match="slimgc-torch-CODEC-STEP"):
        cluster.config_args("slimgc-torch-9bit-full")


def test_torch_groups_expand():
    assert cluster.parse_configs("torch", ["2bit"]) == cluster.TORCH_CONFIGS
    every = cluster.parse_configs("torch-all", ["2bit"])
    from slimgc_mx import codecs
    assert {"slimgc-torch-%s-full" % c for c in codecs.available() if c != "none"} <= set(every)
    assert every[:3] == ["torch-ddp", "torch-fp16", "torch-powersgd"]
    assert every[-1] == "torch-no-comm"
    assert cluster.parse_configs("slimgc-torch-1bit,fp32", ["1bit"]) == [
        "slimgc-torch-1bit-classic", "slimgc-torch-1bit-cgopt", "slimgc-torch-1bit-offload",
        "slimgc-torch-1bit-full", "fp32"]
    with pytest.raises(ValueError):
        cluster.parse_configs("slimgc-torch-9bit", ["2bit"])


def test_torch_workers_get_torch_distributed_variables_and_no_servers(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    plan = cluster.build_tasks(None, 3, 3, ["true"], comm=True, torch_job=True)
    assert [(t.role, t.index) for t in plan] == [("worker", 0), ("worker", 1), ("worker", 2)]
    env = [t.env for t in plan]
    assert [e["RANK"] for e in env] == ["0", "1", "2"]
    assert [e["LOCAL_RANK"] for e in env] == ["0", "1", "2"]
    assert {e["WORLD_SIZE"] for e in env} == {"3"} and {e["LOCAL_WORLD_SIZE"] for e in env} == {"3"}
    assert {e["MASTER_ADDR"] for e in env} == {"127.0.0.1"}
    assert len({e["MASTER_PORT"] for e in env}) == 1
    assert {e["GLOO_SOCKET_IFNAME"] for e in env} == {"lo"}
    assert not any(k.startswith("DMLC_") for e in env for k in e)
    assert [e["SLIMGC_LAUNCH_INDEX"] for e in env] == ["0", "1", "2"]


def test_the_launchers_torch_mode_in_namespaces_binds_each_workers_eth0():
    """Rank 0's namespace address is MASTER_ADDR; each namespace is a node of its own."""
    args = launch.parse_args(["-n", "2", "--framework", "torch", "--launcher", "netns", "--",
                              "python", "x.py"])
    assert args.num_servers == 0
    box = netns.NetnsCluster(0, 2, "1gbit", None)  # (not brought up: addresses only)
    plan = launch.build_plan(args, box)
    assert [t.node for t in plan] == [box.ns("worker 0"), box.ns("worker 1")]
    assert {t.env["MASTER_ADDR"] for t in plan} == {box.ip("worker 0")}
    assert {t.env["GLOO_SOCKET_IFNAME"] for t in plan} == {netns.NODE_IFACE}
    assert [t.env["LOCAL_RANK"] for t in plan] == ["0", "0"]
    again = launch.plan.plan_again(plan, None)
    assert [t.env["RANK"] for t in again] == ["0", "1"] and "DMLC_PS_ROOT_PORT" not in \
        again[0].env


@pytest.mark.parametrize("argv, message", [
    (["-n", "2", "-s", "2", "--framework", "torch"], "starts no servers"),
    (["-n", "2", "--framework", "torch", "-H", "hosts", "--launcher", "ssh"],
     "--launcher local or netns"),
    (["-n", "2", "--framework", "torch", "--env-server", "A:1"], "--env-server"),
])
@pytest.mark.slow
def test_the_launchers_torch_mode_refuses_what_it_cannot_do(argv, message, tmp_path):
    r = subprocess.run([sys.executable, "-m", "slimgc_mx.launch"] + argv + ["--", "true"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def _row(config, sps, ok=True):
    return {"config": config, "ok": ok, "samples_per_s_per_worker": sps,
            "step_s": {"median": 32.0 / sps}, "cpu_s_per_step_per_worker": 1.0}


def test_torch_ratios_are_against_pytorchs_own_baselines():
    summary = {"bandwidth": None, "results": [
        _row("torch-ddp", 10.0), _row("torch-fp16", 20.0), _row("torch-powersgd", 25.0),
        _row("slimgc-torch-2bit-full", 75.0), _row("slimgc-torch-powersgd-full", 50.0),
        _row("torch-no-comm", 100.0), _row("no-comm", 200.0)]}
    cluster.add_derived(summary)
    by = {r["config"]: r for r in summary["results"]}
    vs = by["slimgc-torch-2bit-full"]["vs"]
    assert vs["torch-ddp"] == pytest.approx(7.5) and vs["torch-hook"] == pytest.approx(3.0)
    assert vs["torch-no-comm"] == pytest.approx(0.75) and vs["no-comm"] == pytest.approx(0.375)
    assert by["slimgc-torch-powersgd-full"]["vs"]["torch-powersgd"] == pytest.approx(2.0)
    # a torch row's time split counts torch-no-comm's step as its compute
    assert by["slimgc-torch-2bit-full"]["time_composition_s"]["compute"] == pytest.approx(0.32)
    lines = cluster.format_torch_ratios(summary)
    assert lines[0] == ("slimgc-torch-2bit-full: 7.50x torch-ddp, 3.00x the best PyTorch hook, "
                        "3.00x torch-powersgd, 0.75x torch-no-comm")
    assert len(lines) == 2


def test_torch_rows_are_skipped_with_a_note_without_pytorch(monkeypatch, tmp_path, capsys):
    real = cluster.importlib.util.find_spec
    monkeypatch.setattr(cluster.importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real(name, *a))
    ran = []
    monkeypatch.setattr(cluster, "run_config", lambda name, *a, **k: ran.append(name) or {
        "ok": True, "status": 0, "samples_per_s_per_worker": 1.0, "step_s": {"median": 1.0},
        "wall_s": 0.0, "config": name})
    cluster.main(["--model", "mlp", "--dataset", "digits", "--configs", "torch-ddp,fp32",
                  "--out", str(tmp_path), "--no-netns"])
    assert ran == ["fp32"]
    assert "PyTorch is not installed; skipping torch-ddp" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_every_torch_configuration_runs_and_reports(tmp_path, monkeypatch, mnist1d_dir):
    """Two workers, a few steps each: on rate-limited namespaces where this machine can make
    them (bytes from eth0 then), else on loopback."""
    pytest.importorskip("torch")
    monkeypatch.setenv("SLIMGC_DATA_DIR", mnist1d_dir)  # generated once, not by each worker
    out = tmp_path / "torch"
    configs = ["torch-ddp", "torch-fp16", "torch-powersgd", "slimgc-torch-2bit-full",
               "torch-no-comm"]
    argv = [sys.executable, "-m", "slimgc_mx.bench", "cluster", "--model", "mlp",
            "--dataset", "mnist1d", "--workers", "2", "--bandwidth", "100mbit",
            "--steps", "2", "--warmup", "6", "--slimgc-warmup", "4", "--threads", "1",
            "--configs", ",".join(configs), "--out", str(out)]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    by = {r["config"]: r for r in summary["results"]}
    assert sorted(by) == sorted(configs)
    for name, r in by.items():
        assert r["ok"] and r["samples_per_s_per_worker"] > 0, (name, r)
        assert r["model"]["num_params"] == 78858  # the Gluon MLP's count
        assert sorted(r["peak_rss_mb"]["workers"]) == ["0", "1"]
        assert r["peak_rss_mb"]["server_max"] is None  # no servers
        assert r["train_command"][2:4] == ["--model", "mlp"] and "torch" in r["train_command"]
    stats = by["slimgc-torch-2bit-full"]["kvstore_per_step_per_worker"]
    assert stats["bytes_fp32"] > 0  # SlimGC's stats() reached the probe
    assert "slimgc-torch-2bit-full:" in proc.stdout and "x torch-ddp" in proc.stdout
    if summary["netns"]:  # Gloo went over the emulated links, each hook as its bytes say
        wire = {n: by[n]["wire_bytes_per_step_per_worker"]["tx"] for n in configs}
        assert wire["torch-ddp"] >= 0.9 * 4 * 78858
        assert wire["torch-fp16"] < 0.6 * wire["torch-ddp"]
        assert wire["torch-powersgd"] < 0.2 * wire["torch-ddp"]
        assert wire["torch-no-comm"] < 1000
