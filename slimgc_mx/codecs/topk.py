"""topk: the k largest |g + residual| of a tensor, sent as values and indices, gathered.

c = g + r; the k = ceil(ratio * n) elements of largest |c| (ties: the lower index first)
go out as (value, index) pairs in index order, and the residual keeps the rest (r = c,
zero where sent). The servers cannot add sparse vectors whose indices differ, so they
travel on the gather route: every worker's slot side by side ("The allgather route",
docs/codecs.md); decode adds the N sparse vectors, worker after worker in rank order.

Slot, float32 lanes: [count | k values | k index lanes], zeros after `count` entries,
padded to whole rows of at most ROW_LANES. Indices travel as integers below 2**24, which
x + 0 on the servers keeps; a tensor of more than 2**24 elements sends each index in two
lanes (i mod 2**24 in the first block, i >> 24 in a third block of k lanes).

Selection (cython_ext/codec_topk.pxi) never sorts the tensor: a threshold from a sample
of |c| lets about 1.25 k elements through, the exact k-th largest among them is found by
a selection, and a threshold that lets fewer than k through is lowered. The result does
not depend on the sample: the NumPy reference selects from the whole tensor.
"""
import math
import numbers
from dataclasses import replace

import numpy as np

from .base import (Codec, NonFiniteGradientError, Option, check_disjoint, check_num_workers,
                   check_vector, kernels, output, raise_nonfinite)
from .registry import register

#: Most lanes in a row of a slot: rows of 4 KiB outweigh the ~12 bytes per row that the
#: row_sparse route adds each way.
ROW_LANES = 1024
#: Bits of an index lane: integers below 2**24 are exact in float32.
INDEX_BITS = 24
#: Elements whose |c| topk samples for its threshold (all of a smaller tensor).
SAMPLES = 16384
#: Tensors must have fewer elements (sample positions are drawn below 2**32).
SIZE_LIMIT = 1 << 32
#: What decode's kernel reports of a slot that this codec did not write.
_PROBLEMS = {1: "its count is not an integer in [0, k]",
             2: "an index lane is not an integer below 2**%d",
             3: "its indices do not increase, or reach past the tensor",
             4: "a value is not finite"}


def check_size(size):
    """The element count as an int, or a ValueError: an integer in [0, 2**32)."""
    if isinstance(size, bool) or not isinstance(size, numbers.Integral) \
            or not 0 <= size < SIZE_LIMIT:
        raise ValueError("size must be an integer in [0, 2**32), got %r" % (size,))
    return int(size)


def top_count(ratio, size):
    """k = ceil(ratio * size), at least 1 and at most size (0 for an empty tensor)."""
    return min(size, max(1, math.ceil(ratio * size))) if size else 0


def slot_shape(size, k, index_bits=INDEX_BITS):
    """(rows, columns) of a slot of k entries: a count lane, k values and k index lanes
    (2k when size > 2**index_bits), in rows of at most ROW_LANES."""
    lanes = 1 + k * (2 if size <= 1 << index_bits else 3)
    cols = min(ROW_LANES, lanes)
    return -(-lanes // cols), cols


def largest(magnitudes, k):
    """Ascending indices of the k largest magnitudes, ties to the lower index: every one
    above the k-th largest value, then the first of those equal to it."""
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    top = np.partition(magnitudes, magnitudes.size - k)[magnitudes.size - k]
    above = np.flatnonzero(magnitudes > top)
    equal = np.flatnonzero(magnitudes == top)[:k - above.size]
    return np.sort(np.concatenate([above, equal]))


def write_slot(out, values, indices, k, size, index_bits):
    """The slot of len(indices) entries, as the kernel writes it."""
    m = indices.size
    out.fill(0.0)
    out[0] = m
    out[1:1 + m] = values
    out[1 + k:1 + k + m] = indices & ((1 << index_bits) - 1)
    if size > 1 << index_bits:
        out[1 + 2 * k:1 + 2 * k + m] = indices >> index_bits


def read_slot(slot, k, size, index_bits):
    """(problem, indices, values) of one worker's slot, problem as the kernel numbers it
    (0: none; else the first bad entry's first failed check)."""
    count = float(slot[0])
    if not (0 <= count <= k and count == int(count)):
        return 1, None, None
    m = int(count)
    values = slot[1:1 + m]
    lanes = [slot[1 + k:1 + k + m].astype(np.float64)]
    lanes.append(slot[1 + 2 * k:1 + 2 * k + m].astype(np.float64) if size > 1 << index_bits
                 else np.zeros(m))
    ok = np.ones(m, dtype=bool)
    with np.errstate(invalid="ignore"):
        for x in lanes:
            ok &= (x >= 0) & (x < 2.0 ** index_bits) & (x == np.floor(x))
    lo, hi = (np.where(ok, x, 0).astype(np.int64) for x in lanes)
    indices = lo + (hi << index_bits)
    before = np.concatenate([[-1], indices[:-1]])
    problem = np.where(~np.isfinite(values), 4,
                       np.where(~ok, 2, np.where((indices <= before) | (indices >= size), 3, 0)))
    bad = np.flatnonzero(problem)
    if bad.size:
        return int(problem[bad[0]]), None, None
    return 0, indices, values


@register
class TopK(Codec):
    """The k largest |c| of a tensor as (value, index) pairs on the gather route."""

    name = "topk"
    wire_dtype = np.dtype(np.float32)
    options = {"ratio": Option(float, 0.01, lambda v: 0 < v <= 1,
                               "a number in (0, 1]: the fraction of elements sent "
                               "(the paper used 0.1)")}
    index_bits = INDEX_BITS

    # ------------------------------------------------------------ geometry
    def density(self):
        """Fraction of the elements the next push sends."""
        return self.ratio

    def _slot(self, size):
        """(k, lanes) of the next push's slot for `size` elements (cached)."""
        key = ("slot", check_size(size), self.density(), self.index_bits)
        if key not in self._cache:
            k = top_count(key[2], key[1])
            rows, cols = slot_shape(size, k, self.index_bits)
            self._cache[key] = k, rows * cols
        return self._cache[key]

    def residual_fill(self, size):
        """size / k pushes: an element not among the largest waits about that long."""
        return size / top_count(self.ratio, size) if size else 0

    def capacity(self, size):
        """Entries in a slot of the next push: k."""
        return self._slot(size)[0]

    def lane_count(self, size, num_workers):
        """Lanes of this worker's slot (what it pushes) at the next push."""
        check_num_workers(num_workers)
        return self._slot(size)[1]

    def wire_bits_per_element(self, num_workers):
        """Bits pulled per element: N slots of a value and an index lane per element sent
        (the push is 1/N of it; counts, padding and the lanes above 2**24 left out)."""
        return 64.0 * self.ratio * check_num_workers(num_workers)

    def _gather_round(self, slot, num_workers):
        """The wire round of a slot of (rows, columns): N of them come back."""
        rows, cols = slot
        return ("gather", (rows, cols), (check_num_workers(num_workers) * rows, cols),
                self.wire_dtype)

    def wire_rounds(self, size, shape, num_workers):
        return [self._gather_round(slot_shape(size, self.capacity(size), self.index_bits),
                                   num_workers)]

    # ------------------------------------------------------------ encode / decode
    def encode(self, grad, residual, num_workers, out=None, grad_checked=False, rank=0):
        """Select, write this worker's slot, update `residual` (memory_size(n) float32) in
        place; NaN/Inf raise NonFiniteGradientError as for the lane codecs (docs/codecs.md)."""
        n_workers = check_num_workers(num_workers)
        check_vector("grad", grad, np.float32)
        size = check_size(grad.shape[0])
        check_vector("residual", residual, np.float32, writeable=True,
                     length=self.memory_size(size))
        k, lanes = self._slot(size)
        out = output(out, lanes, self.wire_dtype)
        check_disjoint(grad=grad, residual=residual, out=out)
        bad_grad, bad_c, _, _ = self._encode_into(grad, residual, out, k, n_workers,
                                                  grad_checked)
        if bad_grad:
            raise_nonfinite(grad, residual[:size])
        if bad_c:
            raise NonFiniteGradientError(
                "%s: the compensated gradient is not finite at index %d (a float32 overflow, "
                "or a non-finite residual handed in); found while encoding, so the residual "
                "was updated: reset it (residual[:] = 0)"
                % (self.name, int(np.flatnonzero(~np.isfinite(residual))[0])))
        return out

    def decode(self, gathered, size, num_workers, out=None):
        """Sum over workers of their sparse vectors, float32 (size,), from every worker's
        slot side by side; a slot this codec did not write raises ValueError."""
        n_workers = check_num_workers(num_workers)
        size = check_size(size)
        k, slot = self._slot(size)
        check_vector("gathered", gathered, self.wire_dtype, length=n_workers * slot)
        out = output(out, size, np.float32)
        check_disjoint(gathered=gathered, out=out)
        worker, problem = self._decode_into(gathered, out, slot, k, n_workers)
        if problem:
            raise ValueError("%s: the slot of worker %d is not one this codec wrote: %s "
                             "(wrong codec, worker count, tensor size or step)"
                             % (self.name, worker, _PROBLEMS[problem].replace(
                                 "%d", str(self.index_bits))))
        self.pushes += 1
        return out

    # ------------------------------------------------------------ kernels (Cython)
    def _sample_plan(self, size, k):
        """(S, rank): the threshold is the rank-th largest |c| of S sampled elements; the
        rank lets about 1.25 k elements pass (3 standard deviations above k * S / n)."""
        if size <= SAMPLES:
            return max(size, 1), max(k, 1)
        expected = SAMPLES * k / size
        return SAMPLES, min(SAMPLES, int(expected + 3 * math.sqrt(expected)) + 1)

    def _encode_into(self, grad, residual, out, k, num_workers, grad_checked):
        """(non-finite grad count, non-finite c count, entries sent, clipping factor)."""
        samples, rank = self._sample_plan(grad.shape[0], k)
        return kernels().encode_topk(grad, residual, out, k, self.push_seed(), samples, rank,
                                     self.index_bits, self.num_threads, grad_checked)

    def _decode_into(self, gathered, out, slot, k, num_workers):
        """(0, 0), or (rank, problem) of the first slot this codec did not write."""
        return kernels().decode_topk(gathered, out, slot, k, self.index_bits, num_workers,
                                     self.num_threads)


class SparseReference:
    """NumPy decode of topk's slots (mixed in before the codec class): parse every slot,
    then add them into zeros worker after worker."""

    def declare_traits(self):
        return replace(super().declare_traits(), reference=True)

    def _decode_into(self, gathered, out, slot, k, num_workers):
        entries = []
        for w in range(num_workers):
            problem, indices, values = read_slot(gathered[w * slot:(w + 1) * slot], k,
                                                 out.shape[0], self.index_bits)
            if problem:
                return w, problem
            entries.append((indices, values))
        out.fill(0.0)
        for indices, values in entries:  # indices are unique within a slot
            out[indices] += values
        return 0, 0


@register(reference=True)
class TopKReference(SparseReference, TopK):
    def _encode_into(self, grad, residual, out, k, num_workers, grad_checked):
        c = self.compensated(grad, residual)
        sent = largest(np.abs(c), k)
        write_slot(out, c[sent], sent, k, grad.shape[0], self.index_bits)
        residual[...] = c
        residual[sent] = 0.0
        return 0, 0, sent.size, 1.0
