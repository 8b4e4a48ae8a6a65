"""Buffer: a CPU NDArray and a zero-copy NumPy view of the same memory; copy_array;
ArrayInPlace: an array MXNet owns (a gradient), read in place inside an engine operator."""
import ctypes

import mxnet as mx
import numpy as np
from mxnet.base import _LIB, check_call, py_str
from mxnet.ndarray.ndarray import DLManagedTensor

from .. import env

_CTYPES = {np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double}


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
        wait_to_write(self.nd)
        return self._np

    def held(self):
        """The NumPy view without waiting: for code that already has the access (a WriteHold fill).

        Waiting there could deadlock: a fill may run on one of the engine's own threads.
        """
        return self._np


def wait_to_write(nd):
    """Block until every pending engine read and write of the NDArray `nd` has finished."""
    check_call(_LIB.MXNDArrayWaitToWrite(nd.handle))


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


class LayoutError(RuntimeError):
    """An array MXNet owns is not in the default layout (MKLDNN's), so it has no plain view."""


class ArrayInPlace:
    """A CPU float32 NDArray that MXNet owns, read where it lies instead of copied.

    `nd` is what engine operators declare; held() exports its memory through DLPack,
    which neither waits nor reorders: it refuses an array in MKLDNN's layout
    (LayoutError) where MXNDArrayGetData would reorder and wait (a deadlock inside an
    operator that holds the array). The view is taken anew at each call: a reorder
    moves the memory.
    """

    def __init__(self, nd):
        self.nd = nd
        self.size = int(np.prod(nd.shape))

    @staticmethod
    def supports(nd):
        """True for a dense float32 CPU array (the only kind read in place)."""
        return (nd.context.device_type == "cpu" and nd.stype == "default"
                and np.dtype(nd.dtype) == np.float32)

    def for_read(self):
        """The flat NumPy view, after the array's pending writes (outside an operator)."""
        self.nd.wait_to_read()
        return self.held()

    def held(self):
        """The flat NumPy view, without waiting: for an operator that declares `nd`."""
        handle = ctypes.c_void_p()
        if _LIB.MXNDArrayToDLPack(self.nd.handle, ctypes.byref(handle)) != 0:
            raise LayoutError("an array of shape %s is in MKLDNN's layout, which cannot be "
                              "read in place inside MXNet's engine (%s)"
                              % (tuple(self.nd.shape), py_str(_LIB.MXGetLastError())
                                 .strip().splitlines()[0]))
        managed = ctypes.cast(handle, ctypes.POINTER(DLManagedTensor))
        try:
            t = managed.contents.dl_tensor
            size = int(np.prod([t.shape[i] for i in range(t.ndim)]))
            if (t.ctx.device_type != 1 or t.dtype.type_code != 2 or t.dtype.bits != 32
                    or t.dtype.lanes != 1 or size != self.size or bool(t.strides)):
                raise LayoutError("an array of shape %s is not a compact float32 CPU array"
                                  % (tuple(self.nd.shape),))
            ptr = ctypes.cast(t.data + t.byte_offset, ctypes.POINTER(ctypes.c_float))
            return np.ctypeslib.as_array(ptr, shape=(size,)) if size else np.empty(0, np.float32)
        finally:
            managed.contents.deleter(managed)


class ArrayOps:
    """What the model backup needs of MXNet: float32 CPU Buffers, copies in the engine's
    order, and (with an EngineNotifier under the asynchronous engine) write holds."""

    def __init__(self, engine=None):
        self._engine = engine
        self.can_hold = engine is not None and env.async_engine()

    @staticmethod
    def new(shape):
        return Buffer(shape, np.float32)

    @staticmethod
    def array(buf):
        """The NDArray over a Buffer's memory."""
        return buf.nd

    @staticmethod
    def copy(src, dst):
        copy_array(src, dst)

    @staticmethod
    def copy_many(pairs):
        for src, dst in pairs:
            copy_array(src, dst)

    def hold(self, buf):
        return self._engine.hold(buf.nd)
