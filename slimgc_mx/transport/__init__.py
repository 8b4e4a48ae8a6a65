"""Transports under the SlimGC kvstore: MXNet's own dist_sync, in-process, or threads.

A transport moves fixed-shape float arrays ("wire keys") and returns their sum over
all workers. The pipeline owns the buffers (`Buffer`: a CPU NDArray plus a zero-copy
NumPy view of it), so codecs write straight into what MXNet sends.

    host.py     HostBuffer: a host array on plain NumPy memory (no framework)
    buffers.py  Buffer, copy_array, ArrayInPlace (a gradient read where MXNet keeps it)
    engine.py   MXNet's engine: callbacks, CPU work in order, holds
    base.py     Transport, handles, timeouts
    keys.py     the owner of every wire key
    local.py    one worker in this process
    threads.py  N workers as threads (tests)
    dist.py     MXNet dist_sync (stock servers), the server precision probe, pieces
"""
import importlib

from .. import env
from .base import (PiecesHandle, TransferHandle, Transport, TransportTimeout, piece_bounds,
                   wait_readable)
from .host import HostArrays, HostBuffer, HostReadiness
from .keys import KeyWire, WireKeyError, WireKeys
from .local import LocalTransport
from .threads import ThreadGroup, ThreadTransport

# The names of the modules that import MXNet, loaded on first use, so that the transports
# above and the engine's host side import no framework (docs/backend.md).
_MXNET_NAMES = {
    "buffers": ("ArrayInPlace", "ArrayOps", "Buffer", "LayoutError", "copy_array",
                "wait_to_write"),
    "dist": ("BIGARRAY_BOUND", "DistTransport", "ServerPrecisionError"),
    "engine": ("EngineNotifier", "WriteHold"),
}
_LAZY = {name: module for module, names in _MXNET_NAMES.items() for name in names}


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module("." + _LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


def create_transport(timeout=None, piece_bytes=0):
    """MXNet dist_sync when this process was launched as a worker, else in-process."""
    if env.launched_as_worker():
        from .dist import DistTransport
        return DistTransport(timeout=timeout, piece_bytes=piece_bytes)
    return LocalTransport()


__all__ = ["ArrayInPlace", "ArrayOps", "BIGARRAY_BOUND", "Buffer", "DistTransport",
           "EngineNotifier", "HostArrays", "HostBuffer", "HostReadiness", "KeyWire", "LayoutError", "LocalTransport",
           "PiecesHandle",
           "ServerPrecisionError", "ThreadGroup", "ThreadTransport", "TransferHandle",
           "Transport", "TransportTimeout", "WireKeyError", "WireKeys", "WriteHold",
           "copy_array", "create_transport", "piece_bounds", "wait_readable", "wait_to_write"]
