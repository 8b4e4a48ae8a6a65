"""`python -m slimgc_mx.bench gpu` on the CPU: every config's ranks, JSON, table, figure.

docs/benchmarks.md ("GPU memory and step composition") runs it on a GPU; here the tiny
model on the CPU checks the harness: DDP, its fp16 hook and SlimGC at 1 and 2 ranks. The
smoke test runs its configs in the same ranks (--reuse-ranks); the profile test and
run_config's tests run them in fresh ones, as on a GPU.
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="bench gpu needs PyTorch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = ["no-ddp", "ddp", "ddp-fp16", "ddp-gpu-1bit", "slimgc-offload",
           "slimgc-device-cttab", "slimgc-device-nooverlap", "slimgc-device-offload"]


def _bench(*args, timeout=240, tmpdir=None):
    env = dict(os.environ, PYTHONPATH=ROOT)
    if tmpdir is not None:  # where the ranks' folders go (and must be gone from, after)
        env["TMPDIR"] = str(tmpdir)
    for name in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "slimgc_mx.bench", "gpu"] + list(args),
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


#: The configs also run at two ranks (the others' two-rank runs add time, not coverage).
TWO_RANKS = ["ddp", "ddp-gpu-1bit", "slimgc-offload", "slimgc-device-cttab",
             "slimgc-device-powersgd"]


@pytest.mark.slow
def test_tiny_model_on_the_cpu_at_one_and_two_ranks(tmp_path):
    docs, outs = [], []
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    for procs, configs in (("1", CONFIGS), ("2", TWO_RANKS)):
        out = tmp_path / ("p" + procs)
        r = _bench("--model", "tiny", "--device", "cpu", "--procs", procs, "--steps", "3",
                   "--warmup", "1", "--configs", ",".join(configs), "--out", str(out),
                   "--reuse-ranks", tmpdir=scratch)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert not [p.name for p in scratch.iterdir() if p.name.startswith("slimgc-")]
        docs.append(json.loads((out / "results.json").read_text()))
        outs.append((out, r))
    got = {(x["procs"], x["config"]): x for doc in docs for x in doc["results"]}
    assert sorted(got) == sorted([(1, c) for c in CONFIGS] + [(2, c) for c in TWO_RANKS])
    doc = docs[0]  # the projection needs no-ddp's compute, measured at one rank
    for (procs, config), rec in got.items():
        assert rec["status"] == "ok", rec
        assert len(rec["ranks"]) == procs
        assert all(rank["ms_step"] > 0 and rank["samples_per_s"] > 0 for rank in rec["ranks"])
        assert rec["ms_step"] > 0 and rec["peak_gib"] is None  # no GPU memory on the CPU
    slim = got[(2, "slimgc-offload")]
    assert set(slim["composition"]) >= {"fwd_bwd", "copies", "encode", "transfer", "blocked",
                                        "overlap"}
    assert slim["ranks"][0]["per_step"]["bytes_pushed"] > 0
    for procs in (1, 2):  # the device path's CTTab decided in the run's warm-up
        stats = got[(procs, "slimgc-device-cttab")]["ranks"][0]["stats"]
        assert stats["cttab_phase"] == "decided" and stats["data_path"] == "device", stats
    assert got[(1, "slimgc-device-nooverlap")]["ranks"][0]["stats"]["overlap"] == "off"
    home = got[(1, "slimgc-device-offload")]["ranks"][0]
    assert home["info"]["options"]["state_on"] == "host", home["info"]
    assert home["step_copies"]["h2d_bytes"] > 0 and home["step_copies"]["pageable_bytes"] == 0
    low = got[(2, "slimgc-device-powersgd")]["ranks"][0]["stats"]
    assert low["compressor"] == "powersgd" and low["compressed_buckets"] > 0, low
    assert doc["machine"]["torch"] == torch.__version__
    assert {p["link"] for p in doc["projection"]} == {"10gbit", "100gbit"}
    tables = [(out / "table.md").read_text() for out, _ in outs]
    assert "| tiny | 2 | slimgc-offload |" in tables[1] and "Projection" in tables[0]
    for procs, table in zip((1, 2), tables):  # every config over the 1bit hook's samples/s
        fig12 = table.split("## Fig. 12: throughput over the GPU 1bit hook's")[1].split("##")[0]
        base = got[(procs, "ddp-gpu-1bit")]["samples_per_s"]
        ddp = got[(procs, "ddp")]["samples_per_s"]
        assert "| tiny | %d | ddp-gpu-1bit | %.1f | 1.00 |" % (procs, base) in fig12
        assert "| tiny | %d | ddp | %.1f | %.2f |" % (procs, ddp, ddp / base) in fig12
    for (out, r), configs in zip(outs, (CONFIGS, TWO_RANKS)):
        if importlib.util.find_spec("matplotlib") is not None:
            assert (out / "fig14.png").stat().st_size > 1000
        else:  # a machine without it (the GPU machine may be one) is told, the rest written
            assert "fig14.png not drawn" in r.stderr and "pip install matplotlib" in r.stderr
        # a progress line per config as it finishes
        assert sum(line.startswith("tiny ") for line in r.stdout.splitlines()) == len(configs)


def test_the_targets_hold_offloaded_state_to_no_ddps_memory_and_1_5x_ddps_step():
    from slimgc_mx.bench import gpu

    def rec(config, ms, peak):
        return {"model": "vgg16", "procs": 1, "config": config, "status": "ok",
                "ms_step": ms, "peak_gib": peak}
    for ms, peak, met in ((40.0, 3.5, (True, True)), (45.0, 4.0, (False, False))):
        found = {c["target"]: c for c in gpu.checks([
            rec("no-ddp", 26.0, 3.86), rec("ddp", 28.0, 4.89),
            rec("slimgc-device-offload", ms, peak)])}
        peak_row = found["slimgc-device-offload peak <= no-ddp peak"]
        step_row = found["slimgc-device-offload step <= 1.5x ddp"]
        assert (peak_row["met"], step_row["met"]) == met
        assert step_row["value"] == "%.1f vs 28.0 ms (%.2fx)" % (ms, ms / 28.0)


def test_the_targets_compare_slimgcs_powersgd_with_the_hook_at_two_ranks():
    from slimgc_mx.bench import gpu

    def rec(procs, config, ms):
        return {"model": "vgg16", "procs": procs, "config": config, "status": "ok",
                "ms_step": ms, "peak_gib": None}
    target = "slimgc-device-powersgd step <= ddp-powersgd"
    for low, hook, met in ((70.0, 77.0, True), (80.0, 77.0, False)):
        found = [c for c in gpu.checks([rec(2, "ddp-powersgd", hook),
                                        rec(2, "slimgc-device-powersgd", low),
                                        rec(1, "ddp-powersgd", 1.0),
                                        rec(1, "slimgc-device-powersgd", 2.0)])
                 if c["target"] == target]
        assert [(c["procs"], c["met"]) for c in found] == [(2, met)]  # one rank: no wire
        assert found[0]["value"] == "%.1f vs %.1f ms (%.2fx)" % (low, hook, low / hook)


@pytest.mark.slow
def test_a_failing_config_is_recorded_and_the_others_still_run(tmp_path):
    from slimgc_mx.bench import gpu
    args = gpu.parse_args(["--model", "tiny", "--device", "cpu", "--steps", "2", "--warmup",
                           "1", "--timeout", "60"], "gpu")
    bad = gpu.run_config("no-ddp", "no-such-model", 1, args, str(tmp_path))
    assert bad["status"] == "error" and "no-such-model" in bad["error"]
    good = gpu.run_config("no-ddp", "tiny", 1, args, str(tmp_path))
    assert good["status"] == "ok" and good["ms_step"] > 0


@pytest.mark.slow
def test_profile_writes_rank_0s_busiest_operators_outside_the_timed_steps(tmp_path):
    r = _bench("--model", "tiny", "--device", "cpu", "--procs", "2", "--steps", "2",
               "--warmup", "1", "--configs", "slimgc-offload", "--profile", "2",
               "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = (tmp_path / "profile-tiny-slimgc-offload-p2.txt").read_text()
    assert text.startswith("tiny, slimgc-offload, 2 steps profiled on rank 0")
    assert "Self CPU" in text and "aten::" in text
    rec = json.loads((tmp_path / "results.json").read_text())["results"][0]
    assert rec["status"] == "ok"
    assert [rank.get("profile") for rank in rec["ranks"]] == [
        str(tmp_path / "profile-tiny-slimgc-offload-p2.txt"), None]


@pytest.mark.slow
def test_bad_arguments_name_the_problem():
    r = _bench("--configs", "ddp,nonesuch")
    assert r.returncode == 2 and "nonesuch" in r.stderr and "slimgc-offload" in r.stderr
    r = _bench("--procs", "0")
    assert r.returncode == 2 and "--procs" in r.stderr
    r = _bench("--batch", "0")
    assert r.returncode == 2 and "--batch" in r.stderr and "Traceback" not in r.stderr
    r = _bench("--help")
    assert r.returncode == 0 and "ddp-powersgd" in r.stdout


def test_the_gpu_2bit_hook_without_the_device_codec_feeds_back_its_error():
    """The plain torch-ops hook (used when the device codec is missing): levels at the
    threshold, the rest kept in the residual, so grad = sent + new residual."""
    from slimgc_mx.bench import gpu
    state = gpu.LaneHookState(group=None, world=1, threshold=0.5)
    buf = torch.tensor([0.7, -0.2, -0.9, 0.3])
    e = {"residual": torch.tensor([0.0, -0.4, 0.0, 0.1])}
    sent = buf + e["residual"]
    q = (sent >= 0.5).float() - (sent <= -0.5).float()
    # the all_reduce of one rank returns the levels themselves
    import torch.distributed as dist
    fut = torch.futures.Future()
    real = dist.all_reduce
    try:
        dist.all_reduce = lambda t, group=None, async_op=False: type(
            "W", (), {"get_future": lambda self: (fut.set_result([t]) or fut)})()
        out = gpu._plain_2bit(state, e, buf.clone()).wait()
    finally:
        dist.all_reduce = real
    assert torch.equal(out, q * 0.5)
    assert torch.allclose(out + e["residual"], sent)


class _Exited:
    """A rank process of the mocked harness that has exited with `code`."""

    pid = 0

    def __init__(self, code):
        self.returncode = code

    def poll(self):
        return self.returncode


def _write_result(path, rank, ms_step):
    """A rank's result file, as a rank of the harness writes it."""
    with open(path, "w") as f:
        json.dump({"rank": rank, "ms_step": ms_step, "samples_per_s": 1.0, "peak_gib": None,
                   "ms_fwd_bwd": 0.5, "ms_opt_step": 0.5}, f)


def _cpu_args(gpu, tmp_path, *more):
    """The mocked harness's arguments: one tiny step on the CPU."""
    return gpu.parse_args(["--batch", "2", "--steps", "1", "--warmup", "0", "--device", "cpu",
                           "--timeout", "5", "--out", str(tmp_path)] + list(more), "gpu")


def test_a_rank_that_aborts_at_exit_after_its_result_keeps_it(tmp_path, monkeypatch):
    """The known abort at exit follows the measured steps: the row stays, noted; any other
    failure, or a missing result, is still an error."""
    from slimgc_mx.bench import gpu

    def fake_popen(cmd, stdout, stderr, env, start_new_session):
        out, rank = cmd[-1], int(env["RANK"])
        code = dict(ok=0, abort=-6, crash=-11)[MODE[rank]]
        if MODE[rank] != "crash":
            _write_result(out, rank, 1.0)
        if code:
            stdout.write(gpu.EXIT_ABORT + "\n" if code == -6 else "Segmentation fault\n")
            stdout.flush()
        return _Exited(code)

    monkeypatch.setattr(gpu.subprocess, "Popen", fake_popen)
    monkeypatch.setattr(gpu, "_kill", lambda running: None)
    args = _cpu_args(gpu, tmp_path)
    MODE = ["ok", "abort"]
    kept = gpu.run_config("no-ddp", "tiny", 2, args, str(tmp_path))
    assert kept["status"] == "ok" and kept["exit_abort"] == [1] and len(kept["ranks"]) == 2
    assert "aborted at exit" in gpu._notes(kept)
    MODE[1] = "crash"
    lost = gpu.run_config("no-ddp", "tiny", 2, args, str(tmp_path))
    assert lost["status"] == "error" and "exit_abort" not in lost


def test_reused_ranks_record_a_failing_config_and_run_the_ones_after_it_afresh(tmp_path,
                                                                              monkeypatch,
                                                                              capsys):
    """--reuse-ranks: the configs in turn in the same ranks, each recorded as its results
    come; a config whose rank fails is an error, the ones before it keep their rows and the
    ones after it run in fresh ranks. Only on the CPU."""
    from slimgc_mx.bench import gpu
    launches = []

    def fake_popen(cmd, stdout, stderr, env, start_new_session):
        with open(cmd[-2]) as f:
            specs = json.load(f)
        rank, code = int(env["RANK"]), 0
        if rank == 0:
            launches.append([spec["config"] for spec in specs])
        for i, spec in enumerate(specs):
            if spec["config"] == "ddp":  # rank 1 dies in it, rank 0 loses its peer
                code = -11 if rank else 1
                stdout.write("Segmentation fault\n" if rank else "Connection closed\n")
                stdout.flush()
                break
            _write_result(gpu._config_out(cmd[-1], i), rank, 1.0 + i)
        return _Exited(code)

    monkeypatch.setattr(gpu.subprocess, "Popen", fake_popen)
    monkeypatch.setattr(gpu, "_kill", lambda running: None)
    args = _cpu_args(gpu, tmp_path, "--reuse-ranks")
    assert args.reuse_ranks
    got = []
    configs = ["no-ddp", "ddp", "ddp-fp16", "slimgc-offload"]
    gpu.run_reusing_ranks(configs, "tiny", 2, args, str(tmp_path), got.append)
    assert launches == [configs, ["ddp-fp16", "slimgc-offload"]]
    assert [(r["config"], r["status"]) for r in got] == [
        ("no-ddp", "ok"), ("ddp", "error"), ("ddp-fp16", "ok"), ("slimgc-offload", "ok")]
    assert "Connection closed" in got[1]["error"] and got[1]["ranks"] == []
    assert [len(r["ranks"]) for r in got] == [2, 0, 2, 2]
    assert [r.get("ms_step") for r in got] == [1.0, None, 1.0, 2.0]
    assert all(r["wall_s"] >= 0 for r in got)
    with pytest.raises(SystemExit):
        gpu.parse_args(["--reuse-ranks"], "gpu")  # --device cuda: fresh ranks each
    assert "--reuse-ranks needs --device cpu" in capsys.readouterr().err
