# 4bit (slimgc_mx/codecs/fourbit.py): q = offset +- units[#thresholds <= |c|] / unit.

cdef Py_ssize_t _levels_4bit(const float* g, float* r, float* q, Py_ssize_t cnt,
                             const LevelArgs* a, Py_ssize_t e0, Py_ssize_t ce0,
                             double* stat) noexcept nogil:
    # Largest threshold <= |c| by seven selects (branch-free, vectorizes). The value sent
    # is +-th[k] = +-float32(0.01 * units[k+1]): own[q] bit for bit. The statistic, sum
    # |g|, is added in element order in a loop of its own. The level counts the group's
    # unit: every threshold's units divide exactly (checked by encode_4bit).
    cdef const float* th = a.table
    cdef const int* units = a.units
    cdef int offset = a.offset
    cdef int unit = a.unit
    cdef float t0 = th[0], t1 = th[1], t2 = th[2], t3 = th[3], t4 = th[4], t5 = th[5]
    cdef float t6 = th[6]
    cdef int u1 = units[1] // unit, u2 = units[2] // unit, u3 = units[3] // unit
    cdef int u4 = units[4] // unit, u5 = units[5] // unit, u6 = units[6] // unit
    cdef int u7 = units[7] // unit
    cdef Py_ssize_t j
    cdef float c, x, ab
    cdef int u, bad = 0
    cdef double total = stat[0]
    for j in range(cnt):
        c = g[j] + r[j]
        ab = fabsf(c)
        x = 0.0
        u = 0
        x = t0 if ab >= t0 else x
        u = u1 if ab >= t0 else u
        x = t1 if ab >= t1 else x
        u = u2 if ab >= t1 else u
        x = t2 if ab >= t2 else x
        u = u3 if ab >= t2 else u
        x = t3 if ab >= t3 else x
        u = u4 if ab >= t3 else u
        x = t4 if ab >= t4 else x
        u = u5 if ab >= t4 else u
        x = t5 if ab >= t5 else x
        u = u6 if ab >= t5 else u
        x = t6 if ab >= t6 else x
        u = u7 if ab >= t6 else u
        u = -u if c < 0 else u
        x = -x if c < 0 else x
        q[j] = <float>(offset + u)
        r[j] = c - x
        bad += not (ab <= FLT_MAX)
    for j in range(cnt):
        total += fabs(<double>g[j])
    stat[0] = total
    return bad


def encode_4bit(const float[::1] grad, float[::1] residual, double[::1] lanes,
                const uint64_t[::1] powers, const float[::1] thresholds,
                const int[::1] units, int unit, int offset, int num_threads,
                bint grad_checked=False, LocalSGD local=None):
    """4bit: returns (counts as encode_2bit, sum |g|).

    thresholds ascending, thresholds[k] = float32(0.01 * units[k+1]) (the decoded
    values); units[0] = 0, every unit a multiple of `unit`. Level q = offset +- units /
    unit lies in 0..2*offset.
    """
    if thresholds.shape[0] != 7 or units.shape[0] != 8:
        raise ValueError("encode_4bit needs 7 thresholds and 8 units")
    if unit < 1 or any(u % unit for u in units):
        raise ValueError("encode_4bit: unit must be >= 1 and divide every unit")
    if units[0] != 0 or min(units) < 0 or max(units) // unit > offset:
        raise ValueError("encode_4bit: units must start at 0 and stay in 0..offset*unit")
    cdef EncodeJob job = _lane_job(_levels_4bit, grad, residual, lanes, powers,
                                   grad_checked, local)
    job.args.table = &thresholds[0]
    job.args.units = &units[0]
    job.args.unit = unit
    job.args.offset = offset
    return _run(&job, num_threads)
