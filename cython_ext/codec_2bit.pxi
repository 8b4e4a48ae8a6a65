# 2bit (slimgc_mx/codecs/twobit.py): levels {-t, 0, +t} -> q in {0, 1, 2}.

cdef Py_ssize_t _levels_2bit(const float* g, float* r, float* q, Py_ssize_t cnt,
                             const LevelArgs* a, Py_ssize_t e0, Py_ssize_t ce0,
                             double* stat) noexcept nogil:
    # Branch-free so it vectorizes; t * (q - 1) in float32 is exact, so it equals
    # own[q] = float32(double(t) * (q - 1)) bit for bit. No statistic.
    cdef Py_ssize_t j
    cdef float c, t = a.scale
    cdef int d, bad = 0
    for j in range(cnt):
        c = g[j] + r[j]
        d = (c >= t) - (c <= -t)
        q[j] = <float>(1 + d)
        r[j] = c - t * <float>d
        bad += not (fabsf(c) <= FLT_MAX)
    return bad


def encode_2bit(const float[::1] grad, float[::1] residual, double[::1] lanes,
                const uint64_t[::1] powers, float threshold, int num_threads,
                bint grad_checked=False, LocalSGD local=None):
    """2bit: fills lanes[:ceil(n/k)], updates residual.

    Returns (non-finite grad count, non-finite grad + residual count, 0.0); nothing is
    written when the first count is not 0. grad_checked: the caller has counted no
    NaN/Inf in grad, so the read-only pre-check is skipped (a non-finite grad is then
    found while encoding, in the second count, after residual and lanes are written).
    local: a LocalSGD run in the same pass over grad (implies grad_checked's semantics).
    Every lane encoder takes both.
    """
    cdef EncodeJob job = _lane_job(_levels_2bit, grad, residual, lanes, powers,
                                   grad_checked, local)
    job.args.scale = threshold
    return _run(&job, num_threads)
