"""terngrad (Wen et al. 2017): stochastic ternarization to {-s, 0, +s}.

Level q = 1 + sign(c) * [u < min(|c|, s) / s] for c = g + r and u uniform (rng.py),
value s * (q - 1): unbiased for |c| <= s, L = 3, so the workers' levels add in radix
2N+1 lanes. The scale s is shared: every worker appends its statistic in its own slot of
N trailer lanes, the sum puts them side by side, and decode() sets the NEXT push's scale
to their maximum, a value every worker receives identically. The statistic is max |c|,
or with option clip_sigma > 0 (default: the paper's 2.5) min(max |c|, clip_sigma * std(c)):
the paper's clipping of outliers, without which the codec's variance stops training
(docs/results.md, Table 3). What lies above s stays in the residual (the first push has
s = 0: it sends only the statistics and the residual keeps the gradient); the rounding
noise does too only with option error_feedback=true (lanes.NO_FEEDBACK_BY_DEFAULT), which
is refused unless allow_unbiased_feedback=true (lanes.refuse_divergent).
"""
import math

import numpy as np

from . import rng
from .base import Option, Traits, kernels
from .lanes import LaneCodec, LaneReference, SharedScale, UnbiasedFeedback, chunk_sum
from .registry import register


def _clip_stat(top, total, squares, size, clip_sigma):
    """max |c|, or with clipping min(max |c|, clip_sigma * std(c)), as a float32 value."""
    if clip_sigma > 0 and size:
        mean = total / size
        std = math.sqrt(max(squares / size - mean * mean, 0.0))
        top = min(top, clip_sigma * std)
    return float(np.float32(top))


@register
class TernGrad(UnbiasedFeedback, SharedScale, LaneCodec):
    """Ternary levels with a scale shared through gathered trailer values (the max)."""

    name = "terngrad"
    levels = 3
    gathered = 1
    TRAITS = Traits(fuses_local_update=True)
    options = {
        "clip_sigma": Option(float, 2.5, lambda v: 0 <= v < 1e6 and math.isfinite(v),
                             "a number >= 0 (the paper's 2.5; 0: no clipping)"),
        **UnbiasedFeedback.FEEDBACK_OPTIONS,
    }

    def __init__(self, threshold=None, num_threads=None, **options):
        super().__init__(threshold=threshold, num_threads=num_threads, **options)
        self.scale = 0.0

    def _affine(self):
        return self.scale, 1, -1

    def _agree(self, gathered):
        self.scale = float(np.float32(gathered[:, 0].max()))

    def _encode_into(self, grad, residual, out, radix, k, grad_checked=False, local=None):
        rows = self._kernel_result(
            kernels().encode_terngrad(grad, residual, out, self._powers(radix, k),
                                      np.float32(self.scale), self.push_seed(),
                                      self.num_threads, grad_checked,
                                      not self.option_values["error_feedback"], local),
            grad, residual, out)
        return [_clip_stat(float(rows[:, 0].max()) if rows.size else 0.0,
                           self._chunk_order_sum(rows, 1), self._chunk_order_sum(rows, 2),
                           grad.shape[0], self.clip_sigma)]

    # ------------------------------------------------------------ device path (DeviceOps)
    def device_state(self, size, ops):
        """The scale, a float64 0-dim array: decode multiplies by it, encode by its float32
        value (as _affine and the kernel do; they differ only for a loaded scale)."""
        return ops.array(self.scale, "float64")

    def device_levels(self, c, ops):
        s = ops.float32(ops.state)
        inv = ops.where(s > 0, ops.divide(1.0, s), 0.0)
        x = ops.minimum(ops.abs(c), s) * inv
        d = ops.level(ops.uniform(self.push_seed(), c.shape[0]) < x)
        return ops.where(c < 0.0, 1 - d, 1 + d)

    def device_sent(self, c, q, ops):
        s = ops.float32(ops.state)
        if not self.option_values["error_feedback"]:  # what the scale clipped, no noise
            return ops.copysign(ops.minimum(ops.abs(c), s), c)
        return s * ops.float32(q - 1)

    def device_gathered(self, grad, c, ops):
        """_clip_stat of max |c| and of sum c, sum c^2 added in the kernels' order."""
        v = ops.float64(c)
        top = ops.max(ops.abs(v))
        if self.clip_sigma > 0:
            n = c.shape[0]
            sums = ops.chunk_sums(ops.stack([v, v * v], 1), ops.k)
            mean = ops.divide(sums[0], n)
            std = ops.sqrt(ops.maximum(ops.divide(sums[1], n) - mean * mean, 0.0))
            top = ops.minimum(top, std * self.clip_sigma)
        return ops.float64(ops.float32(top)).reshape(1)

    def device_agree(self, gathered, ops):
        return ops.float64(ops.float32(ops.max(gathered[:, 0])))

    def device_values(self, d, num_workers, ops):
        return ops.float32(ops.float64(d - num_workers) * ops.state)

    def adopt_device_state(self, state):
        self.scale = float(state)


@register(reference=True)
class TernGradReference(LaneReference, TernGrad):
    def _clipped(self, c):
        return np.copysign(np.minimum(np.abs(c), np.float32(self.scale)), c)

    def _levels(self, c):
        s = np.float32(self.scale)
        inv = np.float32(1.0) / s if s > 0 else np.float32(0.0)
        x = np.minimum(np.abs(c), s) * inv
        d = (rng.uniform(self.push_seed(), 0, c.shape[0]) < x).astype(np.int64)
        return 1 + np.where(c < 0, -d, d)

    def _statistic(self, grad, c, k):
        v = c.astype(np.float64)
        top = float(np.abs(v).max()) if v.size else 0.0
        return [_clip_stat(top, chunk_sum(v, k), chunk_sum(v * v, k), c.shape[0],
                           self.clip_sigma)]
