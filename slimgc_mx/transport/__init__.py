"""Transports under the SlimGC kvstore: MXNet's own dist_sync, in-process, or threads.

A transport moves fixed-shape float arrays ("wire keys") and returns their sum over
all workers. The pipeline owns the buffers (`Buffer`: a CPU NDArray plus a zero-copy
NumPy view of it), so codecs write straight into what MXNet sends.

    buffers.py  Buffer, copy_array, ArrayInPlace (a gradient read where MXNet keeps it)
    engine.py   MXNet's engine: callbacks, CPU work in order, holds
    base.py     Transport, handles, timeouts
    keys.py     the owner of every wire key
    local.py    one worker in this process
    threads.py  N workers as threads (tests)
    dist.py     MXNet dist_sync (stock servers), the server precision probe, pieces
"""
from .. import env
from .base import (PiecesHandle, TransferHandle, Transport, TransportTimeout, piece_bounds,
                   wait_readable)
from .buffers import ArrayInPlace, ArrayOps, Buffer, LayoutError, copy_array, wait_to_write
from .dist import BIGARRAY_BOUND, DistTransport, ServerPrecisionError
from .engine import EngineNotifier, WriteHold
from .keys import KeyWire, WireKeyError, WireKeys
from .local import LocalTransport
from .threads import ThreadGroup, ThreadTransport


def create_transport(timeout=None, piece_bytes=0):
    """MXNet dist_sync when this process was launched as a worker, else in-process."""
    if env.launched_as_worker():
        return DistTransport(timeout=timeout, piece_bytes=piece_bytes)
    return LocalTransport()


__all__ = ["ArrayInPlace", "ArrayOps", "BIGARRAY_BOUND", "Buffer", "DistTransport",
           "EngineNotifier", "KeyWire", "LayoutError", "LocalTransport", "PiecesHandle",
           "ServerPrecisionError", "ThreadGroup", "ThreadTransport", "TransferHandle",
           "Transport", "TransportTimeout", "WireKeyError", "WireKeys", "WriteHold",
           "copy_array", "create_transport", "piece_bounds", "wait_readable", "wait_to_write"]
