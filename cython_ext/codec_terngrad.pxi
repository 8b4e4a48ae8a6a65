# terngrad (slimgc_mx/codecs/terngrad.py): stochastic levels {-s, 0, +s}, P(|level| = 1)
# = min(|c|, s) / s, with s the shared scale. Statistics per chunk, in element order:
# max |c|, sum c, sum c^2.

cdef Py_ssize_t _levels_terngrad(const float* g, float* r, float* q, Py_ssize_t cnt,
                                 const LevelArgs* a, Py_ssize_t e0, Py_ssize_t ce0,
                                 double* stat) noexcept nogil:
    # The value sent is s * d, d in {-1, 0, 1}: exact in float32, own[q] bit for bit.
    # s = 0 (the first push) sends zeros and keeps everything in the residual.
    # clip_only: the residual keeps c - clamp(c, -s, s), not the rounding noise.
    cdef Py_ssize_t j
    cdef float c, x, s = a.scale
    cdef float inv = 1.0 / s if s > 0 else 0.0
    cdef int d, bad = 0
    cdef float comp[BLOCK * MAX_DIGITS]
    cdef float u[BLOCK * MAX_DIGITS]
    cdef double top = stat[0], total = stat[1], squares = stat[2], v
    slimgc_uniforms(a.seed, e0, cnt, u)
    for j in range(cnt):
        c = g[j] + r[j]
        comp[j] = c
        x = min(fabsf(c), s) * inv
        d = <int>(u[j] < x)
        d = -d if c < 0 else d
        q[j] = <float>(1 + d)
        r[j] = c - (copysignf(min(fabsf(c), s), c) if a.clip_only else s * <float>d)
        bad += not (fabsf(c) <= FLT_MAX)
    for j in range(cnt):
        v = <double>comp[j]
        top = max(top, fabs(v))
        total += v
        squares += v * v
    stat[0] = top
    stat[1] = total
    stat[2] = squares
    return bad


def encode_terngrad(const float[::1] grad, float[::1] residual, double[::1] lanes,
                    const uint64_t[::1] powers, float scale, uint64_t seed, int num_threads,
                    bint grad_checked=False, bint clip_only=False, LocalSGD local=None):
    """terngrad: returns (counts as encode_2bit, statistics rows (max |c|, sum c, sum c^2))."""
    cdef EncodeJob job = _lane_job(_levels_terngrad, grad, residual, lanes, powers,
                                   grad_checked, local)
    job.args.scale = scale
    job.args.seed = seed
    job.args.clip_only = clip_only
    job.stat_width = 3
    return _run(&job, num_threads)
