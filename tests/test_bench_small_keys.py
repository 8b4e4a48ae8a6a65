"""`bench small-keys`: SlimGC's step over DDP's in the same ranks, rounds interleaved with
another checkout's (here the same one), as docs/pytorch.md's numbers were measured."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # two-rank jobs in fresh interpreters

from torch_launch import ROOT  # noqa: E402


def _bench(*args, tmpdir=None):
    env = dict(os.environ)
    if tmpdir is not None:  # where the rounds' folders go (and must be gone from, after)
        env["TMPDIR"] = str(tmpdir)
    return subprocess.run([sys.executable, "-m", "slimgc_mx.bench", "small-keys"] + list(args),
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


def test_rounds_interleaved_with_another_checkout_report_ratios(tmp_path):
    options = '{"backup": false, "compression": "2bit", "warmup_steps": 2}'
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    r = _bench("--params", "20", "--steps", "5", "--rounds", "1", "--options", options,
               "--build", "same=%s" % ROOT, "--out", str(tmp_path), tmpdir=scratch)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert not [p.name for p in scratch.iterdir() if p.name.startswith("small-keys-")]
    doc = json.loads((tmp_path / "results.json").read_text())
    assert sorted(doc["runs"]) == ["same", "this checkout"]
    for label, runs in doc["runs"].items():
        (run,) = runs
        for key in ("total", "median_step", "warmup_step", "after_step"):
            assert run[key] > 0, (label, key)
        assert run["best_ct"] == "never"  # tiny tensors alone: full precision, fused
        assert run["transfers_last_step"] == 1  # one bucket after the warm-up
        assert doc["summary"][label]["total"] == run["total"]
    lines = r.stdout.splitlines()
    assert sum(line.startswith("round 1, ") for line in lines) == 2
    assert any(line.startswith("total time, this checkout / same per round: ") for line in lines)


def test_bad_arguments_name_the_problem(tmp_path):
    r = _bench("--options", "{backup: false}")
    assert r.returncode == 2 and "--options is not JSON" in r.stderr
    r = _bench("--build", "old=%s" % tmp_path)
    assert r.returncode == 2 and "a checkout of this project" in r.stderr
    r = _bench("--steps", "1")
    assert r.returncode == 2 and "--steps >= 2" in r.stderr
