"""Transports under the SlimGC kvstore: MXNet's own dist_sync, or in-process.

A transport moves fixed-shape float arrays ("wire keys") and returns their sum
over all workers. The pipeline owns the buffers (`Buffer`: a CPU NDArray plus a
zero-copy NumPy view of it), so codecs write straight into what MXNet sends.
"""
import ctypes
import itertools
import logging
import os
import threading

import mxnet as mx
import numpy as np
from mxnet.base import _LIB, NDArrayHandle, check_call

from ._threads import env_count
from .launch import ENGINE_THREADS_VAR, WORKER_ENGINE_THREADS
from .servers import SERVER_ENV_TEXT

log = logging.getLogger(__name__)
_CTYPES = {np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double}


class TransportTimeout(TimeoutError):
    """A transfer did not complete within the configured timeout."""


class ServerPrecisionError(RuntimeError):
    """A parameter server sums float64 arrays in float32, which would corrupt packed lanes."""


class Buffer:
    """A CPU NDArray and a flat NumPy view of the same memory.

    The NDArray is what MXNet's engine reads and writes; the view is what the
    Cython codecs read and write. `for_read` / `for_write` wait for the engine
    so that the two never touch the memory at the same time.
    """

    def __init__(self, shape, dtype):
        dtype = np.dtype(dtype)
        if dtype not in _CTYPES:
            raise TypeError("wire buffers are float32 or float64, not %s" % dtype)
        self.nd = mx.nd.zeros(shape, ctx=mx.cpu(), dtype=dtype)
        self.nd.wait_to_read()
        ptr = ctypes.c_void_p()
        check_call(_LIB.MXNDArrayGetData(self.nd.handle, ctypes.byref(ptr)))
        size = int(np.prod(shape))
        self._np = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(_CTYPES[dtype])),
                                         shape=(size,))
        self._pieces = {}

    def view(self, offset, shape):
        """A Buffer over elements [offset, offset + prod(shape)) of this one, sharing its memory.

        MXNet slices share their parent's engine variable, so a write to the view
        holds back a read of the whole buffer until it is done.
        """
        size = int(np.prod(shape))
        if offset < 0 or offset + size > self._np.size:
            raise ValueError("view [%d, %d) outside a buffer of %d elements"
                             % (offset, offset + size, self._np.size))
        view = Buffer.__new__(Buffer)
        view.nd = self.nd.reshape(-1)[offset:offset + size].reshape(shape)
        view._np = self._np[offset:offset + size]
        view._pieces = {}
        return view

    def pieces(self, bounds):
        """One NDArray per (lo, hi) in `bounds` over elements [lo, hi) of this buffer's memory.

        Unlike a view, each piece has its own engine variable, so an operator on one
        piece does not wait for another. The engine does not order them against `nd`
        either: callers wait on `nd` first (for_read / for_write). Made once per bounds.
        """
        key = tuple(bounds)
        arrays = self._pieces.get(key)
        if arrays is None:
            # from_numpy marks the slice it wraps read-only; the slices are private here.
            arrays = [mx.nd.from_numpy(self._np[lo:hi], zero_copy=True) for lo, hi in key]
            self._pieces[key] = arrays
        return arrays

    @property
    def nbytes(self):
        return self._np.nbytes

    def for_read(self):
        """The NumPy view, after every pending engine write has finished."""
        self.nd.wait_to_read()
        return self._np

    def for_write(self):
        """The NumPy view, after every pending engine read and write has finished."""
        check_call(_LIB.MXNDArrayWaitToWrite(self.nd.handle))
        return self._np

    def held(self):
        """The NumPy view without waiting: for code that already has the access (a WriteHold fill).

        Waiting there could deadlock: a fill may run on one of the engine's own threads.
        """
        return self._np


# Elements from which MXNet's `_copy` operator beats NDArray.copyto: its memcpy costs
# half the CPU per element, its Python call about 20 us more (scripts/per_key_cost.py).
COPY_OP_MIN_SIZE = 1 << 16


def copy_array(src, dst):
    """Queue dst <- src in MXNet's engine, like src.copyto(dst), at half its CPU when it can.

    On the same context and dtype, MXNet's `_copy` operator copies with memcpy, where
    CopyFromTo (copyto) moves 16 bytes per loop step; both bring an MKLDNN-layout
    source into the destination's default layout (tests/test_copy_array.py). Small
    arrays, another device, a cast or sparse storage go through copyto.
    """
    if (src.size >= COPY_OP_MIN_SIZE and src.context == dst.context
            and src.dtype == dst.dtype and src.stype == "default" and dst.stype == "default"):
        mx.nd.identity(src, out=dst)
    else:
        src.copyto(dst)


class _Context(ctypes.Structure):
    _fields_ = [("dev_type", ctypes.c_int), ("dev_id", ctypes.c_int)]


_ENGINE_FUNC = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)
_ENGINE_ASYNC_FUNC = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)


class _OnComplete(ctypes.Structure):
    """MXNet's engine::CallbackOnComplete (include/mxnet/engine.h, copyable by design)."""

    _fields_ = [("callback", ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p,
                                              ctypes.c_void_p)),
                ("engine", ctypes.c_void_p), ("param", ctypes.c_void_p)]

    def __call__(self):
        self.callback(self.engine, self.param, None)


class WriteHold:
    """Write access to an NDArray, held in MXNet's engine until `release`.

    Operators pushed after the hold on that array (a copy into the model's
    parameters, the next forward pass) wait for the release, while the thread
    that pushed them goes on. `release(fill)` runs fill() once the engine has
    granted the access, in whichever thread comes second, then lets them run.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._granted = None
        self._released = False
        self._fill = None

    def _grant(self, on_complete):  # an engine thread
        with self._lock:
            if not self._released:
                self._granted = on_complete
                return
        self._complete(self._fill, on_complete)

    def release(self, fill=None):
        """Finish the hold (once; later calls do nothing), writing with fill() first if given."""
        with self._lock:
            if self._released:
                return
            self._released = True
            self._fill = fill
            granted = self._granted
        if granted is not None:
            self._complete(fill, granted)

    @staticmethod
    def _complete(fill, on_complete):
        try:
            if fill is not None:
                fill()
        finally:
            on_complete()


def async_engine():
    """True when MXNet's engine runs operators asynchronously (not NaiveEngine)."""
    return "naive" not in os.environ.get("MXNET_ENGINE_TYPE", "").lower()


class EngineNotifier:
    """Hooks into MXNet's engine: callbacks when an array is ready, CPU work in order, write holds.

    `when_readable` pushes a tiny operator that reads the array; the engine runs
    it right after the array's producer (e.g. the copy of a gradient that backward
    has just finished), so keys are consumed as they become ready. `run` pushes a
    Python function as an operator that reads and writes given arrays. `hold`
    pushes an asynchronous operator that writes the array and completes on release.
    An exception in a function run by the engine goes to `on_error` (else the log).
    """

    def __init__(self, on_error=None):
        self.on_error = on_error
        self._callbacks = {}
        self._tokens = itertools.count(1)
        self._lock = threading.Lock()
        self._func = _ENGINE_FUNC(self._fire)  # kept alive as long as the notifier
        self._async_func = _ENGINE_ASYNC_FUNC(self._grant)
        self._cpu = _Context(1, 0)

    def _pop(self, token):
        with self._lock:
            return self._callbacks.pop(token)

    def _fire(self, run_context, token):
        fn = self._pop(token)
        try:
            fn()
        except BaseException as exc:  # an engine thread: nobody above would see it
            if self.on_error is None:
                log.exception("slimgc: a function run by MXNet's engine failed")
            else:
                self.on_error(exc)

    def _grant(self, run_context, on_complete, token):
        callback = _OnComplete.from_buffer_copy(
            ctypes.string_at(on_complete, ctypes.sizeof(_OnComplete)))
        self._pop(token)._grant(callback)

    def _register(self, callback):
        token = next(self._tokens)
        with self._lock:
            self._callbacks[token] = callback
        return ctypes.c_void_p(token)

    def when_readable(self, nd, callback):
        """Call callback() on an engine thread once every pending write of `nd` is done."""
        self.run(callback, [nd], [])

    def run(self, fn, reads, writes):
        """Call fn() on an engine thread after the pending writes of `reads` and all pending
        access to `writes`; operators pushed later wait for it as for any writer of `writes`.

        fn must not wait on the engine (it holds these arrays): use Buffer.held().
        """
        check_call(_LIB.MXEnginePushSyncND(
            self._func, self._register(fn), None, ctypes.byref(self._cpu),
            (NDArrayHandle * len(reads))(*[nd.handle for nd in reads]), len(reads),
            (NDArrayHandle * len(writes))(*[nd.handle for nd in writes]), len(writes),
            None, 0, None))

    def hold(self, nd):
        """A WriteHold on `nd`; needs the asynchronous engine (see async_engine)."""
        hold = WriteHold()
        check_call(_LIB.MXEnginePushAsyncND(
            self._async_func, self._register(hold), None, ctypes.byref(self._cpu),
            None, 0, (NDArrayHandle * 1)(nd.handle), 1, None, 0, None, ctypes.c_bool(False)))
        return hold


class Handle:
    """A transfer in flight; `wait()` returns once the summed result is in `recv`.

    It blocks without a limit: the training thread, not the pipeline thread,
    enforces the timeout (see backup.ModelBackup.wait_version).
    """

    def __init__(self, recv, elapsed=None):
        self._recv = recv
        self.elapsed = elapsed  # set by emulated links: the modeled transfer time

    def wait(self):
        self._recv.nd.wait_to_read()


class _PiecesHandle(Handle):
    """A transfer sent as pieces: done once every piece of `recv` has its sum."""

    def __init__(self, recv, pieces):
        super().__init__(recv)
        self._pieces = pieces

    def wait(self):
        for nd in self._pieces:
            nd.wait_to_read()


def _wait_nd(arrays, timeout):
    """Block until every NDArray in `arrays` (or the one NDArray) is readable, or raise
    TransportTimeout after `timeout` seconds in all.

    For the rare collective calls made on the training thread (broadcast, allgather).
    """
    arrays = arrays if isinstance(arrays, list) else [arrays]
    if timeout is None:
        for nd in arrays:
            nd.wait_to_read()
        return
    done = threading.Event()
    err = []

    def waiter():
        try:
            for nd in arrays:
                nd.wait_to_read()
        except Exception as exc:  # surfaced in the caller below
            err.append(exc)
        done.set()

    threading.Thread(target=waiter, name="slimgc-wait", daemon=True).start()
    if not done.wait(timeout):
        raise TransportTimeout(
            "a transfer did not complete in %.0f s: a worker or server may have died "
            "(raise SLIMGC_TIMEOUT if your steps are legitimately slower)" % timeout)
    if err:
        raise err[0]


class Transport:
    """Sums fixed-shape arrays over workers; `declare` must run in the same order everywhere."""

    rank = 0
    num_workers = 1
    num_servers = 1
    kind = "abstract"
    timeout = None
    bigarray_bound = None  # elements from which MXNet splits an array over all servers
    pieces_declared = 0  # wire keys made by splitting declared buffers into pieces

    def declare(self, wire_key, buf):
        """Create `wire_key` with the shape and dtype of `buf` (collective)."""
        raise NotImplementedError

    def push_pull(self, wire_key, send, recv):
        """Start summing `send` over workers into `recv`; returns a Handle."""
        raise NotImplementedError

    def broadcast(self, wire_key, buf):
        """Overwrite `buf` with rank 0's value (collective; wire_key must be declared)."""
        raise NotImplementedError

    def allgather(self, values):
        """Every worker's float64 vector, stacked as (num_workers, len) (collective)."""
        raise NotImplementedError

    def check_exact_sums(self):
        """Raise ServerPrecisionError unless float64 sums are exact (collective)."""

    def close(self, timeout=None):
        """Release the transport; returns False if that did not finish within `timeout`."""
        return True


class LocalTransport(Transport):
    """One worker in this process: the sum over workers is the worker's own array."""

    kind = "local"

    def declare(self, wire_key, buf):
        pass

    def push_pull(self, wire_key, send, recv):
        np.copyto(recv.for_write(), send.for_read())
        return Handle(recv)

    def broadcast(self, wire_key, buf):
        pass

    def allgather(self, values):
        return np.asarray(values, dtype=np.float64).reshape(1, -1)


# Key bands. Per-key wire keys (3 * index + 0..2) live below _CONTROL_KEY_BASE; above it
# sit the allgather keys, the precision probe, the fused buckets (fusion.py) and the
# pieces of large buffers.
# MXNet picks a small key's server as (key * 9973) % S in 32-bit int arithmetic, which
# stays positive only for keys below 2**31 / 9973 (about 215000) and for keys in
# [2**30, 2**30 + 107000): every band must stay inside those.
_CONTROL_KEY_BASE = 1 << 30
_PROBE_KEY_BASE = _CONTROL_KEY_BASE + 4096
FUSED_KEY_BASE = _CONTROL_KEY_BASE + 16384
_PIECE_KEY_BASE = _CONTROL_KEY_BASE + 32768
_PIECE_KEY_END = _CONTROL_KEY_BASE + 107000

# A buffer larger than this travels as pieces of at most this many bytes, each its own
# wire key (SLIMGC_PIECE_BYTES; 0: whole). MXNet's dist_sync answers a pull only after
# every worker's push of that key, so a whole key's sum comes back only once all of it
# was pushed; with pieces the first sums flow back while later pieces are still pushed,
# and a worker's link carries both directions at once.
PIECE_BYTES = 1 << 20


def piece_bounds(size, itemsize, piece_bytes):
    """[(lo, hi), ...] element ranges of at most piece_bytes each, or None for one piece."""
    per = max(1, piece_bytes // itemsize) if piece_bytes else size
    if size <= per:
        return None
    return [(lo, min(lo + per, size)) for lo in range(0, size, per)]


# MXNet splits an array evenly over all servers only from MXNET_KVSTORE_BIGARRAY_BOUND
# elements on (default 10**6); smaller ones go whole to server (key * 9973) % S. A float64
# lane packs about 20 gradient elements, so at that default no compressed key is ever
# split, and the wire keys 3 * index + 1 of same-parity indices all land on one server
# (with 2 servers, every weight of a Dense stack). Unless the user set the variable, the
# dist transport lowers the bound to 2 MB of lanes (1 MB of float32).
BIGARRAY_BOUND = 1 << 18


def _bigarray_bound(raw):
    """MXNET_KVSTORE_BIGARRAY_BOUND as a positive integer, or a ValueError naming it."""
    try:
        bound = int(raw)
    except ValueError:
        bound = 0
    if bound < 1:
        raise ValueError("MXNET_KVSTORE_BIGARRAY_BOUND=%r: expected a positive number of "
                         "elements (unset it to use %d)" % (raw, BIGARRAY_BOUND))
    return bound


def _probe_values(rank):
    """What worker `rank` pushes in the precision probe: integers float32 cannot hold."""
    return np.array([2.0 ** 48 + 2 * rank + 1, 2.0 ** 30 + rank, 1.0], dtype=np.float64)


def engine_threads_warning(environ):
    """A warning when MXNet's engine has one CPU worker thread (its default), else None.

    Then the kvstore's push and pull operators, and SlimGC's copies, wait behind every
    forward and backward operator queued before them, and pieces cannot overlap.
    """
    try:
        threads = env_count(ENGINE_THREADS_VAR, "", environ) or 1
    except ValueError:  # not a count: MXNet would not get more threads from it either
        threads = 1
    if threads >= 2:
        return None
    return ("%s=%s: MXNet's engine has one CPU worker thread, so transfers wait behind "
            "compute; start workers with %s=%d (python -m slimgc_mx.launch does)"
            % (ENGINE_THREADS_VAR, environ.get(ENGINE_THREADS_VAR, "1"), ENGINE_THREADS_VAR,
               WORKER_ENGINE_THREADS))


class DistTransport(Transport):
    """MXNet's native dist_sync kvstore: stock servers sum what the workers push."""

    kind = "dist_sync"

    def __init__(self, timeout=None, piece_bytes=PIECE_BYTES):
        # Read by MXNet when the kvstore is created; a value the user set stays.
        os.environ.setdefault("MXNET_KVSTORE_BIGARRAY_BOUND", str(BIGARRAY_BOUND))
        self.bigarray_bound = _bigarray_bound(os.environ["MXNET_KVSTORE_BIGARRAY_BOUND"])
        self._kv = mx.kv.create("dist_sync")
        self.rank = self._kv.rank
        self.num_workers = self._kv.num_workers
        self.num_servers = max(1, int(os.environ.get("DMLC_NUM_SERVER", "1")))
        self.timeout = timeout
        self.piece_bytes = piece_bytes
        warning = engine_threads_warning(os.environ)
        if warning and self.rank == 0:
            log.warning("slimgc: %s", warning)
        self._gather_keys = {}
        self._pieces = {}  # wire key -> (piece wire keys, element bounds)

    def declare(self, wire_key, buf):
        if _CONTROL_KEY_BASE <= wire_key < FUSED_KEY_BASE or wire_key >= _PIECE_KEY_BASE:
            raise ValueError("wire key %d collides with control or piece keys" % wire_key)
        bounds = piece_bounds(buf.nd.size, np.dtype(buf.nd.dtype).itemsize, self.piece_bytes)
        if bounds is None:
            self._kv.init(wire_key, buf.nd)
            return
        first = _PIECE_KEY_BASE + self.pieces_declared
        if first + len(bounds) > _PIECE_KEY_END:
            raise ValueError(
                "%d more pieces of %d bytes do not fit the %d piece keys MXNet can place: "
                "raise piece_bytes (SLIMGC_PIECE_BYTES) or set it to 0 to send buffers whole"
                % (len(bounds), self.piece_bytes, _PIECE_KEY_END - _PIECE_KEY_BASE))
        keys = list(range(first, first + len(bounds)))
        self.pieces_declared += len(bounds)
        buf.for_read()  # the pieces' engine variables do not see pending writes of buf.nd
        self._kv.init(keys, buf.pieces(bounds))
        self._pieces[wire_key] = (keys, bounds)

    def push_pull(self, wire_key, send, recv):
        split = self._pieces.get(wire_key)
        if split is None:
            self._kv.push(wire_key, send.nd)
            self._kv.pull(wire_key, out=recv.nd)
            return Handle(recv)
        keys, bounds = split
        # MXNet pulls each sum into the pushed array itself before copying it to `recv`,
        # so both buffers are written: wait for the engine's pending access to either.
        send.for_write()
        recv.for_write()
        sends, recvs = send.pieces(bounds), recv.pieces(bounds)
        for key, s, r in zip(keys, sends, recvs):
            self._kv.push(key, s)
            self._kv.pull(key, out=r)
        return _PiecesHandle(recv, recvs)

    def broadcast(self, wire_key, buf):
        split = self._pieces.get(wire_key)
        if split is None:
            self._kv.pull(wire_key, out=buf.nd)
            _wait_nd(buf.nd, self.timeout)
            return
        keys, bounds = split
        buf.for_write()
        pieces = buf.pieces(bounds)
        self._kv.pull(keys, out=pieces)
        _wait_nd(pieces, self.timeout)

    def allgather(self, values):
        values = np.asarray(values, dtype=np.float64).ravel()
        n = values.size
        key = self._gather_keys.get(n)
        if key is None:
            key = _CONTROL_KEY_BASE + len(self._gather_keys)
            self._gather_keys[n] = key
            self._kv.init(key, mx.nd.zeros((self.num_workers, n), dtype=np.float64))
        slots = np.zeros((self.num_workers, n), dtype=np.float64)
        slots[self.rank] = values
        send = mx.nd.array(slots, dtype=np.float64)
        recv = mx.nd.zeros((self.num_workers, n), dtype=np.float64)
        self._kv.push(key, send)
        self._kv.pull(key, out=recv)
        _wait_nd(recv, self.timeout)
        return recv.asnumpy()

    def check_exact_sums(self):
        """Push float64 integers through every server and compare the sums with the exact ones.

        MXNet 1.9.1's server leaves its multi_precision_ flag uninitialized; a server that
        starts with it set sums float64 in float32 (docs/launcher.md). Small keys
        go to server (key * 9973) % S, so S consecutive keys reach all S servers.
        """
        servers = self.num_servers
        keys = [_PROBE_KEY_BASE + i for i in range(servers)]
        mine = _probe_values(self.rank)
        self._kv.init(keys, [mx.nd.zeros(mine.shape, dtype=np.float64) for _ in keys])
        sums = [mx.nd.zeros(mine.shape, dtype=np.float64) for _ in keys]
        for key, out in zip(keys, sums):
            self._kv.push(key, mx.nd.array(mine, dtype=np.float64))
            self._kv.pull(key, out=out)
        expected = sum(_probe_values(r) for r in range(self.num_workers))
        lossy = 0
        for out in sums:
            _wait_nd(out, self.timeout)
            lossy += int(not np.array_equal(out.asnumpy(), expected))
        if lossy:
            raise ServerPrecisionError(
                "%d of %d parameter servers sum float64 arrays in float32: MXNet 1.9.1's "
                "KVStoreDistServer leaves its multi_precision_ flag uninitialized, and SlimGC's "
                "packed lanes would be silently corrupted. Start the servers with %s in "
                "their environment (python -m slimgc_mx.launch does so), or train with "
                "compressor 'none'." % (lossy, servers, SERVER_ENV_TEXT))

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


class ThreadGroup:
    """N in-process workers (threads) that sum through a shared dict: tests and demos.

    Each worker gets `group.transport(rank)`. A push_pull completes once all N
    workers pushed that wire key for that round, like a dist_sync server.
    """

    def __init__(self, num_workers, link=None):
        self.num_workers = num_workers
        # Optional callable(nbytes) -> seconds: an emulated link whose modeled time is
        # reported as the transfer time (Handle.elapsed), so timings are reproducible.
        self.link = link
        self._cond = threading.Condition()
        self._rounds = {}  # (wire_key, round) -> [sum, arrivals, results_taken]

    def transport(self, rank):
        return _ThreadTransport(self, rank)

    def _add(self, wire_key, rnd, array):
        """Add one worker's contribution; returns a function that waits for and takes the sum."""
        with self._cond:
            slot = self._rounds.setdefault((wire_key, rnd), [np.zeros_like(array), 0, 0])
            slot[0] += array
            slot[1] += 1
            self._cond.notify_all()

        def take():
            with self._cond:
                if not self._cond.wait_for(lambda: slot[1] == self.num_workers, timeout=60):
                    raise TransportTimeout("thread group: not every worker pushed key %r"
                                           % (wire_key,))
                slot[2] += 1
                if slot[2] == self.num_workers:
                    del self._rounds[(wire_key, rnd)]
                return slot[0].copy()
        return take

    def _sum(self, wire_key, rnd, array):
        return self._add(wire_key, rnd, array)()


class _ThreadHandle(Handle):
    """Waits for the other workers' contributions, like a pull from a dist_sync server."""

    def __init__(self, recv, take, elapsed):
        super().__init__(recv, elapsed)
        self._take = take

    def wait(self):
        np.copyto(self._recv.for_write(), self._take())


class _ThreadTransport(Transport):
    kind = "threads"

    def __init__(self, group, rank):
        self._group = group
        self.rank = rank
        self.num_workers = group.num_workers
        self._round = {}

    def _next_round(self, key):
        rnd = self._round.get(key, 0)
        self._round[key] = rnd + 1
        return rnd

    def declare(self, wire_key, buf):
        pass

    def push_pull(self, wire_key, send, recv):
        take = self._group._add(wire_key, self._next_round(wire_key), send.for_read())
        link = self._group.link
        return _ThreadHandle(recv, take, None if link is None else link(send.nbytes))

    def broadcast(self, wire_key, buf):
        view = buf.for_read()
        contribution = view if self.rank == 0 else np.zeros_like(view)
        total = self._group._sum(("bcast", wire_key), self._next_round(("bcast", wire_key)),
                                 contribution)
        np.copyto(buf.for_write(), total)

    def allgather(self, values):
        values = np.asarray(values, dtype=np.float64).ravel()
        slots = np.zeros((self.num_workers, values.size))
        slots[self.rank] = values
        key = ("gather", values.size)
        return self._group._sum(key, self._next_round(key), slots)


def create_transport(timeout=None, piece_bytes=PIECE_BYTES):
    """MXNet dist_sync when this process was launched as a worker, else in-process."""
    if os.environ.get("DMLC_ROLE") == "worker" and os.environ.get("DMLC_NUM_WORKER"):
        return DistTransport(timeout=timeout, piece_bytes=piece_bytes)
    return LocalTransport()
