"""Error feedback: the seam every codec with memory shares.

    c = g + e            compensate: the gradient plus what earlier steps did not send
    send Q(c)            the codec's quantizer
    e' = c - D(Q(c))     update: keep what this step did not send

so that g + e == D(Q(c)) + e' exactly in float32 arithmetic (the identity the codec
tests check). The compiled kernels fuse the three steps into one pass; these NumPy
versions are what the references run and what a new codec calls. `flush` hands the
whole residual to a full-precision transfer, so a key that leaves the compressed route
loses nothing.
"""
import numpy as np


class ErrorFeedback:
    """The residual arithmetic around a codec's quantizer (stateless: the caller owns e)."""

    @staticmethod
    def compensate(grad, residual):
        """c = grad + residual in float32; NaN/Inf are left for the caller to find."""
        with np.errstate(over="ignore", invalid="ignore"):
            return grad + residual

    @staticmethod
    def update(residual, compensated, sent):
        """residual <- compensated - sent (what the decoder will see of this worker)."""
        residual[...] = compensated - sent

    @staticmethod
    def flush(grad, residual, out):
        """out <- grad + residual; residual <- 0 (full precision sends the memory too)."""
        np.add(grad, residual, out=out)
        residual[...] = 0
