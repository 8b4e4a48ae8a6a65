"""float32 lanes: a lane codec's float64 lanes carried by servers that sum in float32.

MXNet 1.9.1's server may sum float64 arrays in float32 (docs/launcher.md); float32 sums
are exact on any server while the integers stay below 2**24. The digit stream of the
float64 lanes (k radix-R digits each) is regrouped into float32 lanes of g digits,
R**g <= 2**24; every digit sum of N workers is below R (lanes.lane_geometry), so the
parts add without carries and joining the summed parts gives the float64 lanes' sum.

Trailer values keep their meaning:
  - gathered slots (terngrad's max, qsgd's norms, thc's max): worker j writes its
    values in slot j, the others 0, and the codec reads them through float32 (a max,
    then float32()). They travel as float32 slots: x + 0 + ... = x, and rounding to
    float32 first gives the same max (rounding is monotonic).
  - a summed statistic (1bit's scale, 4bit's group: `trailer_lanes`): each worker's
    float64 value travels bit for bit in its own slot of 3 float32 integers (22, 21 and
    21 bits); the join adds the N values in rank order. With 2 workers that equals
    the server's float64 sum; with more it may differ from it in the last bit as the
    server's own order (the order of arrival) does, and every worker gets the same.
"""
import logging
from dataclasses import dataclass

import numpy as np

from .. import env
from ..codecs.base import check_num_workers, kernels
from ..codecs.lanes import LaneCodec, lane_geometry

#: Largest integer below which every integer is exact in float32.
EXACT_LIMIT_32 = 2 ** 24
#: Bit widths of the float32 pieces of one float64 trailer value (22 + 21 + 21 = 64).
PIECE_BITS = (22, 21, 21)
LANE_DTYPES = ("auto", "float64", "float32")

log = logging.getLogger(__name__)


def uses_float64_lanes(codec):
    """True for a codec whose sum rounds travel as float64 lanes (what float32 lanes replace)."""
    return (isinstance(codec, LaneCodec) and codec.levels is not None
            and codec.wire_dtype == np.float64)


@dataclass(frozen=True)
class Lanes32Layout:
    """Where a key's float64 lanes go in its float32 lanes, for one size and worker count."""

    codec: str
    radix: int  # R
    k: int  # digits per float64 lane
    g: int  # digits per float32 lane: R**g <= 2**24
    body64: int  # float64 lanes holding digits
    trailer: int  # float64 lanes of a summed statistic (0 or 1)
    gathered: int  # float64 gathered slots (N * values per worker)
    num_workers: int

    @classmethod
    def of(cls, codec, size, num_workers, levels=None):
        """The layout of `codec`'s lanes for `size` elements, of its current geometry or of
        the one of `levels` levels (a round of a codec with several); ValueError if float32
        lanes cannot carry them."""
        n = check_num_workers(num_workers)
        if not uses_float64_lanes(codec):
            raise ValueError("codec %r does not send float64 lanes; lane_dtype does not apply"
                             % getattr(codec, "name", codec))
        if levels is None:
            radix, k = codec.geometry(n)
        else:
            radix, k = lane_geometry(levels, n, codec.name)
        g = digits_per_lane32(radix)
        if g == 0:
            raise ValueError("%s: %d workers need radix %d > 2**24, so not one element fits a "
                             "float32 lane; use lane_dtype=float64 with servers started with "
                             "the launcher's server environment" % (codec.name, n, radix))
        g = min(g, k)
        gathered = n * codec.gathered_count(size)
        body = -(-int(size) // k)
        return cls(codec.name, radix, k, g, body, codec.trailer_lanes, gathered, n)

    @property
    def count64(self):
        return self.body64 + self.trailer + self.gathered

    @property
    def body32(self):
        return -(-self.body64 * self.k // self.g)

    @property
    def count32(self):
        """Length of the float32 lanes array."""
        return self.body32 + self.trailer * len(PIECE_BITS) * self.num_workers + self.gathered

    def powers(self):
        return np.array([self.radix ** j for j in range(self.k + 1)], dtype=np.uint64)

    def split(self, lanes64, out32, rank):
        """out32 <- this worker's float64 lanes `lanes64` as float32 lanes."""
        self._check(lanes64, np.float64, self.count64, "lanes64")
        self._check(out32, np.float32, self.count32, "out32")
        bad = kernels().split_lanes32(lanes64[:self.body64], out32[:self.body32],
                                      self.powers(), self.k, self.g)
        if bad:
            raise ValueError("%s: %d float64 lanes are not integers in [0, R**k): not this "
                             "codec's lanes" % (self.codec, bad))
        pos, end = self.body32, self.body64
        if self.trailer:
            w = len(PIECE_BITS) * self.num_workers
            slots = out32[pos:pos + w]
            slots.fill(0.0)
            slots[rank * 3:rank * 3 + 3] = _pieces(lanes64[end])
            pos, end = pos + w, end + 1
        gathered = lanes64[end:]
        with np.errstate(over="ignore"):
            out32[pos:] = gathered  # float32 rounding; a value beyond float32 becomes inf
        return out32

    def join(self, sum32, out64):
        """out64 <- the float64 lanes' sum over workers from the summed float32 lanes."""
        self._check(sum32, np.float32, self.count32, "sum32")
        self._check(out64, np.float64, self.count64, "out64")
        bad = kernels().join_lanes32(sum32[:self.body32], out64[:self.body64],
                                     self.powers(), self.k, self.g)
        if bad:
            raise ValueError("%s: %d summed float32 lanes are not integers in [0, R**g): not a "
                             "sum of this codec's lanes (wrong codec, worker count, or a server "
                             "that lost precision)" % (self.codec, bad))
        pos, end = self.body32, self.body64
        if self.trailer:
            w = len(PIECE_BITS) * self.num_workers
            total = 0.0
            for piece in sum32[pos:pos + w].reshape(self.num_workers, 3):
                total += _value(piece, self.codec)
            out64[end] = total
            pos, end = pos + w, end + 1
        out64[end:] = sum32[pos:]
        return out64

    @staticmethod
    def _check(array, dtype, length, name):
        if not (isinstance(array, np.ndarray) and array.dtype == dtype and array.ndim == 1
                and array.shape[0] == length and array.flags.c_contiguous):
            raise ValueError("%s must be a C-contiguous 1-D %s array of %d elements, got %r"
                             % (name, np.dtype(dtype), length,
                                getattr(array, "shape", type(array).__name__)))

    def bits_per_element(self):
        """Bits per element on the wire, each direction, trailer excluded."""
        return 32.0 / self.g


def digits_per_lane32(radix):
    """The most radix-R digits g with R**g <= 2**24 (0 when R > 2**24)."""
    g, p = 0, 1
    while p * radix <= EXACT_LIMIT_32:
        p *= radix
        g += 1
    return g


def _pieces(value):
    """One float64 value as 3 float32 integers of 22, 21 and 21 bits, high bits first."""
    bits = int(np.float64(value).view(np.uint64))
    return np.array([bits >> 42, (bits >> 21) & 0x1FFFFF, bits & 0x1FFFFF], dtype=np.float32)


def _value(pieces, codec):
    """The float64 value of _pieces (ValueError when they are not a slot's pieces)."""
    ints = [float(p) for p in pieces]
    limits = [1 << b for b in PIECE_BITS]
    if not all(x.is_integer() and 0 <= x < lim for x, lim in zip(ints, limits)):
        raise ValueError("%s: a trailer slot holds %r, not the pieces of one float64 value"
                         % (codec, ints))
    bits = (int(ints[0]) << 42) | (int(ints[1]) << 21) | int(ints[2])
    return float(np.array(bits, dtype=np.uint64).view(np.float64))


def split_reference(lanes64, radix, k, g):
    """NumPy split of digit lanes (the kernel's test oracle)."""
    x = np.asarray(lanes64, dtype=np.float64).astype(np.uint64)
    powers = np.array([radix ** j for j in range(k)], dtype=np.uint64)
    digits = ((x[:, None] // powers[None, :]) % np.uint64(radix)).ravel()
    n32 = -(-digits.shape[0] // g)
    padded = np.zeros(n32 * g, dtype=np.uint64)
    padded[:digits.shape[0]] = digits
    pg = np.array([radix ** j for j in range(g)], dtype=np.uint64)
    return (padded.reshape(n32, g) * pg).sum(axis=1).astype(np.float32)


def join_reference(sum32, n64, radix, k, g):
    """NumPy join of summed float32 lanes into n64 float64 lanes (the kernel's test oracle)."""
    x = np.asarray(sum32, dtype=np.float32).astype(np.uint64)
    pg = np.array([radix ** j for j in range(g)], dtype=np.uint64)
    digits = ((x[:, None] // pg[None, :]) % np.uint64(radix)).ravel()[:n64 * k]
    powers = np.array([radix ** j for j in range(k)], dtype=np.uint64)
    return (digits.reshape(n64, k) * powers).sum(axis=1).astype(np.float64)


def choose(setting, codec, transport):
    """True when this job's float64 lanes travel as float32 lanes (collective).

    'float32': always. 'float64': never, and servers that sum float64 inexactly raise
    ServerPrecisionError. 'auto': every worker probes every server and the verdicts are
    gathered, so that one lossy verdict anywhere switches every worker to float32 lanes.
    """
    if setting == "float32":
        return True
    if setting == "float64":
        transport.check_exact_sums()
        return False
    if setting != "auto":
        raise ValueError("lane_dtype must be one of %s, got %r" % (", ".join(LANE_DTYPES),
                                                                    setting))
    lossy = transport.lossy_servers()
    verdicts = transport.allgather([float(lossy > 0)])  # 0 or 1: exact on any server
    if not np.asarray(verdicts).any():
        return False
    if transport.rank == 0:
        log.warning("slimgc: %s", fallback_warning(codec, transport.num_workers,
                                                   lossy, transport.num_servers))
    return True


def fallback_warning(codec, num_workers, lossy, num_servers):
    """The one warning of lane_dtype=auto switching to float32 lanes: the cost and the fix."""
    if uses_float64_lanes(codec):
        radix, k = codec.geometry(num_workers)
        g = min(digits_per_lane32(radix), k)
        cost = ("%s with %d workers sends %.2f instead of %.2f bits per element"
                % (codec.name, num_workers, 32.0 / g if g else float("inf"), 64.0 / k))
    else:
        cost = "codec %s sends no float64 lanes, so it costs nothing" % getattr(
            codec, "name", "none")
    return ("%d of %d parameter servers sum float64 arrays in float32 (MXNet 1.9.1 leaves "
            "their multi_precision_ flag uninitialized), so lanes travel as float32 "
            "(lane_dtype=auto): %s. Start the servers with %s in their environment "
            "(python -m slimgc_mx.launch does so) to keep float64 lanes."
            % (lossy, num_servers, cost, env.SERVER_ENV_TEXT))
