"""The device path (slimgc_mx/torch/device_path.py) end to end on CPU tensors, 2 ranks over
Gloo: against the host path, DDP and itself; its planning and choice in one process."""
import pytest

torch = pytest.importorskip("torch")

from slimgc_mx import codecs  # noqa: E402
from slimgc_mx.engine.config import SlimGCConfig  # noqa: E402
from slimgc_mx.torch import buckets, device_path  # noqa: E402
from torch_launch import Batch, results  # noqa: E402

MODES = ("match", "nan", "settings", "resume", "changed", "overlap")
SHARED = Batch(*(("device_path.py", mode) for mode in MODES))
#: torch_jobs/device_path.py's CODECS: each codec it serves, and two with options (thc's
#: rotation; qsgd's buckets below 8 elements and levels not a power of two).
SERVED = ("none", "1bit", "2bit", "4bit", "terngrad", "qsgd", "thc", "randomk",
          "thc_hadamard", "qsgd_small")
CASES = ["%s-%s-%s" % (c, b, o) for c in SERVED
         for b in ("backup", "nobackup") for o in ("sgd", "adam")]


def job(tmp_path, mode):
    code, text = SHARED.run("device_path.py", tmp_path, mode)
    assert code == 0, text[-4000:]
    return results(tmp_path, mode)


@pytest.mark.slow
def test_every_codec_it_serves_gives_the_host_paths_global_weights(tmp_path):
    """Adam runs torch's own step on both paths: bit for bit, backup on and off, for every
    codec (the stochastic ones draw from the host path's seeds, and their shared scale or
    norms, agreed on the device, are the host path's). SGD: the host path's global update
    is a Cython kernel a rounding away from torch's (within 1.2e-7 of it here), while the
    device path runs torch's own SGD, so with full precision and no backup it gives DDP's
    weights bit for bit. Small buckets are tried where a bucket holds several tensors."""
    ranks = job(tmp_path, "match")
    assert ranks[0] == ranks[1]  # every rank the same global weights
    r = ranks[0]
    assert sorted(r) == sorted(CASES + ["ddp-sgd", "ddp-adam"])
    for case in CASES:
        got = r[case]
        assert got["data_path"] == "device", case
        if case.endswith("adam"):
            assert got["device"] == got["host"], case
        else:
            assert 0 < got["max_diff"] <= 2e-7, case  # the kernel's rounding, no more
        assert got["compressed_buckets"] == (0 if case.startswith("none") else
                                             got["buckets"] - 1), case
        per_tensor = case.split("-")[0] not in ("none", "2bit")
        assert ("small_buckets" in got) != per_tensor, case
        if not per_tensor:
            assert got["small_buckets"] == got["device"], case  # buckets change no sum
    for optimizer in ("sgd", "adam"):
        assert r["ddp-" + optimizer]["device"] == r["ddp-" + optimizer]["ddp"]


@pytest.mark.slow
def test_a_nan_gradient_on_one_rank_stops_every_rank_naming_it(tmp_path):
    for r in job(tmp_path, "nan"):
        assert "NonFiniteAggregateError" in r["error"], r["error"]
        for word in ("step 3", "0.weight", "rank 1", "no global weight was written"):
            assert word in r["error"], r["error"]


@pytest.mark.slow
def test_buckets_started_in_backward_give_the_same_weights(tmp_path):
    """Buckets started from the post-accumulate hooks (in bucket order) against started in
    step(): the same global weights bit for bit, backup on and off, full precision and 2bit;
    with accumulation (two backward calls a step) the first step shows it and buckets
    start in step() on every rank."""
    ranks = job(tmp_path, "overlap")
    assert ranks[0] == ranks[1]
    for case, got in ranks[0].items():
        assert got["on"] == got["off"], case
        assert got["overlap"] == ("off" if case == "accumulate" else "on"), case


@pytest.mark.slow
def test_a_gradient_changed_after_backward_sent_it_stops_every_rank(tmp_path):
    for r in job(tmp_path, "changed"):
        assert r["error"].startswith("RuntimeError: step 3"), r["error"]
        for word in ("rank 1", "overlap=False", "no global weight was written"):
            assert word in r["error"], r["error"]


@pytest.mark.slow
def test_a_setting_changed_on_one_rank_stops_every_rank(tmp_path):
    for r in job(tmp_path, "settings"):
        assert "ConfigMismatchError" in r["error"], r["error"]
        assert "lr at step 4" in r["error"] and "rank 1 has 0.01" in r["error"], r["error"]


@pytest.mark.slow
def test_a_resumed_run_continues_bit_for_bit(tmp_path):
    """2bit, and terngrad, whose scale the device keeps: the checkpoint reads it back."""
    for r in job(tmp_path, "resume"):
        for compression in ("2bit", "terngrad"):
            got = r[compression]
            assert got["params"][0] == got["params"][1], compression
            assert got["flushed"][0] == got["flushed"][1], compression
        scales = r["terngrad"]["scales"]
        assert len(scales) == 5 and all(s > 0 for s in scales), scales


def _named(*sizes):
    return [("p%d" % i, torch.nn.Parameter(torch.zeros(n))) for i, n in enumerate(sizes)]


def test_buckets_run_in_backward_order_by_group_kind_and_cap():
    named = _named(10, 1000, 1000, 5, 1000)
    groups = {0: 0, 1: 0, 2: 0, 3: 0, 4: 1}
    specs = buckets.plan_buckets(named, groups, codecs.create("2bit"), 1024, 8000)
    assert [s.indices for s in specs] == [(4,), (3,), (2, 1), (0,)]
    assert [s.group for s in specs] == [1, 0, 0, 0]
    assert [s.compressed for s in specs] == [True, False, True, False]
    # a cap below one tensor: one tensor per bucket
    specs = buckets.plan_buckets(named, groups, codecs.create("2bit"), 1024, 100)
    assert [s.indices for s in specs] == [(4,), (3,), (2,), (1,), (0,)]
    # a codec with a per-tensor statistic or gathered values: one bucket per compressed
    # tensor (the full-precision ones still fuse)
    for name in ("1bit", "4bit", "terngrad", "qsgd", "thc", "randomk"):
        specs = buckets.plan_buckets(named, groups, codecs.create(name), 0, 10 ** 9)
        assert [s.indices for s in specs] == [(4,), (3,), (2,), (1,), (0,)], name
        mixed = _named(10, 1000, 5, 7, 1000)  # 2 and 3 below 1024 bytes: full precision
        specs = buckets.plan_buckets(mixed, {i: 0 for i in range(5)}, codecs.create(name),
                                     1024, 10 ** 9)
        assert [(s.indices, s.compressed) for s in specs] == [
            ((4,), True), ((3, 2), False), ((1,), True), ((0,), False)], name
    # full precision: every bucket full precision, one per group
    specs = buckets.plan_buckets(named, groups, None, 0, 10 ** 9)
    assert [(s.indices, s.compressed) for s in specs] == [((4,), False), ((3, 2, 1, 0), False)]


def test_the_choice_of_path_is_made_in_one_place_and_refuses_with_the_fix():
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    config = SlimGCConfig(compressor="2bit")
    assert device_path.choose("auto", config, sgd, cuda=True) == "device"
    assert device_path.choose("auto", config, sgd, cuda=False) == "host"
    assert device_path.choose("device", config, sgd, cuda=False) == "device"
    assert device_path.choose("host", config, sgd, cuda=True) == "host"
    for name, options in (("terngrad", {}), ("qsgd", {"bucket_size": 4}),
                          ("thc", {"hadamard": True}), ("randomk", {"ratio": 0.1})):
        served = SlimGCConfig(compressor=name, codec_options=options)
        assert device_path.choose("auto", served, sgd, cuda=True) == "device", name
    for bad, words in ((SlimGCConfig(compressor="powersgd"), "powersgd"),
                       (SlimGCConfig(compressor="2bit", loc_lr=0.1), "loc_lr"),
                       (SlimGCConfig(compressor="2bit", audit_every=5), "audit_every")):
        assert device_path.choose("auto", bad, sgd, cuda=True) == "host"
        with pytest.raises(ValueError, match=words + ".*data_path='host'"):
            device_path.choose("device", bad, sgd, cuda=True)
    # offload asked for (True, or the CTTab's 'auto'): the host path's CPU codecs
    for offload in (True, "auto"):
        given = SlimGCConfig(compressor="2bit", offload=offload)
        assert device_path.choose("auto", given, sgd, cuda=True, offload_given=True) == "host"
        with pytest.raises(ValueError, match="offload.*data_path='host'"):
            device_path.choose("device", given, sgd, cuda=True, offload_given=True)
    given = SlimGCConfig(compressor="2bit", offload=False)
    assert device_path.choose("auto", given, sgd, cuda=True, offload_given=True) == "device"
    with pytest.raises(ValueError, match="data_path must be one of"):
        device_path.choose("gpu", config, sgd, cuda=True)


def test_bad_bucket_cap_or_overlap_is_refused_naming_it():
    import slimgc_mx.torch as slimgc
    net = torch.nn.Linear(2, 2)
    for bad in (0, -1.0, float("nan"), "25", True):
        with pytest.raises(ValueError, match="bucket_cap_mb must be a positive number"):
            slimgc.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), net,
                                        data_path="device", bucket_cap_mb=bad)
    with pytest.raises(TypeError, match="overlap must be True"):
        slimgc.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), net,
                                    data_path="device", overlap="yes")


def test_one_process_without_torch_distributed_matches_plain_torch():
    """A world of one without torch.distributed: the device path is torch's own optimizer
    on the summed (here: own) gradient, so full precision gives plain SGD's weights."""
    import slimgc_mx.torch as slimgc

    def train(wrap):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        inner = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, nesterov=True)
        opt = slimgc.DistributedOptimizer(inner, net, compression="none", backup=False,
                                          data_path="device") if wrap else inner
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            opt.zero_grad()
            x = torch.randn(16, 4, generator=g)
            net(x).square().mean().backward()
            opt.step()
        if wrap:
            stats = opt.stats()
            assert stats["data_path"] == "device" and stats["buckets"] == 1
            assert stats["step_copies"]["pageable_bytes"] == 0
            opt.close()
        return torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    assert torch.equal(train(True), train(False))


def _cuda_job(device, compression, backup, wrap=True, optimizer="sgd", data_path="auto"):
    """Five steps of given random gradients (not computed from the weights, so a rounding
    apart in the update cannot move a level); the weights and the last step's copies."""
    import slimgc_mx.torch as slimgc
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 8)).to(device)
    inner = (torch.optim.Adam(net.parameters(), lr=0.01) if optimizer == "adam" else
             torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
    opt = slimgc.DistributedOptimizer(inner, net, compression=compression, backup=backup,
                                      comm_threshold=0, data_path=data_path) if wrap else inner
    for step in range(5):
        gen = torch.Generator().manual_seed(step)
        for p in net.parameters():
            p.grad = torch.randn(p.shape, generator=gen).to(device)
        opt.step()
    counts = path = None
    if wrap:
        counts, path = opt.stats()["step_copies"], opt.data_path
        opt.flush()
        opt.close()
    return [p.detach().cpu() for p in net.parameters()], counts, path


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backup", [True, False])
@pytest.mark.parametrize("compression", ["none", "2bit"])
def test_a_cuda_model_takes_the_device_path_without_copies(compression, backup):
    """data_path='auto' picks the device path for a CUDA model; a steady step copies only the
    tail (flags and settings, bytes), none of it pageable, and synchronises the host at most
    once; the weights are the CPU device path's (full precision without backup: torch's own
    SGD on the card, bit for bit)."""
    cuda, counts, path = _cuda_job("cuda", compression, backup)
    assert path == "device"
    assert counts["pageable_bytes"] == 0 and counts["host_syncs"] <= 1, counts
    assert counts["d2h_bytes"] < 1024 and counts["h2d_bytes"] < 1024, counts
    cpu, _, _ = _cuda_job("cpu", compression, backup, data_path="device")
    for a, b in zip(cpu, cuda):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), (a - b).abs().max()
    if compression == "none" and not backup:
        plain, _, _ = _cuda_job("cuda", compression, backup, wrap=False)
        for a, b in zip(plain, cuda):
            assert torch.equal(a, b)


def test_a_grad_scaler_keeps_buckets_out_of_backward():
    """GradScaler's unscale writes .grad without bumping its version, so the watch cannot see
    it: a scaler at the first step keeps buckets in step() (the weights are those of
    overlap=False), and one that appears once they start in backward raises, naming the
    fix, rather than send scaled gradients."""
    import slimgc_mx.torch as slimgc

    def train(overlap, scaler_from):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        opt = slimgc.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), net,
                                          compression="2bit", backup=False,
                                          data_path="device", overlap=overlap)
        scaler = torch.amp.GradScaler("cpu", init_scale=64.0)
        g = torch.Generator().manual_seed(1)
        try:
            for step in range(4):
                opt.zero_grad()
                loss = net(torch.randn(16, 4, generator=g)).square().mean()
                if step >= scaler_from:
                    scaler.scale(loss).backward()
                    scaler.step(opt)
                    scaler.update()
                else:
                    loss.backward()
                    opt.step()
            return torch.cat([p.detach().reshape(-1) for p in net.parameters()]), opt.stats()
        finally:
            opt.close()
    on, stats = train(True, 0)
    off, _ = train(False, 0)
    assert stats["overlap"] == "off" and torch.equal(on, off)
    with pytest.raises(RuntimeError, match="GradScaler.*overlap=False"):
        train(True, 2)
