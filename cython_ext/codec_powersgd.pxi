# powersgd (slimgc_mx/codecs/powersgd.py): the per-element passes around the BLAS products.
# The matrix products M Q and M^T P_hat are NumPy (BLAS) calls, the same in the codec and
# its reference; these kernels compensate (M = g + r) and expand rank-r outer products
# x[i, j] = sum_t P[i, t] * Q[j, t] in float64 (float32 products are exact there, so the
# sum is the same with or without fused multiply-adds), t in order, then rounded to float32.
# Work items: (row, tile of SLIMGC_PS_TILE columns), the same arithmetic whatever thread
# runs them.


cdef Py_ssize_t _ps_compensate_chunk(const float* g, float* r, Py_ssize_t e0,
                                     Py_ssize_t e1) noexcept nogil:
    cdef Py_ssize_t j
    for j in range(e0, e1):
        r[j] = g[j] + r[j]
    return _count_bad(r + e0, e1 - e0)


def powersgd_compensate(const float[::1] grad, float[::1] residual, int num_threads,
                        bint grad_checked=False):
    """residual = grad + residual (M). Returns (non-finite grad count, non-finite M count) as
    the lane encoders do: nothing is written when the first is not 0; grad_checked skips
    the read-only pre-check."""
    cdef Py_ssize_t n = grad.shape[0]
    cdef Py_ssize_t n_chunks = _ceil_div(n, CHECK_CHUNK)
    cdef Py_ssize_t n_checked = 0 if grad_checked else n_chunks
    cdef Py_ssize_t c1, c2, bad = 0, bad_comp = 0
    cdef bint clean = False
    if residual.shape[0] != n:
        raise ValueError("residual has %d elements, grad %d" % (residual.shape[0], n))
    if n == 0:
        return 0, 0
    cdef const float* g = &grad[0]
    cdef float* r = &residual[0]
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
                comp_flags[c2] = _ps_compensate_chunk(g, r, c2 * CHECK_CHUNK,
                                                      min((c2 + 1) * CHECK_CHUNK, n))
    for c1 in range(n_checked):
        bad += flags[c1]
    if bad == 0:
        for c2 in range(n_chunks):
            bad_comp += comp_flags[c2]
    free(flags)
    free(comp_flags)
    return bad, bad_comp


cdef extern from *:
    """
    /* Columns [j0, j1) of one row: acc = p[0] q[0, j] + p[1] q[1, j] + ..., added in t
       order (up to three terms per pass over the tile); x = acc, or x = x - acc, in
       float32. Built twice on x86-64 GCC (AVX2 and the baseline, picked at load time):
       the products are exact in double, so both give the same bits. */
    #define SLIMGC_PS_TILE 512  /* columns per work item: a float64 row on the stack */
    #if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
    __attribute__((target_clones("avx2", "default")))
    #endif
    static void slimgc_ps_outer_tile(const double* p, const double* qt, float* x,
                                     Py_ssize_t rank, Py_ssize_t m, Py_ssize_t j0,
                                     Py_ssize_t j1, int subtract) {
        double acc[SLIMGC_PS_TILE];
        Py_ssize_t j, t = 1, w = j1 - j0;
        double a0 = p[0], a1, a2;
        const double *q0 = qt + j0, *q1, *q2;
        for (j = 0; j < w; j++)
            acc[j] = a0 * q0[j];
        while (t < rank) {
            a0 = p[t];
            q0 = qt + t * m + j0;
            if (rank - t >= 3) {
                a1 = p[t + 1]; a2 = p[t + 2]; q1 = q0 + m; q2 = q0 + 2 * m;
                for (j = 0; j < w; j++)
                    acc[j] = ((acc[j] + a0 * q0[j]) + a1 * q1[j]) + a2 * q2[j];
                t += 3;
            } else if (rank - t == 2) {
                a1 = p[t + 1]; q1 = q0 + m;
                for (j = 0; j < w; j++)
                    acc[j] = (acc[j] + a0 * q0[j]) + a1 * q1[j];
                t += 2;
            } else {
                for (j = 0; j < w; j++)
                    acc[j] = acc[j] + a0 * q0[j];
                t += 1;
            }
        }
        x += j0;
        if (subtract)
            for (j = 0; j < w; j++)
                x[j] = x[j] - (float)acc[j];
        else
            for (j = 0; j < w; j++)
                x[j] = (float)acc[j];
    }
    """
    enum: SLIMGC_PS_TILE
    void slimgc_ps_outer_tile(const double* p, const double* qt, float* x, Py_ssize_t rank,
                              Py_ssize_t m, Py_ssize_t j0, Py_ssize_t j1,
                              bint subtract) noexcept nogil


def powersgd_outer(float[::1] x, const double[:, ::1] p, const double[:, ::1] qt,
                   bint subtract, int num_threads):
    """x (n*m, row-major) = P Q^T, or x -= P Q^T with subtract, for P (n, r) and Q^T (r, m)
    given in float64; each element's r products are summed in float64, t in order, and
    rounded to float32 once."""
    cdef Py_ssize_t n = p.shape[0], rank = p.shape[1], m = qt.shape[1], item, i, tile
    if qt.shape[0] != rank or x.shape[0] != n * m:
        raise ValueError("powersgd_outer: P is %dx%d, Q^T %dx%d, x has %d elements"
                         % (n, rank, qt.shape[0], m, x.shape[0]))
    if n == 0 or m == 0:
        return
    if rank < 1:
        raise ValueError("powersgd_outer: rank must be >= 1")
    cdef Py_ssize_t tiles = _ceil_div(m, SLIMGC_PS_TILE)
    cdef Py_ssize_t items = n * tiles
    cdef const double* pp = &p[0, 0]
    cdef const double* qq = &qt[0, 0]
    cdef float* xx = &x[0]
    with nogil:
        for item in prange(items, schedule="static", num_threads=_team(num_threads, items)):
            i = item // tiles
            tile = item - i * tiles
            slimgc_ps_outer_tile(pp + i * rank, qq, xx + i * m, rank, m,
                                 tile * SLIMGC_PS_TILE, min((tile + 1) * SLIMGC_PS_TILE, m),
                                 subtract)
