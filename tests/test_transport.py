"""The dist transport's pieces: bounds, shared memory, wire keys and the order of transfers."""
import mxnet as mx
import numpy as np
import pytest

from slimgc_mx.mxnet.buffers import Buffer
from slimgc_mx.mxnet.dist import DistTransport, engine_threads_warning
from slimgc_mx.transport import keys, piece_bounds


@pytest.mark.parametrize("size, itemsize, piece_bytes", [
    (1000, 8, 800), (1000, 8, 808), (1000, 4, 4000), (7, 8, 8), (262144, 8, 1 << 20)])
def test_piece_bounds_cover_the_buffer_in_order(size, itemsize, piece_bytes):
    bounds = piece_bounds(size, itemsize, piece_bytes)
    per = piece_bytes // itemsize
    if size <= per:
        assert bounds is None
        return
    assert bounds[0][0] == 0 and bounds[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous, no gap
    assert all(0 < hi - lo <= per for lo, hi in bounds)
    assert len(bounds) == -(-size // per)


def test_no_pieces_when_off_or_small():
    assert piece_bounds(10 ** 6, 4, 0) is None
    assert piece_bounds(100, 8, 800) is None


def test_pieces_share_the_buffers_memory_both_ways():
    buf = Buffer((10,), np.float64)
    bounds = [(0, 4), (4, 8), (8, 10)]
    pieces = buf.pieces(bounds)
    assert buf.pieces(bounds) is pieces  # made once
    buf.for_write()[:] = np.arange(10)
    assert [p.asnumpy().tolist() for p in pieces] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    mx.nd.full((2,), 7.0, dtype=np.float64).copyto(pieces[2])  # an engine write into a piece
    pieces[2].wait_to_read()
    np.testing.assert_array_equal(buf.for_read(), [0, 1, 2, 3, 4, 5, 6, 7, 7, 7])
    view = buf.view(2, (6,))
    np.testing.assert_array_equal(view.pieces([(0, 3)])[0].asnumpy(), [2, 3, 4])


class _RecordingKV:
    """Stands in for MXNet's dist kvstore: sums one worker's pushes, records every call."""

    def __init__(self):
        self.calls = []
        self.store = {}

    def init(self, keys, values):
        keys, values = (keys, values) if isinstance(keys, list) else ([keys], [values])
        for k, v in zip(keys, values):
            self.calls.append(("init", k, v.size))
            self.store[k] = v.asnumpy()

    def push(self, key, value, priority=0):
        self.calls.append(("push", key, value.size))
        self.store[key] = value.asnumpy()

    def pull(self, keys, out, priority=0):
        keys, out = (keys, out) if isinstance(keys, list) else ([keys], [out])
        for k, o in zip(keys, out):
            self.calls.append(("pull", k, o.size))
            o[:] = self.store[k]


def _transport(piece_bytes):
    t = DistTransport.__new__(DistTransport)  # no cluster: only the piece logic runs
    t._kv, t.piece_bytes, t.timeout, t._pieces = _RecordingKV(), piece_bytes, None, {}
    return t


def test_a_large_buffer_travels_as_pieces_with_their_own_wire_keys():
    t = _transport(piece_bytes=80)  # 10 float64 lanes per piece
    send, recv = Buffer((25,), np.float64), Buffer((25,), np.float64)
    small = Buffer((10,), np.float64)
    send.for_write()[:] = np.arange(25) * 2.0 ** 40  # lanes only float64 holds exactly
    t.declare(7, send)
    t.declare(10, small)  # fits one piece: declared whole, under its own key
    assert t.pieces_declared == 3
    base = keys.PIECE_BASE
    assert [c for c in t._kv.calls if c[0] == "init"] == [
        ("init", base, 10), ("init", base + 1, 10), ("init", base + 2, 5), ("init", 10, 10)]
    t._kv.calls.clear()
    t.push_pull(7, send, recv).wait()
    # each piece is pulled right after its push, so early sums return while later pieces go
    assert t._kv.calls == [("push", base, 10), ("pull", base, 10), ("push", base + 1, 10),
                           ("pull", base + 1, 10), ("push", base + 2, 5),
                           ("pull", base + 2, 5)]
    np.testing.assert_array_equal(recv.for_read(), np.arange(25) * 2.0 ** 40)
    out = Buffer((25,), np.float64)
    t.broadcast(7, out)
    np.testing.assert_array_equal(out.for_read(), np.arange(25) * 2.0 ** 40)


def test_piece_keys_are_bounded_and_cannot_be_declared_directly(monkeypatch):
    t = _transport(piece_bytes=8)
    with pytest.raises(ValueError, match="collides with control or piece keys"):
        t.declare(keys.PIECE_BASE + 3, Buffer((4,), np.float64))
    monkeypatch.setattr(keys, "PIECE_END", keys.PIECE_BASE + 5)
    t.declare(1, Buffer((4,), np.float64))
    with pytest.raises(ValueError, match=r"raise piece_bytes \(SLIMGC_PIECE_BYTES\) or set it to 0"):
        t.declare(2, Buffer((4,), np.float64))


def test_one_engine_thread_is_warned_about_with_the_fix():
    for environ in ({}, {"MXNET_CPU_WORKER_NTHREADS": "1"}, {"MXNET_CPU_WORKER_NTHREADS": "x"}):
        assert "start workers with MXNET_CPU_WORKER_NTHREADS=2" in engine_threads_warning(environ)
    assert engine_threads_warning({"MXNET_CPU_WORKER_NTHREADS": "2"}) is None


def test_a_second_dist_store_in_one_process_is_refused(monkeypatch):
    """MXNet's dist kvstore exists once per process: a second one would hang."""
    from slimgc_mx.mxnet import dist
    live = _transport(piece_bytes=0)  # stands in for the first store's transport
    monkeypatch.setattr(dist, "_LIVE", {live})
    with pytest.raises(RuntimeError, match="already has a SlimGC store on MXNet's dist kvstore"):
        DistTransport()
