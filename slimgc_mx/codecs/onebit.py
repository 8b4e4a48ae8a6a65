"""1bit: sign with error feedback and a scale all workers share (EF-signSGD, aggregatable).

Level q = 1 if r + g >= 0 else 0 decodes to s * (2q - 1). Every worker appends one
float64 trailer lane, its mean |g + r| at this push; decode() sets the scale of the
NEXT push to (trailer sum) / N, a value every worker receives identically. The first
push has s = 0: it sends only the statistic and error feedback keeps the gradient.
"""
import numpy as np

from .base import Traits, kernels
from .lanes import LaneCodec, LaneReference, SharedScale
from .registry import register


@register
class OneBit(SharedScale, LaneCodec):
    """Sign codec, L = 2, shared scale from the previous push's aggregated mean |g + r|.

    `threshold` is accepted for a uniform create() call and ignored: the scale adapts.
    """

    name = "1bit"
    levels = 2
    trailer_lanes = 1
    TRAITS = Traits(fuses_local_update=True)

    def __init__(self, threshold=None, num_threads=None):
        super().__init__(threshold=threshold, num_threads=num_threads)
        self.scale = 0.0

    def _affine(self):
        return self.scale, 2, -1

    def _agree(self, mean_stat):
        self.scale = float(mean_stat)

    def _encode_into(self, grad, residual, out, radix, k, grad_checked=False, local=None):
        return self._chunk_order_sum(self._kernel_result(
            kernels().encode_1bit(grad, residual, out, self._powers(radix, k),
                                  np.float32(self.scale), self.num_threads, grad_checked,
                                  local),
            grad, residual, out))

    def device_levels(self, c, ops):
        return ops.level(c >= 0.0)

    def device_statistic(self, grad, compensated):
        return compensated


@register(reference=True)
class OneBitReference(LaneReference, OneBit):
    def _levels(self, c):
        return (c >= 0).astype(np.int64)

    def _statistic(self, grad, c, k):
        return np.abs(c).astype(np.float64)
