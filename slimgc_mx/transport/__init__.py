"""Transports under the SlimGC kvstore: in-process, threads, or (from MXNet's adapter)
MXNet's own dist_sync.

A transport moves fixed-shape float arrays ("wire keys") and returns their sum over
all workers. The pipeline owns the buffers (host arrays: HostBuffer here, MXNet's
Buffer in slimgc_mx.mxnet.buffers), so codecs write straight into what is sent.
Nothing here imports a framework (docs/backend.md).

    host.py     HostBuffer: a host array on plain NumPy memory (no framework)
    base.py     Transport, handles, timeouts
    keys.py     the owner of every wire key
    local.py    one worker in this process
    threads.py  N workers as threads (tests)

MXNet dist_sync (stock servers, the server precision probe, pieces) is
slimgc_mx.mxnet.dist; create_transport imports it only in a launched worker.
"""
from .. import env
from .base import (PiecesHandle, TransferHandle, Transport, TransportTimeout, piece_bounds,
                   wait_readable)
from .host import HostArrays, HostBuffer, HostReadiness
from .keys import KeyWire, WireKeyError, WireKeys
from .local import LocalTransport
from .threads import ThreadGroup, ThreadTransport


def create_transport(timeout=None, piece_bytes=0):
    """MXNet dist_sync when this process was launched as a worker, else in-process."""
    if env.launched_as_worker():
        from ..mxnet.dist import DistTransport
        return DistTransport(timeout=timeout, piece_bytes=piece_bytes)
    return LocalTransport()


__all__ = ["HostArrays", "HostBuffer", "HostReadiness", "KeyWire", "LocalTransport",
           "PiecesHandle", "ThreadGroup", "ThreadTransport", "TransferHandle", "Transport",
           "TransportTimeout", "WireKeyError", "WireKeys", "create_transport", "piece_bounds",
           "wait_readable"]
