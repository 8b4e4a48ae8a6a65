"""none: full-precision passthrough; the lanes are the float32 gradient itself."""
import numpy as np

from .base import Traits, check_num_workers, kernels
from .lanes import LaneCodec
from .registry import register


@register
class NoneCodec(LaneCodec):
    """Sends grad (+ residual, which it then zeroes) as float32; decode returns the sum.

    A lane codec with one float32 element per lane and no levels: error feedback's
    flush (the residual goes out with the gradient) is all it does.
    """

    name = "none"
    wire_dtype = np.dtype(np.float32)

    def geometry(self, num_workers):
        """No packing: one element per float32 lane, for any number of workers."""
        check_num_workers(num_workers)
        return None, 1

    def _affine(self):
        return 1.0, 1, 0

    def _encode_into(self, grad, residual, out, radix, k, grad_checked=False, local=None):
        self._kernel_result(
            kernels().encode_none(grad, residual, out, self.num_threads, grad_checked),
            grad, residual, out)

    def _decode_into(self, lanes_sum, out, num_workers, radix, k):
        np.copyto(out, lanes_sum)

    def device_levels(self, c, ops):
        raise TypeError("codec 'none' has no levels: it sends the float32 values")


@register(reference=True)
class NoneReference(NoneCodec):
    TRAITS = Traits(reference=True)

    def _encode_into(self, grad, residual, out, radix, k, grad_checked=False, local=None):
        self.compensated(grad, residual)  # NaN/Inf refused before anything is written
        self.feedback.flush(grad, residual, out)
