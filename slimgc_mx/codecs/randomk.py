"""randomk: shared-seed random sparsification, k float32 values each way, error feedback.

Every worker draws the same k = round(ratio * n) indices from the push's seed
(Codec.push_seed(): job seed, key, step): one index per stratum [s*n//k, (s+1)*n//k),
so the k indices are distinct, identical on every worker and independent of the thread
count, and no index travels. Only the k values of c = g + r at those indices are sent;
the servers add them, decode scatters the sum into zeros, and the residual keeps the rest.
"""
import math
import numbers

import numpy as np

from . import rng
from .base import (Codec, Option, Traits, check_disjoint, check_num_workers, check_vector,
                   kernels, output, raise_nonfinite)
from .registry import register

#: The smallest ratio tried that trained every job of docs/codecs.md ("Defaults that train")
#: with momentum 0.9: an element goes out about once per 1/ratio pushes with all it
#: accumulated, and at ratios 0.01 to 0.25 momentum made that diverge or oscillate.
STABLE_WITH_MOMENTUM = 0.5
#: Largest tensor randomk takes: stratum arithmetic s * n stays in int64.
MAX_SIZE = (1 << 31) - 1


def strata_indices(seed, n, k):
    """The k indices of a push keyed by `seed`: lo_s + floor(u_s * width_s) per stratum s,
    u_s = rng.uniform(seed, s) (the kernels' _rk_index, bit for bit)."""
    s = np.arange(k, dtype=np.int64)
    lo = s * n // k
    width = (s + 1) * n // k - lo
    u = rng.uniform(seed, 0, k).astype(np.float64)
    return lo + (u * width).astype(np.int64)


@register
class RandomK(Codec):
    """k values of the compensated gradient at shared random indices, summed by the servers."""

    name = "randomk"
    wire_dtype = np.dtype(np.float32)
    options = {"ratio": Option(float, STABLE_WITH_MOMENTUM,
                               lambda v: math.isfinite(v) and 0 < v <= 1,
                               "a number in (0, 1]: the fraction of elements sent")}

    def momentum_advice(self, momentum):
        """Below STABLE_WITH_MOMENTUM, momentum amplifies the stale accumulated steps that
        error feedback sends."""
        if momentum and self.ratio < STABLE_WITH_MOMENTUM:
            return ("codec 'randomk': ratio=%g with optimizer momentum %g: with error feedback an "
                    "element goes out about once per 1/ratio pushes with all it accumulated, "
                    "which momentum amplifies; with momentum 0.9, ratios 0.01 to 0.25 diverged "
                    "or oscillated (docs/codecs.md, \"Defaults that train\"): use ratio >= %g "
                    "or momentum 0" % (self.ratio, momentum, STABLE_WITH_MOMENTUM))
        return None

    def count(self, size):
        """k: values sent for `size` elements, round(ratio * size), at least 1, at most size."""
        if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 0:
            raise ValueError("size must be an integer >= 0, got %r" % (size,))
        if size > MAX_SIZE:
            raise ValueError("randomk takes tensors of at most 2**31 - 1 elements, got %d; "
                             "split the parameter" % size)
        size = int(size)
        return min(size, max(1, int(round(self.ratio * size)))) if size else 0

    def residual_fill(self, size):
        """size / k pushes: an element is drawn about once in that many."""
        return size / self.count(size) if size else 0

    def lane_count(self, size, num_workers):
        """k float32 values, whatever the number of workers."""
        check_num_workers(num_workers)
        return self.count(size)

    def wire_bits_per_element(self, num_workers):
        """32 * k / n = 32 * ratio (up to the rounding of k), independent of N."""
        check_num_workers(num_workers)
        return 32.0 * self.ratio

    def wire_rounds(self, size, shape, num_workers):
        """One 'sum' round of k float32."""
        k = self.lane_count(size, num_workers)
        return [("sum", (k,), (k,), self.wire_dtype)]

    def encode(self, grad, residual, num_workers, out=None, grad_checked=False, rank=0):
        """out = the k values of grad + residual at this push's indices; residual = grad +
        residual with those elements zeroed. NaN/Inf as for the lane codecs (docs/codecs.md)."""
        check_num_workers(num_workers)
        check_vector("grad", grad, np.float32)
        check_vector("residual", residual, np.float32, writeable=True, length=grad.shape[0])
        k = self.count(grad.shape[0])
        out = output(out, k, self.wire_dtype)
        check_disjoint(grad=grad, residual=residual, out=out)
        self._encode_into(grad, residual, out, grad_checked)
        return out

    def decode(self, wire_sum, size, num_workers, out=None):
        """float32 (size,): zeros, with the summed values at this push's indices."""
        check_num_workers(num_workers)
        k = self.count(size)
        check_vector("wire_sum", wire_sum, self.wire_dtype, length=k)
        out = output(out, size, np.float32)
        check_disjoint(wire_sum=wire_sum, out=out)
        self._decode_into(wire_sum, out)
        self.pushes += 1
        return out

    def _encode_into(self, grad, residual, out, grad_checked):
        bad_grad, bad_sum = kernels().encode_randomk(grad, residual, out, self.push_seed(),
                                                     self.num_threads, grad_checked)
        if bad_grad:
            raise_nonfinite(grad, residual)
        if bad_sum:
            raise_nonfinite(grad, residual, out)

    def _decode_into(self, wire_sum, out):
        kernels().decode_randomk(wire_sum, out, self.push_seed(), self.num_threads)

    # ------------------------------------------------------------ device path (DeviceOps)
    def _device_indices(self, n, ops):
        """strata_indices in DeviceOps: lo + floor(u * width) per stratum, in double."""
        k = self.count(n)
        s = ops.arange(k)
        lo = s * n // k
        width = (s + 1) * n // k - lo
        u = ops.float64(ops.uniform(self.push_seed(), k))
        return lo + ops.to_level(u * ops.float64(width))

    def device_encode(self, c, ops):
        """(the k values of c at this push's indices, what error feedback subtracts: those
        values there, zeros elsewhere), for a torch device codec."""
        idx = self._device_indices(c.shape[0], ops)
        values = c[idx]
        return values, ops.scatter(c.shape[0], idx, values)

    def device_decode(self, wire_sum, size, ops):
        """float32 (size,): zeros, with the summed values at this push's indices."""
        return ops.scatter(size, self._device_indices(size, ops), wire_sum)


@register(reference=True)
class RandomKReference(RandomK):
    """The NumPy oracle: the same indices, gather and scatter."""

    TRAITS = Traits(reference=True)

    def _encode_into(self, grad, residual, out, grad_checked):
        c = self.compensated(grad, residual)
        idx = strata_indices(self.push_seed(), c.shape[0], out.shape[0])
        out[...] = c[idx]
        sent = np.zeros_like(c)
        sent[idx] = out
        self.feedback.update(residual, c, sent)

    def _decode_into(self, wire_sum, out):
        out.fill(0.0)
        out[strata_indices(self.push_seed(), out.shape[0], wire_sum.shape[0])] = wire_sum
