"""lane_dtype: float64 lanes carried as float32 lanes (slimgc_mx/engine/lanes32.py)."""
import json
import sys

import numpy as np
import pytest

from slimgc_mx import codecs
from slimgc_mx.codecs.base import kernels
from slimgc_mx.engine.config import SlimGCConfig
from slimgc_mx.engine.lanes32 import (Lanes32Layout, fallback_warning, join_reference,
                               split_reference)

LANE_CODECS = ["1bit", "2bit", "4bit", "terngrad", "qsgd", "thc"]


def _random_lanes(rng, codec, n_lanes, num_workers):
    """One worker's digit lanes: k random levels in [0, L) per lane."""
    radix, k = codec.geometry(num_workers)
    q = rng.integers(0, codec.levels, size=(n_lanes, k), dtype=np.int64).astype(np.uint64)
    powers = np.array([radix ** j for j in range(k)], dtype=np.uint64)
    return (q * powers).sum(axis=1).astype(np.float64)


@pytest.mark.parametrize("name", LANE_CODECS)
@pytest.mark.parametrize("num_workers", range(1, 9))
def test_kernel_matches_reference_and_sums_are_exact(name, num_workers):
    codec = codecs.create(name)
    rng = np.random.default_rng(num_workers)
    layout = Lanes32Layout.of(codec, 1000, num_workers)
    radix, k, g, n64 = layout.radix, layout.k, layout.g, 37
    n32 = -(-n64 * k // g)
    pw = layout.powers()
    total64 = np.zeros(n64)
    total32 = np.zeros(n32, np.float32)
    for _ in range(num_workers):
        lanes = _random_lanes(rng, codec, n64, num_workers)
        out = np.full(n32, -1.0, np.float32)
        assert kernels().split_lanes32(lanes, out, pw, k, g) == 0
        assert np.array_equal(out.view(np.uint32),
                              split_reference(lanes, radix, k, g).view(np.uint32))
        assert out.max() < 2 ** 24
        total64 += lanes
        total32 += out
    joined = np.empty(n64)
    assert kernels().join_lanes32(total32, joined, pw, k, g) == 0
    assert np.array_equal(joined.view(np.uint64), total64.view(np.uint64))
    assert np.array_equal(join_reference(total32, n64, radix, k, g), joined)


@pytest.mark.parametrize("name", LANE_CODECS)
@pytest.mark.parametrize("num_workers", [1, 2, 3, 8])
def test_encoded_lanes_and_trailers_survive(name, num_workers):
    """split, float32 sum of N workers, join == the float64 sum, trailer included."""
    rng = np.random.default_rng(7)
    size = 3001
    workers = [codecs.create(name) for _ in range(num_workers)]
    layout = Lanes32Layout.of(workers[0], size, num_workers)
    total64, total32 = 0.0, np.zeros(layout.count32, np.float32)
    for rank, codec in enumerate(workers):
        for step in range(2):  # the second push uses the agreed trailer state
            grad = rng.standard_normal(size).astype(np.float32)
            if step == 0:
                residual = np.zeros(size, np.float32)
            lanes = codec.encode(grad, residual, num_workers, rank=rank)
        sent = np.empty(layout.count32, np.float32)
        layout.split(lanes, sent, rank)
        total64 = total64 + lanes
        total32 += sent
    joined = np.empty(layout.count64)
    layout.join(total32, joined)
    body = layout.body64
    assert np.array_equal(joined[:body].view(np.uint64), total64[:body].view(np.uint64))
    if layout.trailer and num_workers <= 2:  # the server's float64 sum in any order
        assert joined[body] == total64[body]
    # decoded values are what matter: equal for every codec
    a = codecs.create(name).decode(joined, size, num_workers)
    b = codecs.create(name).decode(total64, size, num_workers)
    if num_workers <= 2 or not layout.trailer:
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_bad_lanes_raise():
    codec = codecs.create("2bit")
    layout = Lanes32Layout.of(codec, 100, 2)
    lanes = np.zeros(layout.count64)
    lanes[0] = 0.5
    with pytest.raises(ValueError, match="not integers"):
        layout.split(lanes, np.empty(layout.count32, np.float32), 0)
    lanes[0] = np.nan
    with pytest.raises(ValueError, match="not integers"):
        layout.split(lanes, np.empty(layout.count32, np.float32), 0)
    summed = np.zeros(layout.count32, np.float32)
    summed[0] = 2 ** 24
    with pytest.raises(ValueError, match="not a sum"):
        layout.join(summed, np.empty(layout.count64))
    with pytest.raises(ValueError, match="C-contiguous"):
        layout.join(summed[:-1], np.empty(layout.count64))


def test_codecs_without_float64_lanes_are_refused():
    with pytest.raises(ValueError, match="lane_dtype does not apply"):
        Lanes32Layout.of(codecs.create("topk"), 100, 2)


def test_geometry_and_warning_name_the_cost():
    layout = Lanes32Layout.of(codecs.create("2bit"), 10 ** 6, 2)
    assert (layout.radix, layout.k, layout.g) == (5, 22, 10)
    assert layout.body32 == -(-layout.body64 * 22 // 10)
    text = fallback_warning(codecs.create("2bit"), 2, 1, 2)
    assert "3.20 instead of 2.91 bits per element" in text
    assert "MALLOC_PERTURB_" in text


def test_config():
    assert SlimGCConfig().lane_dtype == "auto"
    assert SlimGCConfig.from_sources({}, {"SLIMGC_LANE_DTYPE": "Float32"}).lane_dtype == "float32"
    assert SlimGCConfig.from_sources({"lane_dtype": "float64"}).lane_dtype == "float64"
    assert SlimGCConfig().agreement_fields()["lane_dtype"] == "auto"
    with pytest.raises(ValueError, match="auto, float64, float32"):
        SlimGCConfig(lane_dtype="float16")
    with pytest.raises(ValueError, match="auto, float64, float32"):
        SlimGCConfig.from_sources({}, {"SLIMGC_LANE_DTYPE": "half"})


# ---------------------------------------------------------------- the kvstore, in threads
@pytest.mark.parametrize("name, offload, n", [
    ("2bit", True, 2), ("1bit", True, 2), ("4bit", False, 2), ("terngrad", True, 3),
    ("qsgd", True, 3), ("thc", True, 2), ("topk", True, 2)])
def test_float32_lanes_give_the_same_sums(name, offload, n):
    """The lane sums are exact either way, so the decoded sums are bitwise equal; the
    bytes counted are the float32 lanes'."""
    import training_helpers as th

    size, steps = 5000, 4
    grads = np.random.RandomState(3).randn(steps, n, size).astype(np.float32)
    options = {"ratio": 0.05} if name == "topk" else {}

    def run(lane_dtype):
        return th.pushpull_workers(grads, compressor=name, comm_threshold="off", backup=False,
                                   offload=offload, lane_dtype=lane_dtype, **options)

    r64, r32 = run("float64"), run("float32")
    for (o64, s64), (o32, s32) in zip(r64, r32):
        for a, b in zip(o64, o32):
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    s64, s32 = r64[0][1], r32[0][1]
    codec = codecs.create(name, **options)
    if name == "topk":
        assert s32["bytes_pushed"] == s64["bytes_pushed"]
    else:
        layout = Lanes32Layout.of(codec, size, n)
        assert s64["bytes_pushed"] == steps * 8 * layout.count64
        assert s32["bytes_pushed"] == steps * 4 * layout.count32


def test_auto_switches_every_worker_when_a_server_is_inexact(caplog):
    """One worker's lossy verdict switches both; one warning names the cost and the fix."""
    import mxnet as mx
    import training_helpers as th
    from slimgc_mx.mxnet.kvstore import SlimGC

    def worker(rank, transport):
        if rank == 1:
            transport.lossy_servers = lambda: 1
        kv = SlimGC(transport=transport, compressor="2bit", comm_threshold="off",
                    backup=False)
        kv.init(0, mx.nd.zeros(1000))
        out = mx.nd.zeros(1000)
        kv.pushpull(0, mx.nd.ones(1000), out=out)
        chosen = kv._agg.lanes32
        kv.close()
        return chosen, out.asnumpy()

    with caplog.at_level("WARNING", logger="slimgc_mx.engine.lanes32"):
        results = th.in_threads(2, worker)
    assert [r[0] for r in results] == [True, True]
    assert np.array_equal(results[0][1], results[1][1])
    warnings = [r for r in caplog.records if "lanes travel as float32" in r.getMessage()]
    assert len(warnings) == 1
    assert "3.20 instead of 2.91 bits per element" in warnings[0].getMessage()


def test_float64_refuses_inexact_servers():
    import training_helpers as th
    from slimgc_mx.mxnet.kvstore import SlimGC
    import mxnet as mx

    def worker(rank, transport):
        transport.lossy_servers = lambda: 1
        kv = SlimGC(transport=transport, compressor="2bit", lane_dtype="float64")
        try:
            kv.init(0, mx.nd.zeros(10))
        except RuntimeError as exc:
            return str(exc)
        finally:
            kv.close()
        return None

    assert all(r is not None for r in th.in_threads(2, worker))


# ---------------------------------------------------------------- under the launcher
def _dist_job(tmp_path, name, options):
    from test_distributed import _launch

    out = tmp_path / name
    proc = _launch(2, 2, [sys.executable, "tests/dist_job.py", "--out", str(out), "--kvstore",
                          "slimgc", "--compressor", "2bit", "--comm-threshold", "0",
                          "--steps", "6"], 240, options)
    ranks = [json.loads((out / ("rank%d.json" % r)).read_text()) for r in range(2)]
    weights = [dict(np.load(out / ("weights_rank%d.npz" % r))) for r in range(2)]
    return proc, ranks, weights


@pytest.mark.parametrize("forced", [False, True])
@pytest.mark.slow
def test_auto_on_servers_without_the_server_environment(tmp_path, forced):
    """Servers started without the launcher's environment may sum float64 in float32
    (forced: a 0xfe-filled heap makes every server do so): lane_dtype=auto finishes
    anyway, the workers agree, and a switch warns once."""
    options = ["--no-server-env", "--env", "SLIMGC_LANE_DTYPE:auto"]
    if forced:
        options += ["--env-server", "MALLOC_PERTURB_:1"]
    proc, info, _ = _dist_job(tmp_path, "auto", options)
    assert info[0]["sha256"] == info[1]["sha256"]
    assert info[0]["lanes32"] == info[1]["lanes32"]
    assert info[0]["lanes32"] or not forced
    assert info[0]["allgather_exact"] and info[1]["allgather_exact"]  # hashes, votes
    warned = (proc.stdout + proc.stderr).count("lanes travel as float32")
    assert warned == (1 if info[0]["lanes32"] else 0)


# test_float32_lanes_equal_float64_lanes_on_exact_servers: in test_distributed.py (shared job)
