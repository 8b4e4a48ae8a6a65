"""dgc (Lin et al., ICLR 2018): deep gradient compression on topk's slots and selection.

Per worker and element, the optimizer's momentum being 0 (the codec owns the momentum):
    u = momentum * u + s * g    momentum correction: accumulate the velocity, not g
    v = v + u                   local gradient accumulation (the residual)
    send the entries with |v| >= thr, at most k = ceil(density * n): the largest
    v = u = 0 where sent        error feedback keeps the rest; momentum factor masking
s is the local gradient clipping, min(1, clip_norm / (sqrt(N) * ||g||)) per tensor (the
paper scales the threshold by N^-1/2). thr is estimated as the paper does: the k_s-th
largest |v| of S = sample_ratio * n sampled elements (at least 1024, or all of them),
k_s = ceil(S * k / n); when more than k pass it the k largest of them go (the paper's
hierarchical selection), when fewer pass all of them go.

Warm-up of the sparsity: densities 25 %, 6.25 %, 1.5625 % and 0.4 % for
`warmup_stage_steps` pushes each (the kvstore counts steps, not epochs: about one
epoch's steps per stage follows the paper), then `ratio`; no stage is sparser than
`ratio`. Every distinct slot size is its own gather key, and every worker picks the same
one from the count of decoded pushes (push_rounds), so a stage costs its own slot only.
"""
import math

import numpy as np

from . import rng
from .base import NonFiniteGradientError, Option, Traits, kernels, raise_nonfinite
from .layout import CHECK_CHUNK, CHUNK_LANES
from .lanes import chunk_sum
from .registry import register
from .topk import SparseReference, TopK, largest, slot_shape, top_count, write_slot

#: Densities of the warm-up stages (the paper's sparsities 75 %, 93.75 %, 98.4375 %, 99.6 %).
STAGES = (0.25, 0.0625, 0.015625, 0.004)
#: Fewest elements sampled for the threshold (all of a smaller tensor).
MIN_SAMPLES = 1024


@register
class DGC(TopK):
    """Momentum correction, local accumulation and masking before topk's selection."""

    name = "dgc"
    TRAITS = Traits(owns_momentum=True)
    options = {
        "ratio": Option(float, 0.001, lambda v: 0 < v <= 1,
                        "a number in (0, 1]: the fraction sent after warm-up (the paper: "
                        "0.001)"),
        "momentum": Option(float, 0.9, lambda v: 0 <= v < 1,
                           "a number in [0, 1): the momentum the codec applies (the "
                           "optimizer's must be 0)"),
        "warmup_stage_steps": Option(int, 0, lambda v: v >= 0,
                                     "an integer >= 0: pushes per warm-up stage (0: none)"),
        "clip_norm": Option(float, 0.0, lambda v: 0 <= v < math.inf,
                            "a number >= 0: the L2 norm a tensor's summed gradient is "
                            "clipped to, each worker at clip_norm / sqrt(N) (0: none)"),
        "sample_ratio": Option(float, 0.01, lambda v: 0 < v <= 1,
                               "a number in (0, 1]: the fraction of elements sampled for "
                               "the threshold (the paper: 0.001 to 0.01)"),
    }

    def memory_size(self, size):
        """[v | u]: the accumulated gradient (the residual), then the velocity."""
        return 2 * size

    def density(self):
        """The warm-up stage's density (never below ratio), after the warm-up ratio."""
        steps = self.warmup_stage_steps
        if steps and self.pushes < len(STAGES) * steps:
            return max(self.ratio, STAGES[self.pushes // steps])
        return self.ratio

    def _shapes(self, size):
        """The distinct slot shapes of the schedule, in order of first use."""
        densities = [max(self.ratio, d) for d in STAGES] if self.warmup_stage_steps else []
        shapes = []
        for d in densities + [self.ratio]:
            shape = slot_shape(size, top_count(d, size), self.index_bits)
            if shape not in shapes:
                shapes.append(shape)
        return shapes

    def wire_rounds(self, size, shape, num_workers):
        """One gather key per slot size of the warm-up schedule and of the target."""
        return [self._gather_round(slot, num_workers) for slot in self._shapes(size)]

    def push_rounds(self, size, num_workers):
        """The key of this push's slot size (a function of the push count)."""
        current = slot_shape(size, self.capacity(size), self.index_bits)
        return (self._shapes(size).index(current),)

    def _clip(self, num_workers):
        """Each worker's clipping norm: clip_norm / sqrt(N), or 0 (none)."""
        return self.clip_norm / math.sqrt(num_workers) if self.clip_norm else 0.0

    def _sample_plan(self, size, k):
        """(S, k_s): S = sample_ratio * n sampled elements, at least MIN_SAMPLES (all of a
        smaller tensor); the threshold is their k_s-th largest |v|, k_s = ceil(S * k / n)."""
        samples = min(size, max(MIN_SAMPLES, math.ceil(self.sample_ratio * size)))
        if samples == 0:
            return 1, 1
        return samples, max(1, -(-samples * k // size))

    def _encode_into(self, grad, memory, out, k, num_workers, grad_checked):
        samples, rank = self._sample_plan(grad.shape[0], k)
        return kernels().encode_dgc(grad, memory, out, k, self.push_seed(), samples, rank,
                                    np.float32(self.momentum), self._clip(num_workers),
                                    self.index_bits, self.num_threads, grad_checked)


@register(reference=True)
class DGCReference(SparseReference, DGC):
    def _gscale(self, grad, num_workers):
        """The clipping factor, from the squares summed as the kernel sums them."""
        clip = self._clip(num_workers)
        g = grad.astype(np.float64)
        norm = math.sqrt(chunk_sum(g * g, CHECK_CHUNK // CHUNK_LANES)) if clip else 0.0
        return np.float32(clip / norm if norm > clip else 1.0)

    def _encode_into(self, grad, memory, out, k, num_workers, grad_checked):
        size = grad.shape[0]
        v, u = memory[:size], memory[size:]
        if not np.isfinite(grad).all():
            raise_nonfinite(grad, v)
        velocity = np.float32(self.momentum) * u + self._gscale(grad, num_workers) * grad
        with np.errstate(over="ignore", invalid="ignore"):
            c = v + velocity
        bad = np.flatnonzero(~np.isfinite(c))
        if bad.size:
            raise NonFiniteGradientError(
                "dgc: v + u is not finite at index %d (a float32 overflow, or a non-finite "
                "memory handed in); the memory and out were not modified" % bad[0])
        samples, rank = self._sample_plan(size, k)
        picked = np.arange(size) if samples >= size else rng.positions(self.push_seed(),
                                                                        samples, size)
        sampled = np.abs(c[picked])
        threshold = np.partition(sampled, samples - rank)[samples - rank] if size else 0.0
        candidates = np.flatnonzero(np.abs(c) >= threshold)
        sent = candidates[largest(np.abs(c[candidates]), k)] if candidates.size > k \
            else candidates
        write_slot(out, c[sent], sent, k, size, self.index_bits)
        v[...] = c
        u[...] = velocity
        v[sent] = 0.0
        u[sent] = 0.0
        return 0, 0, sent.size, 1.0
