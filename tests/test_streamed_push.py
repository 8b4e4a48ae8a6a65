"""A streamed push: a large 2bit key encoded piece by piece by the local update's operators,
each piece pushed as soon as it is encoded. The oracle is the same key encoded whole."""
import mxnet as mx
import numpy as np
import pytest

import training_helpers as th
from slimgc_mx import codecs
from slimgc_mx.codecs.base import kernels
from slimgc_mx.engine.grad_buf import FusedEncode, GradCheck, KeyBuffers, nonfinite_sender, \
    stream_pieces
from slimgc_mx.engine.offload import NonFiniteAggregateError, PipelineError
from slimgc_mx.mxnet.buffers import Buffer
from slimgc_mx.transport import piece_bounds

LR, WD, RESCALE, MOMENTUM, CLIP = 0.05, 1e-3, 0.25, 0.9, -1.0


def _encode(size, workers, piece_bytes, grad, weight, mom, residual, rank=1):
    """(lanes, residual, local output, GradCheck) of one fused encode, in pieces when
    piece_bytes makes any."""
    codec = codecs.create("2bit", threshold=0.3)
    b = KeyBuffers(0, (size,), codec, workers, Buffer)
    b.residual.for_write()[:] = residual
    send = b.rounds[0].send
    bounds = piece_bounds(send.nbytes // 8, 8, piece_bytes)
    pieces = None if bounds is None else stream_pieces(codec, size, send, bounds, workers)
    check = GradCheck()
    encoder = FusedEncode(b, send, workers, rank, check, pieces)
    g = th.buffer_of(grad)
    out = np.full(size, np.nan, np.float32)
    for piece in pieces or [None]:
        part = slice(0, size) if piece is None else slice(piece.lo, piece.hi)
        local = kernels().LocalSGD(weight[part], mom[part], out[part], LR, WD, RESCALE,
                                   MOMENTUM, CLIP)
        encoder(g, local, piece)
    return send.for_read().copy(), b.residual.for_read().copy(), out, check, pieces


@pytest.mark.parametrize("size, workers", [(5000, 2), (4999, 3), (1000, 2)])
def test_pieces_encode_bitwise_the_whole_key(size, workers):
    rng = np.random.RandomState(size)
    grad, weight, mom = (rng.randn(size).astype(np.float32) for _ in range(3))
    residual = (rng.randn(size) * 0.1).astype(np.float32)
    whole = _encode(size, workers, 0, grad, weight, mom, residual)
    streamed = _encode(size, workers, 64, grad, weight, mom, residual)
    pieces = streamed[4]
    assert len(pieces) > 1
    assert pieces[0].lo == 0 and pieces[-1].hi == size
    assert all(a.hi == b.lo for a, b in zip(pieces, pieces[1:]))  # every element once
    for a, b in zip(whole[:3], streamed[:3]):
        np.testing.assert_array_equal(a, b)
    assert whole[3].nonfinite == streamed[3].nonfinite == 0


def test_a_nan_in_one_piece_marks_that_piece_with_the_sender():
    size, workers = 5000, 2
    rng = np.random.RandomState(0)
    grad, weight, mom = (rng.randn(size).astype(np.float32) for _ in range(3))
    grad[3000] = np.nan
    lanes, _, _, check, pieces = _encode(size, workers, 64, grad, weight, mom,
                                         np.zeros(size, np.float32), rank=1)
    bad = [p for p in pieces if p.lo <= 3000 < p.hi]
    assert check.nonfinite == 1
    assert np.isnan(lanes[bad[0].lanes]).all()
    assert nonfinite_sender(lanes, workers) == 1
    assert np.isfinite(np.delete(lanes, np.arange(len(lanes))[bad[0].lanes])).all()


def test_codecs_whose_lanes_depend_on_the_whole_key_are_not_streamed():
    for name in ("1bit", "4bit", "terngrad", "qsgd", "thc"):
        codec = codecs.create(name)
        lanes = codec.lane_count(5000, 2)
        assert codec.piece_elements(5000, 2, [(0, 8), (8, lanes)]) is None, name
    two = codecs.create("2bit")
    with pytest.raises(ValueError, match="lane ranges end at 8"):
        two.piece_elements(5000, 2, [(0, 8)])


def test_training_is_bitwise_that_of_whole_pushes():
    """Two workers with backup: the 32x12 weight's 2bit lanes go as 64-byte pieces, each
    pushed once its operator has encoded it; weights equal those of whole pushes."""
    run = dict(compressor="2bit", threshold=0.01, comm_threshold=256, warmup_steps=2)
    make = lambda: th.dense_net((32, 4), 0)  # noqa: E731
    streamed = th.slimgc_workers(2, make, th.batches(12), piece_bytes=64, **run)
    whole = th.slimgc_workers(2, make, th.batches(12), piece_bytes=64, stream=False, **run)
    for (w_streamed, s), (w_whole, s_whole) in zip(streamed, whole):
        assert s["streamed_transfers"] > 0 and s_whole["streamed_transfers"] == 0
        assert s["compressed_transfers"] == s_whole["compressed_transfers"]
        for a, b in zip(w_streamed, w_whole):
            np.testing.assert_array_equal(a, b)


def _failing_step(make_bad, size=3000, piece_bytes=128):
    """Two workers stream a key; at step 1 worker 1's gradient goes through make_bad(kv,
    grad). Per worker: (the error of its next call, glo_buf before, glo_buf after)."""

    def worker(rank, transport):
        kv, w = th.compressed_sgd_store(transport, size)
        grad = np.linspace(-1, 1, size).astype(np.float32) * (rank + 1)
        kv.pushpull(0, mx.nd.array(grad), out=w)
        kv._agg.pipeline.wait_idle(30)
        assert kv.stats()["streamed_transfers"] == 1
        before = kv._agg.backup.glo_buf(0).asnumpy()
        if rank == 1:
            grad = make_bad(kv, grad)
        kv.pushpull(0, mx.nd.array(grad), out=w)
        with pytest.raises(PipelineError) as info:
            kv.pushpull(0, mx.nd.array(grad), out=w)
        after = kv._agg.backup.glo_buf(0).asnumpy()
        kv.close()
        return info.value, before, after

    return th.in_threads(2, worker, piece_bytes=piece_bytes)


def test_a_nan_in_one_piece_fails_every_worker_without_updating():
    def nan(kv, grad):
        grad = grad.copy()
        grad[2000] = np.nan  # in one piece of many
        return grad

    for err, before, after in _failing_step(nan):
        assert isinstance(err.__cause__, NonFiniteAggregateError)
        assert "sent by worker rank 1" in str(err)
        np.testing.assert_array_equal(before, after)


def test_an_error_in_one_pieces_operator_fails_every_worker_without_updating():
    """Worker 1's encoder fails on one piece: it raises that error; the piece goes out as
    NaN naming it, so worker 0 fails too instead of summing what was never encoded."""
    def broken(kv, grad):
        codec = kv._agg.planner.keys[0].codec
        encode = codec.encode

        def fails_once(g, *args, **kw):
            if len(g) < len(grad) and not broken.failed:
                broken.failed = True
                raise RuntimeError("encoder broke (injected)")
            return encode(g, *args, **kw)
        codec.encode = fails_once
        return grad

    broken.failed = False
    (err0, before0, after0), (err1, before1, after1) = _failing_step(broken)
    assert isinstance(err0.__cause__, NonFiniteAggregateError)
    assert "sent by worker rank 1" in str(err0)
    assert "injected" in str(err1.__cause__)
    np.testing.assert_array_equal(before0, after0)
    np.testing.assert_array_equal(before1, after1)


def test_the_trace_shows_each_pieces_encode_before_its_transfer_ends(tmp_path):
    import json
    from slimgc_mx import trace

    path = str(tmp_path / "run.json")
    results = th.slimgc_workers(2, lambda: th.dense_net((32, 4), 0), th.batches(6),
                                piece_bytes=64, compressor="2bit", comm_threshold="off",
                                warmup_steps=2, trace=path)
    streamed = results[0][1]["streamed_transfers"]
    assert streamed > 0
    with open(trace.rank_path(path, 0)) as f:
        events = json.load(f)["traceEvents"]
    rows = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    spans = [e for e in events if e["ph"] == "X"]
    pieces = [e for e in spans if e["name"] == "encode" and "piece" in e["args"]]
    assert {rows[e["tid"]] for e in pieces} == {"mxnet-engine"}
    ends = {(e["args"]["key"], e["args"]["step"]): e["ts"] + e["dur"] for e in spans
            if e["name"] == "transfer"}
    by_push = {}
    for e in pieces:
        by_push.setdefault((e["args"]["key"], e["args"]["step"]), []).append(e)
    assert len(by_push) == streamed
    for push, encodes in by_push.items():
        assert sorted(e["args"]["piece"] for e in encodes) == list(range(len(encodes)))
        assert len(encodes) > 1
        assert max(e["ts"] + e["dur"] for e in encodes) <= ends[push]
