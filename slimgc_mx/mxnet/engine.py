"""The MXNet engine binding: callbacks when an array is ready, CPU work in order, write holds.

Built on MXNet 1.9.1's C API (MXEnginePushSyncND / MXEnginePushAsyncND) and on the
layout of its C++ struct engine::CallbackOnComplete, mirrored here: another MXNet
version may lay that struct out differently, so EngineNotifier refuses to start on one.
"""
import ctypes
import itertools
import logging
import threading

import mxnet as mx
from mxnet.base import _LIB, NDArrayHandle, check_call

log = logging.getLogger(__name__)

#: The MXNet version whose engine.h the structs below mirror.
MXNET_VERSION = "1.9.1"


def check_mxnet_version(version=None):
    """Raise RuntimeError unless MXNet is the version the engine binding was written against."""
    version = mx.__version__ if version is None else version
    if version != MXNET_VERSION:
        raise RuntimeError(
            "slimgc_mx's engine binding mirrors MXNet %s's engine::CallbackOnComplete; this is "
            "MXNet %s, whose layout may differ. Install mxnet==%s (requirements.txt)."
            % (MXNET_VERSION, version, MXNET_VERSION))


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
        check_mxnet_version()
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

    def when_readable(self, buf, callback, priority=0):
        """Call callback() on an engine thread once every pending write of the Buffer `buf`
        is done (backend.Readiness)."""
        self.run(callback, [buf.nd], [], priority)

    def run(self, fn, reads, writes, priority=0):
        """Call fn() on an engine thread after the pending writes of `reads` and all pending
        access to `writes`; operators pushed later wait for it as for any writer of `writes`.

        fn must not wait on the engine (it holds these arrays): use Buffer.held().
        """
        check_call(_LIB.MXEnginePushSyncND(
            self._func, self._register(fn), None, ctypes.byref(self._cpu),
            (NDArrayHandle * len(reads))(*[nd.handle for nd in reads]), len(reads),
            (NDArrayHandle * len(writes))(*[nd.handle for nd in writes]), len(writes),
            None, ctypes.c_int(priority), None))

    def hold(self, nd):
        """A WriteHold on `nd`; needs the asynchronous engine (see env.async_engine)."""
        hold = WriteHold()
        check_call(_LIB.MXEnginePushAsyncND(
            self._async_func, self._register(hold), None, ctypes.byref(self._cpu),
            None, 0, (NDArrayHandle * 1)(nd.handle), 1, None, 0, None, ctypes.c_bool(False)))
        return hold
