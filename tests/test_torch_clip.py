"""slimgc.clip_grad_norm_: DDP's clipping of the mean gradient, in a job of one against
torch's own clip, and in two-rank jobs over Gloo (torchrun) against DDP itself and under
compression and backup."""
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import slimgc_mx.torch as slimgc  # noqa: E402
from torch_launch import Batch, results  # noqa: E402

MAX_NORM = 0.5


def _train(clip, backup=None, steps=5):
    """Weights and returned norms of a small SGD job of one: torch's own optimizer with
    torch's clip (backup None), or SlimGC's with its clip; the .grad left after each clip."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if backup is not None:
        opt = slimgc.DistributedOptimizer(opt, model, compression="none", backup=backup)
    norms, grads = [], []
    for step in range(steps):
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        norms.append(float(clip(opt, model)))
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone())
        opt.step()
    if backup is not None:
        slimgc.flush(opt)
        opt.close()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), norms, grads


@pytest.mark.parametrize("backup", [False, True])
def test_a_job_of_one_clips_as_torch(backup):
    """One rank: the mean is its own gradient, so both updates are torch's clipped step;
    the returned norm is torch's, and .grad is left unclipped."""
    want, torch_norms, _ = _train(
        lambda opt, model: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
    got, norms, grads = _train(lambda opt, model: slimgc.clip_grad_norm_(opt, MAX_NORM),
                               backup)
    assert min(torch_norms) > MAX_NORM
    np.testing.assert_allclose(norms, torch_norms, rtol=1e-6)
    assert grads[0].norm().item() == pytest.approx(norms[0], rel=1e-5)
    assert (got - want).abs().max().item() <= 1e-6


def test_bad_arguments_are_refused():
    model = torch.nn.Linear(2, 1)
    opt = slimgc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    with pytest.raises(TypeError, match="torch.nn.utils.clip_grad_norm_"):
        slimgc.clip_grad_norm_(torch.optim.SGD(model.parameters(), lr=0.1), 1.0)
    with pytest.raises(ValueError, match="norm_type"):
        slimgc.clip_grad_norm_(opt, 1.0, norm_type=0)
    with pytest.raises(ValueError, match="max_norm"):
        slimgc.clip_grad_norm_(opt, -1.0)
    opt.close()


#: The two-rank jobs below, in one torchrun (a job asked for that is not listed runs alone).
PATHS = {"host": {"warmup_steps": 3, "fuse_compressed": 4096}, "device": {"data_path": "device"}}


def _ddp_job(path):
    return json.dumps(dict({"max_norm": MAX_NORM, "compression": "none", "backup": False},
                           **({"data_path": "device"} if path == "device" else {})))


def _backup_job(path):
    return json.dumps(dict({"max_norm": MAX_NORM, "compression": "2bit", "backup": True,
                            "momentum": 0, "probe": True, "steps": 30, "comm_threshold": 0},
                           **PATHS[path]))


SHARED = Batch(*(job for path in PATHS for job in (
    ("clip.py", "ddp,slimgc,plain", _ddp_job(path)), ("clip.py", "slimgc", _backup_job(path)))))


def run_ok(*args, **kw):
    code, text = SHARED.run(*args, **kw)
    assert code == 0, text[-4000:]
    return text


@pytest.mark.slow
@pytest.mark.parametrize("path", list(PATHS))
def test_full_precision_without_backup_clips_as_ddp(tmp_path, path):
    """The weights are DDP's with torch's clip_grad_norm_ (which clips at every step here);
    torch's clip on the parameters under SlimGC clips each rank's own gradient instead.
    Both data paths (the device path on CPU tensors)."""
    run_ok("clip.py", tmp_path, "ddp,slimgc,plain", _ddp_job(path))
    ddp, mine, plain = (results(tmp_path, m) for m in ("ddp", "slimgc", "plain"))
    for r in range(2):
        assert min(ddp[r]["norms"]) > MAX_NORM  # the clip was active at every step
        np.testing.assert_allclose(mine[r]["global_norms"], ddp[r]["norms"], rtol=1e-5)
        assert np.abs(np.subtract(ddp[r]["weights"], mine[r]["weights"])).max() <= 1e-6
        assert np.abs(np.subtract(ddp[r]["weights"], plain[r]["weights"])).max() > 1e-3
    assert mine[0]["fused"] > 0  # fused buckets after the warm-up


@pytest.mark.slow
@pytest.mark.parametrize("path", list(PATHS))
def test_compressed_with_backup_clips_both_updates(tmp_path, path):
    """2bit with backup, SGD without momentum: the global update moves the weights by
    lr * min(norm, max_norm) of the decoded mean gradient, the local one by lr * min(norm,
    max_norm) of this rank's own; the job trains and the ranks agree bitwise."""
    run_ok("clip.py", tmp_path, "slimgc", _backup_job(path))
    ranks = results(tmp_path, "slimgc")
    r0 = ranks[0]
    assert r0["weights"] == ranks[1]["weights"]
    assert r0["compressed"] > 0 and r0["fused"] > 0
    assert np.mean(r0["losses"][-5:]) < 0.75 * np.mean(r0["losses"][:5])
    norms = np.array(r0["global_norms"])
    assert (norms > MAX_NORM).sum() > 20  # the clip was active
    clipped = np.minimum(norms, MAX_NORM * norms / (norms + 1e-6))
    np.testing.assert_allclose(r0["moved_global"], clipped, rtol=1e-3, atol=1e-6)
    for rank in ranks:
        np.testing.assert_allclose(rank["moved_local"], np.minimum(rank["norms"], MAX_NORM),
                                   rtol=1e-3)
