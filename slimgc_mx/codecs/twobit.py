"""2bit (MXNet semantics): r += g; r >= t -> +t, r <= -t -> -t, else 0; r keeps the rest."""
import numpy as np

from .base import Traits, kernels
from .lanes import LaneCodec, LaneReference
from .registry import register


@register
class TwoBit(LaneCodec):
    """Levels q = 0, 1, 2 decode to -t, 0, +t: value = t * (q - 1), L = 3."""

    name = "2bit"
    levels = 3
    takes_threshold = True
    default_threshold = 0.5
    TRAITS = Traits(fuses_local_update=True, encodes_by_piece=True)

    def _affine(self):
        return float(np.float32(self._threshold)), 1, -1

    def _encode_into(self, grad, residual, out, radix, k, grad_checked=False, local=None):
        return self._kernel_result(
            kernels().encode_2bit(grad, residual, out, self._powers(radix, k),
                                  np.float32(self._threshold), self.num_threads, grad_checked,
                                  local),
            grad, residual, out)

    def device_levels(self, c, ops):
        t = float(np.float32(self._threshold))
        return ops.level(c >= t) - ops.level(c <= -t) + 1


@register(reference=True)
class TwoBitReference(LaneReference, TwoBit):
    def _levels(self, c):
        t = np.float32(self._threshold)
        return 1 + (c >= t).astype(np.int64) - (c <= -t).astype(np.int64)
