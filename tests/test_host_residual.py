"""KeyBuffers.host_residual: a device codec that keeps the residual on its device (a CUDA
model's offload=False) is asked for it before the host reads or writes b.residual."""
import numpy as np

from slimgc_mx import codecs
from slimgc_mx.engine.grad_buf import KeyBuffers
from slimgc_mx.engine.stages import flush_residual
from slimgc_mx.transport.host import HostBuffer


class DeviceResidual:
    """A device codec stub whose residual lives elsewhere until residual_to_host."""

    def __init__(self, values):
        self.values = values
        self.calls = 0

    def residual_to_host(self, b):
        self.calls += 1
        np.copyto(b.residual.for_write()[:b.size], self.values)


def key(size=10):
    b = KeyBuffers(0, (size,), codecs.create("2bit"), 2, HostBuffer)
    b.device = DeviceResidual(np.arange(size, dtype=np.float32))
    return b


def test_a_full_precision_push_flushes_the_device_residual():
    b = key()
    np.copyto(b.grad_buf.for_write(), 1.0)
    flush_residual(b)
    assert b.device.calls == 1
    np.testing.assert_array_equal(b.grad_buf.for_read(), 1.0 + np.arange(10))
    assert not b.residual.for_read().any()


def test_without_a_device_codec_the_host_residual_is_the_residual():
    b = key()
    b.device = None
    assert b.host_residual() is b.residual
