"""The counter-based generator of stochastic rounding, in NumPy: the kernels' twin.

A uniform float32 in [0, 1) for element e of a push is a pure function of (seed, e):
24 bits of SplitMix64's finalizer of seed + (e >> 1) * golden ratio, bits 0..23 for even
e and 40..63 for odd e (one hash serves a pair of elements, which halves the kernels'
cost), so 1 or N threads, any order, any run draw the same numbers. A push's seed mixes
the job's seed, the key and the step (Codec.push_seed), so every worker draws the same
numbers too.
"""
import numpy as np

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def mix64(x):
    """SplitMix64's finalizer of the integer x (Python ints, 64-bit wrap-around)."""
    x &= _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def key_seed(job_seed, key_index):
    """The seed of one key: every worker derives the same from the job's seed."""
    return mix64(mix64(job_seed) + key_index + 1)


def _hash(x):
    """SplitMix64's finalizer, elementwise on uint64 arrays (the kernels' slimgc_mix)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def bits(seed, start, count):
    """uint64 draws start .. start+count-1 keyed by `seed`, one hash each (positions)."""
    with np.errstate(over="ignore"):
        j = np.arange(start, start + count, dtype=np.uint64)
        return _hash(np.uint64(seed) + j * np.uint64(_GOLDEN))


def uniform(seed, start, count):
    """float32 uniforms of elements start .. start+count-1 of the push keyed by `seed`."""
    with np.errstate(over="ignore"):
        e = np.arange(start, start + count, dtype=np.uint64)
        x = _hash(np.uint64(seed) + (e >> np.uint64(1)) * np.uint64(_GOLDEN))
    drawn = np.where(e & np.uint64(1), x >> np.uint64(40), x & np.uint64(0xFFFFFF))
    return drawn.astype(np.float32) * np.float32(2.0 ** -24)


def positions(seed, count, n):
    """`count` element indices uniform in [0, n) (n < 2**32) keyed by `seed`: the high 32
    bits of each draw times n, shifted down (the kernels' slimgc_position)."""
    x = bits(seed, 0, count)
    with np.errstate(over="ignore"):
        return (((x >> np.uint64(32)) * np.uint64(n)) >> np.uint64(32)).astype(np.int64)
