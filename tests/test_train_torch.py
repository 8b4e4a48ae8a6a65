"""scripts/train.py --framework torch (scripts/train_torch.py): the main job through PyTorch,
its models against the Gluon ones, its usage errors, and `run.sh train --framework torch`."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "scripts", "train.py")


def _train_torch():
    spec = importlib.util.spec_from_file_location(
        "train_torch_under_test", os.path.join(ROOT, "scripts", "train_torch.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_torch_models_have_the_gluon_models_tensors():
    mx = pytest.importorskip("mxnet")
    from slimgc_mx.bench import jobtools, models, torch_models
    assert sorted(models.MODELS) == sorted(torch_models.MODELS) == sorted(jobtools.MODELS)
    for name, shape in [("mlp", (40,)), ("fc", (3, 32, 32)), ("cnn1d", (40,)),
                        ("cnn1d", (2, 40)), ("resnet20", (3, 32, 32)), ("vgg", (3, 64, 64))]:
        gluon = models.get_model(name, 10, shape)
        gluon.initialize()
        with mx.autograd.train_mode():
            gluon(mx.nd.zeros((2,) + shape))
        want = [p.shape for p in gluon.collect_params().values() if p.grad_req != "null"]
        net = torch_models.get_model(name, 10, shape)
        assert [tuple(p.shape) for p in net.parameters()] == want, name
        assert torch_models.count_params(net) == models.count_params(gluon)
        assert tuple(net(torch.zeros((2,) + shape)).shape) == (2, 10)


def test_weights_start_as_train_pys():
    """N(0, 2 / fan_in) weights (MXNet's Gaussian Xavier, magnitude 2), zero biases."""
    from slimgc_mx.bench import torch_models
    torch.manual_seed(0)
    net = torch_models.get_model("fc", 10, (3, 32, 32))
    first = net[1]
    assert first.weight.std().item() == pytest.approx((2.0 / 3072) ** 0.5, rel=0.02)
    assert not first.bias.any()


@pytest.mark.parametrize("argv, message", [
    (["--kvstore", "ddp", "--compressor", "2bit"], "--kvstore ddp takes --compressor none, "
                                                   "fp16 or powersgd"),
    (["--kvstore", "slimgc", "--compressor", "fp16"], "use --kvstore ddp --compressor fp16"),
    (["--checkpoint-dir", "ckpt"], "--checkpoint-dir: checkpoints are train.py's (MXNet) only"),
    (["--kvstore", "ddp", "--powersgd-start-iter", "1"], "at least 2"),
])
def test_usage_errors_name_the_fix(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        _train_torch().parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_ddp_without_a_job_says_how_to_start_one(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    module = _train_torch()
    with pytest.raises(SystemExit, match="--framework torch --launcher local"):
        module.init_distributed(module.parse_args(["--kvstore", "ddp"]))


@pytest.mark.slow
def test_framework_torch_runs_without_importing_mxnet(tmp_path):
    out = tmp_path / "r.json"
    code = ("import runpy, sys\n"
            "sys.argv = %r\n"
            "try:\n    runpy.run_path(%r, run_name='__main__')\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "assert 'mxnet' not in sys.modules\n"
            % (["train.py", "--framework", "torch", "--kvstore", "local", "--model", "mlp",
                "--dataset", "digits", "--epochs", "2", "--json", str(out)], TRAIN))
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["framework"] == "torch" and res["final_test_acc"] > 0.5  # chance is 0.1
    assert [h["epoch"] for h in res["history"]] == [1, 2]
    assert res["model"] == {"name": "mlp", "num_params": 85002, "num_tensors": 6}
    assert "epoch   2  train loss" in r.stdout and "summary: final test acc" in r.stdout


@pytest.mark.multiprocess
def test_run_sh_train_framework_torch_runs_the_main_job_through_pytorch(tmp_path, monkeypatch,
                                                                      mnist1d_dir):
    monkeypatch.setenv("SLIMGC_DATA_DIR", mnist1d_dir)  # generated once, not by each worker
    out = tmp_path / "r.json"
    r = subprocess.run(["bash", "scripts/run.sh", "train", "--framework", "torch", "--epochs",
                        "1", "--steps", "8", "--no-progress", "--json", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "2 PyTorch workers (Gloo, no servers)" in r.stderr
    assert "[worker 0] cnn1d on mnist1d | kvstore slimgc (2 workers, PyTorch) | compressor " \
           "2bit" in r.stdout
    assert "[worker 0] epoch   1  train loss" in r.stdout
    assert "[worker 0] summary: final test acc" in r.stdout and "pushed" in r.stdout
    ranks = [json.loads((tmp_path / ("r.rank%d.json" % i)).read_text()) for i in range(2)]
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["num_workers"] == 2
    assert ranks[0]["weights_sha256"] == ranks[1]["weights_sha256"]  # one synchronous job
    assert ranks[0]["kvstore_stats"]["compressor"] == "2bit"


@pytest.mark.slow
def test_run_sh_train_knows_its_frameworks():
    r = subprocess.run(["bash", "scripts/run.sh", "train", "--framework", "jax"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "expected mxnet or torch" in r.stderr
    r = subprocess.run(["bash", "scripts/run.sh", "train", "--framework=torch", "--help"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "usage: train.py --framework torch" in r.stdout
    assert "--powersgd-rank" in r.stdout and "[launcher]" not in r.stderr
