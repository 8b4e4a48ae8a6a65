"""qsgd (Alistarh et al. 2017): s levels per sign and bucket, scaled by a shared L2 norm.

Per bucket b of `bucket_size` elements, level q in [0, 2s] decodes to
norm_b * (q - s) / s; x = min(|c| / norm_b, 1) * s for c = g + r is rounded up with
probability x - floor(x) (rng.py), so the value is unbiased for |c| <= norm_b. The norms
are shared, so the workers' levels add in radix 2sN+1 lanes: every worker gathers its
per-bucket L2 norms of c in its slot of the trailer, and decode() sets the NEXT push's
norms to their maximum over workers. What lies above a norm stays in the residual (the
first push has norms 0, sends zeros and keeps the gradient); the rounding noise does too
only with option error_feedback=true (lanes.NO_FEEDBACK_BY_DEFAULT), which is refused
unless allow_unbiased_feedback=true (lanes.refuse_divergent).

The option `levels` is the paper's s (levels per sign); the lane codec's L is 2s + 1.
Buckets lie inside the kernels' chunks (CHUNK_LANES * k elements), so each bucket's norm
is summed by one thread, and 1 and N threads agree bit for bit.
"""
import numpy as np

from . import rng
from .base import Option, Traits, kernels
from .lanes import LaneCodec, LaneReference, UnbiasedFeedback
from .layout import CHUNK_LANES
from .registry import register

#: Smallest normal float32: a norm below it counts as 0 (its inverse would overflow).
TINY = float(np.finfo(np.float32).tiny)
#: Interleaved partial sums per bucket: element e adds its c^2 to partial e % 8.
PARTIALS = 8


def _is_bucket_size(v):
    return 1 <= v <= CHUNK_LANES and v & (v - 1) == 0


def bucket_norms(partials):
    """float32 L2 norms from (buckets, 8) float64 partial sums of c^2, added as a fixed tree."""
    p = partials
    total = ((p[:, 0] + p[:, 1]) + (p[:, 2] + p[:, 3])) + ((p[:, 4] + p[:, 5])
                                                           + (p[:, 6] + p[:, 7]))
    return np.sqrt(total).astype(np.float32)


@register
class QSGD(UnbiasedFeedback, LaneCodec):
    """2s + 1 levels per element with per-bucket norms shared through gathered trailer values."""

    name = "qsgd"
    gathered = 1  # per bucket: gathered_count(size) values per worker
    TRAITS = Traits(fuses_local_update=True)
    options = {
        "levels": Option(int, 16, lambda v: 1 <= v <= 32767,
                         "an integer s in 1..32767 (levels per sign; 2s + 1 levels in all)"),
        "bucket_size": Option(int, 512, _is_bucket_size,
                              "a power of two in 1..%d: a bucket must lie inside one of the "
                              "kernels' chunks of %d lanes * k elements, so that its norm does "
                              "not depend on the thread count" % (CHUNK_LANES, CHUNK_LANES)),
        **UnbiasedFeedback.FEEDBACK_OPTIONS,
    }

    def __init__(self, threshold=None, num_threads=None, **options):
        super().__init__(threshold=threshold, num_threads=num_threads, **options)
        self.s = self.option_values["levels"]
        self.levels = 2 * self.s + 1  # L, the lane codec's level count
        self.bucket = self.option_values["bucket_size"]
        self.norms = None  # float32 per-bucket norms of this push; None: all 0 (first push)

    def gathered_count(self, size):
        """One norm per bucket."""
        return -(-int(size) // self.bucket)

    def _affine(self):
        # The unit value (q - s) / s; decode multiplies it by the bucket's norm.
        return 1.0 / self.s, 1, -self.s

    def _norm_table(self, size):
        """The float32 norms of this push for a tensor of `size` elements."""
        nb = self.gathered_count(size)
        if self.norms is None:
            key = ("zeros", nb)
            if key not in self._cache:
                self._cache[key] = np.zeros(nb, np.float32)
            return self._cache[key]
        if self.norms.shape[0] != nb:
            raise ValueError("qsgd: this instance holds the norms of %d buckets, but %d elements "
                             "make %d; use one codec instance per key (clone())"
                             % (self.norms.shape[0], size, nb))
        return self.norms

    def _agree(self, gathered):
        if (gathered < 0).any():
            raise ValueError("qsgd: a gathered norm is negative; the lanes were not produced by "
                             "this codec")
        self.norms = gathered.max(axis=0).astype(np.float32)

    def state_dict(self):
        state = super().state_dict()
        state["norms"] = None if self.norms is None else self.norms.tolist()
        return state

    def load_state_dict(self, state):
        super().load_state_dict(state)
        norms = state.get("norms")
        if norms is not None:
            norms = np.asarray(norms, dtype=np.float64)
            if norms.ndim != 1 or not (np.isfinite(norms).all() and (norms >= 0).all()):
                raise ValueError("qsgd norms must be a list of finite numbers >= 0")
            norms = norms.astype(np.float32)
        self.norms = norms

    def _check_bucket(self, k):
        if (CHUNK_LANES * k) % self.bucket:
            raise ValueError("qsgd: bucket_size=%d does not divide the kernels' chunk of %d "
                             "elements; use a power of two <= %d"
                             % (self.bucket, CHUNK_LANES * k, CHUNK_LANES))

    def _encode_into(self, grad, residual, out, radix, k, grad_checked=False, local=None):
        self._check_bucket(k)
        n = grad.shape[0]
        rows = self._kernel_result(
            kernels().encode_qsgd(grad, residual, out, self._powers(radix, k),
                                  self._norm_table(n), self.s, self.bucket, self.push_seed(),
                                  self.num_threads, grad_checked,
                                  not self.option_values["error_feedback"], local),
            grad, residual, out)
        nb = self.gathered_count(n)
        return bucket_norms(rows.reshape(-1, PARTIALS)[:nb])

    def _decode_into(self, lanes_sum, out, num_workers, radix, k):
        m, rows = self._rows(num_workers, radix, k, out.shape[0])
        kernels().decode_qsgd(lanes_sum, out, rows, k, m, self._norm_table(out.shape[0]),
                              self.bucket, self.num_threads)

    # ------------------------------------------------------------ device path (DeviceOps)
    def device_state(self, size, ops):
        """The norms of this push, float32, one per bucket."""
        return ops.array(self._norm_table(size), "float32")

    def _device_inverse(self, n, ops):
        """1 / norm (0 for a norm below TINY) of each element's bucket."""
        norms = ops.state
        return ops.repeat(ops.where(norms >= TINY, ops.divide(1.0, norms), 0.0),
                          self.bucket, n)

    def device_levels(self, c, ops):
        n = c.shape[0]
        x = ops.minimum(ops.abs(c) * self._device_inverse(n, ops), 1.0) * float(self.s)
        low = ops.floor(x)
        m = ops.to_level(low) + ops.level(ops.uniform(self.push_seed(), n) < x - low)
        return ops.where(c < 0.0, self.s - m, self.s + m)

    def _device_units(self, d, num_workers, ops):
        """float32(double(1/s) * (D - N*s)): the unit value of digit sums D of N workers."""
        return ops.float32(ops.float64(d - num_workers * self.s) * (1.0 / self.s))

    def device_sent(self, c, q, ops):
        n, norms = c.shape[0], ops.state
        if not self.option_values["error_feedback"]:  # what the norms clipped, no noise
            cap = ops.repeat(ops.where(norms >= TINY, norms, 0.0), self.bucket, n)
            return ops.copysign(ops.minimum(ops.abs(c), cap), c)
        return self._device_units(q, 1, ops) * ops.repeat(norms, self.bucket, n)

    def device_gathered(self, grad, c, ops):
        """The bucket norms: partial sums of c^2 (element e into partial e % 8), each added
        in element order, then bucket_norms' tree."""
        self._check_bucket(ops.k)
        n = c.shape[0]
        nb = self.gathered_count(n)
        v = ops.float64(c)
        sq = v * v
        if self.bucket >= PARTIALS:
            p = ops.run_sums(sq, self.bucket // PARTIALS, PARTIALS)
        else:
            e = ops.arange(n)
            p = ops.scatter(nb * PARTIALS, (e // self.bucket) * PARTIALS + e % PARTIALS,
                            sq).reshape(nb, PARTIALS)
        total = ((p[:, 0] + p[:, 1]) + (p[:, 2] + p[:, 3])) + ((p[:, 4] + p[:, 5])
                                                              + (p[:, 6] + p[:, 7]))
        return ops.float64(ops.float32(ops.sqrt(total)))

    def device_agree(self, gathered, ops):
        return ops.float32(ops.max(gathered, axis=0))

    def device_values(self, d, num_workers, ops):
        return self._device_units(d, num_workers, ops) * ops.repeat(ops.state, self.bucket,
                                                                     d.shape[0])

    def adopt_device_state(self, state):
        self.norms = np.asarray(state, dtype=np.float32)


@register(reference=True)
class QSGDReference(LaneReference, QSGD):
    def _element_norms(self, n):
        return np.repeat(self._norm_table(n), self.bucket)[:n]

    def _levels(self, c):
        norms = self._element_norms(c.shape[0])
        with np.errstate(divide="ignore"):
            inv = np.where(norms >= TINY, np.float32(1) / norms, np.float32(0))
        x = np.minimum(np.abs(c) * inv, np.float32(1)) * np.float32(self.s)
        low = np.floor(x)
        up = rng.uniform(self.push_seed(), 0, c.shape[0]) < x - low
        m = low.astype(np.int64) + up
        return self.s + np.where(c < 0, -m, m)

    def _sent_values(self, levels):
        return self._values(levels, 1) * self._element_norms(levels.shape[0])

    def _clipped(self, c):
        norms = self._element_norms(c.shape[0])
        cap = np.where(norms >= TINY, norms, np.float32(0))
        return np.copysign(np.minimum(np.abs(c), cap), c)

    def _statistic(self, grad, c, k):
        self._check_bucket(k)
        n = c.shape[0]
        nb = self.gathered_count(n)
        sq = c.astype(np.float64) ** 2
        partials = np.zeros((nb, PARTIALS), np.float64)
        e = np.arange(n)
        if nb and self.bucket >= PARTIALS:  # (no bucket: no norm; reshape refuses (0, -1))
            padded = np.zeros(nb * self.bucket, np.float64)
            padded[:n] = sq
            partials[...] = np.cumsum(padded.reshape(nb, -1, PARTIALS), axis=1)[:, -1]
        else:
            partials[e // self.bucket, e % PARTIALS] = sq
        return bucket_norms(partials)

    def _decode_into(self, lanes_sum, out, num_workers, radix, k):
        LaneReference._decode_into(self, lanes_sum, out, num_workers, radix, k)
        out *= self._element_norms(out.shape[0])

