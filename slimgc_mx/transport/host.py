"""HostBuffer: a HostArray (backend.py) on plain NumPy memory, for a process with no
framework's engine: every access is immediate, so the engine's pipeline, backup and
transports run on it in tests without MXNet or PyTorch."""
import numpy as np


class HostBuffer:
    """A flat NumPy array in the shape of a HostArray; no framework writes it behind our back."""

    def __init__(self, shape, dtype=np.float32):
        self.shape = tuple(int(n) for n in shape)
        self._np = np.zeros(int(np.prod(self.shape)), dtype=np.dtype(dtype))

    @property
    def nbytes(self):
        return self._np.nbytes

    def for_read(self):
        return self._np

    def for_write(self):
        return self._np

    def held(self):
        return self._np

    def view(self, offset, shape):
        """A HostBuffer over elements [offset, offset + prod(shape)), sharing this memory."""
        size = int(np.prod(shape))
        if offset < 0 or offset + size > self._np.size:
            raise ValueError("view [%d, %d) outside a buffer of %d elements"
                             % (offset, offset + size, self._np.size))
        out = HostBuffer.__new__(HostBuffer)
        out.shape = tuple(int(n) for n in shape)
        out._np = self._np[offset:offset + size]
        return out


class HostReadiness:
    """backend.Readiness for host arrays that no framework writes: ready at once."""

    ordered = True  # callbacks run in the order asked

    @staticmethod
    def when_readable(buf, callback, priority=0):
        callback()


class HostArrays:
    """backend.Arrays over HostBuffers, for a process with no framework: a buffer's
    framework array is its NumPy view in its shape, copies happen at once, nothing holds."""

    can_hold = False

    @staticmethod
    def new(shape):
        return HostBuffer(shape, np.float32)

    @staticmethod
    def array(buf):
        return buf.for_read().reshape(buf.shape)

    @staticmethod
    def copy(src, dst):
        np.copyto(dst, np.reshape(src, np.shape(dst)))

    @classmethod
    def copy_many(cls, pairs):
        for src, dst in pairs:
            cls.copy(src, dst)

    def hold(self, buf):
        raise RuntimeError("host arrays have no engine to hold a writer in (can_hold is False)")
