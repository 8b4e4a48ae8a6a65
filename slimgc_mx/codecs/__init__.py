"""Gradient codecs whose compressed lanes a stock MXNet server can sum exactly.

    c = create("2bit", threshold=0.5)
    lanes = c.encode(grad, residual, num_workers)        # residual updated in place
    total = c.decode(lanes_sum, size, num_workers)       # sum over workers, float32

See docs/codecs.md for the levels, the wire format and the shared state.
"""
from .base import Codec, NonFiniteGradientError, lane_geometry
from .fourbit import FourBit
from .none import NoneCodec
from .onebit import OneBit
from .reference import FourBitReference, NoneReference, OneBitReference, TwoBitReference
from .twobit import TwoBit

__all__ = ["Codec", "NonFiniteGradientError", "available", "create", "lane_geometry",
           "register"]

_CODECS = {}
_REFERENCES = {}


def register(cls=None, *, reference=False):
    """Register a Codec subclass under its `name` (usable as a decorator)."""
    def add(codec_cls):
        if not (isinstance(codec_cls, type) and issubclass(codec_cls, Codec) and codec_cls.name):
            raise TypeError("register() needs a Codec subclass with a name, got %r"
                            % (codec_cls,))
        (_REFERENCES if reference else _CODECS)[codec_cls.name] = codec_cls
        return codec_cls
    return add if cls is None else add(cls)


def available():
    """Names create() accepts, sorted."""
    return sorted(_CODECS)


def create(name, threshold=None, num_threads=None, reference=False):
    """A new codec instance by name; reference=True gives the NumPy implementation."""
    table = _REFERENCES if reference else _CODECS
    if not isinstance(name, str) or name not in table:
        raise ValueError("unknown codec %r; valid names: %s"
                         % (name, ", ".join(repr(n) for n in sorted(table))))
    return table[name](threshold=threshold, num_threads=num_threads)


for _cls in (NoneCodec, OneBit, TwoBit, FourBit):
    register(_cls)
for _cls in (NoneReference, OneBitReference, TwoBitReference, FourBitReference):
    register(_cls, reference=True)
del _cls
