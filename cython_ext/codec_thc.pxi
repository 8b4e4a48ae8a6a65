# thc (slimgc_mx/codecs/thc.py): uniform levels on [-M, M]. y = clamp(c, -M, M),
# x = min((y + M) * inv, g - 1), q = floor(x) + [u < x - floor(x)], value
# step * (q - (g-1)/2) in float32 (= float32(double(step) * (q - (g-1)/2)), the table's
# value: the product is exact in double). Statistic per chunk: max |c|.
# And the randomized Hadamard rotation of option hadamard: y = f * H(D c), zero-padded to
# a power of two P, with D = diag(+-1) from the push's sign stream and f = 1/sqrt(P).

from cython.parallel cimport threadid
from libc.stdint cimport int32_t
from libc.stdlib cimport malloc

cdef enum:
    THC_ROW = 4096   # elements of a row of the rotation, transformed in cache (16 KiB)
    THC_PANEL = 16   # columns of a panel of the column stages: one 64-byte line per row

cdef extern from *:
    """
    /* One block of thc levels; returns the count of non-finite c and raises *top to the
       bit pattern of max |c| (non-negative floats order as their bits, and an integer
       maximum vectorizes where a float one may not). Every select picks a value that is
       computed unconditionally, so the loop stays branch-free. */
    SLIMGC_CLONES
    static int slimgc_thc_run(const float* g, float* r, float* q, const float* u,
                                     Py_ssize_t cnt, float m, float inv, float step,
                                     float gm1, int32_t* top) {
        int bad = 0;
        int32_t t = *top;
        float half = 0.5f * gm1;
        float lo = -m;
        Py_ssize_t j;
        SLIMGC_OPAQUE(gm1);
        for (j = 0; j < cnt; j++) {
            float c = g[j] + r[j];
            float y = c < lo ? lo : c;
            float x, low, qf, a;
            int32_t bits;
            y = m < y ? m : y;
            x = (y + m) * inv;
            x = x < gm1 ? x : gm1;
            low = (float)(int)x;
            qf = low + (u[j] < x - low ? 1.0f : 0.0f);
            a = fabsf(c);
            memcpy(&bits, &a, sizeof bits);
            q[j] = qf;
            r[j] = c - step * (qf - half);
            t = bits > t ? bits : t;
            bad += !(a <= FLT_MAX);
        }
        *top = t;
        return bad;
    }

    /* In-place Walsh-Hadamard butterflies (a, b) -> (a + b, a - b) of x[0..len), len a
       power of two, stage by stage for h = 1, 2, 4, ..., len/2: the order the NumPy
       reference uses, so the result is bitwise the same. The first three stages stay
       inside aligned groups of 8 and run group by group (the same arithmetic). */
    static void slimgc_fwht(float* x, Py_ssize_t len) {
        Py_ssize_t h = 1, i, j;
        if (len >= 8) {
            for (i = 0; i < len; i += 8) {
                float* p = x + i;
                float a0 = p[0] + p[1], a1 = p[0] - p[1], a2 = p[2] + p[3], a3 = p[2] - p[3];
                float a4 = p[4] + p[5], a5 = p[4] - p[5], a6 = p[6] + p[7], a7 = p[6] - p[7];
                float b0 = a0 + a2, b2 = a0 - a2, b1 = a1 + a3, b3 = a1 - a3;
                float b4 = a4 + a6, b6 = a4 - a6, b5 = a5 + a7, b7 = a5 - a7;
                p[0] = b0 + b4; p[4] = b0 - b4; p[1] = b1 + b5; p[5] = b1 - b5;
                p[2] = b2 + b6; p[6] = b2 - b6; p[3] = b3 + b7; p[7] = b3 - b7;
            }
            h = 8;
        }
        for (; h < len; h *= 2)
            for (i = 0; i < len; i += 2 * h) {
                float* restrict a = x + i;
                float* restrict b = x + i + h;
                for (j = 0; j < h; j++) {
                    float u = a[j], v = b[j];
                    a[j] = u + v;
                    b[j] = u - v;
                }
            }
    }

    /* The column stages of a row-major (rows x width) panel: butterflies between rows j
       and j + h on `width` contiguous floats, for h = 1, 2, ..., rows/2 in this order. */
    static void slimgc_fwht_panel(float* x, Py_ssize_t rows, Py_ssize_t width) {
        Py_ssize_t h, i, j, t;
        for (h = 1; h < rows; h *= 2)
            for (i = 0; i < rows; i += 2 * h)
                for (j = i; j < i + h; j++) {
                    float* restrict a = x + j * width;
                    float* restrict b = x + (j + h) * width;
                    for (t = 0; t < width; t++) {
                        float u = a[t], v = b[t];
                        a[t] = u + v;
                        b[t] = u - v;
                    }
                }
    }

    /* The rotation's diagonal: +1 or -1 from element e's uniform of the sign stream. */
    static inline float slimgc_sign_of(float u) {
        return u < 0.5f ? 1.0f : -1.0f;
    }
    """
    int slimgc_thc_run(const float* g, float* r, float* q, const float* u, Py_ssize_t cnt,
                       float m, float inv, float step, float gm1, int32_t* top) noexcept nogil
    void slimgc_fwht(float* x, Py_ssize_t len) noexcept nogil
    void slimgc_fwht_panel(float* x, Py_ssize_t rows, Py_ssize_t width) noexcept nogil
    float slimgc_sign_of(float u) noexcept nogil


cdef Py_ssize_t _levels_thc(const float* g, float* r, float* q, Py_ssize_t cnt,
                            const LevelArgs* a, Py_ssize_t e0, Py_ssize_t ce0,
                            double* stat) noexcept nogil:
    # a.table = (M, inv, step) of this push (all 0 while M is 0), a.offset = g.
    cdef int32_t top = 0
    cdef float v
    cdef float u[BLOCK * MAX_DIGITS]
    slimgc_uniforms(a.seed, e0, cnt, u)
    cdef Py_ssize_t bad = slimgc_thc_run(g, r, q, u, cnt, a.table[0], a.table[1], a.table[2],
                                         <float>(a.offset - 1), &top)
    memcpy(&v, &top, sizeof(float))
    stat[0] = max(stat[0], <double>v)
    return bad


def encode_thc(const float[::1] grad, float[::1] residual, double[::1] lanes,
               const uint64_t[::1] powers, const float[::1] grid, int levels, uint64_t seed,
               int num_threads, bint grad_checked=False, LocalSGD local=None):
    """thc: grid = (M, inv, step) float32; returns (counts as encode_2bit, statistics rows:
    max |c| per chunk)."""
    cdef EncodeJob job = _lane_job(_levels_thc, grad, residual, lanes, powers,
                                   grad_checked, local)
    if grid.shape[0] != 3:
        raise ValueError("grid must hold (M, 1/step, step), got %d values" % grid.shape[0])
    if levels < 2:
        raise ValueError("levels must be >= 2, got %d" % levels)
    job.args.table = &grid[0]
    job.args.offset = levels
    job.args.seed = seed
    return _run(&job, num_threads)


# ---------------------------------------------------------------- the rotation
# P elements as rows of THC_ROW (or one row of P): each row is transformed in cache
# (stages h < THC_ROW), then the column stages (h >= THC_ROW) run on panels of THC_PANEL
# columns copied to a contiguous buffer. Stages keep the reference's order, and each
# butterfly is the same arithmetic whichever thread runs it.

cdef Py_ssize_t _thc_check(Py_ssize_t n, Py_ssize_t p) except -1:
    if p < n or p & (p - 1):
        raise ValueError("the rotation's length %d must be a power of two >= %d" % (p, n))
    return p


cdef inline Py_ssize_t _thc_finish(const float* t, Py_ssize_t e, Py_ssize_t cnt, float f,
                                   uint64_t seed, float* x, float* out, const float* g,
                                   float* r, Py_ssize_t n) noexcept nogil:
    # Elements e .. e+cnt-1 of f * t, rotated back or scaled: forward (x): x = f * t, and
    # returns the count of non-finite values; back: w = D (f * t) for e < n into out, or
    # into the residual as r = (g + r) - w. The signs come THC_PANEL at a time.
    cdef Py_ssize_t j, j0, m, stop = min(cnt, n - e)
    cdef float u[THC_PANEL]
    cdef float w
    if x != NULL:
        for j in range(cnt):
            x[j] = t[j] * f
        return _count_bad(x, cnt)
    j0 = 0
    while j0 < stop:
        m = min(<Py_ssize_t>THC_PANEL, stop - j0)
        slimgc_uniforms(seed, e + j0, m, u)
        if out != NULL:
            for j in range(m):
                out[e + j0 + j] = slimgc_sign_of(u[j]) * (t[j0 + j] * f)
        else:
            for j in range(m):
                w = slimgc_sign_of(u[j]) * (t[j0 + j] * f)
                r[e + j0 + j] = (g[e + j0 + j] + r[e + j0 + j]) - w
        j0 += m
    return 0


cdef Py_ssize_t _thc_transform(float* x, Py_ssize_t p, float f, uint64_t seed, float* out,
                               const float* g, float* r, Py_ssize_t n, bint forward,
                               int num_threads) except -1:
    # Forward: x = f * H(D (g + r)) zero-padded, returns the non-finite count. Back: x = H x,
    # then _thc_finish writes D (f * x) to out or into the residual.
    cdef Py_ssize_t width = min(p, <Py_ssize_t>THC_ROW), rows = p // width
    cdef Py_ssize_t n_panels = width // THC_PANEL if rows > 1 else 0
    cdef Py_ssize_t i, j, c, e, row, bad = 0
    cdef int team = _team(num_threads, rows)
    cdef float* panel
    with nogil:
        for i in prange(rows, schedule="dynamic", num_threads=team):
            e = i * width
            if forward:
                # the row's signs first, in place, then D (g + r), zero past n
                slimgc_uniforms(seed, e, width, x + e)
                for j in range(min(width, max(n - e, 0))):
                    x[e + j] = slimgc_sign_of(x[e + j]) * (g[e + j] + r[e + j])
                for j in range(max(n - e, 0), width):
                    x[e + j] = 0.0
            slimgc_fwht(x + e, width)
            if rows == 1:
                bad += _thc_finish(x, 0, width, f, seed, x if forward else NULL, out, g, r, n)
    if n_panels == 0:
        return bad
    team = _team(num_threads, n_panels)
    cdef float* bufs = <float*>malloc(team * rows * THC_PANEL * sizeof(float))
    if bufs == NULL:
        raise MemoryError()
    with nogil:
        for c in prange(n_panels, schedule="dynamic", num_threads=team):
            panel = bufs + threadid() * rows * THC_PANEL
            for row in range(rows):
                memcpy(panel + row * THC_PANEL, x + row * width + c * THC_PANEL,
                       THC_PANEL * sizeof(float))
            slimgc_fwht_panel(panel, rows, THC_PANEL)
            for row in range(rows):
                e = row * width + c * THC_PANEL
                bad += _thc_finish(panel + row * THC_PANEL, e, THC_PANEL, f, seed,
                                   x + e if forward else NULL, out, g, r, n)
    free(bufs)
    return bad


def thc_rotate(const float[::1] grad, const float[::1] residual, float[::1] y, uint64_t seed,
               float factor, int num_threads):
    """y = factor * H(D (grad + residual)), zero-padded to len(y), a power of two; returns
    the number of non-finite values in y."""
    cdef Py_ssize_t n = grad.shape[0], p = _thc_check(grad.shape[0], y.shape[0])
    if residual.shape[0] != n:
        raise ValueError("residual has %d elements, grad %d" % (residual.shape[0], n))
    if p == 0:
        return 0
    return _thc_transform(&y[0], p, factor, seed, NULL, &grad[0] if n else NULL,
                          <float*>&residual[0] if n else NULL, n, True, num_threads)


def thc_unrotate(float[::1] v, float[::1] out, const float[::1] grad, float[::1] residual,
                 uint64_t seed, float factor, int num_threads):
    """w = D (factor * H v), v overwritten (scratch). out given: out = w[:len(out)]; else
    residual = (grad + residual) - w[:len(grad)] (error feedback in the original domain)."""
    cdef Py_ssize_t n, p = v.shape[0]
    if out is not None:
        n = out.shape[0]
    elif grad is not None and residual is not None and residual.shape[0] == grad.shape[0]:
        n = grad.shape[0]
    else:
        raise ValueError("thc_unrotate needs out, or grad and residual of equal length")
    _thc_check(n, p)
    if p == 0:
        return
    _thc_transform(&v[0], p, factor, seed, &out[0] if out is not None and n else NULL,
                   &grad[0] if out is None and n else NULL,
                   &residual[0] if out is None and n else NULL, n, False, num_threads)
