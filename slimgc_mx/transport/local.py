"""One worker in this process: the sum over workers is the worker's own array."""
import numpy as np

from .base import TransferHandle, Transport


class LocalTransport(Transport):
    """No communication: every transfer returns what was sent."""

    kind = "local"

    def declare(self, wire_key, buf):
        pass

    def push_pull(self, wire_key, send, recv, priority=0, in_pieces=False):
        np.copyto(recv.for_write(), send.for_read())
        return TransferHandle(recv)

    def declare_gather(self, wire_key, send, recv):
        pass

    def gather(self, wire_key, send, recv, priority=0):
        return self.push_pull(wire_key, send, recv, priority)

    def broadcast(self, wire_key, buf):
        pass

    def allgather(self, values):
        return np.asarray(values, dtype=np.float64).reshape(1, -1)
