"""Aggregatable lanes: integer levels packed in floats so that a stock server's sum is exact.

A lane codec maps each element to a level q in [0, L-1] whose value is affine with a
scale every worker shares: value = scale * (a*q + b). It packs k levels per float64
lane in radix R = N*(L-1)+1 (R**k <= 2**53), so that the server's float sum of N
workers' lanes is exactly the packing of the level sums (no carry, no rounding), and
decode() unpacks digit sums D into scale * (a*D + N*b). A codec whose shared state
moves appends trailer lanes: either one lane whose sum is the workers' summed statistic
(the 1bit scale, the 4bit group: `trailer_lanes`), or N slots of `gathered` values, worker
j's in slot j and zeros elsewhere, so that the sum is every worker's values side by side
(a maximum over workers, per-bucket norms). Every worker receives the same sum, so
decode() updates every worker's state alike.

LaneCodec drives the compiled kernels; LaneReference is the NumPy implementation of
the same arithmetic, bitwise equal, the test oracle. A codec file gives `_levels`
(NumPy), `device_levels` (its rule once in array ops that each adapter's device codec
hands it: MXNet's NDArrays, torch's tensors; DeviceOps) and its kernel entry point.
"""
import functools
import math
import numbers
import warnings
from dataclasses import replace

import numpy as np

from .base import (Codec, Option, check_disjoint, check_grad_residual, check_num_workers,
                   check_vector, kernels, output, raise_nonfinite)
from .layout import CHUNK_LANES, ROW

#: Largest integer below which every integer is exact in float64.
EXACT_LIMIT = 2 ** 53
#: Most rows in a decoder table (ROW * 4 bytes each: 512 KiB, an L2 cache's worth).
MAX_ROWS = 16384


def lane_geometry(levels, num_workers, name="codec"):
    """(R, k): radix R = N*(L-1)+1 and the most digits k with R**k <= 2**53."""
    n = check_num_workers(num_workers)
    radix = n * (levels - 1) + 1
    if radix > EXACT_LIMIT:
        raise ValueError("%s: %d workers need radix %d > 2**53, so not even one element fits "
                         "a float64 lane exactly; use fewer workers or codec 'none'"
                         % (name, n, radix))
    k, p = 0, 1
    while p * radix <= EXACT_LIMIT:
        p *= radix
        k += 1
    return radix, k


def affine_values(digit_sums, scale, a, b, num_workers):
    """The decoded sum: float32(double(scale) * (a*D + N*b)) for integer digit sums D."""
    d = np.asarray(digit_sums, dtype=np.int64)
    return (scale * (a * d + num_workers * b).astype(np.float64)).astype(np.float32)


@functools.lru_cache(maxsize=64)
def _decode_rows(radix, m, scale, a, b, num_workers):
    s = np.arange(radix ** m, dtype=np.int64)
    digits = (s[:, None] // (radix ** np.arange(m, dtype=np.int64))[None, :]) % radix
    rows = np.zeros((radix ** m, ROW), dtype=np.float32)
    rows[:, :m] = affine_values(digits, scale, a, b, num_workers)
    rows = rows.ravel()
    rows.setflags(write=False)
    return rows


def pack_lanes(levels, out, radix, k):
    """out[:ceil(n/k)] = sum_j q_j * R**j over each lane's k levels (int64 `levels`, n of them)."""
    n = levels.shape[0]
    n_lanes = -(-n // k)
    digits = np.zeros(n_lanes * k, dtype=np.uint64)
    digits[:n] = levels
    powers = np.array([radix ** j for j in range(k)], dtype=np.uint64)
    out[:n_lanes] = (digits.reshape(n_lanes, k) * powers).sum(axis=1).astype(np.float64)


def chunk_sum(values, k):
    """Sum float64 `values` the kernels' way: in order within chunks of CHUNK_LANES*k, then
    the chunk sums in order; deterministic and independent of the thread count."""
    n = values.shape[0]
    if n == 0:
        return 0.0
    block = CHUNK_LANES * k
    nb = -(-n // block)
    padded = np.zeros(nb * block, dtype=np.float64)
    padded[:n] = values
    partials = np.cumsum(padded.reshape(nb, block), axis=1)[:, -1]
    total = 0.0
    for p in partials.tolist():
        total += p
    return total


#: The `error_feedback` option of an unbiased quantizer (terngrad, qsgd). Off by default:
#: their rounding noise can exceed the gradient and would pile up in the residual
#: (docs/codecs.md has the measurement), so the residual keeps only what the shared,
#: previous-step scale clipped (a reference codec gives `_clipped(c)`). On, it is refused
#: unless ALLOW_UNBIASED_FEEDBACK overrides (refuse_divergent).
NO_FEEDBACK_BY_DEFAULT = Option(
    bool, False, lambda v: True,
    "true or false (true: the residual keeps everything a push does not send, noise "
    "included, as the biased codecs do; needs allow_unbiased_feedback=true)")

#: The override of refuse_divergent: run a combination known to diverge, warned once.
ALLOW_UNBIASED_FEEDBACK = Option(
    bool, False, lambda v: True,
    "true or false (true: run an unbiased quantizer's rounding noise through error "
    "feedback although it is known to diverge; warned once)")

#: Why error feedback on an unbiased quantizer diverges, as the refusal says it.
NOISE_GROWS = ("keeps the unbiased quantizer's rounding noise in the residual, where it "
               "comes back larger at every push until training diverges (docs/codecs.md, "
               "\"Error feedback on unbiased quantizers\")")
_WARNED = set()  # (codec, setting) overrides already warned about in this process


def refuse_divergent(codec, setting, fix):
    """Refuse `setting` of `codec` (ValueError: the option, why it diverges, `fix` and the
    override), or with allow_unbiased_feedback=true warn once per process and go on."""
    why = "codec %r: %s %s" % (codec.name, setting, NOISE_GROWS)
    if not codec.option_values["allow_unbiased_feedback"]:
        raise ValueError("%s; %s, or pass allow_unbiased_feedback=true to run it anyway"
                         % (why, fix))
    if (codec.name, setting) not in _WARNED:
        _WARNED.add((codec.name, setting))
        warnings.warn("%s; running it because allow_unbiased_feedback=true" % why,
                      UserWarning, stacklevel=2)


class UnbiasedFeedback:
    """Mixin of an unbiased quantizer (terngrad, qsgd): its two feedback options
    (FEEDBACK_OPTIONS, merged into the codec's `options`) and the refusal of
    error_feedback=true unless allow_unbiased_feedback=true overrides it."""

    FEEDBACK_OPTIONS = {"error_feedback": NO_FEEDBACK_BY_DEFAULT,
                        "allow_unbiased_feedback": ALLOW_UNBIASED_FEEDBACK}

    def check_options(self):
        """error_feedback=true diverges (NO_FEEDBACK_BY_DEFAULT): refused unless overridden."""
        if self.option_values["error_feedback"]:
            refuse_divergent(self, "error_feedback=true",
                             "leave error_feedback false (the default)")


class LaneCodec(Codec):
    """A codec whose workers' levels add exactly in float64 lanes.

    Subclasses set `levels` (L), `trailer_lanes` and implement `_affine`, `_encode_into`
    (the kernel call), `device_levels` (the rule in DeviceOps, for either adapter's device
    codec), and `_agree` when they carry a trailer statistic.
    """

    levels = None
    trailer_lanes = 0  # lanes whose sum over workers is a statistic (mean via / N)
    gathered = 0  # values per worker gathered side by side in N slots of trailer lanes

    # ------------------------------------------------------------ geometry
    def geometry(self, num_workers):
        """(R, k): lane radix and elements per lane for `num_workers`."""
        key = ("geometry", check_num_workers(num_workers), self.levels)
        if key not in self._cache:
            self._cache[key] = lane_geometry(self.levels, key[1], self.name)
        return self._cache[key]

    def round_levels(self):
        """L of the lanes of each round wire_rounds() declares (one round: the codec's)."""
        return (self.levels,)

    def lane_count(self, size, num_workers):
        """Length of the lanes array for `size` elements (trailer lanes included)."""
        return (self.body_lanes(size, num_workers) + self.trailer_lanes
                + num_workers * self.gathered_count(size))

    def piece_elements(self, size, num_workers, lane_bounds):
        if not self.traits.encodes_by_piece or self.trailer_lanes or self.gathered_count(size):
            return None
        _, k = self.geometry(num_workers)
        if lane_bounds[-1][1] != self.body_lanes(size, num_workers):
            raise ValueError("lane ranges end at %d, %d elements have %d lanes"
                             % (lane_bounds[-1][1], size, self.body_lanes(size, num_workers)))
        return [(lo * k, min(hi * k, size)) for lo, hi in lane_bounds]

    def body_lanes(self, size, num_workers):
        """The lanes that hold `size` elements' digits: the first ceil(size / k)."""
        if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 0:
            raise ValueError("size must be an integer >= 0, got %r" % (size,))
        _, k = self.geometry(num_workers)
        return -(-int(size) // k)

    def gathered_count(self, size):
        """Values this codec gathers per worker for a tensor of `size` elements."""
        return self.gathered

    def wire_bits_per_element(self, num_workers):
        """Bits per element on the wire, each direction (per-tensor trailer lanes excluded)."""
        _, k = self.geometry(num_workers)
        return 8.0 * self.wire_dtype.itemsize / k

    # ------------------------------------------------------------ values
    def _affine(self):
        """(scale, a, b): a level q decodes to scale * (a*q + b)."""
        raise NotImplementedError

    def _values(self, digit_sums, num_workers):
        """float32(double(scale) * (a*D + N*b)) for integer digit sums D of N workers."""
        scale, a, b = self._affine()
        return affine_values(digit_sums, float(scale), a, b, num_workers)

    def own_values(self):
        """Decoded value of each level for one worker: what error feedback subtracts."""
        affine = self._affine()
        cached = self._cache.get("own")
        if cached is None or cached[0] != affine:   # the state moved (1bit scale)
            cached = self._cache["own"] = (affine, self._values(np.arange(self.levels), 1))
        return cached[1]

    def _powers(self, radix, k):
        key = ("powers", radix, k)
        if key not in self._cache:
            self._cache[key] = np.array([radix ** j for j in range(k)], dtype=np.uint64)
        return self._cache[key]

    def _rows(self, num_workers, radix, k, size):
        """Decoder table (m, rows): R**m rows of ROW float32, row s = values of the m
        radix-R digits of s. Rows are capped by MAX_ROWS and, so that building the
        table never outweighs decoding, by the size; tables are shared by all
        instances with the same parameters."""
        limit = min(MAX_ROWS, max(radix, size // 4))
        m = 1
        while m < min(ROW, k) and radix ** (m + 1) <= limit:
            m += 1
        scale, a, b = self._affine()
        return m, _decode_rows(radix, m, float(scale), a, b, num_workers)

    # ------------------------------------------------------------ encode / decode
    def encode(self, grad, residual, num_workers, out=None, grad_checked=False, rank=0,
               local=None):
        """Compensate, quantize and pack: returns the lanes; `residual` is updated in place.

        grad, residual: 1-D C-contiguous float32 of equal length. NaN/Inf in grad raises
        NonFiniteGradientError before residual or out is touched (a read-only pass runs
        first); a non-finite grad + residual (float32 overflow, or a non-finite residual
        handed in) raises it too, found while encoding (see docs/codecs.md).
        grad_checked=True: the caller has already found grad finite (the kvstore's local
        update counts it), so the read-only pass is skipped; a non-finite grad is still
        found, while encoding, after residual and out were written.
        rank: this worker's slot of gathered values.
        local: a kernels.LocalSGD (codecs that fuses_local_update): the backup's local
        SGD step runs in the same pass over grad, tile by tile, and writes local.output;
        grad is then checked as with grad_checked=True.
        """
        if local is not None and not self.traits.fuses_local_update:
            raise TypeError("%s cannot run the local update in its encoder; call encode "
                            "without local" % self.name)
        n_workers = check_num_workers(num_workers)
        radix, k = self.geometry(n_workers)
        size = check_grad_residual(grad, residual)
        n_lanes = self.lane_count(size, n_workers)
        out = output(out, n_lanes, self.wire_dtype)
        arrays = dict(grad=grad, residual=residual, out=out)
        if local is not None:
            arrays["local_output"] = local.output
        check_disjoint(**arrays)
        stat = self._encode_into(grad, residual, out, radix, k, grad_checked, local)
        if self.trailer_lanes:
            out[-1] = stat / size if size else 0.0
        t = self.gathered_count(size)
        if t:
            if not 0 <= rank < n_workers:
                raise ValueError("rank must be in 0..%d, got %r" % (n_workers - 1, rank))
            slots = out[n_lanes - n_workers * t:]
            slots.fill(0.0)
            slots[rank * t:(rank + 1) * t] = stat
        return out

    def decode(self, lanes_sum, size, num_workers, out=None):
        """Sum over workers of the decoded values, float32 (size,), from the summed lanes.

        Codecs with a trailer lane also update their shared state here (every worker
        receives the same sum, so every worker's instance stays equal).
        """
        n_workers, radix, k, stat = self._check_sum(lanes_sum, size, num_workers)
        out = output(out, size, np.float32)
        check_disjoint(lanes_sum=lanes_sum, out=out)
        self._decode_into(lanes_sum, out, n_workers, radix, k)
        self._agreed(stat)
        return out

    def _agreed(self, stat):
        """After a decode: shared state from the trailer, and the next push's step."""
        if stat is not None:
            self._agree(stat)
        self.pushes += 1

    def declare_traits(self):
        """decodes_by_table where decode_table serves this codec: its decode is the shared
        table kernel's."""
        return replace(super().declare_traits(),
                       decodes_by_table=type(self)._decode_into is LaneCodec._decode_into)

    def decode_table(self, lanes_sum, size, num_workers):
        """(k, m, rows) for kernels.decode_sgd_step: decode() without writing the values.

        Checks lanes_sum as decode does and advances the shared state as decode does,
        so the table must serve exactly this sum.
        """
        if not self.traits.decodes_by_table:
            raise TypeError("%s decodes without the table kernel; call decode" % self.name)
        n_workers, radix, k, stat = self._check_sum(lanes_sum, size, num_workers)
        m, rows = self._rows(n_workers, radix, k, size)
        self._agreed(stat)
        return k, m, rows

    def _check_sum(self, lanes_sum, size, num_workers):
        """(N, R, k, the trailer: mean statistic, (N, values) gathered array, or None) of a
        valid lanes sum for `size` elements."""
        n_workers = check_num_workers(num_workers)
        radix, k = self.geometry(n_workers)
        check_vector("lanes_sum", lanes_sum, self.wire_dtype,
                     length=self.lane_count(size, n_workers))
        stat = None
        if self.trailer_lanes:
            stat = float(lanes_sum[-1]) / n_workers
            if not (math.isfinite(stat) and stat >= 0):
                raise ValueError("%s: the trailer lane sums to %r, not a finite statistic >= 0; "
                                 "the lanes were not produced by this codec"
                                 % (self.name, lanes_sum[-1]))
        t = self.gathered_count(size)
        if t:
            stat = lanes_sum[len(lanes_sum) - n_workers * t:].reshape(n_workers, t)
            if not np.isfinite(stat).all():
                raise ValueError("%s: the gathered trailer holds NaN/Inf; the lanes were not "
                                 "produced by this codec" % self.name)
        return n_workers, radix, k, stat

    def _agree(self, stat):
        """Update the shared state from the trailer: the workers' mean statistic, or the
        (N, values) array of what every worker gathered."""

    # ------------------------------------------------------------ kernels (Cython)
    def _encode_into(self, grad, residual, out, radix, k, grad_checked=False, local=None):
        """Fill out[:ceil(n/k)], update residual; return the trailer sum (or None).

        Raises NonFiniteGradientError when grad holds NaN/Inf (having written nothing,
        unless grad_checked or local) or when grad + residual is not finite. `local` is
        passed to the kernel by a codec that fuses_local_update; it is None for the rest.
        """
        raise NotImplementedError

    @staticmethod
    def _kernel_result(result, grad, residual, out):
        """A kernel's (non-finite grad count, non-finite grad + residual count, statistics
        rows) -> the rows (one per chunk), or the error."""
        bad_grad, bad_sum, rows = result
        if bad_grad:
            raise_nonfinite(grad, residual)
        if bad_sum:
            raise_nonfinite(grad, residual, out)
        return rows

    @staticmethod
    def _chunk_order_sum(rows, column=0):
        """A statistic summed the kernels' way: chunk by chunk, in order (chunk_sum)."""
        total = 0.0
        for part in rows[:, column].tolist():
            total += part
        return total

    def _decode_into(self, lanes_sum, out, num_workers, radix, k):
        m, rows = self._rows(num_workers, radix, k, out.shape[0])
        kernels().decode_lanes(lanes_sum, out, rows, k, m, self.num_threads)

    # ------------------------------------------------------------ device path (offload off)
    def device_levels(self, compensated, ops):
        """The level of each compensated value on its own device, in `ops` (DeviceOps): the
        codec's rule written once for both adapters' device codecs, bitwise the kernel's."""
        raise NotImplementedError

    def device_statistic(self, grad, compensated):
        """The device array whose |.| the trailer statistic sums (None without a trailer)."""
        return None

    # A codec with gathered values (terngrad, qsgd, thc) gives its whole push in DeviceOps,
    # its shared state kept on the device between pushes (ops.state), so that no host read
    # of the sum is needed to agree on the next push's scale. torch's device codec runs them.

    def device_state(self, size, ops):
        """The shared state of the next push for a tensor of `size` elements as device
        arrays (ops.state), made from this instance's (host) state; None: none beyond
        _affine() (1bit, 2bit, 4bit read theirs on the host)."""
        return None

    def device_transform(self, compensated, ops):
        """The values to level in place of the compensated ones (thc's rotation), or None."""
        return None

    def levelled_count(self, size):
        """How many values a push of `size` elements levels (thc's rotation pads them)."""
        return size

    def transform_overflow(self, grad, residual):
        """Raise NonFiniteGradientError for finite grad + residual (NumPy) whose
        device_transform is not finite."""
        raise_nonfinite(grad, residual)

    def device_untransform(self, values, size, ops):
        """device_transform's inverse on one worker's (or the sum's) decoded values: the
        first `size` elements in the gradient's domain."""
        return values

    def device_sent(self, x, levels, ops):
        """What error feedback subtracts from x (float32, x's domain), or None: the decoded
        value of each level for one worker (own_values())."""
        return None

    def device_gathered(self, grad, x, ops):
        """This worker's gathered values (float64, gathered_count(size) of them) for the
        levelled values x (the compensated ones, or device_transform's)."""
        raise NotImplementedError

    def device_agree(self, gathered, ops):
        """The next push's device state from the summed slots, (N, values) float64: what
        _agree() sets on the host, on the device."""
        raise NotImplementedError

    def device_values(self, digit_sums, num_workers, ops):
        """float32 decoded sum of N workers from int64 digit sums, with the device state;
        None: affine with _affine() (the state on the host)."""
        return None

    def adopt_device_state(self, state):
        """Set this instance's host state from device_agree()'s (copied to NumPy): the host
        read a checkpoint makes, after which state_dict() is the device's."""
        raise NotImplementedError


class DeviceOps:
    """The few array ops a codec's device_levels may use, each adapter's own (MXNet's
    NDArrays in slimgc_mx.mxnet.device, torch's tensors in slimgc_mx.torch.device), so that
    a codec writes its device rule once and imports no framework. Levels come in the
    adapter's level dtype (float32 NDArrays, int64 tensors); arithmetic with Python
    numbers (+, -, *) and comparisons (>=, <=, <) work on them as on NumPy arrays.

        level(mask)          a comparison's result as levels (1 where true, else 0)
        abs(x)               |x|
        where(mask, a, b)    a where mask, else b
        take(table, index)   table[index] for a table of levels
        table(kind, params, values)
                             a small constant table of levels on the values' device, made
                             once per (kind, params) and cached

    The gathered codecs' device push (device_state ... device_agree; torch's ops only, as
    MXNet's device codec serves no gathered codec) adds: `state` (the shared state on the
    device), `k` (digits per lane), and

        array(values, dtype)     a host array's values on the device ('float32', ...)
        uniform(seed, count)     float32 uniforms of elements 0..count-1 (rng.uniform)
        minimum(a, b), maximum(a, b), copysign(a, b), floor(x), sqrt(x)
        divide(a, b)             a / b correctly rounded (either may be a Python number)
        max(x, axis=None)        the largest value (of each column with axis=0)
        float32(x), float64(x)   conversions (round to nearest); to_level(x): float to level
        pad(x, count)            x zero-padded to count elements
        repeat(x, times, count)  each value `times` times, the first count values
        scatter(count, index, values)
                                 count zeros with values at index (distinct)
        run_sums(x, run, width)  float64 x as rows of `width` values: the sum of each run of
                                 `run` rows (the last zero-padded), added in row order
        chunk_sums(columns, k)   (n, w) float64 columns summed as chunk_sum() sums them
        butterfly(x, h)          one Walsh-Hadamard stage: pairs h apart -> (a + b, a - b)
        arange(count), stack(arrays), to_host(x)
    """


class ConstCache:
    """Small constant arrays per (kind, device), rebuilt only when their parameters change:
    the device codecs' tables (decoded values, powers of the radix, a codec's own)."""

    def __init__(self):
        self._hits = {}

    def get(self, kind, device, params, make):
        key = (kind, device)
        hit = self._hits.get(key)
        if hit is None or hit[0] != params:
            hit = (params, make())
            self._hits[key] = hit
        return hit[1]


class SharedScale:
    """Mixin of a lane codec whose shared state is one scale that decode() sets (1bit,
    terngrad, thc): kept in state_dict() and checked against `scale_rule` on load."""

    scale_rule = "finite and >= 0"

    @staticmethod
    def _valid_scale(scale):
        return scale >= 0 and math.isfinite(scale)

    def state_dict(self):
        state = super().state_dict()
        state["scale"] = self.scale
        return state

    def load_state_dict(self, state):
        super().load_state_dict(state)
        scale = float(state["scale"])
        if not self._valid_scale(scale):
            raise ValueError("%s scale must be %s, got %r"
                             % (self.name, self.scale_rule, state["scale"]))
        self.scale = scale


class LaneReference:
    """NumPy encode/decode of a lane codec: compensate, level, feed back, pack; unpack, scale.

    Mixed in before the codec class (class TwoBitReference(LaneReference, TwoBit)); the
    codec gives `_levels` and, with a trailer, `_statistic`.
    """

    def declare_traits(self):
        """The oracle: NumPy passes, so neither a fused local update nor the table decode."""
        return replace(super().declare_traits(), reference=True, fuses_local_update=False,
                       decodes_by_table=False)

    def _levels(self, compensated):
        """int64 level q of each compensated value (grad + residual, float32)."""
        raise NotImplementedError

    def _statistic(self, grad, compensated, k):
        """float64 per-element statistic whose mean is the trailer lane, or None; a codec
        with gathered values returns them instead, reduced as its kernel reduces its
        per-chunk rows (k: elements per lane, for chunk_sum)."""
        return None

    def _sent_values(self, levels):
        """float32 value of each element's level for one worker: what error feedback
        subtracts (a codec whose scale varies along the tensor multiplies it in)."""
        return self._values(levels, 1)

    def _before_levels(self, compensated):
        """Hook for a codec that transforms the compensated values before levelling."""

    def _encode_into(self, grad, residual, out, radix, k, grad_checked=False, local=None):
        c = self.feedback.compensate(grad, residual)
        self._before_levels(c)
        if not np.isfinite(c).all():
            raise_nonfinite(grad, residual)
        q = self._levels(c)
        feedback = self.option_values.get("error_feedback", True)
        self.feedback.update(residual, c, self._sent_values(q) if feedback else self._clipped(c))
        pack_lanes(q, out, radix, k)
        stat = self._statistic(grad, c, k)
        if stat is None or self.gathered_count(grad.shape[0]):
            return stat
        return chunk_sum(stat, k)

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
