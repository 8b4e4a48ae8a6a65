# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False
"""nogil kernels: the lane codecs' encoder (one block driver, per-codec level functions),
the lane decoder, and the SGD updates of MXNet and PyTorch (sgd_torch.pxi).

Every kernel takes caller-provided outputs and a thread count, and splits its work
into fixed chunks (slimgc_mx/codecs/layout.py), so 1 thread and N threads give bitwise
equal results (whichever thread runs a chunk, its arithmetic is the same).
Validation lives in the Python wrappers (slimgc_mx.codecs); the kernels only guard
the sizes their raw-pointer loops rely on. A codec's level function and entry point
live in codec_<name>.pxi, included below the driver.
"""
import numpy as np

from cython.parallel cimport parallel, prange
from libc.stdlib cimport calloc, free
from libc.float cimport FLT_MAX
from libc.math cimport copysignf, fabs, fabsf
from libc.stdint cimport int64_t, uint64_t
from libc.string cimport memcpy
from layout cimport BLOCK, CHECK_CHUNK, CHUNK_LANES, GROUP, MAX_DIGITS, ROW, SGD_CHUNK

cdef extern from *:
    """
    /* Orphaned barrier: binds to the enclosing parallel region (prange's loops are
       "omp for nowait"); a no-op without OpenMP. */
    static inline void slimgc_barrier(void) {
    #ifdef _OPENMP
        #pragma omp barrier
    #endif
    }
    """
    void slimgc_barrier() noexcept nogil

cdef extern from *:
    """
    /* lane = sum_j q[j] * pw[j] in double. Every term and partial sum is an integer
       below 2**53 (the lane geometry guarantees it), so any summation order gives the
       exact result, and the reduction may run in SIMD lanes. */
    static inline double slimgc_pack(const float* q, const double* pw, Py_ssize_t cnt) {
        double acc = 0.0;
        Py_ssize_t j;
        #pragma omp simd reduction(+:acc)
        for (j = 0; j < cnt; j++)
            acc += (double)q[j] * pw[j];
        return acc;
    }
    """
    double slimgc_pack(const float* q, const double* pw, Py_ssize_t cnt) noexcept nogil

cdef extern from *:
    """
    /* The counter-based generator of stochastic rounding: a uniform float in [0, 1) for
       element e of the push keyed by `seed`. SplitMix64's finalizer of
       seed + (e >> 1) * golden ratio gives 64 bits for a pair of elements: bits 0..23 for
       even e, bits 40..63 for odd e. Any thread, any order: the same number
       (slimgc_mx/codecs/rng.py mirrors it). The 24 bits convert through int32, the same
       value: x86-64 has no SSE instruction for uint64 -> float. */
    static inline uint64_t slimgc_mix(uint64_t x) {
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
        x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
        return x ^ (x >> 31);
    }
    static inline uint64_t slimgc_pair_hash(uint64_t seed, int64_t pair) {
        return slimgc_mix(seed + (uint64_t)pair * 0x9E3779B97F4A7C15ULL);
    }
    static inline float slimgc_uniform(uint64_t seed, int64_t e) {
        uint64_t h = slimgc_pair_hash(seed, e >> 1);
        uint32_t bits = (e & 1) ? (uint32_t)(h >> 40) : (uint32_t)h & 0xFFFFFFu;
        return (float)(int32_t)bits * 5.9604644775390625e-08f;
    }
    /* SLIMGC_CLONES: a hot loop is also built for AVX2 and picked at load time (GCC on
       x86-64 Linux). Both builds do the same IEEE float operations (AVX2 brings no fused
       multiply-add) and exact integer arithmetic, so they give bitwise the same results. */
    #if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
    #define SLIMGC_CLONES __attribute__((target_clones("avx2", "default")))
    #else
    #define SLIMGC_CLONES
    #endif
    /* Hide a value from the optimizer (it goes through memory once): a constant folded
       into a select can turn it into a branch of float operations, which the vectorizer
       refuses because they might trap. */
    #define SLIMGC_OPAQUE(v) __asm__("" : "+m"(v))
    /* u[j] = slimgc_uniform(seed, e0 + j) for j < cnt: one hash per pair of elements, in
       a loop the compiler vectorizes (the hash dominates a level loop's cost). */
    SLIMGC_CLONES
    static void slimgc_uniforms(uint64_t seed, int64_t e0, Py_ssize_t cnt, float* u) {
        Py_ssize_t j = 0, i, pairs;
        int64_t p0;
        if (cnt <= 0)
            return;
        if (e0 & 1) {
            u[0] = slimgc_uniform(seed, e0);
            j = 1;
        }
        pairs = (cnt - j) / 2;
        p0 = (e0 + j) >> 1;
        for (i = 0; i < pairs; i++) {
            uint64_t h = slimgc_pair_hash(seed, p0 + i);
            u[j + 2 * i] = (float)(int32_t)((uint32_t)h & 0xFFFFFFu) * 5.9604644775390625e-08f;
            u[j + 2 * i + 1] = (float)(int32_t)(h >> 40) * 5.9604644775390625e-08f;
        }
        j += 2 * pairs;
        if (j < cnt)
            u[j] = slimgc_uniform(seed, e0 + j);
    }
    """
    uint64_t slimgc_mix(uint64_t x) noexcept nogil
    float slimgc_uniform(uint64_t seed, int64_t e) noexcept nogil
    void slimgc_uniforms(uint64_t seed, int64_t e0, Py_ssize_t cnt, float* u) noexcept nogil


def uniform(uint64_t seed, int64_t e):
    """slimgc_uniform(seed, e): the RNG the kernels use, for tests against rng.py."""
    return slimgc_uniform(seed, e)


def uniforms(uint64_t seed, int64_t e0, Py_ssize_t count):
    """slimgc_uniforms: float32 uniforms of elements e0 .. e0+count-1, as a block fills them."""
    out = np.empty(max(count, 0), dtype=np.float32)
    cdef float[::1] u = out
    if count > 0:
        slimgc_uniforms(seed, e0, count, &u[0])
    return out


chunk_lanes = CHUNK_LANES
check_chunk = CHECK_CHUNK
row_width = ROW

cdef inline Py_ssize_t _ceil_div(Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    return (a + b - 1) // b


cdef inline int _team(int num_threads, Py_ssize_t n_chunks) noexcept nogil:
    # No more threads than chunks (small arrays run on one); chunks are handed out
    # dynamically, so a preempted thread on a busy machine does not hold up the rest.
    return <int>max(1, min(<Py_ssize_t>num_threads, n_chunks))


cdef Py_ssize_t _count_bad(const float* x, Py_ssize_t count) noexcept nogil:
    # NaN and +-Inf fail |x| <= FLT_MAX; an integer count, so the loop vectorizes.
    cdef Py_ssize_t j, bad = 0
    for j in range(count):
        bad += not (fabsf(x[j]) <= FLT_MAX)
    return bad



# ---------------------------------------------------------------- encode driver
# Per lane i (elements i*k .. i*k+k-1): c = g + r; q = level(c); r = c - own[q], where
# own[q] is the one-worker decoded value of level q (error feedback);
# lane = sum_j q_j * R**j, exact in float64 (below 2**53). Levels are kept as float32
# (small integers, exact) so that the packing is a SIMD dot product.
#
# One parallel region per call: a read-only pass checks the gradient for NaN/Inf in
# chunks of CHECK_CHUNK elements; only when every chunk is clean (all threads see the
# same flags after the barrier) does the encoding pass write anything. The encoding
# pass also counts non-finite c = g + r (float32 overflow, or a non-finite residual
# handed in), which it can only find while writing.

cdef struct LevelArgs:
    float scale          # the codec's scalar: 2bit threshold t, 1bit scale s, a shared max
    const float* table   # a codec's float table (4bit thresholds, per-bucket scales)
    const int* units     # a codec's int table (4bit units)
    int offset           # a codec's level offset (4bit), or its number of levels
    int unit             # a codec's level unit, in units of its int table (4bit group)
    Py_ssize_t bucket    # elements per bucket of a codec with per-bucket state
    uint64_t seed        # the counter-based RNG's key of this push (slimgc_uniform)
    bint clip_only       # the residual keeps only what the shared scale clipped (no noise)


# A codec's level function: for cnt elements starting at element e0 of the tensor
# (ce0: the first element of their chunk), levels q, residual r and the count of
# non-finite c; adds its statistics (if any) to the chunk's row `stat` in element order.
ctypedef Py_ssize_t (*levels_fn)(const float* g, float* r, float* q, Py_ssize_t cnt,
                                 const LevelArgs* a, Py_ssize_t e0, Py_ssize_t ce0,
                                 double* stat) noexcept nogil


cdef struct TorchStep:
    # torch.optim.SGD's settings of one step (sgd_torch.pxi)
    float neg_lr
    float wd
    float div
    float momentum
    float keep           # 1 - dampening
    bint nesterov


cdef struct LocalStep:
    # The backup's local SGD step run inside the encoder's pass (LocalSGD): out from w,
    # the gradient being encoded and mom (read, not written), as sgd_step computes it,
    # or as TorchSGD.step does where `torch` is set.
    const TorchStep* torch
    const float* w
    const float* mom     # NULL: plain SGD
    float* out
    float lr
    float wd
    float rescale
    float momentum
    float clip


cdef struct EncodeJob:
    levels_fn levels     # NULL: the passthrough (codec 'none', float32 lanes)
    LevelArgs args
    const LocalStep* local  # NULL, or the local update that reads each tile first
    const float* g
    float* r
    void* out
    double pw[MAX_DIGITS]
    Py_ssize_t n
    Py_ssize_t k
    Py_ssize_t n_lanes
    Py_ssize_t chunk
    Py_ssize_t stat_width  # doubles of statistics per chunk
    bint checked


cdef Py_ssize_t _check_shapes(Py_ssize_t n, Py_ssize_t n_residual, Py_ssize_t n_out,
                              Py_ssize_t k) except -1:
    """Guard the raw-pointer loops: returns ceil(n / k), the lanes the kernel writes."""
    if n_residual != n:
        raise ValueError("residual has %d elements, grad %d" % (n_residual, n))
    if k < 1 or k > MAX_DIGITS:
        raise ValueError("digits per lane must be in 1..%d, got %d" % (MAX_DIGITS, k))
    if n_out < _ceil_div(n, k):
        raise ValueError("lanes has %d elements, needs %d" % (n_out, _ceil_div(n, k)))
    return _ceil_div(n, k)


# Per lane i (elements i*k .. i*k+k-1): c = g + r; q = level(c); r = c - own[q], where
# own[q] is the one-worker decoded value of level q;
# lane = sum_j q_j * R**j, exact in float64 (below 2**53). Levels are kept as float32
# (small integers, exact) so that the packing is a SIMD dot product.


cdef inline void _pack_block(const float* q, const double* pw, double* lanes,
                             Py_ssize_t i0, Py_ssize_t i1, Py_ssize_t n,
                             Py_ssize_t k) noexcept nogil:
    # Lanes i0..i1-1 from the levels q of their elements (q[0] is element i0*k).
    cdef Py_ssize_t i
    for i in range(i0, i1):
        lanes[i] = slimgc_pack(q + (i - i0) * k, pw, min(k, n - i * k))



cdef void _encode_blocks(const EncodeJob* job, Py_ssize_t lo, Py_ssize_t hi,
                         Py_ssize_t* bad, double* stat) noexcept nogil:
    # Lanes [lo, hi) in blocks of BLOCK lanes: one level loop over their elements, then
    # the packing; the chunk's statistics go to its row `stat`.
    cdef Py_ssize_t i0 = lo, i1, start, cnt
    cdef float q[BLOCK * MAX_DIGITS]
    cdef const LocalStep* loc = job.local
    while i0 < hi:
        i1 = min(i0 + BLOCK, hi)
        start = i0 * job.k
        cnt = min(i1 * job.k, job.n) - start
        if loc != NULL and loc.torch != NULL:  # the tile is in L1 when the levels read it
            _torch_sgd(loc.torch, loc.w, job.g, loc.mom, NULL, loc.out, start, start + cnt)
        elif loc != NULL:
            _sgd_chunk(loc.w, job.g, loc.mom, NULL, loc.out, start, start + cnt, loc.lr,
                       loc.wd, loc.rescale, loc.momentum, loc.clip, False)
        bad[0] += job.levels(job.g + start, job.r + start, q, cnt, &job.args, start,
                             lo * job.k, stat)
        _pack_block(q, job.pw, <double*>job.out, i0, i1, job.n, job.k)
        i0 = i1


cdef void _copy_sum(const float* g, float* r, float* lanes, Py_ssize_t lo,
                    Py_ssize_t hi, Py_ssize_t* bad) noexcept nogil:
    cdef Py_ssize_t j
    for j in range(lo, hi):
        lanes[j] = g[j] + r[j]
        r[j] = 0.0
    bad[0] += _count_bad(lanes + lo, hi - lo)



cdef void _encode_chunk(const EncodeJob* job, Py_ssize_t c, Py_ssize_t* bad,
                        double* stat) noexcept nogil:
    """Encode lanes [c*chunk, (c+1)*chunk) with statistics row `stat`; adds the count of
    non-finite c to bad[0]."""
    cdef Py_ssize_t lo = c * job.chunk
    cdef Py_ssize_t hi = min(lo + job.chunk, job.n_lanes)
    if job.levels == NULL:
        _copy_sum(job.g, job.r, <float*>job.out, lo, hi, bad)
    else:
        _encode_blocks(job, lo, hi, bad, stat)


cdef inline bint _all_zero(const Py_ssize_t* flags, Py_ssize_t count) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(count):
        if flags[i]:
            return False
    return True



cdef tuple _run(EncodeJob* job, int num_threads):
    """Check, then encode. Returns (non-finite grad count, non-finite grad + residual
    count, statistics): one row of stat_width doubles per chunk, in chunk order, for the
    codec to reduce (sum, max, per bucket); nothing is written when the first count is
    not 0. A job whose gradient the caller has already checked skips the read-only pass."""
    cdef Py_ssize_t n_check = _ceil_div(job.n, CHECK_CHUNK)
    cdef Py_ssize_t n_checked = 0 if job.checked else n_check
    cdef Py_ssize_t n_chunks = _ceil_div(job.n_lanes, job.chunk)
    cdef Py_ssize_t width = max(1, job.stat_width)
    cdef Py_ssize_t c1, c2, bad = 0, bad_comp = 0
    cdef bint clean = False
    cdef int team = _team(num_threads, max(n_check, n_chunks))
    stats = np.zeros((n_chunks, width), dtype=np.float64)
    if job.n == 0:
        return 0, 0, stats
    cdef double[:, ::1] rows = stats
    cdef double* part = &rows[0, 0]
    cdef Py_ssize_t* flags = <Py_ssize_t*>calloc(n_check, sizeof(Py_ssize_t))
    cdef Py_ssize_t* comp_flags = <Py_ssize_t*>calloc(n_chunks, sizeof(Py_ssize_t))
    if flags == NULL or comp_flags == NULL:
        free(flags)
        free(comp_flags)
        raise MemoryError()
    with nogil, parallel(num_threads=team):
        for c1 in prange(n_checked, schedule="dynamic"):
            flags[c1] = _count_bad(job.g + c1 * CHECK_CHUNK,
                                   min(CHECK_CHUNK, job.n - c1 * CHECK_CHUNK))
        slimgc_barrier()   # every flag is written before anyone reads them
        clean = _all_zero(flags, n_check)
        if clean:
            for c2 in prange(n_chunks, schedule="dynamic"):
                _encode_chunk(job, c2, &comp_flags[c2], part + c2 * width)
    for c1 in range(n_check):
        bad += flags[c1]
    if bad == 0:
        for c2 in range(n_chunks):
            bad_comp += comp_flags[c2]
    free(flags)
    free(comp_flags)
    return bad, bad_comp, stats


cdef class LocalSGD:
    """The backup's local SGD step, fused into a lane encoder's pass over the gradient.

    out <- sgd_step(weight, grad, mom_in=mom, mom_out=None) with the gradient the encoder
    reads, tile by tile, so the gradient is read from memory once; out comes out bitwise
    sgd_step's (TorchSGD.local's: TorchSGD.step's). Pass it as `local` to a lane codec's
    encode.
    """
    cdef LocalStep step
    cdef TorchStep rule  # TorchSGD.local: torch's rule (step.torch points here)
    cdef readonly Py_ssize_t size
    cdef readonly object output  # out, for the caller's overlap checks
    cdef object _inputs  # keeps weight and mom alive while the pointers are in use

    def __init__(self, const float[::1] weight, const float[::1] mom, float[::1] out,
                 float lr, float wd, float rescale, float momentum, float clip):
        cdef Py_ssize_t n = weight.shape[0]
        if out.shape[0] != n or (mom is not None and mom.shape[0] != n):
            raise ValueError("LocalSGD: weight %d, mom %s and out %d elements differ"
                             % (n, None if mom is None else mom.shape[0], out.shape[0]))
        self.size = n
        self.output = out.base
        self._inputs = (weight, mom)
        self.step.torch = NULL
        self.step.w = &weight[0] if n else NULL
        self.step.mom = &mom[0] if mom is not None and n else NULL
        self.step.out = &out[0] if n else NULL
        self.step.lr = lr
        self.step.wd = wd
        self.step.rescale = rescale
        self.step.momentum = momentum
        self.step.clip = clip


cdef EncodeJob _job(levels_fn levels, const float[::1] grad, float[::1] residual, void* out,
                    Py_ssize_t n_out, const uint64_t[::1] powers, bint checked) except *:
    cdef EncodeJob job
    cdef Py_ssize_t j, k = powers.shape[0]
    job.levels = levels
    job.n = grad.shape[0]
    job.k = k
    job.n_lanes = _check_shapes(job.n, residual.shape[0], n_out, k)
    job.chunk = CHECK_CHUNK if levels == NULL else CHUNK_LANES
    job.g = &grad[0] if job.n else NULL
    job.r = &residual[0] if job.n else NULL
    job.out = out
    for j in range(k):
        if powers[j] >= 9007199254740992ULL:
            raise ValueError("digit weight %d is not below 2**53" % powers[j])
        job.pw[j] = <double>powers[j]
    job.args.scale = 0.0
    job.args.table = NULL
    job.args.units = NULL
    job.args.offset = 0
    job.args.unit = 1
    job.args.bucket = 0
    job.args.seed = 0
    job.stat_width = 1
    job.checked = checked
    job.local = NULL
    return job


cdef EncodeJob _lane_job(levels_fn levels, const float[::1] grad, float[::1] residual,
                         double[::1] lanes, const uint64_t[::1] powers, bint checked,
                         LocalSGD local=None) except *:
    """The job of a lane codec's entry point: `levels` over grad, packed into `lanes`;
    with `local`, the local update runs in the same pass (no read-only pre-check: a
    non-finite grad is found while encoding, as with `checked`)."""
    cdef EncodeJob job = _job(levels, grad, residual, &lanes[0] if lanes.shape[0] else NULL,
                              lanes.shape[0], powers, checked or local is not None)
    if local is not None:
        if local.size != job.n:
            raise ValueError("the local update has %d elements, grad %d" % (local.size, job.n))
        job.local = &local.step
    return job


def count_nonfinite(const float[::1] values, int num_threads):
    """The number of NaN and +-Inf in `values` (chunks of CHECK_CHUNK over the threads)."""
    cdef Py_ssize_t n = values.shape[0], c, bad = 0
    cdef Py_ssize_t n_chunks = _ceil_div(n, CHECK_CHUNK)
    if n == 0:
        return 0
    cdef const float* x = &values[0]
    with nogil:
        for c in prange(n_chunks, schedule="static", num_threads=_team(num_threads, n_chunks)):
            bad += _count_bad(x + c * CHECK_CHUNK, min(CHECK_CHUNK, n - c * CHECK_CHUNK))
    return bad


# ---------------------------------------------------------------- codecs
include "codec_none.pxi"
include "codec_1bit.pxi"
include "codec_2bit.pxi"
include "codec_4bit.pxi"
include "codec_terngrad.pxi"
include "codec_qsgd.pxi"
include "codec_thc.pxi"
include "codec_randomk.pxi"
include "codec_powersgd.pxi"
include "codec_topk.pxi"
include "codec_dgc.pxi"
include "codec_gcomp.pxi"
include "lanes32.pxi"


# ---------------------------------------------------------------- decoder
# A lane holds k digits in radix R. The decoder peels "super-digits" of m <= ROW digits
# at a time (radix Rm = R**m) and copies their decoded values from a table whose rows
# are ROW floats wide, so it divides once per m elements and copies fixed-size rows.
# Division of x < 2**53 by Rm (2**s <= Rm < 2**(s+1)) is a multiply by the reciprocal
# M = ceil(2**(63+s) / Rm): floor(x * M / 2**(63+s)) = floor(x / Rm), because the
# rounding up of M adds less than x / 2**(63+s) < 2**-(10+s) < 1/Rm.

cdef extern from *:
    """
    /* High 64 bits of a * b. */
    #ifndef __SIZEOF_INT128__
    #error "slimgc_mx needs a compiler with unsigned __int128 (GCC or Clang on a 64-bit target)"
    #endif
    static inline uint64_t slimgc_mulhi(uint64_t a, uint64_t b) {
        return (uint64_t)(((unsigned __int128)a * b) >> 64);
    }
    """
    uint64_t slimgc_mulhi(uint64_t a, uint64_t b) noexcept nogil


cdef struct Divisor:
    uint64_t d
    uint64_t magic
    int shift


cdef Divisor _divisor(uint64_t d):
    # d >= 2 (checked by _check_table): s >= 1, so the shift 63 + s - 64 is >= 0.
    cdef Divisor v
    cdef object divisor = d
    cdef int s = divisor.bit_length() - 1
    v.d = d
    v.magic = ((<object>1 << (63 + s)) + divisor - 1) // divisor  # Python integers: exact
    v.shift = s - 1
    return v


cdef inline uint64_t _divmod(uint64_t* x, const Divisor* dv) noexcept nogil:
    cdef uint64_t q = slimgc_mulhi(x[0], dv.magic) >> dv.shift
    cdef uint64_t rem = x[0] - q * dv.d
    x[0] = q
    return rem


cdef Py_ssize_t _dec(const double* lanes, float* out, const float* rows, Py_ssize_t lo,
                     Py_ssize_t hi, Py_ssize_t n, Py_ssize_t k, Py_ssize_t m,
                     const Divisor* dv) noexcept nogil:
    # Decodes lanes [lo, hi) into out, which starts at element lo * k. Returns the number
    # of lanes outside [0, 2**53) (NaN included), decoded as 0: the division is only
    # exact below 2**53, and table rows must never be read out of range.
    cdef Py_ssize_t i = lo, b, nb, pos, cnt, t, bad = 0
    cdef bint full
    cdef uint64_t x[GROUP]
    cdef uint64_t s
    cdef double v
    cdef const float* src
    cdef float* dst
    while i < hi:
        # A block of up to GROUP lanes, digit position by digit position: GROUP
        # independent division chains. The block's last lane may be partial.
        nb = min(<Py_ssize_t>GROUP, hi - i)
        for b in range(nb):
            v = lanes[i + b]
            if v >= 0 and v < 9007199254740992.0:
                x[b] = <uint64_t>v
            else:
                x[b] = 0
                bad += 1
        pos = 0
        full = (i + nb) * k <= n
        while pos < k:
            if full and pos + ROW <= k:
                # A whole row fits inside every lane: copy it; the spill past m is
                # overwritten by the next position of the same lane.
                for b in range(nb):
                    s = _divmod(&x[b], dv)
                    memcpy(out + (i - lo + b) * k + pos, rows + s * ROW, ROW * sizeof(float))
            elif full and m <= 4 and pos + 4 <= k:
                # Near the lane's end, a shorter fixed-size copy that still fits (wide
                # radixes: m is small and the lane ends before a whole row).
                for b in range(nb):
                    s = _divmod(&x[b], dv)
                    memcpy(out + (i - lo + b) * k + pos, rows + s * ROW, 4 * sizeof(float))
            elif full and m == 3 and pos + 3 <= k:
                for b in range(nb):
                    s = _divmod(&x[b], dv)
                    memcpy(out + (i - lo + b) * k + pos, rows + s * ROW, 3 * sizeof(float))
            elif full and m <= 2 and pos + 2 <= k:
                for b in range(nb):
                    s = _divmod(&x[b], dv)
                    memcpy(out + (i - lo + b) * k + pos, rows + s * ROW, 2 * sizeof(float))
            else:
                for b in range(nb):
                    s = _divmod(&x[b], dv)
                    cnt = min(m, k - pos, n - (i + b) * k - pos)
                    src = rows + s * ROW
                    dst = out + (i - lo + b) * k + pos
                    for t in range(cnt):
                        dst[t] = src[t]
            pos += m
        i += nb
    return bad


cdef Py_ssize_t _outside(const double* lanes, Py_ssize_t n) noexcept nogil:
    # Lanes outside [0, 2**53), NaN included: those the decoder cannot divide exactly.
    cdef Py_ssize_t i, bad = 0
    for i in range(n):
        if not (lanes[i] >= 0 and lanes[i] < 9007199254740992.0):
            bad += 1
    return bad


def count_lanes_outside(const double[::1] lanes):
    """The number of lanes outside [0, 2**53) (NaN and +-Inf included): the lanes that
    decode_lanes and decode_sgd_step cannot decode."""
    if lanes.shape[0] == 0:
        return 0
    cdef Py_ssize_t bad
    with nogil:
        bad = _outside(&lanes[0], lanes.shape[0])
    return bad


cdef Py_ssize_t _check_table(str name, const double[::1] lanes, const float[::1] rows,
                             Py_ssize_t n, Py_ssize_t k, Py_ssize_t m) except -1:
    # The sizes the decoder's raw-pointer loops rely on; returns the lanes n elements take.
    if m < 1 or m > ROW or rows.shape[0] // ROW < 2 or rows.shape[0] % ROW or k < 1 \
            or k > MAX_DIGITS:
        raise ValueError("%s: rows must be R**m rows of %d floats, 1 <= m <= %d, "
                         "1 <= k <= %d" % (name, ROW, ROW, MAX_DIGITS))
    cdef Py_ssize_t n_lanes = _ceil_div(n, k)
    if lanes.shape[0] < n_lanes:
        raise ValueError("lanes has %d elements, needs %d" % (lanes.shape[0], n_lanes))
    return n_lanes


def decode_lanes(const double[::1] lanes, float[::1] out, const float[::1] rows,
                 Py_ssize_t k, Py_ssize_t m, int num_threads):
    """Unpack lanes[:ceil(n/k)] into out (n = len(out)): k digits per lane, m per row.

    rows holds R**m rows of ROW float32 values: row s starts with the decoded values
    of the m radix-R digits of s, least significant first (the rest is padding).
    """
    cdef Py_ssize_t n = out.shape[0]
    cdef uint64_t rm = rows.shape[0] // ROW
    cdef Py_ssize_t n_lanes = _check_table("decode_lanes", lanes, rows, n, k, m)
    cdef Py_ssize_t n_chunks = _ceil_div(n_lanes, CHUNK_LANES), c, bad = 0
    if n == 0:
        return
    cdef Divisor dv = _divisor(rm)
    cdef const double* ln = &lanes[0]
    cdef float* o = &out[0]
    cdef const float* tb = &rows[0]
    with nogil:
        for c in prange(n_chunks, schedule="dynamic", num_threads=_team(num_threads, n_chunks)):
            bad += _dec(ln, o + c * CHUNK_LANES * k, tb, c * CHUNK_LANES,
                        min((c + 1) * CHUNK_LANES, n_lanes), n, k, m, &dv)
    if bad:
        raise ValueError("%d lanes lie outside [0, 2**53): not a sum of this codec's lanes "
                         "(wrong codec, worker count or corrupted data)" % bad)


# ---------------------------------------------------------------- optimizer step
# MXNet SGD's update rule (sgd_update / sgd_mom_update), one pass over CPU buffers:
#   g' = clip(rescale * g)              (no clip when clip < 0)
#   m  = momentum * mom_in - lr*wd * w - lr * g'
#   out = w + m;  mom_out = m           (with momentum)
#   out = (1 - lr*wd) * w - lr * g'     (without: mom_in and mom_out are NULL)
# out may be w and mom_out may be mom_in (in place), or separate (the local update
# reads the global weights and momentum and writes neither).


cdef Py_ssize_t _sgd_chunk(const float* w, const float* g, const float* mom_in,
                           float* mom_out, float* out, Py_ssize_t lo, Py_ssize_t hi, float lr,
                           float wd, float rescale, float momentum, float clip,
                           bint count) noexcept nogil:
    # Returns the number of NaN/Inf in g[lo:hi] when `count`, else 0. The local update's
    # usual case (momentum read, not written; no clipping) counts in its own loop.
    cdef Py_ssize_t i
    cdef int bad = 0  # a chunk has at most SGD_CHUNK elements
    cdef float gr, m, gi
    cdef float lr_wd = lr * wd
    cdef float decay = 1.0 - lr * wd
    cdef float lr_rescale = lr * rescale
    if mom_in == NULL:
        if clip >= 0:
            for i in range(lo, hi):
                gr = min(max(rescale * g[i], -clip), clip)
                out[i] = decay * w[i] - lr * gr
        else:
            for i in range(lo, hi):
                out[i] = decay * w[i] - lr_rescale * g[i]
    elif clip >= 0:
        for i in range(lo, hi):
            gr = min(max(rescale * g[i], -clip), clip)
            m = momentum * mom_in[i] - lr_wd * w[i] - lr * gr
            if mom_out != NULL:
                mom_out[i] = m
            out[i] = w[i] + m
    elif mom_out != NULL:
        for i in range(lo, hi):
            m = momentum * mom_in[i] - lr_wd * w[i] - lr_rescale * g[i]
            mom_out[i] = m
            out[i] = w[i] + m
    elif count:
        for i in range(lo, hi):
            gi = g[i]
            out[i] = w[i] + (momentum * mom_in[i] - lr_wd * w[i] - lr_rescale * gi)
            bad += not (fabsf(gi) <= FLT_MAX)
        return bad
    else:
        for i in range(lo, hi):
            out[i] = w[i] + (momentum * mom_in[i] - lr_wd * w[i] - lr_rescale * g[i])
    return _count_bad(g + lo, hi - lo) if count else 0


def sgd_step(const float[::1] weight, const float[::1] grad, const float[::1] mom_in,
             float[::1] mom_out, float[::1] out, float lr, float wd, float rescale,
             float momentum, float clip, int num_threads, bint count_nonfinite=False):
    """One SGD step: out (and mom_out) from weight, grad and mom_in; see the rule above.

    mom_in None: plain SGD. mom_out None: the momentum is read, not written. Returns the
    number of NaN/Inf in grad with count_nonfinite, else 0: counted inside the update's
    loop when the momentum is read and not written and there is no clipping (the local
    update's usual case), otherwise in a second pass over each chunk while it is in
    cache. Either way the encoder need not read grad again.
    """
    cdef Py_ssize_t n = weight.shape[0], c, n_chunks, lo, bad = 0
    if grad.shape[0] != n or out.shape[0] != n:
        raise ValueError("sgd_step: weight %d, grad %d and out %d elements differ"
                         % (n, grad.shape[0], out.shape[0]))
    if mom_in is None and mom_out is not None:
        raise ValueError("sgd_step: mom_out needs mom_in")
    if mom_in is not None and mom_in.shape[0] != n or mom_out is not None and mom_out.shape[0] != n:
        raise ValueError("sgd_step: momentum buffers must have %d elements" % n)
    if n == 0:
        return 0
    cdef const float* w = &weight[0]
    cdef const float* g = &grad[0]
    cdef const float* mi = &mom_in[0] if mom_in is not None else NULL
    cdef float* mo = &mom_out[0] if mom_out is not None else NULL
    cdef float* o = &out[0]
    n_chunks = _ceil_div(n, SGD_CHUNK)
    with nogil:
        for c in prange(n_chunks, schedule="static", num_threads=_team(num_threads, n_chunks)):
            lo = c * SGD_CHUNK
            bad += _sgd_chunk(w, g, mi, mo, o, lo, min(lo + SGD_CHUNK, n), lr, wd, rescale,
                              momentum, clip, count_nonfinite)
    return bad


cdef void _dec_sgd(const double* lanes, const float* rows, Py_ssize_t lo, Py_ssize_t hi,
                   Py_ssize_t n, Py_ssize_t k, Py_ssize_t m, const Divisor* dv, float* w,
                   float* mom, float lr, float wd, float rescale, float momentum,
                   float clip) noexcept nogil:
    # Lanes [lo, hi): BLOCK lanes at a time decoded into a tile that stays in cache,
    # then the SGD step of their elements reads the tile. The caller has range-checked
    # the lanes, so _dec's count of bad lanes is always 0 here.
    cdef float tile[BLOCK * MAX_DIGITS]
    cdef float* mom_e0
    cdef Py_ssize_t i = lo, j, e0
    while i < hi:
        j = min(i + BLOCK, hi)
        _dec(lanes, tile, rows, i, j, n, k, m, dv)
        e0 = i * k
        mom_e0 = mom + e0 if mom != NULL else NULL
        _sgd_chunk(w + e0, tile, mom_e0, mom_e0, w + e0, 0, min(j * k, n) - e0, lr, wd,
                   rescale, momentum, clip, False)
        i = j


def decode_sgd_step(const double[::1] lanes, const float[::1] rows, Py_ssize_t k, Py_ssize_t m,
                    float[::1] weight, float[::1] mom, float lr, float wd, float rescale,
                    float momentum, float clip, int num_threads, bint checked=False):
    """sgd_step in place on weight (and mom) with the gradient that decode_lanes would write.

    The gradient goes through a cache-sized tile, never to memory; the weights come out
    bitwise equal to decode_lanes followed by sgd_step. Lanes outside [0, 2**53) raise
    ValueError before any weight is written, unless `checked`: the caller has counted
    them with count_lanes_outside and found none, so the lanes are read only once here.
    """
    cdef Py_ssize_t n = weight.shape[0]
    cdef uint64_t rm = rows.shape[0] // ROW
    cdef Py_ssize_t n_lanes = _check_table("decode_sgd_step", lanes, rows, n, k, m)
    cdef Py_ssize_t n_chunks = _ceil_div(n_lanes, CHUNK_LANES), c, bad = 0
    if mom is not None and mom.shape[0] != n:
        raise ValueError("decode_sgd_step: mom has %d elements, weight %d" % (mom.shape[0], n))
    if n == 0:
        return
    cdef Divisor dv = _divisor(rm)
    cdef const double* ln = &lanes[0]
    cdef const float* tb = &rows[0]
    cdef float* w = &weight[0]
    cdef float* mo = &mom[0] if mom is not None else NULL
    if not checked:
        with nogil:
            bad = _outside(ln, n_lanes)
    if bad:
        raise ValueError("%d lanes lie outside [0, 2**53): not a sum of this codec's lanes "
                         "(wrong codec, worker count or corrupted data); no weight was written"
                         % bad)
    with nogil:
        for c in prange(n_chunks, schedule="static", num_threads=_team(num_threads, n_chunks)):
            _dec_sgd(ln, tb, c * CHUNK_LANES, min((c + 1) * CHUNK_LANES, n_lanes), n, k, m, &dv,
                     w, mo, lr, wd, rescale, momentum, clip)


include "sgd_torch.pxi"
