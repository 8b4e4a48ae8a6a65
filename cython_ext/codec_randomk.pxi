# randomk (slimgc_mx/codecs/randomk.py): k shared random indices, one per stratum
# [s*n//k, (s+1)*n//k), drawn from the push's seed; the values there travel.
# Work items are fixed chunks of CHECK_CHUNK elements: a chunk compensates its elements
# and handles the strata whose index falls inside it, so every stratum has one owner
# and 1 or N threads write the same bits.

from libc.string cimport memset

cdef inline Py_ssize_t _rk_index(uint64_t seed, Py_ssize_t s, Py_ssize_t n,
                                 Py_ssize_t k) noexcept nogil:
    # Stratum s's index: lo + floor(u * width), u = slimgc_uniform(seed, s) in [0, 1).
    # u has 24 bits, so the double product is exact below 2**29 elements per stratum and
    # stays below width above (codecs/randomk.py computes the same in NumPy).
    cdef Py_ssize_t lo = s * n // k
    cdef Py_ssize_t width = (s + 1) * n // k - lo
    return lo + <Py_ssize_t>(<double>slimgc_uniform(seed, s) * <double>width)


cdef inline Py_ssize_t _rk_stratum(Py_ssize_t e, Py_ssize_t n, Py_ssize_t k) noexcept nogil:
    # The stratum holding element e: the largest s with s*n//k <= e.
    return ((e + 1) * k - 1) // n


cdef Py_ssize_t _rk_encode_chunk(const float* g, float* r, float* out, Py_ssize_t e0,
                                 Py_ssize_t e1, Py_ssize_t n, Py_ssize_t k,
                                 uint64_t seed) noexcept nogil:
    # r = g + r over [e0, e1), then out[s] = r[idx_s], r[idx_s] = 0 for the strata whose
    # index lies in the chunk. Returns the count of non-finite g + r.
    cdef Py_ssize_t j, s, idx, bad
    for j in range(e0, e1):
        r[j] = g[j] + r[j]
    bad = _count_bad(r + e0, e1 - e0)
    for s in range(_rk_stratum(e0, n, k), _rk_stratum(e1 - 1, n, k) + 1):
        idx = _rk_index(seed, s, n, k)
        if e0 <= idx < e1:
            out[s] = r[idx]
            r[idx] = 0.0
    return bad


def encode_randomk(const float[::1] grad, float[::1] residual, float[::1] out, uint64_t seed,
                   int num_threads, bint grad_checked=False):
    """randomk: out[s] = (grad + residual)[idx_s] for the k = len(out) strata, residual =
    grad + residual with those elements zeroed. Returns (non-finite grad count, non-finite
    grad + residual count) as the lane encoders do: nothing is written when the first is
    not 0; grad_checked skips the read-only pre-check."""
    cdef Py_ssize_t n = grad.shape[0], k = out.shape[0]
    cdef Py_ssize_t n_chunks = _ceil_div(n, CHECK_CHUNK)
    cdef Py_ssize_t n_checked = 0 if grad_checked else n_chunks
    cdef Py_ssize_t c1, c2, bad = 0, bad_comp = 0
    cdef bint clean = False
    if residual.shape[0] != n:
        raise ValueError("residual has %d elements, grad %d" % (residual.shape[0], n))
    if k > n or (n > 0 and k < 1) or n >= (<Py_ssize_t>1 << 31):
        raise ValueError("randomk: need 1 <= k <= n < 2**31, got k=%d, n=%d" % (k, n))
    if n == 0:
        return 0, 0
    cdef const float* g = &grad[0]
    cdef float* r = &residual[0]
    cdef float* o = &out[0]
    cdef Py_ssize_t* flags = <Py_ssize_t*>calloc(n_chunks, sizeof(Py_ssize_t))
    cdef Py_ssize_t* comp_flags = <Py_ssize_t*>calloc(n_chunks, sizeof(Py_ssize_t))
    if flags == NULL or comp_flags == NULL:
        free(flags)
        free(comp_flags)
        raise MemoryError()
    with nogil, parallel(num_threads=_team(num_threads, n_chunks)):
        for c1 in prange(n_checked, schedule="dynamic"):
            flags[c1] = _count_bad(g + c1 * CHECK_CHUNK, min(CHECK_CHUNK, n - c1 * CHECK_CHUNK))
        slimgc_barrier()   # every flag is written before anyone reads them
        clean = _all_zero(flags, n_chunks)
        if clean:
            for c2 in prange(n_chunks, schedule="dynamic"):
                comp_flags[c2] = _rk_encode_chunk(g, r, o, c2 * CHECK_CHUNK,
                                                  min((c2 + 1) * CHECK_CHUNK, n), n, k, seed)
    for c1 in range(n_chunks):
        bad += flags[c1]
    if bad == 0:
        for c2 in range(n_chunks):
            bad_comp += comp_flags[c2]
    free(flags)
    free(comp_flags)
    return bad, bad_comp


cdef void _rk_decode_chunk(const float* values, float* out, Py_ssize_t e0, Py_ssize_t e1,
                           Py_ssize_t n, Py_ssize_t k, uint64_t seed) noexcept nogil:
    cdef Py_ssize_t s, idx
    memset(out + e0, 0, (e1 - e0) * sizeof(float))
    for s in range(_rk_stratum(e0, n, k), _rk_stratum(e1 - 1, n, k) + 1):
        idx = _rk_index(seed, s, n, k)
        if e0 <= idx < e1:
            out[idx] = values[s]


def decode_randomk(const float[::1] values, float[::1] out, uint64_t seed, int num_threads):
    """randomk: out = zeros with out[idx_s] = values[s] for the k = len(values) strata of
    the push keyed by `seed`."""
    cdef Py_ssize_t n = out.shape[0], k = values.shape[0], c
    cdef Py_ssize_t n_chunks = _ceil_div(n, CHECK_CHUNK)
    if k > n or (n > 0 and k < 1) or n >= (<Py_ssize_t>1 << 31):
        raise ValueError("randomk: need 1 <= k <= n < 2**31, got k=%d, n=%d" % (k, n))
    if n == 0:
        return
    cdef const float* v = &values[0]
    cdef float* o = &out[0]
    with nogil:
        for c in prange(n_chunks, schedule="dynamic", num_threads=_team(num_threads, n_chunks)):
            _rk_decode_chunk(v, o, c * CHECK_CHUNK, min((c + 1) * CHECK_CHUNK, n), n, k, seed)
