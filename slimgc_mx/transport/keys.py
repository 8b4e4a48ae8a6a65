"""Wire keys: the one owner of every key a worker declares on MXNet's kvstore.

MXNet picks a small key's server as (key * 9973) % S in 32-bit int arithmetic, which
stays positive only for keys below 2**31 / 9973 (about 215000) and for keys in
[2**30, 2**30 + 107000); every band below stays inside those. Keys are handed out in
declaration order, which is the same on every worker.
"""
from dataclasses import dataclass

#: Per-key bands: user key i owns wire keys 3i (fp route), 3i + 1 (compressed route)
#: and 3i + 2 (the broadcast of its initial weights).
PER_KEY_LIMIT = (1 << 31) // 9973
CONTROL_BASE = 1 << 30              # allgathers (agreement, CTTab vote, audit)
PROBE_BASE = CONTROL_BASE + 4096     # the server precision probe, one key per server
FUSED_BASE = CONTROL_BASE + 16384    # fused full-precision buckets
ROUND_BASE = CONTROL_BASE + 24576    # the further rounds of multi-round codecs (PowerSGD)
PIECE_BASE = CONTROL_BASE + 32768    # pieces of large buffers
PIECE_END = CONTROL_BASE + 107000


class WireKeyError(ValueError):
    """A band of wire keys is exhausted."""


@dataclass(frozen=True)
class KeyWire:
    """The wire keys of one user key."""

    fp: int
    bit: int
    weight: int


class WireKeys:
    """Hands out wire keys band by band, in the order the worker declares them."""

    def __init__(self):
        self._next = {"control": CONTROL_BASE, "fused": FUSED_BASE, "round": ROUND_BASE,
                      "piece": PIECE_BASE}

    @staticmethod
    def per_key(index):
        """The wire keys of the user key registered `index`-th."""
        if not 0 <= 3 * index + 2 < PER_KEY_LIMIT:
            raise WireKeyError("key #%d: more than %d keys cannot be placed on MXNet's servers"
                               % (index, PER_KEY_LIMIT // 3))
        return KeyWire(3 * index, 3 * index + 1, 3 * index + 2)

    @staticmethod
    def probe(server):
        """The precision probe's key for server `server` (consecutive keys reach all servers)."""
        return PROBE_BASE + server

    def control(self):
        """A new key for an allgather."""
        return self._take("control", 1, PROBE_BASE, "allgather")[0]

    def fused(self, count):
        """`count` new keys for fused buckets."""
        return self._take("fused", count, ROUND_BASE, "fused bucket")

    def rounds(self, count):
        """`count` new keys for further rounds of a multi-round codec."""
        return self._take("round", count, PIECE_BASE, "round")

    def pieces(self, count, hint):
        """`count` new keys for the pieces of one buffer; `hint` says how to need fewer."""
        return self._take("piece", count, PIECE_END, "piece", hint)

    @property
    def pieces_taken(self):
        return self._next["piece"] - PIECE_BASE

    def _take(self, band, count, end, what, hint=""):
        first = self._next[band]
        if first + count > end:
            raise WireKeyError("%d more %s keys do not fit the %d that MXNet can place%s"
                               % (count, what, end - first, ": " + hint if hint else ""))
        self._next[band] = first + count
        return list(range(first, first + count))
