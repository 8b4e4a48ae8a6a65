# ---------------------------------------------------------------- PyTorch SGD's rule
# torch.optim.SGD's single-tensor step, one pass over CPU buffers, op for op in float32:
#   d = g / div                                 (div 1: the gradient as it is)
#   d = d + wd * w                              (wd != 0)
#   b = d (first step) | momentum * mom_in + (1 - dampening) * d   (momentum != 0)
#   d = d + momentum * b (nesterov) | b;  mom_out = b
#   out = w + (-lr) * d
# Every operation rounds to float32. torch's vector loops fuse multiply and add, so the
# weights agree with torch's own step within a rounding per operation, not bitwise; they
# are bitwise the same for 1 or N threads and on every worker. out may be w and mom_out
# mom_in (the global update), or not (the local update reads glo_buf and the global
# momentum and writes neither).

cdef void _torch_sgd(const TorchStep* s, const float* w, const float* g, const float* mom_in,
                     float* mom_out, float* out, Py_ssize_t lo, Py_ssize_t hi) noexcept nogil:
    # mom_in NULL with momentum: the first step (b = d).
    cdef Py_ssize_t i
    cdef float d, b
    cdef float div = s.div, wd = s.wd, mu = s.momentum, keep = s.keep, neg_lr = s.neg_lr
    cdef bint scaled = div != 1, decays = wd != 0, heavy = mu != 0, nesterov = s.nesterov
    cdef bint first = mom_in == NULL
    for i in range(lo, hi):
        d = g[i]
        if scaled:
            d = d / div
        if decays:
            d = d + wd * w[i]
        if heavy:
            b = d if first else mu * mom_in[i] + keep * d
            if mom_out != NULL:
                mom_out[i] = b
            d = d + mu * b if nesterov else b
        out[i] = w[i] + neg_lr * d


cdef void _dec_torch_sgd(const TorchStep* s, const double* lanes, const float* rows,
                         Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t n, Py_ssize_t k,
                         Py_ssize_t m, const Divisor* dv, float* w, float* mom,
                         bint first) noexcept nogil:
    # Lanes [lo, hi): BLOCK lanes at a time decoded into a tile that stays in cache, then
    # the step of their elements reads the tile (the caller has range-checked the lanes).
    cdef float tile[BLOCK * MAX_DIGITS]
    cdef Py_ssize_t i = lo, j, e0
    while i < hi:
        j = min(i + BLOCK, hi)
        _dec(lanes, tile, rows, i, j, n, k, m, dv)
        e0 = i * k
        _torch_sgd(s, w + e0, tile,
                   NULL if first or mom == NULL else mom + e0,
                   NULL if mom == NULL else mom + e0, w + e0, 0, min(j * k, n) - e0)
        i = j


cdef class TorchSGD:
    """torch.optim.SGD's rule with one step's settings (the rule above): a kernel for
    the global update (in place, the sum divided by the number of workers) and the
    backup's local update (out from glo_buf, the global momentum read only)."""

    cdef TorchStep s

    def local(self, const float[::1] weight, const float[::1] mom, float[::1] out):
        """The backup's local step as a LocalSGD for a lane codec's encode: out from weight
        (glo_buf), the gradient being encoded and mom (the global momentum, read only;
        None: the first step), tile by tile in the encoder's pass."""
        cdef LocalSGD local = LocalSGD(weight, mom, out, 0, 0, 1, 0, -1)
        local.rule = self.s
        local.step.torch = &local.rule
        return local

    def __init__(self, float lr, float weight_decay, float momentum, double dampening,
                 bint nesterov, float div=1.0):
        if not div > 0:
            raise ValueError("TorchSGD: div must be positive, got %r" % div)
        self.s.neg_lr = -lr
        self.s.wd = weight_decay
        self.s.div = div
        self.s.momentum = momentum
        self.s.keep = 1.0 - dampening  # torch's alpha: the double, then float32
        self.s.nesterov = nesterov

    def step(self, const float[::1] weight, const float[::1] grad, const float[::1] mom_in,
             float[::1] mom_out, float[::1] out, int num_threads):
        """out (and mom_out, with momentum) from weight, grad and mom_in; mom_in None:
        the first step with momentum (b = d), or no momentum."""
        cdef Py_ssize_t n = weight.shape[0], c, lo, n_chunks
        if grad.shape[0] != n or out.shape[0] != n:
            raise ValueError("TorchSGD.step: weight %d, grad %d and out %d elements differ"
                             % (n, grad.shape[0], out.shape[0]))
        for name, buf in (("mom_in", mom_in), ("mom_out", mom_out)):
            if buf is not None and buf.shape[0] != n:
                raise ValueError("TorchSGD.step: %s has %d elements, weight %d"
                                 % (name, buf.shape[0], n))
        if n == 0:
            return
        cdef const float* w = &weight[0]
        cdef const float* g = &grad[0]
        cdef const float* mi = &mom_in[0] if mom_in is not None else NULL
        cdef float* mo = &mom_out[0] if mom_out is not None else NULL
        cdef float* o = &out[0]
        n_chunks = _ceil_div(n, SGD_CHUNK)
        with nogil:
            for c in prange(n_chunks, schedule="static",
                            num_threads=_team(num_threads, n_chunks)):
                lo = c * SGD_CHUNK
                _torch_sgd(&self.s, w, g, mi, mo, o, lo, min(lo + SGD_CHUNK, n))

    def decode_step(self, const double[::1] lanes, const float[::1] rows, Py_ssize_t k,
                    Py_ssize_t m, float[::1] weight, float[::1] mom, bint first,
                    int num_threads, bint checked=False):
        """step in place on weight (and mom) with the sum that decode_lanes would write
        (the codec's decode table): bitwise decode_lanes + step, the sum never in memory.
        first: mom holds no momentum yet (b = d). Lanes outside [0, 2**53) raise
        ValueError before any weight is written, unless `checked` (count_lanes_outside
        found none)."""
        cdef Py_ssize_t n = weight.shape[0], c, bad = 0
        cdef Py_ssize_t n_lanes = _check_table("TorchSGD.decode_step", lanes, rows, n, k, m)
        cdef Py_ssize_t n_chunks = _ceil_div(n_lanes, CHUNK_LANES)
        if mom is not None and mom.shape[0] != n:
            raise ValueError("TorchSGD.decode_step: mom has %d elements, weight %d"
                             % (mom.shape[0], n))
        if self.s.momentum != 0 and mom is None:
            raise ValueError("TorchSGD.decode_step: momentum needs mom")
        if n == 0:
            return
        cdef Divisor dv = _divisor(rows.shape[0] // ROW)
        cdef const double* ln = &lanes[0]
        cdef const float* tb = &rows[0]
        cdef float* w = &weight[0]
        cdef float* mo = &mom[0] if mom is not None else NULL
        if not checked:
            with nogil:
                bad = _outside(ln, n_lanes)
        if bad:
            raise ValueError("%d lanes lie outside [0, 2**53): not a sum of this codec's "
                             "lanes (wrong codec, worker count or corrupted data); no weight "
                             "was written" % bad)
        with nogil:
            for c in prange(n_chunks, schedule="static",
                            num_threads=_team(num_threads, n_chunks)):
                _dec_torch_sgd(&self.s, ln, tb, c * CHUNK_LANES,
                               min((c + 1) * CHUNK_LANES, n_lanes), n, k, m, &dv, w, mo,
                               first)
