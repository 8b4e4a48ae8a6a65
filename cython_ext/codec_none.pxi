# none (slimgc_mx/codecs/none.py): the passthrough, lanes = grad + residual in float32.

def encode_none(const float[::1] grad, float[::1] residual, float[::1] lanes, int num_threads,
                bint grad_checked=False):
    """Passthrough: lanes = grad + residual (float32), residual = 0; counts as encode_2bit."""
    cdef uint64_t one[1]
    one[0] = 1
    cdef EncodeJob job = _job(NULL, grad, residual, &lanes[0] if lanes.shape[0] else NULL,
                              lanes.shape[0], <uint64_t[:1]>one, grad_checked)
    return _run(&job, num_threads)
