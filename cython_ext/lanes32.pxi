# ---------------------------------------------------------------- float32 lanes
# The digit stream of float64 lanes (k radix-R digits each) regrouped into float32
# lanes of g digits (R**g <= 2**24), so that servers summing in float32 add them
# exactly; slimgc_mx/lanes32.py holds the geometry and validates the arguments.
# pw[j] = R**j for j = 0..k (uint64).

cdef inline uint64_t _digits(uint64_t v, Py_ssize_t o, Py_ssize_t c,
                             const uint64_t* pw) noexcept nogil:
    # Digits o .. o+c-1 of v as one integer.
    return (v // pw[o]) % pw[c]


def split_lanes32(const double[::1] lanes, float[::1] out, const uint64_t[::1] pw,
                  Py_ssize_t k, Py_ssize_t g):
    """out[m] = digits m*g .. m*g+g-1 of the digit stream of `lanes` (k digits per lane).

    Returns the number of lanes that are not integers in [0, R**k): then out is
    left unwritten.
    """
    cdef Py_ssize_t n = lanes.shape[0], n32 = out.shape[0], i, m, d0, o, c
    cdef Py_ssize_t bad = 0
    cdef double x, limit
    cdef uint64_t part
    if pw.shape[0] < k + 1 or g < 1 or g > k or n32 != (n * k + g - 1) // g:
        raise ValueError("split_lanes32: inconsistent geometry")
    limit = <double>pw[k]
    with nogil:
        for i in range(n):
            x = lanes[i]
            if not (x >= 0.0 and x < limit) or x != <double>(<uint64_t>x):
                bad += 1
        if bad == 0:
            for m in range(n32):
                d0 = m * g
                i = d0 // k
                o = d0 - i * k
                c = g if g < k - o else k - o
                part = _digits(<uint64_t>lanes[i], o, c, &pw[0])
                if c < g and i + 1 < n:
                    part = part + _digits(<uint64_t>lanes[i + 1], 0, g - c, &pw[0]) * pw[c]
                out[m] = <float>part
    return bad


def join_lanes32(const float[::1] parts, double[::1] out, const uint64_t[::1] pw,
                 Py_ssize_t k, Py_ssize_t g):
    """out[i] = the float64 lane whose k digits are digits i*k .. i*k+k-1 of the digit
    stream in `parts` (g digits per float32 lane): split_lanes32 undone, on sums too.

    Returns the number of parts that are not integers in [0, R**g) (the last part:
    [0, R**(digits it holds))): then out is left unwritten.
    """
    cdef Py_ssize_t n = out.shape[0], n32 = parts.shape[0], i, m, o, pos, c, last
    cdef Py_ssize_t bad = 0
    cdef float p
    cdef double limit
    cdef uint64_t acc
    if pw.shape[0] < k + 1 or g < 1 or g > k or n32 != (n * k + g - 1) // g:
        raise ValueError("join_lanes32: inconsistent geometry")
    last = n * k - (n32 - 1) * g if n32 else 0
    with nogil:
        for m in range(n32):
            p = parts[m]
            limit = <double>(pw[last] if m == n32 - 1 else pw[g])
            if not (p >= 0.0 and <double>p < limit) or p != <float>(<uint64_t>p):
                bad += 1
        if bad == 0:
            for i in range(n):
                acc = 0
                pos = 0
                m = (i * k) // g
                o = i * k - m * g
                while pos < k:
                    c = g - o if g - o < k - pos else k - pos
                    acc = acc + _digits(<uint64_t>parts[m], o, c, &pw[0]) * pw[pos]
                    pos = pos + c
                    m = m + 1
                    o = 0
                out[i] = <double>acc
    return bad
