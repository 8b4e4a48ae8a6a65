"""MXNet's own dist_sync kvstore underneath: stock servers sum what the workers push."""
import logging
import sys
import threading
import weakref

import mxnet as mx
import numpy as np

from .. import env
from ..transport.base import (PiecesHandle, TransferHandle, Transport, piece_bounds,
                              wait_readable)
from ..transport.keys import FUSED_BASE, PER_KEY_LIMIT, PIECE_BASE, WireKeyError

log = logging.getLogger(__name__)


def split_bits(values):
    """float64 values -> 3 float64 integers each (22 bits of the value's 64), exact even
    where a server rounds them to float32."""
    bits = np.ascontiguousarray(values, dtype=np.float64).view(np.uint64)
    parts = [(bits >> np.uint64(shift)) & np.uint64(0x3FFFFF) for shift in (0, 22, 44)]
    return np.stack(parts, axis=-1).reshape(-1).astype(np.float64)


def join_bits(parts):
    """The inverse of split_bits, row by row: (rows, 3n) -> (rows, n) float64."""
    rows = np.asarray(parts).reshape(len(parts), -1, 3).astype(np.uint64)
    bits = rows[..., 0] | (rows[..., 1] << np.uint64(22)) | (rows[..., 2] << np.uint64(44))
    return bits.view(np.float64)


class ServerPrecisionError(RuntimeError):
    """A parameter server sums float64 arrays in float32, which would corrupt packed lanes."""


# MXNet splits an array evenly over all servers only from MXNET_KVSTORE_BIGARRAY_BOUND
# elements on (default 10**6); smaller ones go whole to server (key * 9973) % S. A float64
# lane packs about 20 gradient elements, so at that default no compressed key is ever
# split, and the wire keys 3 * index + 1 of same-parity indices all land on one server
# (with 2 servers, every weight of a Dense stack). Unless the user set the variable, the
# dist transport lowers the bound to 2 MB of lanes (1 MB of float32).
BIGARRAY_BOUND = 1 << 18


def _rows(buf):
    """(rows, columns) of a gather buffer: its first dimension, and the rest flattened."""
    shape = tuple(buf.nd.shape)
    return (shape[0], int(np.prod(shape[1:]))) if len(shape) > 1 else (shape[0], 1)


def probe_values(rank):
    """What worker `rank` pushes in the precision probe: integers float32 cannot hold."""
    return np.array([2.0 ** 48 + 2 * rank + 1, 2.0 ** 30 + rank, 1.0], dtype=np.float64)


def engine_threads_warning(environ):
    """A warning when MXNet's engine has one CPU worker thread (its default), else None.

    Then the kvstore's push and pull operators, and SlimGC's copies, wait behind every
    forward and backward operator queued before them, and pieces cannot overlap.
    """
    if env.engine_threads(environ) >= 2:
        return None
    var = env.ENGINE_THREADS_VAR
    return ("%s=%s: MXNet's engine has one CPU worker thread, so transfers wait behind "
            "compute; start workers with %s=%d (python -m slimgc_mx.launch does)"
            % (var, env.value(var, "1", environ), var, env.WORKER_ENGINE_THREADS))


_LIVE = weakref.WeakSet()  # DistTransports whose MXNet kvstore is not released


class DistTransport(Transport):
    """MXNet's native dist_sync kvstore: stock servers sum what the workers push."""

    kind = "dist_sync"

    def __init__(self, timeout=None, piece_bytes=0, environ=None):
        live = [t for t in _LIVE if t._kv is not None]
        if live:
            raise RuntimeError(
                "this process already has a SlimGC store on MXNet's dist kvstore, which exists "
                "once per process; create one store and pass the object (e.g. Module.fit("
                "kvstore=kv)) instead of creating another by name")
        _LIVE.add(self)
        # Read by MXNet when the kvstore is created; a value the user set stays.
        self.bigarray_bound = env.bigarray_bound(BIGARRAY_BOUND, environ)
        self._kv = mx.kv.create("dist_sync")
        self.rank = self._kv.rank
        self.num_workers = self._kv.num_workers
        self.num_servers = env.num_servers(environ)
        self.timeout = timeout
        self.piece_bytes = piece_bytes
        index = env.launch_index(environ)
        if index is not None:  # the launcher labels this worker's lines with its rank
            sys.stderr.write(env.RANK_MARKER % (index, self.rank, self.num_workers) + "\n")
            sys.stderr.flush()
        warning = engine_threads_warning(environ)
        if warning and self.rank == 0:
            log.warning("slimgc: %s", warning)
        self._gather_keys = {}
        self._pieces = {}  # wire key -> (piece wire keys, element bounds)
        self._gathers = {}  # wire key of a gather -> (own rows, all rows, shape)

    def declare(self, wire_key, buf):
        if not (0 <= wire_key < PER_KEY_LIMIT or FUSED_BASE <= wire_key < PIECE_BASE):
            raise WireKeyError("wire key %d collides with control or piece keys" % wire_key)
        bounds = piece_bounds(buf.nd.size, np.dtype(buf.nd.dtype).itemsize, self.piece_bytes)
        if bounds is None:
            self._kv.init(wire_key, buf.nd)
            return
        keys = self.keys.pieces(len(bounds), "%d pieces of %d bytes: raise piece_bytes "
                                "(SLIMGC_PIECE_BYTES) or set it to 0 to send buffers whole"
                                % (len(bounds), self.piece_bytes))
        buf.for_read()  # the pieces' engine variables do not see pending writes of buf.nd
        self._kv.init(keys, buf.pieces(bounds))
        self._pieces[wire_key] = (keys, bounds)

    def pieces(self, wire_key):
        split = self._pieces.get(wire_key)
        return None if split is None else split[1]

    def push_pull(self, wire_key, send, recv, priority=0, in_pieces=False):
        split = self._pieces.get(wire_key)
        if split is None:
            self._kv.push(wire_key, send.nd, priority=priority)
            self._kv.pull(wire_key, out=recv.nd, priority=priority)
            return TransferHandle(recv)
        keys, bounds = split
        # MXNet pulls each sum into the pushed array itself before copying it to `recv`,
        # so both buffers are written: wait for the engine's pending access to either
        # (in_pieces: the engine orders each piece's push after its writer instead).
        if not in_pieces:
            send.for_write()
        recv.for_write()
        sends, recvs = send.pieces(bounds), recv.pieces(bounds)
        for key, s, r in zip(keys, sends, recvs):
            self._kv.push(key, s, priority=priority)
            self._kv.pull(key, out=r, priority=priority)
        return PiecesHandle(recv, recvs)

    def declare_gather(self, wire_key, send, recv):
        """A row_sparse key of N slots of send's rows, every row present from the start.

        The servers merge row_sparse pushes by row: the workers' disjoint slots are put
        side by side, so a pull of every row returns every worker's slot (an allgather on
        stock servers; every worker must push its whole slot every round)."""
        if not (0 <= wire_key < PER_KEY_LIMIT or FUSED_BASE <= wire_key < PIECE_BASE):
            raise WireKeyError("wire key %d collides with control or piece keys" % wire_key)
        rows, cols = _rows(send)
        total = rows * self.num_workers
        if _rows(recv) != (total, cols):
            raise ValueError("gather: the receive buffer holds %s rows x cols, not %d x %d"
                             % (_rows(recv), total, cols))
        every = mx.nd.arange(total, dtype=np.int64)
        zeros = mx.nd.zeros((total, cols), dtype=send.nd.dtype)
        self._kv.init(wire_key, mx.nd.sparse.row_sparse_array((zeros, every),
                                                              shape=(total, cols)))
        mine = mx.nd.arange(self.rank * rows, (self.rank + 1) * rows, dtype=np.int64)
        self._gathers[wire_key] = (mine, every, (total, cols))

    def gather(self, wire_key, send, recv, priority=0):
        """Push this worker's whole slot (copied: `send` may be written again), pull every
        row into `recv` by an engine operator, so that nothing waits for the round here."""
        mine, every, shape = self._gathers[wire_key]
        data = send.nd.reshape(-1, shape[1])
        self._kv.push(wire_key, mx.nd.sparse.row_sparse_array((data, mine), shape=shape),
                      priority=priority)
        pulled = mx.nd.sparse.zeros("row_sparse", shape, dtype=send.nd.dtype)
        self._kv.row_sparse_pull(wire_key, out=pulled, row_ids=every, priority=priority)
        mx.nd.cast_storage(pulled, stype="default", out=recv.nd.reshape(shape))
        return TransferHandle(recv)

    def broadcast(self, wire_key, buf):
        split = self._pieces.get(wire_key)
        if split is None:
            self._kv.pull(wire_key, out=buf.nd)
            wait_readable(buf.nd, self.timeout)
            return
        keys, bounds = split
        buf.for_write()
        pieces = buf.pieces(bounds)
        self._kv.pull(keys, out=pieces)
        wait_readable(pieces, self.timeout)

    def allgather(self, values):
        """Every worker's float64 `values`, bit for bit, also through servers that sum
        float64 in float32: each value travels as three 22-bit integers of its bits."""
        values = np.asarray(values, dtype=np.float64).ravel()
        n = values.size
        key = self._gather_keys.get(n)
        if key is None:
            key = self._gather_keys[n] = self.keys.control()
            self._kv.init(key, mx.nd.zeros((self.num_workers, 3 * n), dtype=np.float64))
        slots = np.zeros((self.num_workers, 3 * n), dtype=np.float64)
        slots[self.rank] = split_bits(values)
        send = mx.nd.array(slots, dtype=np.float64)
        recv = mx.nd.zeros((self.num_workers, 3 * n), dtype=np.float64)
        self._kv.push(key, send)
        self._kv.pull(key, out=recv)
        wait_readable(recv, self.timeout)
        return join_bits(recv.asnumpy())

    def check_exact_sums(self):
        """Raise ServerPrecisionError when lossy_servers() finds a server summing float64
        in float32."""
        lossy = self.lossy_servers()
        if lossy:
            raise ServerPrecisionError(
                "%d of %d parameter servers sum float64 arrays in float32: MXNet 1.9.1's "
                "KVStoreDistServer leaves its multi_precision_ flag uninitialized, and SlimGC's "
                "packed lanes would be silently corrupted. Start the servers with %s in "
                "their environment (python -m slimgc_mx.launch does so), set lane_dtype=auto "
                "or float32 (lanes that any server sums exactly, more bytes), or train with "
                "compressor 'none'." % (lossy, self.num_servers, env.SERVER_ENV_TEXT))

    def lossy_servers(self):
        """Push float64 integers through every server and count the servers whose sums
        differ from the exact ones.

        MXNet 1.9.1's server leaves its multi_precision_ flag uninitialized; a server that
        starts with it set sums float64 in float32 (docs/launcher.md). Small keys
        go to server (key * 9973) % S, so S consecutive keys reach all S servers.
        """
        servers = self.num_servers
        keys = [self.keys.probe(i) for i in range(servers)]
        mine = probe_values(self.rank)
        self._kv.init(keys, [mx.nd.zeros(mine.shape, dtype=np.float64) for _ in keys])
        sums = [mx.nd.zeros(mine.shape, dtype=np.float64) for _ in keys]
        for key, out in zip(keys, sums):
            self._kv.push(key, mx.nd.array(mine, dtype=np.float64))
            self._kv.pull(key, out=out)
        expected = sum(probe_values(r) for r in range(self.num_workers))
        lossy = 0
        for out in sums:
            wait_readable(out, self.timeout)
            lossy += int(not np.array_equal(out.asnumpy(), expected))
        return lossy

    def close(self, timeout=None):
        """Finalize MXNet's kvstore (a barrier with every node); False if not done in `timeout`.

        The release runs on a helper thread so that a finalize that never returns (a
        lost peer, or a transfer left pending) cannot hold the process forever.
        """
        if self._kv is None:
            return True
        holder = [self._kv]
        self._kv = None
        done = threading.Event()

        def release():
            holder.pop()  # the last reference: MXNet's kvstore destructor runs here
            done.set()

        threading.Thread(target=release, name="slimgc-finalize", daemon=True).start()
        return done.wait(timeout)
