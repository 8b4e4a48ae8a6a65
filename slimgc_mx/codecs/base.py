"""Codec base: input validation, lane geometry and the shared state that workers agree on.

A codec maps each element to a level q in [0, L-1] with value scale * (a*q + b), packs
k levels per float64 lane in radix R = N*(L-1)+1 (R**k <= 2**53), so that the server's
float sum of N workers' lanes is exactly the packing of the level sums. Subclasses give
the levels and the kernels; reference.py gives NumPy versions of the same kernels.
"""
import functools
import math
import numbers

import numpy as np

from .._threads import check_num_threads

#: Largest integer below which every integer is exact in float64.
EXACT_LIMIT = 2 ** 53
#: Lanes per parallel work item; fixes the summation order of the trailer statistic.
CHUNK_LANES = 1024
#: Widest decoder table row (float32 values); must match the kernels' ROW.
ROW = 8
#: Most rows in a decoder table (ROW * 4 bytes each: 512 KiB, an L2 cache's worth).
MAX_ROWS = 16384


class NonFiniteGradientError(ValueError):
    """The gradient (or gradient + residual) holds NaN or Inf; nothing was modified."""


_kernels = None


def kernels():
    """The compiled kernels module, with a rebuild hint when it is missing."""
    global _kernels
    if _kernels is None:
        try:
            from .. import _kernels as mod
        except ImportError as exc:
            raise ImportError(
                "slimgc_mx._kernels is not built; run `python setup.py build_ext --inplace` "
                "in the project root, or use codecs.create(name, reference=True) for the "
                "NumPy implementation") from exc
        _kernels = mod
    return _kernels


def check_num_workers(num_workers):
    """Validate the worker count N (an integer >= 1)."""
    if isinstance(num_workers, bool) or not isinstance(num_workers, numbers.Integral) \
            or num_workers < 1:
        raise ValueError("num_workers must be an integer >= 1, got %r" % (num_workers,))
    return int(num_workers)


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


def check_threshold(threshold, name):
    """Validate a threshold: None, or a finite number > 0 that stays > 0 in float32."""
    if threshold is None:
        return None
    ok = isinstance(threshold, numbers.Real) and not isinstance(threshold, bool)
    value = float(threshold) if ok else float("nan")
    if not (math.isfinite(value) and value > 0 and 0 < np.float32(value) < np.inf):
        raise ValueError("%s: threshold must be a finite number > 0 that float32 can hold, "
                         "got %r; pass e.g. threshold=0.5" % (name, threshold))
    return value


def check_vector(name, array, dtype, writeable=False, length=None):
    """Check a 1-D C-contiguous array of `dtype` (optionally writeable / of `length`)."""
    dtype = np.dtype(dtype)
    if not isinstance(array, np.ndarray):
        raise TypeError("%s must be a numpy.ndarray of %s, got %s"
                        % (name, dtype, type(array).__name__))
    if array.dtype != dtype:
        raise TypeError("%s must have dtype %s, got %s; convert with .astype(numpy.%s)"
                        % (name, dtype, array.dtype, dtype))
    if array.ndim != 1:
        raise ValueError("%s must be 1-D, got shape %s; pass a flat view (.ravel())"
                         % (name, array.shape))
    if not array.flags.c_contiguous:
        raise ValueError("%s must be C-contiguous; pass numpy.ascontiguousarray(%s)"
                         % (name, name))
    if writeable and not array.flags.writeable:
        raise ValueError("%s must be writeable" % name)
    if length is not None and array.shape[0] != length:
        raise ValueError("%s must have %d elements, got %d" % (name, length, array.shape[0]))
    return array


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


def _check_disjoint(**arrays):
    items = list(arrays.items())
    for i, (na, a) in enumerate(items):
        for nb, b in items[i + 1:]:
            if np.may_share_memory(a, b):
                raise ValueError("%s and %s must not overlap in memory" % (na, nb))


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


class Codec:
    """Gradient codec with error feedback; one instance is the per-key state all workers share.

    Subclasses set `name`, `levels` (L), `trailer_lanes` and implement `_affine`,
    `_encode_into` (and `_agree` when they carry a trailer statistic).
    """

    name = None
    levels = None
    wire_dtype = np.dtype(np.float64)
    trailer_lanes = 0
    takes_threshold = False
    default_threshold = None
    is_reference = False

    def __init__(self, threshold=None, num_threads=None):
        threshold = check_threshold(threshold, self.name)
        if self.takes_threshold and threshold is None:
            threshold = self.default_threshold
        self._threshold = threshold if self.takes_threshold else None
        self.num_threads = num_threads
        self._cache = {}

    # ------------------------------------------------------------ parameters
    @property
    def threshold(self):
        """The threshold in use (float32 value as a float), or None when the codec has none."""
        return None if self._threshold is None else float(np.float32(self._threshold))

    @property
    def num_threads(self):
        return self._num_threads

    @num_threads.setter
    def num_threads(self, value):
        self._num_threads = check_num_threads(value)

    def __repr__(self):
        return "%s(%r, threshold=%r, num_threads=%d)" % (
            type(self).__name__, self.name, self.threshold, self.num_threads)

    def clone(self):
        """Same parameters, fresh shared state (one instance per key)."""
        return type(self)(threshold=self._threshold, num_threads=self.num_threads)

    def state_dict(self):
        """The shared state as plain Python values (for checkpoints)."""
        return {"codec": self.name, "threshold": self.threshold}

    def load_state_dict(self, state):
        """Restore state_dict(); refuses a state of another codec or threshold."""
        if state.get("codec") != self.name:
            raise ValueError("state of codec %r cannot load into %r"
                             % (state.get("codec"), self.name))
        if state.get("threshold") != self.threshold:
            raise ValueError("state has threshold %r but this codec uses %r; create the codec "
                             "with the same threshold" % (state.get("threshold"), self.threshold))

    # ------------------------------------------------------------ geometry
    def geometry(self, num_workers):
        """(R, k): lane radix and elements per lane for `num_workers`."""
        key = ("geometry", check_num_workers(num_workers))
        if key not in self._cache:
            self._cache[key] = lane_geometry(self.levels, key[1], self.name)
        return self._cache[key]

    def lane_count(self, size, num_workers):
        """Length of the lanes array for `size` elements (trailer lanes included)."""
        if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 0:
            raise ValueError("size must be an integer >= 0, got %r" % (size,))
        _, k = self.geometry(num_workers)
        return -(-int(size) // k) + self.trailer_lanes

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

    def _own_values(self):
        """Decoded value of each level for one worker: the error-feedback subtrahend."""
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
    def encode(self, grad, residual, num_workers, out=None, grad_checked=False):
        """Compensate, quantize and pack: returns the lanes; `residual` is updated in place.

        grad, residual: 1-D C-contiguous float32 of equal length. NaN/Inf in grad raises
        NonFiniteGradientError before residual or out is touched (a read-only pass runs
        first); a non-finite grad + residual (float32 overflow, or a non-finite residual
        handed in) raises it too, found while encoding (see docs/codecs.md).
        grad_checked=True: the caller has already found grad finite (the kvstore's local
        update counts it), so the read-only pass is skipped; a non-finite grad is still
        found, while encoding, after residual and out were written.
        """
        n_workers = check_num_workers(num_workers)
        radix, k = self.geometry(n_workers)
        check_vector("grad", grad, np.float32)
        check_vector("residual", residual, np.float32, writeable=True)
        if residual.shape[0] != grad.shape[0]:
            raise ValueError("residual must have as many elements as grad: %d != %d"
                             % (residual.shape[0], grad.shape[0]))
        size = grad.shape[0]
        n_lanes = self.lane_count(size, n_workers)
        if out is None:
            out = np.empty(n_lanes, dtype=self.wire_dtype)
        else:
            check_vector("out", out, self.wire_dtype, writeable=True, length=n_lanes)
        _check_disjoint(grad=grad, residual=residual, out=out)
        stat = self._encode_into(grad, residual, out, radix, k, grad_checked)
        if self.trailer_lanes:
            out[-1] = stat / size if size else 0.0
        return out

    def decode(self, lanes_sum, size, num_workers, out=None):
        """Sum over workers of the decoded values, float32 (size,), from the summed lanes.

        Codecs with a trailer lane also update their shared state here (every worker
        receives the same sum, so every worker's instance stays equal).
        """
        n_workers, radix, k, stat = self._check_sum(lanes_sum, size, num_workers)
        if out is None:
            out = np.empty(size, dtype=np.float32)
        else:
            check_vector("out", out, np.float32, writeable=True, length=size)
        _check_disjoint(lanes_sum=lanes_sum, out=out)
        self._decode_into(lanes_sum, out, n_workers, radix, k)
        if stat is not None:
            self._agree(stat)
        return out

    @property
    def decodes_by_table(self):
        """True when decode_table serves this codec (it decodes with the shared table kernel)."""
        return type(self)._decode_into is Codec._decode_into

    def decode_table(self, lanes_sum, size, num_workers):
        """(k, m, rows) for kernels.decode_sgd_step: decode() without writing the values.

        Checks lanes_sum as decode does and advances the shared state as decode does,
        so the table must serve exactly this sum.
        """
        if not self.decodes_by_table:
            raise TypeError("%s decodes without the table kernel; call decode" % self.name)
        n_workers, radix, k, stat = self._check_sum(lanes_sum, size, num_workers)
        m, rows = self._rows(n_workers, radix, k, size)
        if stat is not None:
            self._agree(stat)
        return k, m, rows

    def _check_sum(self, lanes_sum, size, num_workers):
        """(N, R, k, mean trailer statistic or None) of a valid lanes sum for `size` elements."""
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
        return n_workers, radix, k, stat

    def _agree(self, mean_stat):
        """Update the shared state from the workers' mean trailer statistic."""

    # ------------------------------------------------------------ kernels (Cython)
    def _encode_into(self, grad, residual, out, radix, k, grad_checked=False):
        """Fill out[:ceil(n/k)], update residual; return the trailer sum (or None).

        Raises NonFiniteGradientError when grad holds NaN/Inf (having written nothing,
        unless grad_checked) or when grad + residual is not finite.
        """
        raise NotImplementedError

    @staticmethod
    def _kernel_result(result, grad, residual, out):
        """A kernel's (non-finite grad, non-finite grad + residual, trailer sum) counts ->
        the trailer sum, or the error."""
        bad_grad, bad_sum, total = result
        if bad_grad:
            raise_nonfinite(grad, residual)
        if bad_sum:
            raise_nonfinite(grad, residual, out)
        return total

    def _decode_into(self, lanes_sum, out, num_workers, radix, k):
        m, rows = self._rows(num_workers, radix, k, out.shape[0])
        kernels().decode_lanes(lanes_sum, out, rows, k, m, self.num_threads)


def raise_nonfinite(grad, residual, out=None):
    """Raise NonFiniteGradientError naming the first offending element (slow path only).

    `out` given: the kernel found a non-finite grad + residual while encoding, so
    residual and out were already written (grad itself is finite unless the caller
    skipped the pre-check with grad_checked).
    """
    bad = np.flatnonzero(~np.isfinite(grad))
    if bad.size:
        i = int(bad[0])
        raise NonFiniteGradientError(
            "grad[%d] = %r is not finite (%d non-finite elements); %s"
            % (i, float(grad[i]), bad.size, "residual and out were not modified" if out is None
               else "found while encoding (grad_checked=True), so residual and out were "
               "updated: reset the residual (residual[:] = 0)"))
    if out is None:
        with np.errstate(over="ignore", invalid="ignore"):
            bad = np.flatnonzero(~np.isfinite(grad + residual))
        i = int(bad[0]) if bad.size else -1
        raise NonFiniteGradientError(
            "grad + residual is not finite at index %d (a float32 overflow, or a non-finite "
            "residual); residual and out were not modified" % i)
    bad = np.flatnonzero(~np.isfinite(residual))
    if not bad.size and out.dtype == np.float32:
        bad = np.flatnonzero(~np.isfinite(out))
    i = int(bad[0]) if bad.size else -1
    raise NonFiniteGradientError(
        "grad is finite but grad + residual is not at index %d (a float32 overflow, or a "
        "non-finite residual handed in); found while encoding, so residual and out were "
        "updated: reset the residual (residual[:] = 0)" % i)
