"""MXNet's other doors, compared with what dist_sync gives: Module.fit as MXNet's
image-classification example drives it, and the classic init/push/pull calls.

Each job runs under the launcher with 2 workers and 2 servers.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.multiprocess


def _launch(script, out, args=(), options=(), timeout=240):
    pytest.importorskip("mxnet")
    argv = [sys.executable, "-m", "slimgc_mx.launch", "-n", "2", "-s", "2", "--launcher",
            "local"] + list(options) + ["--", sys.executable, script, "--out", str(out)] + list(args)
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _module(tmp_path, name, *args, options=()):
    out = tmp_path / name
    proc = _launch("tests/module_job.py", out, args, options)
    info = [json.loads((out / ("rank%d.json" % r)).read_text()) for r in range(2)]
    params = [dict(np.load(out / ("params_rank%d.npz" % r))) for r in range(2)]
    return info, params, proc


def test_module_fit_with_compression_off_follows_dist_sync(tmp_path):
    _, ref, _ = _module(tmp_path, "dist_sync", "--kv-store", "dist_sync")
    info, ours, _ = _module(tmp_path, "slimgc", "--kv-store", "dist_sync_slimgc",
                            options=["--env", "SLIMGC_COMPRESSOR:none", "--env", "SLIMGC_BACKUP:0"])
    assert [i["type"] for i in info] == ["dist_sync_slimgc"] * 2
    assert info[0]["rescale_grad"] == pytest.approx(1.0 / (32 * 2))  # as dist_sync's
    assert set(ref[0]) == set(ours[0])
    for name in ref[0]:
        np.testing.assert_allclose(ours[0][name], ref[0][name], rtol=0, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(ours[1][name], ref[1][name], rtol=0, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("how", [("dist_sync_slimgc", "object", "1"), ("slimgc", "name", "2")])
def test_module_fit_returns_the_same_global_weights_on_every_worker(tmp_path, how):
    """Default settings (2bit, backup on): Module's returned and saved parameters are the
    global weights, bitwise equal on both workers; by name with one device the store is
    still created (MXNet would drop a name without 'dist'), with two devices too."""
    name, fit_kvstore, contexts = how
    info, params, proc = _module(tmp_path, name, "--kv-store", name, "--fit-kvstore",
                                 fit_kvstore, "--contexts", contexts)
    assert [i["kvstore_class"] for i in info] == ["SlimGC"] * 2
    assert info[0]["rescale_grad"] == pytest.approx(1.0 / (32 * 2))
    for key in params[0]:
        np.testing.assert_array_equal(params[0][key], params[1][key], err_msg=key)
    saved = [open(i["checkpoint"], "rb").read() for i in info]
    assert saved[0] == saved[1]  # do_checkpoint wrote the global weights on both ranks
    assert info[0]["accuracy"] == info[1]["accuracy"]
    assert "is kvstore rank" in proc.stderr  # the launcher relabels workers by rank


def test_classic_push_and_pull_follow_dist_sync(tmp_path):
    _launch("tests/classic_job.py", tmp_path / "ref", ["--kvstore", "dist_sync"])
    _launch("tests/classic_job.py", tmp_path / "ours", ["--kvstore", "slimgc"])
    for rank in range(2):
        ref = dict(np.load(tmp_path / "ref" / ("rank%d.npz" % rank)))
        ours = dict(np.load(tmp_path / "ours" / ("rank%d.npz" % rank)))
        assert set(ref) == set(ours)
        for name in sorted(ref):
            if name.startswith("weights_"):  # the servers' SGD against the workers' own
                np.testing.assert_allclose(ours[name], ref[name], rtol=1e-6, atol=1e-6,
                                           err_msg=name)
            else:  # float32 sums, never compressed: no compressor was chosen
                np.testing.assert_array_equal(ours[name], ref[name], err_msg=name)


EXAMPLE_LIKE = """
import mxnet as mx
import numpy as np
kv = mx.kvstore.create("dist_sync_slimgc")  # a script that never imports slimgc_mx
kv.init(0, mx.nd.zeros(4))
kv.push(0, mx.nd.ones(4) * (kv.rank + 1))
out = mx.nd.zeros(4)
kv.pull(0, out=out)
assert kv.type == "dist_sync_slimgc" and (out.asnumpy() == 3).all(), out
print("sum ok on rank", kv.rank)
"""


def test_a_script_that_does_not_import_slimgc_mx_runs_through_the_runner(tmp_path):
    pytest.importorskip("mxnet")
    script = tmp_path / "train_example.py"
    script.write_text(EXAMPLE_LIKE)
    argv = [sys.executable, "-m", "slimgc_mx.launch", "-n", "2", "-s", "1", "--",
            sys.executable, "-m", "slimgc_mx.run", str(script)]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count("sum ok on rank") == 2
