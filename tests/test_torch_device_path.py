"""The device path (slimgc_mx/torch/device_path.py) end to end on CPU tensors, 2 ranks over
Gloo: against the host path, DDP and itself; its planning and choice in one process."""
import pytest

torch = pytest.importorskip("torch")

from slimgc_mx import codecs  # noqa: E402
from slimgc_mx.engine.config import SlimGCConfig  # noqa: E402
from slimgc_mx.engine import stages  # noqa: E402
from slimgc_mx.engine.push_plan import COMPRESSED, FULL, HOST  # noqa: E402
from slimgc_mx.torch import buckets, device_path  # noqa: E402
from torch_launch import Batch, results  # noqa: E402

MODES = ("match", "powersgd", "pieces", "state_on", "nan", "settings", "resume", "changed",
         "overlap", "cttab")
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
def test_powersgd_on_the_device_gives_the_host_paths_weights_given_its_products(tmp_path):
    """powersgd's two rounds on the device path: with the matrix products made by NumPy as
    the host codec makes them, Adam's global weights are the host path's bit for bit (SGD's
    within the Cython kernel's rounding), backup on and off; with torch's own products
    (another BLAS) within float32 rounding of them. One matrix bucket, two sums a step."""
    ranks = job(tmp_path, "powersgd")
    assert ranks[0] == ranks[1]  # every rank the same global weights
    r = ranks[0]
    assert sorted(r) == sorted("%s-%s-%s" % (p, b, o) for p in ("torch", "numpy")
                               for b in ("backup", "nobackup") for o in ("sgd", "adam"))
    for case, got in r.items():
        assert got["data_path"] == "device" and got["compressed_buckets"] == 1, case
        # P and Q of the 300x8 matrix (rank 4), the other bucket, the tail: 4 sums a step
        assert got["transfers"] == 4 * got["steps"], case
        assert got["bytes_pushed"] < got["bytes_fp32"], case
        if case.startswith("numpy") and case.endswith("adam"):
            assert got["device"] == got["host"], case
        elif case.startswith("numpy"):
            assert got["max_diff"] <= 2e-7, case  # the SGD kernel's rounding, no more
        else:
            assert got["max_diff"] <= 1e-5 * got["largest"], case


@pytest.mark.slow
def test_a_job_run_piece_by_piece_gives_the_host_paths_weights(tmp_path):
    """Pieces of 64 elements (a large tensor's, made small): 2bit's encode and decode, 4bit's
    decode, powersgd's outer products piece by piece in a 2-rank job, backup on and off:
    Adam's global weights the host path's bit for bit, as whole tensors give them; 2bit's
    lanes are summed piece by piece, each sum started once its piece is encoded (the large
    tensor split across exchanges, so its sum overlaps its encode)."""
    ranks = job(tmp_path, "pieces")
    assert ranks[0] == ranks[1]
    assert sorted(ranks[0]) == ["2bit-False", "2bit-True", "4bit-True", "powersgd-True"]
    for case, got in ranks[0].items():
        assert got["compressed_buckets"] >= 1, case
        assert got["device"] == got["host"], case
        if case.startswith("2bit"):  # 8 steps, 2400 + 900 elements a step in 64s: far more
            assert got["transfers"] >= got["whole_transfers"] + 8 * 40, case
        else:  # 4bit's statistic, powersgd's rounds: its encodes are whole
            assert got["transfers"] == got["whole_transfers"], case


@pytest.mark.slow
def test_offloaded_state_gives_the_same_weights_and_moves_it_each_step(tmp_path):
    """state_on='host': glo_buf, the optimizer's state and the residuals in host memory,
    staged for each bucket's pass: the weights of state_on='device' bit for bit (SGD, Adam;
    backup on and off; none, 2bit, powersgd; a checkpoint through torch.save at step 4;
    2bit clipped by slimgc.clip_grad_norm_, whose norm needs every bucket's mean first;
    2bit under the CTTab, whose decision reads the last warm-up step's decodes);
    each steady step brings every bucket's glo_buf, state and residual in once and takes
    them out once; between passes nothing is staged, and the optimizer and the bucket hold
    the host tensors."""
    ranks = job(tmp_path, "state_on")
    assert ranks[0] == ranks[1]
    r = ranks[0]
    assert len(r) == 16 and "sgd-True-2bit-clip" in r and "sgd-False-2bit-cttab" in r
    for case, got in r.items():
        on, off = got["device"], got["host"]
        assert on["weights"] == off["weights"], case
        assert on["routes"] == off["routes"], case
        if case.endswith("cttab"):  # decided by the injected timings, the last step's too
            assert set(off["routes"]) == {"compressed on the host"}, off
        assert on["homes"] == 0 and off["homes"] == off["buckets"] > 1, case
        assert off["at_home"], case
        per_element = 2 if case.startswith("adam") else 1  # Adam's moments, SGD's momentum
        assert off["state_bytes"] == per_element * off["glo_bytes"], case
        # the compressed buckets' residuals too (2bit: 1.2 KiB and more, compressed;
        # powersgd: its one matrix)
        assert (off["residual_bytes"] > 0) == ("none" not in case), case
        whole = off["glo_bytes"] + off["state_bytes"] + off["residual_bytes"]
        # steady steps: not the first, nor around the load, nor the CTTab's decision (step
        # 3: every bucket's update staged before it, then each pass)
        for step in (2, 6, 7) if case.endswith("cttab") else (2, 3, 6, 7):
            assert off["moved"][step] == [whole, whole], (case, step, off["moved"])
        assert all(m == [0, 0] for m in on["moved"]), case  # kept on the device: no copy


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
    """2bit, and terngrad, whose scale the device keeps, and powersgd, whose Q it keeps:
    the checkpoint reads them back."""
    for r in job(tmp_path, "resume"):
        for compression in ("2bit", "terngrad", "powersgd"):
            got = r[compression]
            assert got["params"][0] == got["params"][1], compression
            assert got["flushed"][0] == got["flushed"][1], compression
        scales = r["terngrad"]["scales"]
        assert len(scales) == 5 and all(s > 0 for s in scales), scales
        assert r["powersgd"]["q_columns"] == [4], r["powersgd"]  # the 300x8 matrix's Q


@pytest.mark.slow
def test_the_cttab_routes_each_bucket_alike_on_every_rank(tmp_path):
    """comm_threshold='auto', a warm-up of 4 steps: every rank adopts rank 0's routes
    (with its own timings, and with timings that differ between the ranks), the global
    weights are the same on both ranks, and training goes on after the decision; every
    bucket in full precision without backup is DDP's step from the warm-up's weights and
    momentum on; a run resumed mid-warm-up or after the decision routes and trains as the
    uninterrupted one."""
    ranks = job(tmp_path, "cttab")
    r0, r1 = ranks
    for case in ("measured", "disagree", "full"):
        for key in ("routes", "flushed", "glo_buf", "phase", "steps"):
            assert r0[case][key] == r1[case][key], (case, key)
        assert r0[case]["phase"] == "decided" and r0[case]["steps"] == 10, case
    measured = r0["measured"]
    assert len(measured["routes"]) == 6  # 1bit: a bucket per tensor
    assert set(measured["routes"]) <= {"compressed", "full precision"}
    assert measured["moved_after"] > 1e-3  # trained after the decision
    # rank 0 compresses the even buckets, rank 1 would the odd ones: rank 0's on both
    assert r0["disagree"]["routes"] == ["compressed", "full precision"] * 3
    assert "rank 0's choice" in r1["disagree"]["reason"]
    assert "rank 0's choice" not in r0["disagree"]["reason"]
    # 2bit's one bucket on the host codec where it is timed fastest: the device codec's
    # lanes bit for bit, so the same weights as on the device
    assert r0["host"]["routes"] == ["compressed on the host"]
    assert r0["device"]["routes"] == ["compressed"]
    for r in ranks:
        for key in ("glo_buf", "flushed"):  # the global weights: every rank's alike
            assert r["host"][key] == r["device"][key] == r0["host"][key], key
        assert r["host"]["params"] == r["device"]["params"]  # this rank's loc_buf
        assert "on the host" in r["host"]["reason"]
    full = r0["full"]
    assert full["routes"] == ["full precision"]  # 2bit: one bucket
    assert full["moved_after"] > 1e-3
    for r in ranks:
        assert r["full"]["ddp_diff"] <= 1e-6, r["full"]["ddp_diff"]
    for r in ranks:
        whole = r["resume"]["whole"]
        assert whole["routes"] == ["compressed", "full precision"] * 3
        for at, phase in (("2", "warmup"), ("6", "decided")):
            got = r["resume"][at]
            assert got["saved_phase"] == phase
            for key in ("routes", "params", "flushed", "glo_buf"):
                assert got[key] == whole[key], (at, key)


def _encode(bucket, grads, num_workers, flag, rank=0, counts=None):
    """A pass's encode on the bucket's route, through the engine's dispatch of its plan."""
    stages.encode_bucket(bucket.plan(), bucket, grads, num_workers, flag, rank, counts)


def test_a_bucket_in_full_precision_flushes_its_residual_as_the_host_path():
    """The host path's rule for a key that leaves the compressed route (stages.flush_residual):
    its full-precision push sends grad + residual, and the residual starts from zero; a
    bucket the CTTab keeps in full precision flushes once and holds no residual after."""
    import numpy as np

    codec = codecs.create("2bit", threshold=0.5)
    p = torch.nn.Parameter(torch.zeros(1000))
    spec = buckets.BucketSpec((0,), 0, True)
    b = buckets.Bucket(spec, [("p", p)], torch.optim.SGD([p], lr=0.1), codec, 1)
    flag = torch.zeros((), dtype=torch.float64)
    g = [torch.randn(1000, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    _encode(b, [g[0]], 1, flag)  # compressed: the residual keeps what 2bit did not send
    residual = b.residual.clone()
    assert b.sent.compressed and residual.abs().max() > 0

    class Array:  # a host buffer
        def __init__(self, a):
            self.a = a

        def for_write(self):
            return self.a

    class HostKey:  # the host path's buffers of one key, its residual pending
        def __init__(self, grad, memory):
            self.grad_buf, self.memory = Array(grad), Array(memory)
            self.residual_pending = True

        def host_residual(self):
            return self.memory
    host = HostKey(g[1].numpy().copy(), residual.numpy().copy())
    stages.flush_residual(host)
    b.route = FULL  # the warm-up's full-precision step
    _encode(b, [g[1]], 1, flag)
    assert not b.sent.compressed
    assert np.array_equal(b.lanes.numpy(), host.grad_buf.a) and not host.memory.a.any()
    assert b.residual is not None and not b.residual.any()  # kept: compressed steps follow
    b.route = COMPRESSED
    _encode(b, [g[2]], 1, flag)
    residual = b.residual.clone()
    b.settle(FULL)  # the CTTab's decision: full precision from now on
    _encode(b, [g[3]], 1, flag)
    assert torch.equal(b.lanes, g[3] + residual) and b.residual is None
    _encode(b, [g[0]], 1, flag)
    assert torch.equal(b.lanes, g[0])  # an uncompressed bucket's lanes from here on
    assert float(flag) == 0.0


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here (run on a GPU machine)"))]


@pytest.mark.parametrize("device", DEVICES)
def test_the_host_route_sends_the_device_codecs_lanes_bit_for_bit(device):
    """2bit's host route (the Cython codec on the CPU) and its device route (torch ops),
    alternated step by step as the warm-up does, give the lanes and the residual that the
    device route alone gives; a NaN gradient sets the flag and writes nothing. On CUDA its
    copies are counted: a host synchronisation and pageable bytes per host encode."""
    from slimgc_mx.torch.copies import CopyCounts

    codec = codecs.create("2bit", threshold=0.05)
    sizes = (1000, 37)
    named = [(n, torch.nn.Parameter(p.detach().to(device))) for n, p in _named(*sizes)]
    spec = buckets.BucketSpec((1, 0), 0, True)
    opt = torch.optim.SGD([p for _, p in named], lr=0.1)
    host = buckets.Bucket(spec, named, opt, codec.clone(), 3)
    device_only = buckets.Bucket(spec, named, opt, codec.clone(), 3)
    assert host.host_route and device_only.host_route
    flag = torch.zeros((), dtype=torch.float64, device=device)
    counts = CopyCounts()
    for step in range(6):
        gen = torch.Generator().manual_seed(step)
        grads = [(torch.randn(sizes[1], generator=gen) * 0.1).to(device),
                 (torch.randn(sizes[0], generator=gen) * 0.1).to(device)]
        host.route = HOST if step % 2 == 0 else COMPRESSED
        _encode(host, grads, 3, flag, rank=1, counts=counts)
        assert float(flag) == 0.0 and host.sent.compressed
        _encode(device_only, grads, 3, flag, rank=1)
        assert torch.equal(host.lanes, device_only.lanes), step
        assert torch.equal(host.residual, device_only.residual), step
    if device == "cuda":
        assert counts.host_syncs == 3 and counts.pageable_bytes > 0
    else:  # the host's own memory: no copy
        assert counts == CopyCounts()
    lanes, residual = host.lanes.clone(), host.residual.clone()
    host.route = HOST
    _encode(host, [torch.full((sizes[1],), float("nan"), device=device),
                 torch.zeros(sizes[0], device=device)], 3, flag)
    assert float(flag) == 1.0
    assert torch.equal(host.lanes, lanes) and torch.equal(host.residual, residual)
    onebit = buckets.Bucket(spec, named, opt, codecs.create("1bit"), 3)
    assert not onebit.host_route  # 1bit's scale is the tensor's: no host route


def test_a_fixed_threshold_keeps_its_routes_and_auto_warms_up(capsys):
    """comm_threshold a size or 'off': the routes of build time, no warm-up, as before;
    'auto': the CTTab's warm-up, said at start, and its decision said once taken."""
    import slimgc_mx.torch as slimgc

    def train(threshold, steps=3):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 2))
        opt = slimgc.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), net,
                                          compression="2bit", data_path="device",
                                          comm_threshold=threshold, warmup_steps=2)
        g = torch.Generator().manual_seed(1)
        for _ in range(steps):
            opt.zero_grad()
            net(torch.randn(8, 64, generator=g)).square().mean().backward()
            opt.step()
        stats = opt.stats()
        opt.close()
        return stats
    for threshold in (1024, "off"):
        stats = train(threshold)
        assert stats["cttab_phase"] == "fixed"
        assert "full precision" not in stats["routes"] or threshold == 1024
    assert "CTTab" not in capsys.readouterr().err
    stats = train("auto")
    err = capsys.readouterr().err
    assert stats["cttab_phase"] == "decided" and len(stats["routes"]) == stats["buckets"]
    assert "a warm-up of 2 steps" in err and "device path CTTab: " in err
    assert "no CTTab warm-up yet" not in err
    assert train("auto", steps=1)["routes"] == ["warm-up"] * stats["buckets"]


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
    # powersgd: a matrix whose rank-4 factors are smaller per bucket, its vectors (and a
    # matrix too thin to gain) fused in full precision, as the host path routes them
    shaped = [("w0", torch.nn.Parameter(torch.zeros(64, 32))),
              ("b0", torch.nn.Parameter(torch.zeros(64))),
              ("w1", torch.nn.Parameter(torch.zeros(3, 64))),
              ("w2", torch.nn.Parameter(torch.zeros(16, 4, 3, 3)))]
    specs = buckets.plan_buckets(shaped, {i: 0 for i in range(4)}, codecs.create("powersgd"),
                                 0, 10 ** 9)
    assert [(s.indices, s.compressed) for s in specs] == [
        ((3,), True), ((2, 1), False), ((0,), True)]
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
    served = SlimGCConfig(compressor="powersgd", codec_options={"rank": 2})
    assert device_path.choose("auto", served, sgd, cuda=True) == "device"
    for bad, words in ((SlimGCConfig(compressor="topk"), "topk"),
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
    for bad in ("cpu", "gpu", True):
        with pytest.raises(ValueError, match="state_on must be one of 'device', 'host'"):
            slimgc.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), net,
                                        data_path="device", state_on=bad)
    with pytest.raises(ValueError, match="state_on='device' is the device path's.*"
                                         "data_path='device'"):
        slimgc.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), net,
                                    data_path="host", state_on="device")
    opt = slimgc.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), net,
                                      data_path="host", state_on="host")  # what it does
    assert opt.data_path == "host"
    opt.close()
    opt = slimgc.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), net,
                                      data_path="device", state_on="host")
    assert "offloaded to" in opt._device.describe() and opt._device.state_on == "host"
    opt.close()


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


def _cuda_job(device, compression, backup, wrap=True, optimizer="sgd", data_path="auto",
              state_on=None):
    """Five steps of given random gradients (not computed from the weights, so a rounding
    apart in the update cannot move a level); the weights and the last step's copies."""
    import slimgc_mx.torch as slimgc
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 8)).to(device)
    inner = (torch.optim.Adam(net.parameters(), lr=0.01) if optimizer == "adam" else
             torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
    opt = slimgc.DistributedOptimizer(inner, net, compression=compression, backup=backup,
                                      comm_threshold=0, data_path=data_path,
                                      state_on=state_on) if wrap else inner
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("backup", [True, False])
def test_offloaded_state_moves_by_copies_that_block_nothing(device, optimizer, backup):
    """state_on='host': the weights of state_on='device' on the same device, bit for bit; a
    steady step stages every bucket's glo_buf, state and residual in and out once (pinned on
    a GPU: no pageable byte) and synchronises the host at most once (the tail)."""
    on, _, _ = _cuda_job(device, "2bit", backup, optimizer=optimizer, data_path="device",
                         state_on="device")
    off, counts, _ = _cuda_job(device, "2bit", backup, optimizer=optimizer,
                               data_path="device", state_on="host")
    assert all(torch.equal(a, b) for a, b in zip(on, off))
    numel = 64 * 256 + 256 + 256 * 8 + 8
    whole = 4 * numel * (2 + (2 if optimizer == "adam" else 1))  # glo_buf, state, residual
    tail = 1024  # (the tail's bytes, on a GPU)
    assert whole <= counts["h2d_bytes"] < whole + tail, counts
    assert whole <= counts["d2h_bytes"] < whole + tail, counts
    assert counts["pageable_bytes"] == 0 and counts["host_syncs"] <= 1, counts


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


class DeferredStateCopies:
    """A stand-in for state_home.StateCopies on CPU tensors, as a copy stream would run its
    copies: each lands only when a reader waits for an event marked after it (ready) or the
    host settles, in the order queued. Until then a device copy holds NaN, and the host
    memory a stage-out writes holds NaN: whatever reads a buffer before its producer's event
    reads NaN. A host-to-device copy reads its host memory when it lands (after the
    stage-outs queued before it); a stage-out takes the device value when queued."""

    cuda = False

    def __init__(self, device, counts):
        self.counts = counts
        self.queue = []  # (destination, source or snapshot) not landed yet, oldest first
        self.landed = 0
        self.waits = 0

    def host_empty(self, shape, dtype=torch.float32):
        return torch.empty(shape, dtype=dtype)

    def to_device(self, host):
        self.counts.h2d_bytes += host.numel() * host.element_size()
        out = torch.full(host.shape, float("nan"), dtype=host.dtype)
        self.queue.append((out, host))
        return out

    def to_host(self, dev, host):
        self.counts.d2h_bytes += dev.numel() * dev.element_size()
        self.queue.append((host, dev.clone()))
        host.fill_(float("nan"))

    def mark(self):
        return self.landed + len(self.queue)  # every copy queued so far

    def _land(self, upto):
        while self.landed < upto:
            dst, src = self.queue.pop(0)
            dst.copy_(src)
            self.landed += 1

    def ready(self, event, tensors):
        self.waits += 1
        self._land(event)

    def settle(self):
        self._land(self.landed + len(self.queue))


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("backup", [True, False])
def test_offloaded_state_reads_each_staged_copy_only_after_its_event(monkeypatch, optimizer,
                                                                      backup):
    """With copies that land only when their event is waited for (NaN until then), the
    offloaded state's steps give state_on='device''s weights bit for bit: no pass reads a
    staged buffer, and no checkpoint reads host memory, before the copy that writes it."""
    from slimgc_mx.torch import device_path
    made = []

    def stand_in(device, counts):
        made.append(DeferredStateCopies(device, counts))
        return made[-1]
    on, _, _ = _cuda_job("cpu", "2bit", backup, optimizer=optimizer, data_path="device",
                         state_on="device")
    monkeypatch.setattr(device_path, "StateCopies", stand_in)
    off, _, _ = _cuda_job("cpu", "2bit", backup, optimizer=optimizer, data_path="device",
                          state_on="host")
    assert len(made) == 1 and made[0].waits > 0 and made[0].landed > 0
    assert all(torch.equal(a, b) for a, b in zip(on, off))
