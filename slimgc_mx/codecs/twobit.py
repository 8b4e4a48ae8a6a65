"""2bit (MXNet semantics): r += g; r >= t -> +t, r <= -t -> -t, else 0; r keeps the rest."""
import numpy as np

from .base import Codec, kernels


class TwoBit(Codec):
    """Levels q = 0, 1, 2 decode to -t, 0, +t: value = t * (q - 1), L = 3."""

    name = "2bit"
    levels = 3
    takes_threshold = True
    default_threshold = 0.5

    def _affine(self):
        return float(np.float32(self._threshold)), 1, -1

    def _encode_into(self, grad, residual, out, radix, k, grad_checked=False):
        return self._kernel_result(
            kernels().encode_2bit(grad, residual, out, self._powers(radix, k),
                                  np.float32(self._threshold), self.num_threads, grad_checked),
            grad, residual, out)
