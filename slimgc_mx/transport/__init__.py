"""Transports of the engine: in-process and threads here; MXNet's own dist_sync and
torch.distributed live in their adapters (slimgc_mx.mxnet.dist, slimgc_mx.torch.collective).

A transport moves fixed-shape float arrays ("wire keys") and returns their sum over
all workers. The pipeline owns the buffers (host arrays: HostBuffer here, MXNet's
Buffer in slimgc_mx.mxnet.buffers), so codecs write straight into what is sent.
Nothing here imports a framework (docs/backend.md).

    host.py     HostBuffer: a host array on plain NumPy memory (no framework)
    base.py     Transport, handles, timeouts
    keys.py     the owner of every wire key
    local.py    one worker in this process
    threads.py  N workers as threads (tests)
"""
from .base import (PiecesHandle, TransferHandle, Transport, TransportTimeout, piece_bounds,
                   wait_readable)
from .host import HostArrays, HostBuffer, HostReadiness
from .keys import KeyWire, WireKeyError, WireKeys
from .local import LocalTransport
from .threads import ThreadGroup, ThreadTransport


__all__ = ["HostArrays", "HostBuffer", "HostReadiness", "KeyWire", "LocalTransport",
           "PiecesHandle", "ThreadGroup", "ThreadTransport", "TransferHandle", "Transport",
           "TransportTimeout", "WireKeyError", "WireKeys", "piece_bounds",
           "wait_readable"]
