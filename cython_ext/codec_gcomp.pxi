# gcomp (slimgc_mx/codecs/gcomp.py): per value c = g + r, its exponent's code from a table
# (an escape plus the raw 8 bits for rare exponents), then, unless c is zero or denormal,
# sign, a 2-bit level and the mantissa without its 6*level low bits: MSB first into 24-bit
# words stored as float32 integers. Blocks of `block` values each start a new word, so they
# encode and decode independently, one block per work item: 1 and N threads agree bitwise.

from libc.math cimport sqrtf
from libc.stdint cimport int32_t, uint16_t, uint32_t
from libc.string cimport memset
from cython.parallel cimport threadid

cdef extern from *:
    """
    static inline uint32_t slimgc_gc_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
    static inline float slimgc_gc_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
    """
    uint32_t slimgc_gc_bits(float f) noexcept nogil
    float slimgc_gc_float(uint32_t u) noexcept nogil


cdef struct GcEnc:
    const float* g
    float* r
    const float* w       # the weights (NULL: every nonzero value at level `fixed`)
    const float* s1      # optimizer state 1 (momentum / Adam mean), or NULL
    const float* s2      # optimizer state 2 (Adam variance), or NULL
    float E
    float B
    float D
    float T1
    float T2
    float T3
    int fixed
    const uint32_t* code
    const int32_t* length
    float* scratch
    int64_t* words
    Py_ssize_t n
    Py_ssize_t block
    Py_ssize_t stride


cdef enum:
    GC_TILE = 256    # values whose fields are computed before they are packed


cdef inline Py_ssize_t _gc_emit(uint64_t acc, int* nb, float* out, Py_ssize_t w) noexcept nogil:
    # One branch-free step: when 24 bits are pending, the oldest become word w. Otherwise
    # word w gets garbage that the next step or the final word overwrites (a block's
    # stride has a spare word), so the result never depends on a mispredicted branch.
    cdef int k = nb[0] >= 24
    nb[0] -= 24 * k
    out[w] = <float>((acc >> nb[0]) & 0xFFFFFF)
    return w + k


cdef Py_ssize_t _gc_encode_block(const GcEnc* a, Py_ssize_t b) noexcept nogil:
    # Block b into its stride of the scratch; residual r = c - x (exact: x is c with low
    # mantissa bits cleared, or 0). Tile by tile: c, the levels, x and the fields (loops
    # without branches), then the serial packing. Returns the number of non-finite c.
    cdef Py_ssize_t lo = b * a.block
    cdef Py_ssize_t hi = min(lo + a.block, a.n)
    cdef Py_ssize_t t0, i, j, cnt, w = 0, bad = 0
    cdef float* out = a.scratch + b * a.stride
    cdef uint64_t acc = 0
    cdef int nb = 0, t, l
    cdef uint32_t u, e, nz
    cdef float c
    cdef float cv[GC_TILE]
    cdef int lv[GC_TILE]
    cdef uint32_t ex[GC_TILE]
    cdef uint32_t rest[GC_TILE]
    cdef int rlen[GC_TILE]
    cdef uint64_t rec[GC_TILE]
    cdef int reclen[GC_TILE]
    t0 = lo
    while t0 < hi:
        cnt = min(<Py_ssize_t>GC_TILE, hi - t0)
        for j in range(cnt):
            cv[j] = a.g[t0 + j] + a.r[t0 + j]
        for j in range(cnt):
            bad += not (fabsf(cv[j]) <= FLT_MAX)
        _gc_levels(a, t0, cnt, cv, lv)
        for j in range(cnt):
            c = cv[j]
            u = slimgc_gc_bits(c)
            e = (u >> 23) & 0xFF
            nz = 0 - <uint32_t>(e != 0)  # all ones for a nonzero value
            t = 6 * lv[j]
            a.r[t0 + j] = c - slimgc_gc_float(u & (<uint32_t>0xFFFFFFFF << t) & nz)
            ex[j] = e
            rest[j] = ((((u >> 31) << 25) | (<uint32_t>lv[j] << 23) | (u & 0x7FFFFF)) >> t) & nz
            rlen[j] = <int>(<uint32_t>(26 - t) & nz)
        for j in range(cnt):  # the whole record: exponent code, then the rest
            e = ex[j]
            reclen[j] = a.length[e] + rlen[j]
            rec[j] = (<uint64_t>a.code[e] << rlen[j]) | rest[j]
        for j in range(cnt):
            l = reclen[j]
            if l <= 40:  # fits beside < 24 pending bits: one put, at most two words
                acc = (acc << l) | rec[j]
                nb += l
            else:  # an escaped exponent: code and rest in two puts
                e = ex[j]
                acc = (acc << a.length[e]) | a.code[e]
                nb += a.length[e]
                w = _gc_emit(acc, &nb, out, w)
                acc = (acc << rlen[j]) | rest[j]
                nb += rlen[j]
            w = _gc_emit(acc, &nb, out, w)
            w = _gc_emit(acc, &nb, out, w)
        t0 += cnt
    if nb > 0:
        out[w] = <float>((acc << (24 - nb)) & 0xFFFFFF)
        w += 1
    a.words[b] = w
    return bad


cdef void _gc_levels(const GcEnc* a, Py_ssize_t t0, Py_ssize_t cnt, const float* cv,
                     int* lv) noexcept nogil:
    # lv[j] = fixed, or #{T in (T1, T2, T3): |w*(sqrt(s2) + E) + B*s1| >= T*D*|c|}; one loop
    # per kind of view, so that each runs without branches.
    cdef Py_ssize_t j
    cdef float an, den, zero = 0.0
    cdef const float* w = a.w + t0 if a.w != NULL else NULL
    cdef const float* s1 = a.s1 + t0 if a.s1 != NULL else NULL
    cdef const float* s2 = a.s2 + t0 if a.s2 != NULL else NULL
    if a.fixed >= 0:
        for j in range(cnt):
            lv[j] = a.fixed
    elif s2 != NULL and s1 != NULL:
        for j in range(cnt):
            an = fabsf(w[j] * (sqrtf(s2[j]) + a.E) + a.B * s1[j])
            den = a.D * fabsf(cv[j])
            lv[j] = (an >= a.T1 * den) + (an >= a.T2 * den) + (an >= a.T3 * den)
    elif s1 != NULL:
        for j in range(cnt):
            an = fabsf(w[j] * (zero + a.E) + a.B * s1[j])
            den = a.D * fabsf(cv[j])
            lv[j] = (an >= a.T1 * den) + (an >= a.T2 * den) + (an >= a.T3 * den)
    elif s2 != NULL:
        for j in range(cnt):
            an = fabsf(w[j] * (sqrtf(s2[j]) + a.E) + a.B * zero)
            den = a.D * fabsf(cv[j])
            lv[j] = (an >= a.T1 * den) + (an >= a.T2 * den) + (an >= a.T3 * den)
    else:
        for j in range(cnt):
            an = fabsf(w[j] * (zero + a.E) + a.B * zero)
            den = a.D * fabsf(cv[j])
            lv[j] = (an >= a.T1 * den) + (an >= a.T2 * den) + (an >= a.T3 * den)


def encode_gcomp(const float[::1] grad, float[::1] residual, const float[::1] weight,
                 const float[::1] state1, const float[::1] state2, float E, float B, float D,
                 float T1, float T2, float T3, int fixed, const uint32_t[::1] code,
                 const int32_t[::1] length, float[::1] scratch, int64_t[::1] words,
                 Py_ssize_t block, Py_ssize_t stride, int num_threads, bint grad_checked=False):
    """gcomp: every block of grad + residual into scratch (block b at b * stride), its
    lanes into words[b]; residual updated. level = fixed (>= 0), or with the weights the
    count of T in (T1, T2, T3) with |w*(sqrt(state2) + E) + B*state1| >= T*D*|c|.
    Returns (non-finite grad count, non-finite grad + residual count); nothing is written
    when the first is not 0."""
    cdef Py_ssize_t n = grad.shape[0], j, most = 0
    if residual.shape[0] != n:
        raise ValueError("residual has %d elements, grad %d" % (residual.shape[0], n))
    if block < 1 or code.shape[0] != 256 or length.shape[0] != 256:
        raise ValueError("encode_gcomp: block >= 1 and tables of 256 entries")
    for j in range(256):
        if length[j] < 0 or length[j] > 24:
            raise ValueError("encode_gcomp: code lengths must lie in 0..24")
        most = max(most, length[j])
    cdef Py_ssize_t blocks = _ceil_div(n, block)
    if words.shape[0] < blocks or stride * 24 < block * (most + 26) + 24 \
            or scratch.shape[0] < blocks * stride:
        raise ValueError("encode_gcomp: words or scratch too small for %d blocks" % blocks)
    if fixed < -1 or fixed > 3 or (fixed < 0 and weight is None):
        raise ValueError("encode_gcomp: fixed must be a level 0..3, or -1 with weights")
    for name, arr in (("weight", weight), ("state1", state1), ("state2", state2)):
        if arr is not None and arr.shape[0] != n:
            raise ValueError("encode_gcomp: %s has %d elements, grad %d" % (name, arr.shape[0], n))
    if n == 0:
        return 0, 0
    cdef GcEnc a
    a.g = &grad[0]
    a.r = &residual[0]
    a.w = &weight[0] if weight is not None else NULL
    a.s1 = &state1[0] if state1 is not None else NULL
    a.s2 = &state2[0] if state2 is not None else NULL
    a.E = E
    a.B = B
    a.D = D
    a.T1 = T1
    a.T2 = T2
    a.T3 = T3
    a.fixed = fixed
    a.code = &code[0]
    a.length = &length[0]
    a.scratch = &scratch[0]
    a.words = &words[0]
    a.n = n
    a.block = block
    a.stride = stride
    cdef Py_ssize_t n_check = _ceil_div(n, CHECK_CHUNK)
    cdef Py_ssize_t n_checked = 0 if grad_checked else n_check
    cdef Py_ssize_t c1, c2, bad = 0, bad_comp = 0
    cdef bint clean = False
    cdef int team = _team(num_threads, max(n_check, blocks))
    cdef Py_ssize_t* flags = <Py_ssize_t*>calloc(n_check, sizeof(Py_ssize_t))
    cdef Py_ssize_t* comp = <Py_ssize_t*>calloc(blocks, sizeof(Py_ssize_t))
    if flags == NULL or comp == NULL:
        free(flags)
        free(comp)
        raise MemoryError()
    with nogil, parallel(num_threads=team):
        for c1 in prange(n_checked, schedule="dynamic"):
            flags[c1] = _count_bad(a.g + c1 * CHECK_CHUNK, min(CHECK_CHUNK, n - c1 * CHECK_CHUNK))
        slimgc_barrier()   # every flag is written before anyone reads them
        clean = _all_zero(flags, n_check)
        if clean:
            for c2 in prange(blocks, schedule="dynamic"):
                comp[c2] = _gc_encode_block(&a, c2)
    for c1 in range(n_check):
        bad += flags[c1]
    if bad == 0:
        for c2 in range(blocks):
            bad_comp += comp[c2]
    free(flags)
    free(comp)
    return bad, bad_comp


def gcomp_assemble(const float[::1] scratch, Py_ssize_t stride, const int64_t[::1] words,
                   const int64_t[::1] offsets, Py_ssize_t count, float[::1] out,
                   int num_threads):
    """out[offsets[b]:+words[b]] = block b of the scratch, for b < count."""
    cdef Py_ssize_t b
    if count > words.shape[0] or count > offsets.shape[0]:
        raise ValueError("gcomp_assemble: %d blocks, %d lengths, %d offsets"
                         % (count, words.shape[0], offsets.shape[0]))
    for b in range(count):
        if words[b] < 0 or words[b] > stride or offsets[b] < 0 \
                or offsets[b] + words[b] > out.shape[0] or (b + 1) * stride > scratch.shape[0]:
            raise ValueError("gcomp_assemble: block %d does not fit" % b)
    if count == 0:
        return
    cdef const float* src = &scratch[0]
    cdef float* dst = &out[0]
    cdef const int64_t* wd = &words[0]
    cdef const int64_t* off = &offsets[0]
    with nogil:
        for b in prange(count, schedule="static", num_threads=_team(num_threads, count)):
            memcpy(dst + off[b], src + b * stride, wd[b] * sizeof(float))


cdef enum:
    GC_MAX_BLOCK = 4096          # the decoder's bound on values per block
    GC_MAX_WORDS = 8536          # words of such a block at 50 bits per value, and one more


cdef extern from *:
    """
    /* 64 bits of a big-endian byte stream from p (unaligned). */
    static inline uint64_t slimgc_gc_load_be(const unsigned char* p) {
        uint64_t v; memcpy(&v, p, 8); return __builtin_bswap64(v);
    }
    """
    uint64_t slimgc_gc_load_be(const unsigned char* p) noexcept nogil


cdef struct GcReader:
    unsigned char* buf   # the block's words as a big-endian byte string, 16 zero bytes after
    Py_ssize_t pos       # bit position of the next value
    Py_ssize_t limit     # bits in the block's words


cdef inline bint _gc_open(GcReader* r, const float* src, Py_ssize_t n_words,
                          unsigned char* buf) noexcept nogil:
    # A reader over n_words words; False unless they are integers in [0, 2**24) (then the
    # conversion is exact) and fit the buffer.
    cdef Py_ssize_t i
    cdef uint32_t x
    cdef float f
    if n_words > GC_MAX_WORDS:
        return False
    for i in range(n_words):
        f = src[i]
        if not (f >= 0 and f < 16777216.0) or f != <float>(<uint32_t>f):
            return False
        x = <uint32_t>f
        buf[3 * i] = <unsigned char>(x >> 16)
        buf[3 * i + 1] = <unsigned char>(x >> 8)
        buf[3 * i + 2] = <unsigned char>x
    memset(buf + 3 * n_words, 0, 16)
    r.buf = buf
    r.pos = 0
    r.limit = 24 * n_words
    return True


cdef inline bint _gc_next(GcReader* r, const uint16_t* lut, int max_bits, int64_t* hist,
                          float* x) noexcept nogil:
    # The next value into x[0], its exponent counted; False on an invalid code or a value
    # past the block's bits. One 64-bit load holds all of a value's (<= 50) bits.
    cdef uint64_t w = slimgc_gc_load_be(r.buf + (r.pos >> 3)) << (r.pos & 7)
    cdef uint32_t ent = lut[w >> (64 - max_bits)]
    cdef int l = ent >> 8, t
    cdef uint32_t e = ent & 0xFF, v, nz
    cdef uint64_t after, mant
    if l > max_bits:
        return False
    if e == 255:  # the escape: the raw exponent follows
        e = <uint32_t>((w << l) >> 56)
        l += 8
        if e == 255:
            return False
    hist[e] += 1
    after = w << l
    v = <uint32_t>(after >> 61)
    t = <int>(((v & 3) << 2) + ((v & 3) << 1))
    mant = (after << 3) >> (41 + t)
    nz = 0 - <uint32_t>(e != 0)  # all ones for a nonzero value
    r.pos += l + <int>(<uint32_t>(26 - t) & nz)
    x[0] = slimgc_gc_float((((v >> 2) << 31) | (e << 23) | (<uint32_t>mant << t)) & nz)
    return r.pos <= r.limit


cdef inline bint _gc_closed(const GcReader* r) noexcept nogil:
    # The values ended in the block's last word.
    return r.limit - 24 < r.pos <= r.limit


cdef Py_ssize_t _gc_decode_block(const float* src, Py_ssize_t n_words, Py_ssize_t count,
                                 const uint16_t* lut, int max_bits, float* dst,
                                 int64_t* hist) noexcept nogil:
    # dst[i] += the i-th value of a block of n_words words (count values); exponents are
    # counted into hist. Returns 1 when the block is not a valid coding of `count` values
    # in exactly n_words words, else 0.
    cdef unsigned char buf[3 * GC_MAX_WORDS + 16]
    cdef GcReader r
    cdef Py_ssize_t i
    cdef float x
    if count > GC_MAX_BLOCK or not _gc_open(&r, src, n_words, buf):
        return 1
    for i in range(count):
        if not _gc_next(&r, lut, max_bits, hist, &x):
            return 1
        dst[i] = dst[i] + x
    return not _gc_closed(&r)


cdef Py_ssize_t _gc_decode_pair(const float* src_a, Py_ssize_t words_a, float* dst_a,
                                const float* src_b, Py_ssize_t words_b, float* dst_b,
                                Py_ssize_t count_b, const uint16_t* lut, int max_bits,
                                int64_t* hist) noexcept nogil:
    # Two blocks, the first of GC_MAX_BLOCK values, in one loop: two independent chains
    # of bit positions for the core to overlap. Returns the number of invalid blocks.
    cdef unsigned char buf_a[3 * GC_MAX_WORDS + 16]
    cdef unsigned char buf_b[3 * GC_MAX_WORDS + 16]
    cdef GcReader ra, rb
    cdef Py_ssize_t i
    cdef float xa = 0, xb = 0
    cdef bint ok_a, ok_b
    if count_b > GC_MAX_BLOCK or not _gc_open(&ra, src_a, words_a, buf_a) \
            or not _gc_open(&rb, src_b, words_b, buf_b):
        return 2
    for i in range(count_b):
        ok_a = _gc_next(&ra, lut, max_bits, hist, &xa)
        ok_b = _gc_next(&rb, lut, max_bits, hist, &xb)
        if not (ok_a and ok_b):
            return 2
        dst_a[i] = dst_a[i] + xa
        dst_b[i] = dst_b[i] + xb
    for i in range(count_b, GC_MAX_BLOCK):
        if not _gc_next(&ra, lut, max_bits, hist, &xa):
            return 2
        dst_a[i] = dst_a[i] + xa
    return (not _gc_closed(&ra)) + (not _gc_closed(&rb))


def decode_gcomp(const float[::1] slots, const int64_t[::1] starts, const int64_t[::1] words,
                 Py_ssize_t n_workers, Py_ssize_t n, Py_ssize_t block, const uint16_t[::1] lut,
                 int max_bits, float[::1] out, int64_t[::1] histogram, int num_threads):
    """out = sum over workers j (in order, from +0.0) of the values of block b of worker j
    (words[j*blocks + b] lanes from slots[starts[...]]; 0 lanes: not sent). Exponents are
    counted into histogram (256). Blocks are decoded in pairs (b, b + 1), one pair per work
    item. Returns the number of blocks that failed to decode."""
    cdef Py_ssize_t blocks = _ceil_div(n, block) if block > 0 else 0
    cdef Py_ssize_t pairs = _ceil_div(blocks, 2)
    cdef Py_ssize_t k, ka, kb, q, b, j, lo, cnt, cnt_b, bad = 0
    if block != GC_MAX_BLOCK or max_bits < 1 or max_bits > 16 \
            or lut.shape[0] != (1 << max_bits) or histogram.shape[0] != 256 or out.shape[0] != n:
        raise ValueError("decode_gcomp: blocks of %d, a lut of 2**max_bits entries, a "
                         "histogram of 256 and out of n" % GC_MAX_BLOCK)
    if starts.shape[0] != n_workers * blocks or words.shape[0] != n_workers * blocks:
        raise ValueError("decode_gcomp: starts and words need %d entries" % (n_workers * blocks))
    for k in range(n_workers * blocks):
        if words[k] < 0 or words[k] > 0 and (starts[k] < 0
                                             or starts[k] + words[k] > slots.shape[0]):
            raise ValueError("decode_gcomp: block %d lies outside the slots" % k)
    if n == 0:
        return 0
    cdef int team = _team(num_threads, pairs), tid
    cdef int64_t* hist = <int64_t*>calloc(team * 256, sizeof(int64_t))
    cdef Py_ssize_t* flags = <Py_ssize_t*>calloc(pairs, sizeof(Py_ssize_t))
    if hist == NULL or flags == NULL:
        free(hist)
        free(flags)
        raise MemoryError()
    cdef const float* sl = &slots[0] if slots.shape[0] else NULL
    cdef const int64_t* st = &starts[0]
    cdef const int64_t* wd = &words[0]
    cdef const uint16_t* lt = &lut[0]
    cdef float* o = &out[0]
    with nogil, parallel(num_threads=team):
        for q in prange(pairs, schedule="dynamic"):
            tid = threadid()
            b = 2 * q
            lo = b * block
            cnt = min(2 * block, n - lo)  # both blocks' values
            cnt_b = cnt - block           # the second block's (<= 0: there is none)
            memset(o + lo, 0, cnt * sizeof(float))
            for j in range(n_workers):
                ka = j * blocks + b
                kb = ka + 1
                if cnt_b > 0 and wd[ka] > 0 and wd[kb] > 0:
                    flags[q] += _gc_decode_pair(sl + st[ka], wd[ka], o + lo, sl + st[kb], wd[kb],
                                                o + lo + block, cnt_b, lt, max_bits,
                                                hist + tid * 256)
                else:  # one block of the pair is missing or was not sent
                    if wd[ka] > 0:
                        flags[q] += _gc_decode_block(sl + st[ka], wd[ka], min(block, cnt), lt,
                                                     max_bits, o + lo, hist + tid * 256)
                    if cnt_b > 0 and wd[kb] > 0:
                        flags[q] += _gc_decode_block(sl + st[kb], wd[kb], cnt_b, lt, max_bits,
                                                     o + lo + block, hist + tid * 256)
    for k in range(team * 256):
        histogram[k % 256] += hist[k]
    for q in range(pairs):
        bad += flags[q]
    free(hist)
    free(flags)
    return bad


def gcomp_restore(const float[::1] scratch, Py_ssize_t stride, const int64_t[::1] words,
                  Py_ssize_t first, Py_ssize_t n, Py_ssize_t block, const uint16_t[::1] lut,
                  int max_bits, float[::1] residual, int num_threads):
    """residual += the values of scratch blocks first.. (coded, then not sent): their whole
    c is kept. Returns the number of blocks that failed to decode."""
    cdef Py_ssize_t blocks = _ceil_div(n, block) if block > 0 else 0
    cdef Py_ssize_t b, lo, bad = 0
    cdef int64_t* unused
    if block < 1 or max_bits < 1 or max_bits > 16 or lut.shape[0] != (1 << max_bits) \
            or residual.shape[0] != n or words.shape[0] < blocks \
            or scratch.shape[0] < blocks * stride or first < 0:
        raise ValueError("gcomp_restore: inconsistent sizes")
    for b in range(first, blocks):
        if words[b] < 0 or words[b] > stride:
            raise ValueError("gcomp_restore: block %d has %d lanes" % (b, words[b]))
    if first >= blocks:
        return 0
    cdef const float* src = &scratch[0]
    cdef const int64_t* wd = &words[0]
    cdef const uint16_t* lt = &lut[0]
    cdef float* r = &residual[0]
    cdef int team = _team(num_threads, blocks - first), tid
    unused = <int64_t*>calloc(team * 256, sizeof(int64_t))  # the histogram is not needed
    if unused == NULL:
        raise MemoryError()
    with nogil, parallel(num_threads=team):
        for b in prange(first, blocks, schedule="dynamic"):
            tid = threadid()
            lo = b * block
            bad += _gc_decode_block(src + b * stride, wd[b], min(block, n - lo), lt, max_bits,
                                    r + lo, unused + tid * 256)
    free(unused)
    return bad
