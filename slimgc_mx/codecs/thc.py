"""thc (Li et al., NSDI '24): uniform homomorphic quantization with a shared range.

Every worker clamps c = g + r to [-M, M] and rounds it stochastically to one of
`granularity` levels on a uniform grid: level q in [0, g-1] decodes to
step * (q - (g-1)/2), step = float32(2M / (g-1)), so the grid runs from -M to M
(up to rounding) and is affine with parameters all workers share: their levels add
exactly in radix N(g-1)+1 lanes, which the stock servers sum (THC's own servers sum
table indices). M is shared like terngrad's scale: each worker gathers its max |c| in
its slot of the trailer, and decode() sets the NEXT push's M to the maximum over
workers; what the clamp cuts off stays in the residual, and the first push (M = 0)
sends zeros.

Option hadamard=True rotates c first, y = H D c / sqrt(P) with random signs D drawn
per push from the shared RNG and the tensor zero-padded to P = 2**ceil(log2 n), and
quantizes y (the statistic is then max |y|); the decoded sum is rotated back. The
residual stays in the original domain: it is c minus the rotated-back one-worker
value, so error feedback is exact as for every other codec.
"""
from dataclasses import replace

import numpy as np

from . import rng
from .base import NonFiniteGradientError, Option, Traits, kernels, raise_nonfinite
from .lanes import (ALLOW_UNBIASED_FEEDBACK, LaneCodec, LaneReference, SharedScale, pack_lanes,
                    refuse_divergent)
from .registry import register

FLT_MAX = float(np.finfo(np.float32).max)
#: Salt of the rotation's sign stream, so signs and rounding draws are independent.
SIGN_SALT = 0x48414441


def padded_size(size):
    """P: the power of two >= size that the rotation works on (0 stays 0)."""
    return 1 << (size - 1).bit_length() if size > 1 else size


@register
class THC(SharedScale, LaneCodec):
    """Uniform levels on [-M, M], M shared through gathered trailer values (the max)."""

    name = "thc"
    gathered = 1
    TRAITS = Traits(fuses_local_update=True)
    options = {
        "granularity": Option(int, 16, lambda v: 2 <= v <= 65536,
                              "an integer in 2..65536 (levels of the uniform grid)"),
        "hadamard": Option(bool, False, lambda v: True,
                           "true or false (rotate by a randomized Hadamard transform)"),
        "allow_unbiased_feedback": ALLOW_UNBIASED_FEEDBACK,
    }
    scale_rule = "a float32 value in [0, 3.4e38]"

    def check_options(self):
        """Fewer than 4 levels diverge: error feedback (always on) keeps rounding errors up to
        a step 2M/(g-1) >= M, which raise the next push's M as much as they came from it."""
        if self.option_values["granularity"] < 4:
            refuse_divergent(self, "granularity=%d (with error feedback, always on in thc)"
                             % self.option_values["granularity"],
                             "use granularity >= 4 (the default is 16)")

    def declare_traits(self):
        """The rotation's own pass reads the gradient first, and its decode rotates back:
        with it, neither the fused local update nor the table decode."""
        t = super().declare_traits()
        return replace(t, fuses_local_update=t.fuses_local_update and not self.hadamard,
                       decodes_by_table=not self.hadamard)

    @staticmethod
    def _valid_scale(scale):
        return 0 <= scale <= FLT_MAX and scale == float(np.float32(scale))

    def __init__(self, threshold=None, num_threads=None, **options):
        super().__init__(threshold=threshold, num_threads=num_threads, **options)
        self.levels = self.option_values["granularity"]
        self.scale = 0.0  # M of this push, a float32 value

    # ------------------------------------------------------------ shared state
    def _grid(self):
        """float32 (M, 1/step, step) of this push; all 0 while M is 0."""
        m = self.scale
        if m == 0:
            return np.zeros(3, np.float32)
        gm1 = self.levels - 1
        return np.array([m, gm1 / (2.0 * m), 2.0 * m / gm1], np.float32)

    def _affine(self):
        return float(self._grid()[2]), 1, -(self.levels - 1) / 2.0

    def _agree(self, gathered):
        m = float(np.float32(gathered[:, 0].max()))
        if not m >= 0:
            raise ValueError("thc: a gathered maximum is negative; the lanes were not produced "
                             "by this codec")
        # A range whose inverse step overflows float32 is too small to quantize: treat as 0.
        if m and (self.levels - 1) / (2.0 * m) > FLT_MAX:
            m = 0.0
        self.scale = m

    # ------------------------------------------------------------ geometry
    def lane_count(self, size, num_workers):
        """Lanes for `size` elements; with hadamard, of the padded P elements."""
        n = super().lane_count(size, num_workers)
        if not self.hadamard:
            return n
        _, k = self.geometry(num_workers)
        return n - (-(-int(size) // k)) + (-(-padded_size(int(size)) // k))

    def _sign_seed(self):
        return rng.mix64(self.push_seed() ^ SIGN_SALT)

    def _scratch(self, name, size):
        key = ("scratch", name, size)
        if key not in self._cache:
            self._cache[key] = np.empty(size, np.float32)
        return self._cache[key]

    def _factor(self, p):
        """float32 1/sqrt(P): the rotation's normalization."""
        return np.float32(1.0 / np.sqrt(p)) if p else np.float32(1)

    # ------------------------------------------------------------ kernels
    def _levels_into(self, c, residual, out, radix, k, grad_checked, local=None):
        """Levels of c into out (residual: c's own memory, or zeros); returns [max |c|]."""
        rows = self._kernel_result(
            kernels().encode_thc(c, residual, out, self._powers(radix, k), self._grid(),
                                 self.levels, self.push_seed(), self.num_threads,
                                 grad_checked, local),
            c, residual, out)
        return [float(rows[:, 0].max()) if rows.size else 0.0]

    def _encode_into(self, grad, residual, out, radix, k, grad_checked=False, local=None):
        if not self.hadamard:
            return self._levels_into(grad, residual, out, radix, k, grad_checked, local)
        n = grad.shape[0]
        p = padded_size(n)
        y = self._scratch("y", p)
        z = self._scratch("z", p)
        seed, f = self._sign_seed(), self._factor(p)
        if kernels().thc_rotate(grad, residual, y, seed, f, self.num_threads):
            _rotation_overflow(grad, residual)
        z.fill(0.0)
        stat = self._levels_into(y, z, out, radix, k, True)
        # v = the one-worker values of the levels just packed: the decoder's table for N = 1
        m, rows = self._rows(1, radix, k, p)
        kernels().decode_lanes(out, z, rows, k, m, self.num_threads)
        kernels().thc_unrotate(z, None, grad, residual, seed, f, self.num_threads)
        return stat

    def _decode_into(self, lanes_sum, out, num_workers, radix, k):
        if not self.hadamard:
            return LaneCodec._decode_into(self, lanes_sum, out, num_workers, radix, k)
        p = padded_size(out.shape[0])
        v = self._scratch("v", p)
        m, rows = self._rows(num_workers, radix, k, p)
        kernels().decode_lanes(lanes_sum, v, rows, k, m, self.num_threads)
        kernels().thc_unrotate(v, out, None, None, self._sign_seed(), self._factor(p),
                               self.num_threads)

    # ------------------------------------------------------------ device path (DeviceOps)
    def device_state(self, size, ops):
        """M of this push, a float32 0-dim array."""
        return ops.array(np.float32(self.scale), "float32")

    def _device_grid(self, ops):
        """_grid() on the device: float32 (M, 1/step, step), all 0 while M is 0."""
        m = ops.state
        md, gm1 = ops.float64(m), float(self.levels - 1)
        inv = ops.where(m > 0, ops.float32(ops.divide(gm1, 2.0 * md)), 0.0)
        step = ops.where(m > 0, ops.float32(ops.divide(2.0 * md, gm1)), 0.0)
        return m, inv, step

    def levelled_count(self, size):
        return padded_size(size) if self.hadamard else size

    def _device_signs(self, p, ops):
        return ops.where(ops.uniform(self._sign_seed(), p) < 0.5, 1.0, -1.0)

    def _device_fwht(self, x, ops):
        h = 1
        while h < x.shape[0]:
            x = ops.butterfly(x, h)
            h *= 2
        return x

    def device_transform(self, c, ops):
        """With hadamard: y = f * H(D c) zero-padded to P (the kernels' thc_rotate)."""
        if not self.hadamard:
            return None
        n = c.shape[0]
        p = padded_size(n)
        y = ops.pad(self._device_signs(p, ops)[:n] * c, p)
        return self._device_fwht(y, ops) * float(self._factor(p))

    def device_untransform(self, v, size, ops):
        """With hadamard: D (f * H v), the first `size` elements (thc_unrotate)."""
        if not self.hadamard:
            return v
        p = v.shape[0]
        t = self._device_fwht(v, ops)
        return (self._device_signs(p, ops) * (t * float(self._factor(p))))[:size]

    def transform_overflow(self, grad, residual):
        _rotation_overflow(grad, residual)

    def device_levels(self, y, ops):
        m, inv, _ = self._device_grid(ops)
        gm1 = float(self.levels - 1)
        x = ops.minimum((ops.minimum(ops.maximum(y, -m), m) + m) * inv, gm1)
        low = ops.floor(x)
        return ops.to_level(low) + ops.level(ops.uniform(self.push_seed(), y.shape[0])
                                             < x - low)

    def device_sent(self, y, q, ops):
        # step * (q - (g-1)/2) in float32: the one-worker value bit for bit (the kernel's)
        _, _, step = self._device_grid(ops)
        return step * (ops.float32(q) - 0.5 * (self.levels - 1))

    def device_gathered(self, grad, y, ops):
        return ops.float64(ops.max(ops.abs(y))).reshape(1)

    def device_agree(self, gathered, ops):
        m = ops.float32(ops.max(gathered[:, 0]))
        # a range whose inverse step overflows float32 counts as 0 (_agree)
        tiny = (m != 0) & (ops.divide(float(self.levels - 1), 2.0 * ops.float64(m)) > FLT_MAX)
        return ops.where(tiny, 0.0, m)

    def device_values(self, d, num_workers, ops):
        _, _, step = self._device_grid(ops)
        b = -(self.levels - 1) / 2.0
        return ops.float32((ops.float64(d) + num_workers * b) * ops.float64(step))

    def adopt_device_state(self, state):
        self.scale = float(np.float32(state))


def _rotation_overflow(grad, residual):
    """Raise for a non-finite rotation: a NaN/Inf input, or finite values near float32's
    limit whose sums overflow."""
    if not (np.isfinite(grad).all() and np.isfinite(grad + residual).all()):
        raise_nonfinite(grad, residual)
    raise NonFiniteGradientError(
        "thc: the Hadamard rotation of grad + residual overflows float32 (|values| near "
        "3.4e38); residual and out were not modified; scale the gradient down or use "
        "hadamard=False")


def fwht(x):
    """The unnormalized Walsh-Hadamard transform of a float32 power-of-two-length array, in
    place, stage by stage for h = 1, 2, 4, ... (the kernels' order, so bitwise the same)."""
    p = x.shape[0]
    h = 1
    while h < p:
        v = x.reshape(-1, 2, h)
        a = v[:, 0, :].copy()
        b = v[:, 1, :]
        v[:, 0, :] = a + b
        v[:, 1, :] = a - b
        h *= 2
    return x


def signs(seed, p):
    """float32 +-1 of the rotation's diagonal D for P elements."""
    return np.where(rng.uniform(seed, 0, p) < np.float32(0.5), np.float32(1), np.float32(-1))


@register(reference=True)
class THCReference(LaneReference, THC):
    def _levels(self, y):
        m, inv, _ = self._grid()
        gm1 = np.float32(self.levels - 1)
        x = np.minimum((np.minimum(np.maximum(y, -m), m) + m) * inv, gm1)
        low = np.floor(x)
        up = rng.uniform(self.push_seed(), 0, y.shape[0]) < x - low
        return low.astype(np.int64) + up

    def _statistic(self, grad, c, k):
        return [float(np.abs(c).max()) if c.size else 0.0]

    def _rotate(self, c, p):
        y = np.zeros(p, np.float32)
        y[:c.shape[0]] = signs(self._sign_seed(), p)[:c.shape[0]] * c
        return fwht(y) * self._factor(p)

    def _unrotate(self, v, n):
        p = v.shape[0]
        t = fwht(v.copy())
        return (signs(self._sign_seed(), p) * (t * self._factor(p)))[:n]

    def _encode_into(self, grad, residual, out, radix, k, grad_checked=False, local=None):
        if not self.hadamard:
            return LaneReference._encode_into(self, grad, residual, out, radix, k)
        c = self.compensated(grad, residual)
        n = c.shape[0]
        with np.errstate(over="ignore", invalid="ignore"):
            y = self._rotate(c, padded_size(n))
        if not np.isfinite(y).all():
            _rotation_overflow(grad, residual)
        q = self._levels(y)
        self.feedback.update(residual, c, self._unrotate(self._values(q, 1), n))
        pack_lanes(q, out, radix, k)
        return self._statistic(grad, y, k)

    def _decode_into(self, lanes_sum, out, num_workers, radix, k):
        if not self.hadamard:
            return LaneReference._decode_into(self, lanes_sum, out, num_workers, radix, k)
        v = np.empty(padded_size(out.shape[0]), np.float32)
        LaneReference._decode_into(self, lanes_sum, v, num_workers, radix, k)
        out[...] = self._unrotate(v, out.shape[0])
