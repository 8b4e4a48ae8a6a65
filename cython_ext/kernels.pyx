# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""nogil codec kernels: fused compensate + quantize + residual + lane packing, and lane unpacking.

Every kernel takes caller-provided outputs and a thread count, and splits its work
into fixed chunks of CHUNK_LANES lanes, so 1 thread and N threads give bitwise
equal results. Validation lives in the Python wrappers (slimgc_mx.codecs).
"""
from cython.parallel cimport prange
from libc.math cimport fabs, fabsf
from libc.stdint cimport int64_t, uint64_t
from libc.string cimport memcpy
from lane_consts cimport CHECK_CHUNK, CHUNK_LANES, GROUP, ROW

chunk_lanes = CHUNK_LANES
check_chunk = CHECK_CHUNK
row_width = ROW

cdef inline Py_ssize_t _ceil_div(Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    return (a + b - 1) // b


cdef Py_ssize_t _count_bad(const float* g, const float* r, Py_ssize_t lo, Py_ssize_t hi) noexcept nogil:
    cdef Py_ssize_t j, bad = 0
    cdef float c
    for j in range(lo, hi):
        c = g[j] + r[j]
        bad += not (fabsf(c) <= 3.4028234663852886e38)
    return bad


def count_nonfinite(const float[::1] grad, const float[::1] residual, int num_threads):
    """Count elements whose float32 grad + residual is NaN or +-Inf (read-only pre-check)."""
    cdef Py_ssize_t n = grad.shape[0]
    cdef Py_ssize_t n_chunks = _ceil_div(n, CHECK_CHUNK)
    cdef Py_ssize_t c, bad = 0
    if n == 0:
        return 0
    cdef const float* g = &grad[0]
    cdef const float* r = &residual[0]
    with nogil:
        for c in prange(n_chunks, schedule="static", num_threads=num_threads):
            bad += _count_bad(g, r, c * CHECK_CHUNK, min((c + 1) * CHECK_CHUNK, n))
    return bad


# ---------------------------------------------------------------- encoders
# Per lane i (elements i*k .. i*k+k-1): c = g + r; q = level(c); r = c - own[q];
# lane = sum_j q_j * R**j, built in uint64 (exact below 2**53), stored as float64.

cdef void _enc_2bit(const float* g, float* r, double* lanes, const uint64_t* pw,
                    const float* own, float t, Py_ssize_t lo, Py_ssize_t hi,
                    Py_ssize_t n, Py_ssize_t k) noexcept nogil:
    cdef Py_ssize_t i, j, start, stop
    cdef uint64_t acc
    cdef float c
    cdef int q
    for i in range(lo, hi):
        start = i * k
        stop = min(start + k, n)
        acc = 0
        for j in range(start, stop):
            c = g[j] + r[j]
            q = 1 + (c >= t) - (c <= -t)
            r[j] = c - own[q]
            acc += <uint64_t>q * pw[j - start]
        lanes[i] = <double><int64_t>acc


cdef double _enc_1bit(const float* g, float* r, double* lanes, const uint64_t* pw,
                      const float* own, Py_ssize_t lo, Py_ssize_t hi,
                      Py_ssize_t n, Py_ssize_t k) noexcept nogil:
    cdef Py_ssize_t i, j, start, stop
    cdef uint64_t acc
    cdef float c
    cdef int q
    cdef double s = 0.0
    for i in range(lo, hi):
        start = i * k
        stop = min(start + k, n)
        acc = 0
        for j in range(start, stop):
            c = g[j] + r[j]
            q = c >= 0
            r[j] = c - own[q]
            acc += <uint64_t>q * pw[j - start]
            s += fabs(<double>c)
        lanes[i] = <double><int64_t>acc
    return s


cdef double _enc_4bit(const float* g, float* r, double* lanes, const uint64_t* pw,
                      const float* own, const float* th, const int* units, int offset,
                      Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t n, Py_ssize_t k) noexcept nogil:
    cdef Py_ssize_t i, j, start, stop
    cdef uint64_t acc
    cdef float c, a
    cdef int idx, u, q
    cdef double s = 0.0
    for i in range(lo, hi):
        start = i * k
        stop = min(start + k, n)
        acc = 0
        for j in range(start, stop):
            c = g[j] + r[j]
            a = fabsf(c)
            idx = ((a >= th[0]) + (a >= th[1]) + (a >= th[2]) + (a >= th[3])
                   + (a >= th[4]) + (a >= th[5]) + (a >= th[6]))
            u = units[idx]
            q = offset - u if c < 0 else offset + u
            r[j] = c - own[q]
            acc += <uint64_t>q * pw[j - start]
            s += fabs(<double>g[j])
        lanes[i] = <double><int64_t>acc
    return s


def encode_2bit(const float[::1] grad, float[::1] residual, double[::1] lanes,
                const uint64_t[::1] powers, const float[::1] own, float threshold,
                int num_threads):
    """2bit: levels {-t, 0, +t} -> q in {0, 1, 2}; fills lanes[:ceil(n/k)], updates residual."""
    cdef Py_ssize_t n = grad.shape[0], k = powers.shape[0]
    cdef Py_ssize_t n_lanes = _ceil_div(n, k)
    cdef Py_ssize_t n_chunks = _ceil_div(n_lanes, CHUNK_LANES), c
    if n == 0:
        return
    cdef const float* g = &grad[0]
    cdef float* r = &residual[0]
    cdef double* out = &lanes[0]
    cdef const uint64_t* pw = &powers[0]
    cdef const float* ow = &own[0]
    with nogil:
        for c in prange(n_chunks, schedule="static", num_threads=num_threads):
            _enc_2bit(g, r, out, pw, ow, threshold, c * CHUNK_LANES,
                      min((c + 1) * CHUNK_LANES, n_lanes), n, k)


def encode_1bit(const float[::1] grad, float[::1] residual, double[::1] lanes,
                const uint64_t[::1] powers, const float[::1] own, double[::1] partials,
                int num_threads):
    """1bit: q = (c >= 0); returns sum |c| (chunk partials summed in order)."""
    cdef Py_ssize_t n = grad.shape[0], k = powers.shape[0]
    cdef Py_ssize_t n_lanes = _ceil_div(n, k)
    cdef Py_ssize_t n_chunks = _ceil_div(n_lanes, CHUNK_LANES), c
    cdef double total = 0.0
    if n == 0:
        return total
    cdef const float* g = &grad[0]
    cdef float* r = &residual[0]
    cdef double* out = &lanes[0]
    cdef const uint64_t* pw = &powers[0]
    cdef const float* ow = &own[0]
    cdef double* part = &partials[0]
    with nogil:
        for c in prange(n_chunks, schedule="static", num_threads=num_threads):
            part[c] = _enc_1bit(g, r, out, pw, ow, c * CHUNK_LANES,
                                min((c + 1) * CHUNK_LANES, n_lanes), n, k)
        for c in range(n_chunks):
            total += part[c]
    return total


def encode_4bit(const float[::1] grad, float[::1] residual, double[::1] lanes,
                const uint64_t[::1] powers, const float[::1] own, const float[::1] thresholds,
                const int[::1] units, int offset, double[::1] partials, int num_threads):
    """4bit: q = offset +- units[#thresholds <= |c|]; returns sum |g| (chunk partials in order).

    units[0] = 0, units[1:] are the thresholds in base units; own has 2*offset+1 values.
    """
    cdef Py_ssize_t n = grad.shape[0], k = powers.shape[0]
    cdef Py_ssize_t n_lanes = _ceil_div(n, k)
    cdef Py_ssize_t n_chunks = _ceil_div(n_lanes, CHUNK_LANES), c
    cdef double total = 0.0
    if thresholds.shape[0] != 7 or units.shape[0] != 8 or own.shape[0] != 2 * offset + 1:
        raise ValueError("encode_4bit needs 7 thresholds, 8 units and 2*offset+1 values")
    if units[0] != 0 or units[7] > offset:
        raise ValueError("encode_4bit: units must start at 0 and stay <= offset")
    if n == 0:
        return total
    cdef const float* g = &grad[0]
    cdef float* r = &residual[0]
    cdef double* out = &lanes[0]
    cdef const uint64_t* pw = &powers[0]
    cdef const float* ow = &own[0]
    cdef const float* th = &thresholds[0]
    cdef const int* un = &units[0]
    cdef double* part = &partials[0]
    with nogil:
        for c in prange(n_chunks, schedule="static", num_threads=num_threads):
            part[c] = _enc_4bit(g, r, out, pw, ow, th, un, offset, c * CHUNK_LANES,
                                min((c + 1) * CHUNK_LANES, n_lanes), n, k)
        for c in range(n_chunks):
            total += part[c]
    return total


cdef void _copy_sum(const float* g, float* r, float* lanes, Py_ssize_t lo,
                    Py_ssize_t hi) noexcept nogil:
    cdef Py_ssize_t j
    for j in range(lo, hi):
        lanes[j] = g[j] + r[j]
        r[j] = 0.0


def encode_none(const float[::1] grad, float[::1] residual, float[::1] lanes, int num_threads):
    """Passthrough: lanes = grad + residual (float32), residual = 0."""
    cdef Py_ssize_t n = grad.shape[0]
    cdef Py_ssize_t n_chunks = _ceil_div(n, CHECK_CHUNK), c
    if n == 0:
        return
    cdef const float* g = &grad[0]
    cdef float* r = &residual[0]
    cdef float* out = &lanes[0]
    with nogil:
        for c in prange(n_chunks, schedule="static", num_threads=num_threads):
            _copy_sum(g, r, out, c * CHECK_CHUNK, min((c + 1) * CHECK_CHUNK, n))


# ---------------------------------------------------------------- decoder
# A lane holds k digits in radix R. The decoder peels "super-digits" of m <= ROW digits
# at a time (radix Rm = R**m) and copies their decoded values from a table whose rows
# are ROW floats wide, so it divides once per m elements and copies fixed-size rows.
# Division of x < 2**53: the double quotient x * (1/Rm) is within one of floor(x / Rm);
# the exact integer remainder fixes it, branch-free.

cdef inline int64_t _divmod(int64_t* x, int64_t rm, double inv_rm) noexcept nogil:
    cdef int64_t xs = x[0]
    cdef int64_t q = <int64_t>(<double>xs * inv_rm)
    cdef int64_t rem = xs - q * rm
    cdef int64_t mask = -(rem < 0)
    q += mask
    rem += rm & mask
    mask = -(rem >= rm)
    q -= mask
    rem -= rm & mask
    x[0] = q
    return rem


cdef void _dec(const double* lanes, float* out, const float* rows, Py_ssize_t lo,
               Py_ssize_t hi, Py_ssize_t n, Py_ssize_t k, Py_ssize_t m, int64_t rm,
               double inv_rm) noexcept nogil:
    cdef Py_ssize_t i = lo, b, nb, pos, cnt, t
    cdef int64_t x[GROUP]
    cdef int64_t s
    cdef const float* src
    cdef float* dst
    while i < hi:
        # A block of up to GROUP lanes, digit position by digit position: GROUP
        # independent division chains. The block's last lane may be partial.
        nb = min(<Py_ssize_t>GROUP, hi - i)
        for b in range(nb):
            x[b] = <int64_t>lanes[i + b]
        pos = 0
        while pos < k:
            if pos + ROW <= k and (i + nb) * k <= n:
                # A whole row fits inside every lane: copy it; the spill past m is
                # overwritten by the next position of the same lane.
                for b in range(nb):
                    s = _divmod(&x[b], rm, inv_rm)
                    memcpy(out + (i + b) * k + pos, rows + s * ROW, ROW * sizeof(float))
            else:
                for b in range(nb):
                    s = _divmod(&x[b], rm, inv_rm)
                    cnt = min(m, k - pos, n - (i + b) * k - pos)
                    src = rows + s * ROW
                    dst = out + (i + b) * k + pos
                    for t in range(cnt):
                        dst[t] = src[t]
            pos += m
        i += nb


def decode_lanes(const double[::1] lanes, float[::1] out, const float[::1] rows,
                 Py_ssize_t k, Py_ssize_t m, int num_threads):
    """Unpack lanes[:ceil(n/k)] into out (n = len(out)): k digits per lane, m per row.

    rows holds R**m rows of ROW float32 values: row s starts with the decoded values
    of the m radix-R digits of s, least significant first (the rest is padding).
    """
    cdef Py_ssize_t n = out.shape[0]
    cdef int64_t rm = rows.shape[0] // ROW
    cdef Py_ssize_t n_lanes = _ceil_div(n, k)
    cdef Py_ssize_t n_chunks = _ceil_div(n_lanes, CHUNK_LANES), c
    cdef double inv_rm = 1.0 / <double>rm
    if m < 1 or m > ROW or rows.shape[0] % ROW:
        raise ValueError("decode_lanes: rows must be R**m rows of %d floats, 1 <= m <= %d"
                         % (ROW, ROW))
    if n == 0:
        return
    cdef const double* ln = &lanes[0]
    cdef float* o = &out[0]
    cdef const float* tb = &rows[0]
    with nogil:
        for c in prange(n_chunks, schedule="static", num_threads=num_threads):
            _dec(ln, o, tb, c * CHUNK_LANES, min((c + 1) * CHUNK_LANES, n_lanes), n, k, m,
                 rm, inv_rm)
