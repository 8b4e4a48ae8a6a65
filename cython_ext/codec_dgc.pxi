# dgc (slimgc_mx/codecs/dgc.py): momentum correction and local accumulation before topk's
# selection and slot (codec_topk.pxi). Per element, with s the local clipping factor:
#   u = momentum * u + s * g    (the velocity, accumulated instead of the gradient)
#   v = v + u                   (local accumulation: the residual)
# the entries of largest |v| above a sampled threshold are sent, and v and u are zeroed
# there (momentum factor masking).

cdef float _dgc_at(const SparseArgs* a, Py_ssize_t i) noexcept nogil:
    return a.c[i] + (a.momentum * a.u[i] + a.gscale * a.g[i])


cdef int _dgc_pass(const SparseArgs* a, Py_ssize_t lo, Py_ssize_t hi) noexcept nogil:
    cdef Py_ssize_t i
    cdef int bad = 0
    cdef float vel, x
    for i in range(lo, hi):
        vel = a.momentum * a.u[i] + a.gscale * a.g[i]
        x = a.c[i] + vel
        a.u[i] = vel
        a.c[i] = x
        bad += not (fabsf(x) <= FLT_MAX)
    return bad


def encode_dgc(const float[::1] grad, float[::1] memory, float[::1] slot, Py_ssize_t k,
               uint64_t seed, Py_ssize_t samples, Py_ssize_t rank, float momentum, double clip,
               int index_bits, int num_threads, bint grad_checked=False):
    """dgc: memory = [v | u] (2n); at most k entries of largest |v| above the sampled
    threshold into `slot`. Returns as encode_topk, with the clipping factor of g."""
    cdef Py_ssize_t n = grad.shape[0]
    if memory.shape[0] != 2 * n:
        raise ValueError("memory has %d elements, needs 2 * %d" % (memory.shape[0], n))
    cdef SparseJob job = _sparse_job(grad, slot, k, seed, samples, rank, index_bits,
                                     grad_checked)
    job.args.c = &memory[0] if n else NULL
    job.args.u = &memory[n] if n else NULL
    job.args.momentum = momentum
    job.clip = clip
    job.exact = False
    job.at = _dgc_at
    job.compensate = _dgc_pass
    return _sparse_run(&job, num_threads)
