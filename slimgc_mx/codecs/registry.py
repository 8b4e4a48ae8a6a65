"""The codec registry: codec classes register themselves under their `name`."""
from .base import Codec

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


def create(name, threshold=None, num_threads=None, reference=False, **options):
    """A new codec instance by name; reference=True gives the NumPy implementation;
    `options` are the codec's own (its class's `options`)."""
    table = _REFERENCES if reference else _CODECS
    if not isinstance(name, str) or name not in table:
        raise ValueError("unknown codec %r; valid names: %s"
                         % (name, ", ".join(repr(n) for n in sorted(table))))
    return table[name](threshold=threshold, num_threads=num_threads, **options)


def option_names(name):
    """The names of a registered codec's own options."""
    return sorted(_CODECS[name].options)
