"""NumPy reference implementations of every codec: the test oracle, and a fallback that
needs no compiled extension. Same arithmetic as the kernels, so results are bitwise equal.
"""
import numpy as np

from .base import chunk_sum, raise_nonfinite
from .fourbit import GROUPS, MAX_UNITS, FourBit, group_thresholds
from .none import NoneCodec
from .onebit import OneBit
from .twobit import TwoBit


class ReferenceMixin:
    """encode = compensate, level, error feedback, pack; decode = unpack digits, scale."""

    is_reference = True

    def _levels(self, compensated):
        """int64 level q of each compensated value (grad + residual, float32)."""
        raise NotImplementedError

    def _statistic(self, grad, compensated):
        """float64 per-element statistic whose mean is the trailer lane, or None."""
        return None

    def _encode_into(self, grad, residual, out, radix, k, grad_checked=False):
        with np.errstate(over="ignore", invalid="ignore"):
            c = grad + residual
        if not np.isfinite(c).all():
            raise_nonfinite(grad, residual)
        q = self._levels(c)
        residual[...] = c - self._values(q, 1)
        n = q.shape[0]
        n_lanes = -(-n // k)
        digits = np.zeros(n_lanes * k, dtype=np.uint64)
        digits[:n] = q
        powers = np.array([radix ** j for j in range(k)], dtype=np.uint64)
        out[:n_lanes] = (digits.reshape(n_lanes, k) * powers).sum(axis=1).astype(np.float64)
        stat = self._statistic(grad, c)
        return None if stat is None else chunk_sum(stat, k)

    def _decode_into(self, lanes_sum, out, num_workers, radix, k):
        n = out.shape[0]
        v = lanes_sum[:-(-n // k)]
        bad = np.count_nonzero(~((v >= 0) & (v < 2.0 ** 53)))
        if bad:
            raise ValueError("%d lanes lie outside [0, 2**53): not a sum of this codec's lanes "
                             "(wrong codec, worker count or corrupted data)" % bad)
        x = v.astype(np.int64)
        powers = np.array([radix ** j for j in range(k)], dtype=np.int64)
        digits = (x[:, None] // powers[None, :]) % radix
        out[...] = self._values(digits.ravel()[:n], num_workers)


class NoneReference(ReferenceMixin, NoneCodec):
    def _encode_into(self, grad, residual, out, radix, k, grad_checked=False):
        with np.errstate(over="ignore", invalid="ignore"):
            c = grad + residual
        if not np.isfinite(c).all():
            raise_nonfinite(grad, residual)
        out[...] = c
        residual[...] = 0

    def _decode_into(self, lanes_sum, out, num_workers, radix, k):
        out[...] = lanes_sum


class TwoBitReference(ReferenceMixin, TwoBit):
    def _levels(self, c):
        t = np.float32(self._threshold)
        return 1 + (c >= t).astype(np.int64) - (c <= -t).astype(np.int64)


class OneBitReference(ReferenceMixin, OneBit):
    def _levels(self, c):
        return (c >= 0).astype(np.int64)

    def _statistic(self, grad, c):
        return np.abs(c).astype(np.float64)


class FourBitReference(ReferenceMixin, FourBit):
    def _levels(self, c):
        a = np.abs(c)
        idx = np.zeros(c.shape[0], dtype=np.int64)
        for x in group_thresholds(self.group):
            idx += a >= x
        u = np.array((0,) + GROUPS[self.group], dtype=np.int64)[idx]
        return MAX_UNITS + np.where(c < 0, -u, u)

    def _statistic(self, grad, c):
        return np.abs(grad).astype(np.float64)
