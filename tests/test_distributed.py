"""Multi-process jobs through the launcher on MXNet's own dist_sync (scheduler, servers, workers)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from slimgc_mx.mxnet.dist import BIGARRAY_BOUND

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.multiprocess


def _launch(workers, servers, command, timeout, options=()):
    argv = [sys.executable, "-m", "slimgc_mx.launch", "-n", str(workers), "-s", str(servers),
            "--launcher", "local"] + list(options) + ["--"] + command
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def _job(tmp_path, name, *args, options=()):
    out = tmp_path / name
    _launch(2, 2, [sys.executable, "tests/dist_job.py", "--out", str(out)] + list(args), 180,
            options)
    return _read(out)


def _read(out):
    """Each rank's summary and weights, as a finished tests/dist_job.py wrote them in `out`."""
    ranks = [json.loads((out / ("rank%d.json" % r)).read_text()) for r in range(2)]
    weights = [dict(np.load(out / ("weights_rank%d.npz" % r))) for r in range(2)]
    return ranks, weights


def _lanes_command(out, steps):
    """A 2bit job compressing every tensor that saves each transfer's sent and summed lanes."""
    return [sys.executable, "tests/dist_job.py", "--out", str(out), "--compressor", "2bit",
            "--comm-threshold", "off", "--steps", str(steps), "--record-lanes"]


@pytest.fixture(scope="module")
def dist_sync_weights(tmp_path_factory):
    """The weights of MXNet's own dist_sync on the job, once for the tests that compare."""
    return _job(tmp_path_factory.mktemp("ref"), "dist_sync", "--kvstore", "dist_sync",
                "--steps", "20")[1]


@pytest.mark.parametrize("piece_bytes", [None, 1024])
def test_none_without_backup_follows_mxnet_dist_sync(tmp_path, piece_bytes, dist_sync_weights):
    # With 1 KiB pieces the 8 KiB weight, its fused bucket and the broadcast of the initial
    # weights all travel as pieces under their own wire keys.
    ref = dist_sync_weights
    options = [] if piece_bytes is None else ["--env", "SLIMGC_PIECE_BYTES:%d" % piece_bytes]
    info, ours = _job(tmp_path, "slimgc", "--kvstore", "slimgc", "--compressor", "none",
                      "--no-backup", "--steps", "20", options=options)
    assert info[0]["sha256"] == info[1]["sha256"]
    assert info[0]["bigarray_bound"] == BIGARRAY_BOUND  # set before MXNet's kvstore read it
    for name in ref[0]:
        np.testing.assert_allclose(ours[0][name], ref[0][name], rtol=0, atol=1e-5)
    # from step 2 on, the 4 tensors travel as one fused bucket per server
    stats = info[0]["stats"]
    assert (stats["fused_keys"], stats["fused_buckets"]) == (4, 2)
    assert stats["transfers"] == 4 + 2 * 19
    # none of these buffers reaches the default 1 MiB; at 1 KiB the 64x32 weight alone
    # (fp route and broadcast, 8 KiB each) makes 16 pieces
    assert (stats["wire_pieces"] == 0) if piece_bytes is None else stats["wire_pieces"] >= 16


def test_2bit_backup_workers_agree_and_cttab_decides(tmp_path):
    # (the 'measured' rule: under 'fit' a model this small, every tensor under 64 KiB,
    # decides at once with no warm-up, cttab.CTTab.foregone)
    info, weights = _job(tmp_path, "slimgc2bit", "--kvstore", "slimgc", "--compressor", "2bit",
                         "--steps", "12", options=["--env", "SLIMGC_CTTAB_RULE:measured"])
    assert info[0]["sha256"] == info[1]["sha256"]
    for name in weights[0]:
        np.testing.assert_array_equal(weights[0][name], weights[1][name])
    stats = info[0]["stats"]
    assert stats["comm_threshold_phase"] == "trained"
    assert len(stats["cttab"]) >= 2  # sizes measured in the warm-up
    assert stats["bytes_fp32"] > 0


def _streamed_job(out, stream):
    """2bit in 128-byte pieces, streamed ('1') or not ('0'), 8 steps, lanes recorded."""
    _launch(2, 2, _lanes_command(out, 8), 180,
            ["--env", "SLIMGC_PIECE_BYTES:128", "--env", "SLIMGC_STREAM:" + stream])
    return out


@pytest.fixture(scope="module")
def streamed_pieces_job(tmp_path_factory):
    """The streamed run: test_streamed_pieces_give_the_weights_of_whole_pushes reads its
    weights, test_servers_sum_packed_lanes_exactly[None-128] its lanes. Recording copies
    each piece in an engine operator after its writer: nothing waits, pieces still stream."""
    return _streamed_job(tmp_path_factory.mktemp("streamed") / "lanes", "1")


def test_streamed_pieces_give_the_weights_of_whole_pushes(tmp_path, streamed_pieces_job):
    """2bit in 128-byte pieces, each pushed as soon as the local update's operator has
    encoded it, trains bitwise as the same pieces pushed after the whole key is encoded."""
    runs = {"1": _read(streamed_pieces_job), "0": _read(_streamed_job(tmp_path / "whole", "0"))}
    (streamed, w_streamed), (whole, w_whole) = runs["1"], runs["0"]
    assert streamed[0]["stats"]["streamed_transfers"] == 2 * 8  # both weights, every step
    assert whole[0]["stats"]["streamed_transfers"] == 0
    for rank in range(2):
        assert streamed[rank]["sha256"] == whole[rank]["sha256"]
        for name in w_whole[rank]:
            np.testing.assert_array_equal(w_streamed[rank][name], w_whole[rank][name])


@pytest.fixture(scope="module")
def exact_lanes_job(tmp_path_factory):
    """The lanes job with the default placement and lane dtype (float64 lanes on the
    launcher's exact servers): test_servers_sum_packed_lanes_exactly[None-None] reads its
    lanes, test_float32_lanes_equal_float64_lanes_on_exact_servers its weights as the
    float64 run. Recording lanes only copies them, so the weights are the job's own."""
    out = tmp_path_factory.mktemp("exact") / "lanes"
    _launch(2, 2, _lanes_command(out, 6), 180)
    return out


@pytest.mark.parametrize("bound, piece_bytes", [(None, None), (32, None), (None, 128)])
def test_servers_sum_packed_lanes_exactly(tmp_path, request, bound, piece_bytes):
    # The server's float64 sum of the workers' lanes must be exact: a float32 sum (MXNet 1.9.1
    # servers whose multi_precision_ flag starts set) changes the decoded levels silently.
    # With a bound of 32 elements MXNet splits the first layer's ~94 lanes over both servers
    # and sends the second layer's ~30 whole; with 128-byte pieces every layer's lanes go as
    # pieces of 16 lanes on alternating servers: every placement must sum exactly.
    steps = 6
    if (bound, piece_bytes) == (None, None):
        out = request.getfixturevalue("exact_lanes_job")
    elif (bound, piece_bytes) == (None, 128):  # streamed, as by default; 8 steps
        out, steps = request.getfixturevalue("streamed_pieces_job"), 8
    else:
        out = tmp_path / "lanes"
        options = [] if bound is None else ["--env", "MXNET_KVSTORE_BIGARRAY_BOUND:%d" % bound]
        if piece_bytes is not None:
            options += ["--env", "SLIMGC_PIECE_BYTES:%d" % piece_bytes]
        _launch(2, 2, _lanes_command(out, steps), 180, options)
    info = [json.loads((out / ("rank%d.json" % r)).read_text()) for r in range(2)]
    assert [i["bigarray_bound"] for i in info] == [bound or BIGARRAY_BOUND] * 2
    assert info[0]["sha256"] == info[1]["sha256"]
    assert (info[0]["stats"]["wire_pieces"] > 0) == (piece_bytes is not None)
    # in pieces, the local update encodes each piece in an operator of its own (streamed)
    assert (info[0]["stats"]["streamed_transfers"] > 0) == (piece_bytes is not None)
    lanes = [dict(np.load(out / ("lanes_rank%d.npz" % r))) for r in range(2)]
    sums = [name for name in lanes[0] if name.startswith("sum_")]
    assert len(sums) >= 2 * steps  # both weight tensors, every step
    largest = 0
    for name in sums:
        sent = lanes[0]["send_" + name[4:]] + lanes[1]["send_" + name[4:]]
        largest = max(largest, sent.max())
        np.testing.assert_array_equal(lanes[0][name], sent, err_msg=name)
        np.testing.assert_array_equal(lanes[1][name], sent, err_msg=name)
    assert largest > 2 ** 40  # lanes that a float32 sum would have rounded


@pytest.mark.slow
def test_float32_lanes_equal_float64_lanes_on_exact_servers(tmp_path, exact_lanes_job):
    # The float64 run is the lanes job: lane_dtype auto keeps float64 lanes on exact servers
    # (lanes32 False below); the float32 run differs from it in the lane dtype alone.
    out = tmp_path / "f32"
    _launch(2, 2, _lanes_command(out, 6), 240, ["--env", "SLIMGC_LANE_DTYPE:float32"])
    (i64, w64), (i32, w32) = _read(exact_lanes_job), _read(out)
    assert (i64[0]["lanes32"], i32[0]["lanes32"]) == (False, True)
    assert i64[0]["sha256"] == i64[1]["sha256"] == i32[0]["sha256"] == i32[1]["sha256"]
    for name in w64[0]:
        assert np.array_equal(w64[0][name], w32[0][name])
    assert i32[0]["stats"]["bytes_pushed"] > i64[0]["stats"]["bytes_pushed"] * 1.05


def test_servers_that_sum_float64_in_float32_stop_the_job_with_the_fix(tmp_path):
    # A zero-filled heap is what keeps the flag false; a 0xfe-filled one sets it on every server.
    argv = [sys.executable, "-m", "slimgc_mx.launch", "-n", "2", "-s", "2", "--launcher", "local",
            "--env-server", "MALLOC_PERTURB_:1", "--env", "SLIMGC_LANE_DTYPE:float64",
            "--", sys.executable, "tests/dist_job.py",
            "--out", str(tmp_path / "lossy"), "--compressor", "2bit", "--steps", "2"]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "ServerPrecisionError: 2 of 2 parameter servers sum float64 arrays in float32" \
        in proc.stderr
    assert "MALLOC_PERTURB_=255 GLIBC_TUNABLES=glibc.malloc.tcache_count=0" in proc.stderr
    assert not (tmp_path / "lossy" / "rank0.json").exists()


@pytest.mark.slow
def test_train_script_mnist1d_cnn_2bit_backup_reaches_90_percent(tmp_path, monkeypatch,
                                                                 mnist1d_dir):
    monkeypatch.setenv("SLIMGC_DATA_DIR", mnist1d_dir)  # generated once, not by each worker
    out = tmp_path / "train"
    # A fixed threshold of 1000 elements: on loopback the CTTab would (rightly) find that
    # compression does not pay for this small model, and 2bit would never be exercised.
    # train.py pushes batch-sum gradients; t=0.1 trains this CNN further than t=0.5 in
    # 10 epochs (docs/training.md).
    _launch(2, 2, [sys.executable, "scripts/train.py", "--kvstore", "slimgc", "--compressor",
                   "2bit", "--threshold", "0.1", "--comm-threshold", "4000", "--model", "cnn1d",
                   "--dataset",
                   "mnist1d", "--epochs", "10", "--no-progress", "--json",
                   str(out / "result.json")], 900)
    results = [json.loads((out / ("result.rank%d.json" % r)).read_text()) for r in range(2)]
    assert results[0]["final_test_acc"] >= 0.90, results[0]["history"]
    assert results[0]["weights_sha256"] == results[1]["weights_sha256"]
    stats = results[0]["kvstore_stats"]
    assert stats["comm_threshold_bytes"] == 4000
    assert stats["bytes_pushed"] < 0.2 * stats["bytes_fp32"]  # the large tensors went as 2bit
