# topk (slimgc_mx/codecs/topk.py), whose selection and slot dgc shares (codec_dgc.pxi):
# the k largest |c| of a tensor as (value, index) pairs in a gather slot.
#
# Encode, one call: (0) the read-only NaN/Inf pass over g (dgc with clipping: also the
# sum of squares of g, per chunk); (1) a threshold, the rank-th largest |c| of a sample
# (of every element when the tensor is small); (2) per chunk of CHECK_CHUNK elements, c
# written in place and, block by block while in L1, the elements with |c| >= threshold
# collected (index and value); topk lowers the threshold until at least k pass;
# (3) the candidates put together in index order; (4) the exact k-th largest |c| among
# them by a selection (no sort), ties to the lower index; (5) the slot written, and c
# zeroed where sent (dgc: the velocity too). Work is split only at fixed bounds (samples,
# chunks, blocks of entries) and the selections run on one thread, so 1 and N threads
# give the same bits.
#
# Slot (float32 lanes): [count | k values | k index lanes (| k high index lanes)], zeros
# after `count` entries; an index i travels as i mod 2**bits (and i >> bits).

from libc.math cimport sqrt
from libc.stdlib cimport malloc
from libc.string cimport memset

cdef extern from *:
    """
    /* Element index of sample j of the push keyed by `seed`, uniform in [0, n), n < 2**32
       (slimgc_mx/codecs/rng.py positions). */
    static inline Py_ssize_t slimgc_position(uint64_t seed, Py_ssize_t j, uint64_t n) {
        return (Py_ssize_t)(((slimgc_mix(seed + (uint64_t)j * 0x9E3779B97F4A7C15ULL) >> 32)
                             * n) >> 32);
    }
    """
    Py_ssize_t slimgc_position(uint64_t seed, Py_ssize_t j, uint64_t n) noexcept nogil

cdef extern from *:
    """
    /* How many of the 16 values c[0..16) have |c| >= thr: one vectorized test of a block. */
    static inline int slimgc_hits16(const float* c, float thr) {
        int hits = 0, j;
        #pragma omp simd reduction(+:hits)
        for (j = 0; j < 16; j++)
            hits += fabsf(c[j]) >= thr;
        return hits;
    }
    """
    int slimgc_hits16(const float* c, float thr) noexcept nogil

cdef extern from *:
    """
    #if defined(__GNUC__) || defined(__clang__)
    #define slimgc_prefetch(p) __builtin_prefetch(p)
    #else
    #define slimgc_prefetch(p) ((void)(p))
    #endif
    """
    void slimgc_prefetch(const void* p) noexcept nogil


cdef enum:
    BLOCK_SPARSE = 512  # elements compensated, then searched for candidates while in L1
    ENTRY_BLOCK = 16384  # slot entries written per work item


cdef struct SparseArgs:
    const float* g
    float* c          # compensated values, computed in place (topk: the residual; dgc: v)
    float* u          # dgc: the velocity; NULL for topk
    float momentum    # dgc
    float gscale      # dgc: the local clipping factor of g (1: none)


# c at element i as the compensating pass will compute it, without writing (the sample).
ctypedef float (*sparse_at_fn)(const SparseArgs* a, Py_ssize_t i) noexcept nogil
# The compensating pass over [lo, hi) (at most BLOCK_SPARSE elements): writes c (dgc: and
# u); returns the count of non-finite c.
ctypedef int (*sparse_pass_fn)(const SparseArgs* a, Py_ssize_t lo,
                               Py_ssize_t hi) noexcept nogil


cdef struct SparseJob:
    SparseArgs args
    sparse_at_fn at
    sparse_pass_fn compensate
    Py_ssize_t n
    Py_ssize_t k          # slot capacity: topk sends exactly k, dgc at most k
    uint64_t seed
    Py_ssize_t samples    # sample size S (S >= n: every element, in order)
    Py_ssize_t rank       # threshold: the rank-th largest sampled |c| (1-based)
    bint exact            # topk: lower the threshold until at least k elements pass
    float* slot
    Py_ssize_t slot_lanes
    int index_bits
    bint checked
    double clip           # dgc: clip g to this L2 norm (0: no clipping)


cdef float _topk_at(const SparseArgs* a, Py_ssize_t i) noexcept nogil:
    return a.g[i] + a.c[i]


cdef int _topk_pass(const SparseArgs* a, Py_ssize_t lo, Py_ssize_t hi) noexcept nogil:
    # c = g + r, stored in r (the residual keeps c, zeroed later where sent).
    cdef Py_ssize_t i
    cdef int bad = 0
    cdef float x
    for i in range(lo, hi):
        x = a.g[i] + a.c[i]
        a.c[i] = x
        bad += not (fabsf(x) <= FLT_MAX)
    return bad


cdef double _sum_squares(const float* x, Py_ssize_t cnt) noexcept nogil:
    # In element order, in double: the reference's chunk_sum of g*g.
    cdef Py_ssize_t i
    cdef double acc = 0.0
    for i in range(cnt):
        acc += <double>x[i] * <double>x[i]
    return acc


cdef inline void _prefetch_sample(const SparseArgs* a, Py_ssize_t i) noexcept nogil:
    # The sample reads scattered elements: ask for one 16 draws ahead.
    slimgc_prefetch(a.g + i)
    slimgc_prefetch(a.c + i)
    if a.u != NULL:
        slimgc_prefetch(a.u + i)


cdef Py_ssize_t _count_at_least(const float* c, Py_ssize_t lo, Py_ssize_t hi,
                                float thr) noexcept nogil:
    cdef Py_ssize_t i
    cdef int hits = 0
    for i in range(lo, hi):
        hits += fabsf(c[i]) >= thr
    return hits


cdef Py_ssize_t _collect(const float* c, Py_ssize_t lo, Py_ssize_t hi, float thr,
                        int64_t* idx, float* val, Py_ssize_t room) noexcept nogil:
    # The count of elements of [lo, hi) with |c| >= thr; the first `room` of them, in index
    # order, go to idx and val. Blocks of 16 are tested at once and only those with a hit
    # are scanned, without branches while there is room for the whole block.
    cdef Py_ssize_t i = lo, j, found = 0
    cdef float x
    while i < hi:
        if i + 16 <= hi and slimgc_hits16(c + i, thr) == 0:
            i += 16
            continue
        if i + 16 <= hi and found + 16 <= room:
            for j in range(i, i + 16):
                x = c[j]
                idx[found] = j
                val[found] = x
                found += fabsf(x) >= thr
        else:
            for j in range(i, min(i + 16, hi)):
                if fabsf(c[j]) >= thr:
                    if found < room:
                        idx[found] = j
                        val[found] = c[j]
                    found += 1
        i += 16
    return found


cdef int _compensate_chunk(const SparseJob* job, Py_ssize_t lo, Py_ssize_t hi, float thr,
                           int64_t* idx, float* val, Py_ssize_t room,
                           Py_ssize_t* count) noexcept nogil:
    # Compensate [lo, hi) block by block, each block's candidates collected while it is in
    # L1 (the first `room` of them); count[0] = all candidates. Returns the non-finite count.
    cdef Py_ssize_t b0 = lo, b1, found = 0
    cdef int bad = 0
    while b0 < hi:
        b1 = min(b0 + BLOCK_SPARSE, hi)
        bad += job.compensate(&job.args, b0, b1)
        found += _collect(job.args.c, b0, b1, thr, idx + min(found, room),
                          val + min(found, room), max(room - found, 0))
        b0 = b1
    count[0] = found
    return bad


cdef float _kth_largest(float* a, float* b, Py_ssize_t m, Py_ssize_t r) noexcept nogil:
    # The r-th largest (1-based) of a[0..m); a and b (m floats each) are scratch. Quickselect
    # whose partition copies into the other buffer without branches (values above the
    # pivot from the front, below it from the back, both stores always made), with pivots
    # from a fixed sequence: the same input takes the same steps.
    cdef Py_ssize_t t = r - 1, i, above, below
    cdef uint64_t draw = 0
    cdef float p, x
    cdef float* src = a
    cdef float* dst = b  # always a or b: the buffer not holding the values
    while m > 1:
        draw += 1
        p = src[slimgc_mix(draw) % <uint64_t>m]
        above = 0
        below = 0
        for i in range(m):
            x = src[i]
            dst[above] = x
            above += x > p
            dst[m - 1 - below] = x
            below += x < p
        # dst: [0, above) > p, [m - below, m) < p; the rest equals p
        if t < above:
            m = above
            src = dst
        elif t >= m - below:
            t -= m - below
            src = dst + (m - below)
            m = below
        else:
            return p
        dst = a if dst == b else b
    return src[0]


cdef float _sample_threshold(float* vals, Py_ssize_t samples, Py_ssize_t rank) noexcept nogil:
    # The rank-th largest of the sample vals[0..samples), selected in a copy (vals[samples..]
    # holds room for two), so the sample stays for a lower threshold.
    memcpy(vals + samples, vals, samples * sizeof(float))
    return _kth_largest(vals + samples, vals + 2 * samples, samples, rank)


cdef Py_ssize_t _select(int64_t* idx, float* val, Py_ssize_t m, Py_ssize_t k,
                        float* scratch) noexcept nogil:
    # Keep, in place and in index order, the k candidates of largest |value|: those above
    # the k-th largest magnitude T, then those equal to T from the lowest index on.
    # scratch: 2m floats.
    cdef Py_ssize_t i, kept = 0, need = k
    cdef float x, top
    for i in range(m):
        scratch[i] = fabsf(val[i])
    top = _kth_largest(scratch, scratch + m, m, k)
    for i in range(m):
        need -= <Py_ssize_t>(fabsf(val[i]) > top)
    for i in range(m):
        x = fabsf(val[i])
        if x > top or (x == top and need > 0):
            if not x > top:
                need -= 1
            idx[kept] = idx[i]
            val[kept] = val[i]
            kept += 1
    return kept


cdef void _write_entries(const SparseJob* job, const int64_t* idx, const float* val,
                         Py_ssize_t lo, Py_ssize_t hi) noexcept nogil:
    # Slot entries [lo, hi); the sent elements of c (and u) become 0: error feedback keeps
    # c - value = 0 there, and dgc masks the velocity where it sent.
    cdef Py_ssize_t i, k = job.k
    cdef int64_t x, mask = (<int64_t>1 << job.index_bits) - 1
    cdef bint wide = job.n > (<int64_t>1 << job.index_bits)
    cdef float* s = job.slot
    for i in range(lo, hi):
        x = idx[i]
        s[1 + i] = val[i]
        s[1 + k + i] = <float>(x & mask)
        if wide:
            s[1 + 2 * k + i] = <float>(x >> job.index_bits)
        job.args.c[x] = 0.0
        if job.args.u != NULL:
            job.args.u[x] = 0.0


cdef void _write_slot(const SparseJob* job, const int64_t* idx, const float* val,
                      Py_ssize_t sent, int num_threads) noexcept nogil:
    # The slot of `sent` entries, zeros after them; entries in parallel blocks (each
    # touches its own elements of c and of the slot).
    cdef Py_ssize_t i, b, n_blocks = _ceil_div(sent, ENTRY_BLOCK)
    memset(job.slot, 0, job.slot_lanes * sizeof(float))
    job.slot[0] = <float>sent
    for b in prange(n_blocks, schedule="static", num_threads=_team(num_threads, n_blocks)):
        _write_entries(job, idx, val, b * ENTRY_BLOCK, min((b + 1) * ENTRY_BLOCK, sent))


cdef tuple _sparse_run(SparseJob* job, int num_threads):
    """Steps (0)-(5): (non-finite g count, non-finite c count, entries sent, clipping factor);
    a first count > 0 wrote nothing, a second wrote c (and u) but not the slot."""
    cdef Py_ssize_t n = job.n, n_chunks = _ceil_div(n, CHECK_CHUNK)
    cdef Py_ssize_t ch, j, lo, hi, m = 0, bad = 0, bad_comp = 0, sent = 0, rank = job.rank
    cdef Py_ssize_t samples = min(job.samples, n), cap
    cdef bint pre = not job.checked or job.clip > 0, failed = False, local = True
    cdef double total = 0.0, norm
    cdef float thr
    cdef int team = _team(num_threads, n_chunks)
    cdef Py_ssize_t* counts
    cdef Py_ssize_t* flags
    cdef Py_ssize_t* offsets
    cdef double* squares
    cdef float* vals
    cdef int64_t* local_idx = NULL
    cdef float* local_val = NULL
    cdef int64_t* cand = NULL
    cdef float* cand_val = NULL
    cdef float* scratch = NULL
    job.args.gscale = 1.0
    if n == 0:
        _write_slot(job, NULL, NULL, 0, 1)
        return 0, 0, 0, 1.0
    counts = <Py_ssize_t*>calloc(n_chunks, sizeof(Py_ssize_t))
    flags = <Py_ssize_t*>calloc(n_chunks, sizeof(Py_ssize_t))
    offsets = <Py_ssize_t*>calloc(n_chunks + 1, sizeof(Py_ssize_t))
    squares = <double*>calloc(n_chunks, sizeof(double))
    vals = <float*>malloc(3 * samples * sizeof(float))  # the sample, then 2 for selections
    if counts == NULL or flags == NULL or offsets == NULL or squares == NULL or vals == NULL:
        free(counts)
        free(flags)
        free(offsets)
        free(squares)
        free(vals)
        raise MemoryError()
    with nogil:
        # (0) read-only: NaN/Inf in g, and its squares for the clipping norm
        if pre:
            for ch in prange(n_chunks, schedule="dynamic", num_threads=team):
                flags[ch] = _count_bad(job.args.g + ch * CHECK_CHUNK,
                                       min(CHECK_CHUNK, n - ch * CHECK_CHUNK))
                if job.clip > 0:
                    squares[ch] = _sum_squares(job.args.g + ch * CHECK_CHUNK,
                                               min(CHECK_CHUNK, n - ch * CHECK_CHUNK))
            for ch in range(n_chunks):
                bad += flags[ch]
                total += squares[ch]
        if bad == 0:
            if job.clip > 0:
                norm = sqrt(total)
                if norm > job.clip:
                    job.args.gscale = <float>(job.clip / norm)
            # (1) the sampled threshold
            if samples >= n:
                for j in prange(n, schedule="static", num_threads=team):
                    vals[j] = fabsf(job.at(&job.args, j))
            else:
                for j in prange(samples, schedule="static", num_threads=team):
                    _prefetch_sample(&job.args, slimgc_position(job.seed, j + 16, n))
                    vals[j] = fabsf(job.at(&job.args, slimgc_position(job.seed, j, n)))
            thr = _sample_threshold(vals, samples, min(rank, samples))
            # (2) compensate and collect the candidates, block by block while in L1, into
            # each chunk's room for 1.5 times the expected number
            cap = min(<Py_ssize_t>CHECK_CHUNK,
                      <Py_ssize_t>(1.5 * CHECK_CHUNK * min(rank, samples) / samples) + 256)
            local_idx = <int64_t*>malloc(n_chunks * cap * sizeof(int64_t))
            local_val = <float*>malloc(n_chunks * cap * sizeof(float))
            failed = local_idx == NULL or local_val == NULL
            if not failed:
                for ch in prange(n_chunks, schedule="dynamic", num_threads=team):
                    flags[ch] = _compensate_chunk(job, ch * CHECK_CHUNK,
                                                  min((ch + 1) * CHECK_CHUNK, n), thr,
                                                  local_idx + ch * cap, local_val + ch * cap,
                                                  cap, &counts[ch])
                for ch in range(n_chunks):
                    bad_comp += flags[ch]
                    m += counts[ch]
            while not failed and bad_comp == 0 and job.exact and m < job.k:
                # topk: too few passed the sampled threshold; take a lower one, at last 0
                local = False
                if rank >= samples:
                    thr = 0.0
                else:
                    rank = min(samples, 4 * rank)
                    thr = _sample_threshold(vals, samples, rank)
                for ch in prange(n_chunks, schedule="dynamic", num_threads=team):
                    counts[ch] = _count_at_least(job.args.c, ch * CHECK_CHUNK,
                                                 min((ch + 1) * CHECK_CHUNK, n), thr)
                m = 0
                for ch in range(n_chunks):
                    m += counts[ch]
        if bad == 0 and bad_comp == 0 and not failed:
            # (3) the candidates in index order: copied from the chunks' rooms, or
            # collected again where a room overflowed or the threshold moved
            for ch in range(n_chunks):
                offsets[ch + 1] = offsets[ch] + counts[ch]
            cand = <int64_t*>malloc(max(m, 1) * sizeof(int64_t))
            cand_val = <float*>malloc(max(m, 1) * sizeof(float))
            scratch = <float*>malloc(2 * max(m, 1) * sizeof(float))
            failed = cand == NULL or cand_val == NULL or scratch == NULL
            if not failed:
                for ch in prange(n_chunks, schedule="dynamic", num_threads=team):
                    if local and counts[ch] <= cap:
                        memcpy(cand + offsets[ch], local_idx + ch * cap,
                               counts[ch] * sizeof(int64_t))
                        memcpy(cand_val + offsets[ch], local_val + ch * cap,
                               counts[ch] * sizeof(float))
                    elif counts[ch]:
                        _collect(job.args.c, ch * CHECK_CHUNK, min((ch + 1) * CHECK_CHUNK, n),
                                 thr, cand + offsets[ch], cand_val + offsets[ch], counts[ch])
                # (4) the k largest, (5) the slot
                sent = _select(cand, cand_val, m, job.k, scratch) if m > job.k else m
                _write_slot(job, cand, cand_val, sent, num_threads)
    free(counts)
    free(flags)
    free(offsets)
    free(squares)
    free(vals)
    free(local_idx)
    free(local_val)
    free(cand)
    free(cand_val)
    free(scratch)
    if failed:
        raise MemoryError()
    return bad, bad_comp, sent, job.args.gscale


cdef SparseJob _sparse_job(const float[::1] grad, float[::1] slot, Py_ssize_t k,
                           uint64_t seed, Py_ssize_t samples, Py_ssize_t rank, int index_bits,
                           bint checked) except *:
    cdef SparseJob job
    cdef Py_ssize_t n = grad.shape[0]
    if k < 0 or k > n or samples < 1 or rank < 1 or not 1 <= index_bits <= 31:
        raise ValueError("sparse kernel: k %d, samples %d, rank %d or index bits %d out of "
                         "range for %d elements" % (k, samples, rank, index_bits, n))
    if n >= (<int64_t>1 << 32) or n > (<int64_t>1 << (2 * index_bits)):
        raise ValueError("sparse kernel: %d elements are too many" % n)
    if slot.shape[0] < 1 + k * (2 if n <= (<int64_t>1 << index_bits) else 3):
        raise ValueError("sparse kernel: the slot has %d lanes, %d entries need more"
                         % (slot.shape[0], k))
    job.args.g = &grad[0] if n else NULL
    job.args.c = NULL
    job.args.u = NULL
    job.args.momentum = 0.0
    job.args.gscale = 1.0
    job.n = n
    job.k = k
    job.seed = seed
    job.samples = samples
    job.rank = rank
    job.exact = True
    job.slot = &slot[0]
    job.slot_lanes = slot.shape[0]
    job.index_bits = index_bits
    job.checked = checked
    job.clip = 0.0
    job.at = _topk_at
    job.compensate = _topk_pass
    return job


def encode_topk(const float[::1] grad, float[::1] residual, float[::1] slot, Py_ssize_t k,
                uint64_t seed, Py_ssize_t samples, Py_ssize_t rank, int index_bits,
                int num_threads, bint grad_checked=False):
    """topk: the k largest |grad + residual| into `slot`; residual = c, zero where sent.
    Returns (non-finite grad count, non-finite c count, entries sent, 1.0)."""
    if residual.shape[0] != grad.shape[0]:
        raise ValueError("residual has %d elements, grad %d" % (residual.shape[0], grad.shape[0]))
    cdef SparseJob job = _sparse_job(grad, slot, k, seed, samples, rank, index_bits,
                                     grad_checked)
    job.args.c = &residual[0] if grad.shape[0] else NULL
    return _sparse_run(&job, num_threads)


# ---------------------------------------------------------------- decode
cdef int _parse_slot(const float* s, Py_ssize_t k, int bits, bint wide, Py_ssize_t n,
                     int64_t* idx, Py_ssize_t* count) noexcept nogil:
    # A worker's entries: 0, or the problem (1 count, 2 index lane, 3 index order/range,
    # 4 value); the indices go to idx.
    cdef Py_ssize_t i, cnt
    cdef double lim = <double>(<int64_t>1 << bits), lo, hi, v
    cdef int64_t prev = -1, x
    v = s[0]
    if not (v >= 0 and v <= k and v == <double>(<int64_t>v)):
        return 1
    cnt = <Py_ssize_t>v
    count[0] = cnt
    for i in range(cnt):
        if not (fabsf(s[1 + i]) <= FLT_MAX):
            return 4
        lo = s[1 + k + i]
        hi = s[1 + 2 * k + i] if wide else 0.0
        if not (lo >= 0 and lo < lim and lo == <double>(<int64_t>lo)
                and hi >= 0 and hi < lim and hi == <double>(<int64_t>hi)):
            return 2
        x = <int64_t>lo + (<int64_t>hi << bits)
        if x <= prev or x >= n:
            return 3
        idx[i] = x
        prev = x
    return 0


cdef void _scatter(const float* gathered, const int64_t* idx, const Py_ssize_t* counts,
                   Py_ssize_t slot_lanes, Py_ssize_t k, int num_workers, float* out,
                   Py_ssize_t lo, Py_ssize_t hi) noexcept nogil:
    # out[lo:hi] = the sum, worker by worker in rank order, of the entries falling there.
    cdef Py_ssize_t i, w, a, b, mid
    cdef const int64_t* wi
    cdef const float* vals
    for i in range(lo, hi):
        out[i] = 0.0
    for w in range(num_workers):
        wi = idx + w * k
        vals = gathered + w * slot_lanes + 1
        a = 0
        b = counts[w]
        while a < b:  # the first entry with index >= lo
            mid = (a + b) // 2
            if wi[mid] < lo:
                a = mid + 1
            else:
                b = mid
        while a < counts[w] and wi[a] < hi:
            out[wi[a]] += vals[a]
            a += 1


def decode_topk(const float[::1] gathered, float[::1] out, Py_ssize_t slot_lanes, Py_ssize_t k,
                int index_bits, int num_workers, int num_threads):
    """out = the sum of every worker's entries (slots side by side, added in rank order).
    Returns (0, 0), or (rank, problem) of the first bad slot (_parse_slot), out unwritten."""
    cdef Py_ssize_t n = out.shape[0], w, ch, n_chunks = _ceil_div(n, CHECK_CHUNK)
    cdef bint wide = n > (<int64_t>1 << index_bits)
    if num_workers < 1 or not 1 <= index_bits <= 31 or k < 0 \
            or slot_lanes < 1 + k * (3 if wide else 2) \
            or gathered.shape[0] != num_workers * slot_lanes:
        raise ValueError("decode_topk: %d lanes are not %d slots of %d lanes for k = %d"
                         % (gathered.shape[0], num_workers, slot_lanes, k))
    cdef int64_t* idx = <int64_t*>malloc(max(num_workers * k, 1) * sizeof(int64_t))
    cdef Py_ssize_t* counts = <Py_ssize_t*>calloc(num_workers, sizeof(Py_ssize_t))
    cdef int* problems = <int*>calloc(num_workers, sizeof(int))
    if idx == NULL or counts == NULL or problems == NULL:
        free(idx)
        free(counts)
        free(problems)
        raise MemoryError()
    cdef const float* g = &gathered[0]
    cdef float* o = &out[0] if n else NULL
    with nogil:  # one pass over N * k entries: not worth waking threads for
        for w in range(num_workers):
            problems[w] = _parse_slot(g + w * slot_lanes, k, index_bits, wide, n,
                                      idx + w * k, &counts[w])
    result = (0, 0)
    for w in range(num_workers):
        if problems[w]:
            result = (w, problems[w])
            break
    if result == (0, 0) and n:
        with nogil:
            for ch in prange(n_chunks, schedule="dynamic",
                             num_threads=_team(num_threads, n_chunks)):
                _scatter(g, idx, counts, slot_lanes, k, num_workers, o, ch * CHECK_CHUNK,
                         min((ch + 1) * CHECK_CHUNK, n))
    free(idx)
    free(counts)
    free(problems)
    return result
