# qsgd (slimgc_mx/codecs/qsgd.py): per bucket b of a.bucket elements with shared norm n_b
# (a.table), x = min(|c| / n_b, 1) * s, m = floor(x) + [u < x - floor(x)], level
# q = s + sign(c) * m, value float32(double(1/s) * (q - s)) * n_b. Statistics per chunk:
# QSGD_PARTIALS partial sums of c^2 per bucket (element e adds to partial e % 8), each in
# element order; the codec adds them as a fixed tree.

from libc.float cimport FLT_MIN

cdef enum:
    QSGD_PARTIALS = 8  # slimgc_mx/codecs/qsgd.py PARTIALS


cdef inline void _qsgd_squares(const float* comp, Py_ssize_t cnt, Py_ssize_t e0,
                               double* part) noexcept nogil:
    # part[(e0 + j) % 8] += comp[j]^2 in element order; whole groups of 8 in registers.
    cdef double acc[QSGD_PARTIALS]
    cdef double v
    cdef Py_ssize_t j = 0, t
    for t in range(QSGD_PARTIALS):
        acc[t] = part[t]
    while j < cnt and (e0 + j) % QSGD_PARTIALS:
        v = <double>comp[j]
        acc[(e0 + j) % QSGD_PARTIALS] += v * v
        j += 1
    while j + QSGD_PARTIALS <= cnt:
        for t in range(QSGD_PARTIALS):
            acc[t] += <double>comp[j + t] * <double>comp[j + t]
        j += QSGD_PARTIALS
    while j < cnt:
        v = <double>comp[j]
        acc[(e0 + j) % QSGD_PARTIALS] += v * v
        j += 1
    for t in range(QSGD_PARTIALS):
        part[t] = acc[t]


cdef extern from *:
    """
    /* One run of qsgd levels (elements of one bucket, norm `norm`, inv = 1/norm or 0),
       written branch-free so that the compiler vectorizes it; returns the count of
       non-finite c. The value subtracted is the unit value float32(unit * (q - s)) times
       the norm: the one-worker decoded value bit for bit, or with clip_only the clamp of c
       to [-cap, cap] (cap: the norm, 0 where inv is 0), so the rounding noise is not kept. */
    SLIMGC_CLONES
    static int slimgc_qsgd_run(const float* g, float* r, float* q, float* comp,
                                      const float* u, Py_ssize_t cnt, float s, double unit,
                                      float norm, float inv, int clip_only) {
        int bad = 0;
        Py_ssize_t j;
        float one = 1.0f;
        float cap = inv > 0.0f ? norm : 0.0f;
        /* the unit as a float when s is a power of two (then exact), else 0 */
        float unit_f = ((int)s & ((int)s - 1)) ? 0.0f : (float)unit;
        SLIMGC_OPAQUE(one);  /* min(a, 1.0f) * s would fold into a branch: a * s or s */
        for (j = 0; j < cnt; j++) {
            float c = g[j] + r[j];
            float a = fabsf(c) * inv;
            float x = (a < one ? a : one) * s;
            float low = (float)(int)x;
            float m = low + (u[j] < x - low ? 1.0f : 0.0f);
            float qf = s + (c < 0.0f ? -m : m);
            comp[j] = c;
            q[j] = qf;
            /* s a power of two: (q - s) / s is exact in float, the same value */
            float uv = unit_f ? (qf - s) * unit_f : (float)(unit * (double)(qf - s));
            r[j] = c - (clip_only ? copysignf(fminf(fabsf(c), cap), c) : uv * norm);
            bad += !(fabsf(c) <= FLT_MAX);
        }
        return bad;
    }
    """
    int slimgc_qsgd_run(const float* g, float* r, float* q, float* comp, const float* u,
                        Py_ssize_t cnt, float s, double unit, float norm,
                        float inv, int clip_only) noexcept nogil


cdef Py_ssize_t _levels_qsgd(const float* g, float* r, float* q, Py_ssize_t cnt,
                             const LevelArgs* a, Py_ssize_t e0, Py_ssize_t ce0,
                             double* stat) noexcept nogil:
    # The block's uniforms, then runs of elements of one bucket (one norm), each followed
    # by its squares into the bucket's partial sums while they are in cache.
    cdef Py_ssize_t j = 0, j1, b, bucket = a.bucket
    cdef Py_ssize_t bad = 0
    cdef float norm, inv
    cdef float one = 1.0
    cdef float comp[BLOCK * MAX_DIGITS]
    cdef float u[BLOCK * MAX_DIGITS]
    slimgc_uniforms(a.seed, e0, cnt, u)
    while j < cnt:
        b = (e0 + j) // bucket
        j1 = min(cnt, (b + 1) * bucket - e0)
        norm = a.table[b]
        inv = one / norm if norm >= FLT_MIN else 0.0
        bad += slimgc_qsgd_run(g + j, r + j, q + j, comp + j, u + j, j1 - j,
                               <float>a.offset, 1.0 / <double>a.offset, norm, inv,
                               a.clip_only)
        _qsgd_squares(comp + j, j1 - j, e0 + j,
                      stat + ((e0 + j - ce0) // bucket) * QSGD_PARTIALS)
        j = j1
    return bad


def encode_qsgd(const float[::1] grad, float[::1] residual, double[::1] lanes,
                const uint64_t[::1] powers, const float[::1] norms, int levels,
                Py_ssize_t bucket, uint64_t seed, int num_threads, bint grad_checked=False,
                bint clip_only=False, LocalSGD local=None):
    """qsgd: returns (counts as encode_2bit, statistics rows: QSGD_PARTIALS partial sums of
    c^2 per bucket, the chunk's buckets in order)."""
    cdef EncodeJob job = _lane_job(_levels_qsgd, grad, residual, lanes, powers,
                                   grad_checked, local)
    if levels < 1:
        raise ValueError("levels must be >= 1, got %d" % levels)
    if bucket < 1 or (CHUNK_LANES * job.k) % bucket:
        raise ValueError("bucket %d does not divide the chunk of %d elements"
                         % (bucket, CHUNK_LANES * job.k))
    if norms.shape[0] < _ceil_div(job.n, bucket):
        raise ValueError("norms has %d values, needs %d"
                         % (norms.shape[0], _ceil_div(job.n, bucket)))
    job.args.table = &norms[0] if norms.shape[0] else NULL
    job.args.offset = levels
    job.args.bucket = bucket
    job.args.seed = seed
    job.args.clip_only = clip_only
    job.stat_width = QSGD_PARTIALS * (CHUNK_LANES * job.k // bucket)
    return _run(&job, num_threads)


cdef Py_ssize_t _dec_qsgd(const double* lanes, float* out, const float* rows, Py_ssize_t lo,
                          Py_ssize_t hi, Py_ssize_t n, Py_ssize_t k, Py_ssize_t m,
                          const Divisor* dv, const float* norms,
                          Py_ssize_t bucket) noexcept nogil:
    # Lanes [lo, hi) BLOCK at a time: unit values from the table into out (element 0 of the
    # tensor at out[0]), then each element times its bucket's norm while still in cache.
    cdef Py_ssize_t i = lo, i1, e, e1, stop, t, bad = 0
    cdef float norm
    while i < hi:
        i1 = min(i + BLOCK, hi)
        bad += _dec(lanes, out + i * k, rows, i, i1, n, k, m, dv)
        e = i * k
        e1 = min(i1 * k, n)
        while e < e1:
            stop = min(e1, (e // bucket + 1) * bucket)
            norm = norms[e // bucket]
            for t in range(e, stop):
                out[t] = out[t] * norm
            e = stop
        i = i1
    return bad


def decode_qsgd(const double[::1] lanes, float[::1] out, const float[::1] rows, Py_ssize_t k,
                Py_ssize_t m, const float[::1] norms, Py_ssize_t bucket, int num_threads):
    """decode_lanes with a unit table, each element then times its bucket's norm (one pass)."""
    cdef Py_ssize_t n = out.shape[0]
    cdef uint64_t rm = rows.shape[0] // ROW
    cdef Py_ssize_t n_lanes = _check_table("decode_qsgd", lanes, rows, n, k, m)
    cdef Py_ssize_t n_chunks = _ceil_div(n_lanes, CHUNK_LANES), c, bad = 0
    if bucket < 1:
        raise ValueError("bucket must be >= 1, got %d" % bucket)
    if norms.shape[0] < _ceil_div(n, bucket):
        raise ValueError("norms has %d values, needs %d" % (norms.shape[0], _ceil_div(n, bucket)))
    if n == 0:
        return
    cdef Divisor dv = _divisor(rm)
    cdef const double* ln = &lanes[0]
    cdef float* o = &out[0]
    cdef const float* tb = &rows[0]
    cdef const float* nm = &norms[0]
    with nogil:
        for c in prange(n_chunks, schedule="dynamic", num_threads=_team(num_threads, n_chunks)):
            bad += _dec_qsgd(ln, o, tb, c * CHUNK_LANES, min((c + 1) * CHUNK_LANES, n_lanes),
                             n, k, m, &dv, nm, bucket)
    if bad:
        raise ValueError("%d lanes lie outside [0, 2**53): not a sum of this codec's lanes "
                         "(wrong codec, worker count or corrupted data)" % bad)
