# 1bit (slimgc_mx/codecs/onebit.py): q = (c >= 0), value scale * (2q - 1).

cdef Py_ssize_t _levels_1bit(const float* g, float* r, float* q, Py_ssize_t cnt,
                             const LevelArgs* a, Py_ssize_t e0, Py_ssize_t ce0,
                             double* stat) noexcept nogil:
    # s * (2q - 1) in float32 equals own[q] bit for bit. The statistic, sum |c|, is added
    # in element order in a loop of its own, so the level loop still vectorizes.
    cdef Py_ssize_t j
    cdef float c, s = a.scale
    cdef int b, bad = 0
    cdef float comp[BLOCK * MAX_DIGITS]
    cdef double total = stat[0]
    for j in range(cnt):
        c = g[j] + r[j]
        comp[j] = c
        b = c >= 0
        q[j] = <float>b
        r[j] = c - s * <float>(2 * b - 1)
        bad += not (fabsf(c) <= FLT_MAX)
    for j in range(cnt):
        total += fabs(<double>comp[j])
    stat[0] = total
    return bad


def encode_1bit(const float[::1] grad, float[::1] residual, double[::1] lanes,
                const uint64_t[::1] powers, float scale, int num_threads,
                bint grad_checked=False, LocalSGD local=None):
    """1bit: returns (counts as encode_2bit, sum |c|)."""
    cdef EncodeJob job = _lane_job(_levels_1bit, grad, residual, lanes, powers,
                                   grad_checked, local)
    job.args.scale = scale
    return _run(&job, num_threads)
