"""Codec: what every gradient codec shares: parameters, input checks, per-key state.

A codec instance is the per-key state that all workers share; it knows nothing of MXNet.
Families of codecs (lanes.py: levels packed so that a stock server's sum is exact) give
the wire format; one file per codec gives its levels, its NumPy reference and its
NDArray path (docs/extending.md).
"""
import math
import numbers
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..env import check_num_threads
from .feedback import ErrorFeedback


class NonFiniteGradientError(ValueError):
    """The gradient (or gradient + residual) holds NaN or Inf; nothing was modified."""


_kernels = None


def kernels():
    """The compiled kernels module, with a rebuild hint when it is missing."""
    global _kernels
    if _kernels is None:
        try:
            from .. import _kernels as mod
        except ImportError as exc:
            raise ImportError(
                "slimgc_mx._kernels is not built; run `python setup.py build_ext --inplace` "
                "in the project root, or use codecs.create(name, reference=True) for the "
                "NumPy implementation") from exc
        _kernels = mod
    return _kernels


def check_num_workers(num_workers):
    """Validate the worker count N (an integer >= 1)."""
    if isinstance(num_workers, bool) or not isinstance(num_workers, numbers.Integral) \
            or num_workers < 1:
        raise ValueError("num_workers must be an integer >= 1, got %r" % (num_workers,))
    return int(num_workers)


def check_threshold(threshold, name):
    """Validate a threshold: None, or a finite number > 0 that stays > 0 in float32."""
    if threshold is None:
        return None
    ok = isinstance(threshold, numbers.Real) and not isinstance(threshold, bool)
    value = float(threshold) if ok else float("nan")
    with np.errstate(over="ignore"):  # beyond float32 is refused below, not warned about
        single = np.float32(value)
    if not (math.isfinite(value) and value > 0 and 0 < single < np.inf):
        raise ValueError("%s: threshold must be a finite number > 0 that float32 can hold, "
                         "got %r; pass e.g. threshold=0.5" % (name, threshold))
    return value


def check_grad_residual(grad, residual):
    """The element count of an encoder's inputs: grad and residual, 1-D C-contiguous float32
    of one length, residual writeable; TypeError or ValueError naming the problem."""
    check_vector("grad", grad, np.float32)
    check_vector("residual", residual, np.float32, writeable=True)
    if residual.shape[0] != grad.shape[0]:
        raise ValueError("residual must have as many elements as grad: %d != %d"
                         % (residual.shape[0], grad.shape[0]))
    return grad.shape[0]


def check_vector(name, array, dtype, writeable=False, length=None):
    """Check a 1-D C-contiguous array of `dtype` (optionally writeable / of `length`)."""
    dtype = np.dtype(dtype)
    if not isinstance(array, np.ndarray):
        raise TypeError("%s must be a numpy.ndarray of %s, got %s"
                        % (name, dtype, type(array).__name__))
    if array.dtype != dtype:
        raise TypeError("%s must have dtype %s, got %s; convert with .astype(numpy.%s)"
                        % (name, dtype, array.dtype, dtype))
    if array.ndim != 1:
        raise ValueError("%s must be 1-D, got shape %s; pass a flat view (.ravel())"
                         % (name, array.shape))
    if not array.flags.c_contiguous:
        raise ValueError("%s must be C-contiguous; pass numpy.ascontiguousarray(%s)"
                         % (name, name))
    if writeable and not array.flags.writeable:
        raise ValueError("%s must be writeable" % name)
    if length is not None and array.shape[0] != length:
        raise ValueError("%s must have %d elements, got %d" % (name, length, array.shape[0]))
    return array


def output(out, length, dtype):
    """`out` as a codec writes into it: checked to be a writeable 1-D `dtype` array of
    `length` elements, or a new one when it is None."""
    if out is None:
        return np.empty(length, dtype=dtype)
    check_vector("out", out, dtype, writeable=True, length=length)
    return out


def check_disjoint(**arrays):
    """Raise ValueError when two of the named arrays share memory."""
    items = list(arrays.items())
    for i, (na, a) in enumerate(items):
        for nb, b in items[i + 1:]:
            if np.may_share_memory(a, b):
                raise ValueError("%s and %s must not overlap in memory" % (na, nb))


def raise_nonfinite(grad, residual, out=None):
    """Raise NonFiniteGradientError naming the first offending element (slow path only).

    `out` given: the kernel found a non-finite grad + residual while encoding, so
    residual and out were already written (grad itself is finite unless the caller
    skipped the pre-check with grad_checked).
    """
    bad = np.flatnonzero(~np.isfinite(grad))
    if bad.size:
        i = int(bad[0])
        raise NonFiniteGradientError(
            "grad[%d] = %r is not finite (%d non-finite elements); %s"
            % (i, float(grad[i]), bad.size, "residual and out were not modified" if out is None
               else "found while encoding (grad_checked=True), so residual and out were "
               "updated: reset the residual (residual[:] = 0)"))
    if out is None:
        with np.errstate(over="ignore", invalid="ignore"):
            bad = np.flatnonzero(~np.isfinite(grad + residual))
        i = int(bad[0]) if bad.size else -1
        raise NonFiniteGradientError(
            "grad + residual is not finite at index %d (a float32 overflow, or a non-finite "
            "residual); residual and out were not modified" % i)
    bad = np.flatnonzero(~np.isfinite(residual))
    if not bad.size and out.dtype == np.float32:
        bad = np.flatnonzero(~np.isfinite(out))
    i = int(bad[0]) if bad.size else -1
    raise NonFiniteGradientError(
        "grad is finite but grad + residual is not at index %d (a float32 overflow, or a "
        "non-finite residual handed in); found while encoding, so residual and out were "
        "updated: reset the residual (residual[:] = 0)" % i)


_BOOLS = {"1": True, "true": True, "yes": True, "on": True,
          "0": False, "false": False, "no": False, "off": False}


class Option:
    """A codec option: its type, default, the check it must pass and what that check says."""

    def __init__(self, kind, default, check, requirement):
        self.kind, self.default, self.check, self.requirement = kind, default, check, requirement

    def parse(self, codec, name, value):
        """The value as `kind`, or a ValueError naming the codec, the option and the rule."""
        given = value  # what the user wrote, for the message
        if isinstance(value, str):
            try:
                value = self.kind(value) if self.kind is not bool else _BOOLS[value.lower()]
            except (KeyError, ValueError):
                value = None
        ok = (isinstance(value, self.kind) and not (self.kind is not bool
                                                    and isinstance(value, bool))
              or self.kind is float and isinstance(value, int) and not isinstance(value, bool))
        if not ok or not self.check(value):
            raise ValueError("codec %r: option %s=%r: must be %s (e.g. %s=%r)"
                             % (codec, name, given, self.requirement, name, self.default))
        return self.kind(value)


@dataclass
class OptimizerView:
    """What the optimizer holds for one key at the push about to be encoded (read-only).

    A codec whose quantization depends on the optimizer (`wants_optimizer`) gets one
    before each encode; the kvstore builds it, so codecs never see MXNet. `arrays()`,
    called on the encoding thread, returns (weight, state1, state2): float32 1-D
    arrays of the key's size (the global weights w_i; None for a state the optimizer
    does not keep). The kinds and their update rules (g: this step's summed gradient):

        'sgd'   m' = momentum*m - lr*(rescale*g + wd*w);  w' = w + m'   (state1 = m)
        'nag'   m' = momentum*m - lr*(rescale*g + wd*w);  w' = w + momentum*m' - lr*(rescale*g + wd*w)
        'adam'  state1, state2 = Adam's mean and variance before this step; t = this
                step's update count; the rate is lr*sqrt(1-beta2**t)/(1-beta1**t)
    """

    kind: str
    arrays: Callable
    lr: float
    wd: float = 0.0
    rescale_grad: float = 1.0
    momentum: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-8
    t: int = 1


@dataclass(frozen=True)
class Traits:
    """What the engine may assume of one codec instance, beside its wire: fixed when the
    codec is made (from its class and options); the engine decides on it in Planner.plan."""

    #: encode takes `local` (kernels.LocalSGD): the backup's local SGD step runs in the
    #: encoder's pass, so the gradient is read once (lanes.LaneCodec.encode).
    fuses_local_update: bool = False
    #: The lanes of elements [j*k, (j+m)*k) depend on those elements (and their residual)
    #: alone, so a key can be encoded and sent piece by piece (piece_elements).
    encodes_by_piece: bool = False
    #: The SGD kernel can decode this codec's sums inside its update (decode_table).
    decodes_by_table: bool = False
    #: encode reads the optimizer's view of the key (set_optimizer_view).
    wants_optimizer: bool = False
    #: The codec applies momentum itself (dgc's momentum correction): the optimizer's must be 0.
    owns_momentum: bool = False
    #: The NumPy implementation, the test oracle of the compiled one.
    reference: bool = False


_TRAIT_NAMES = frozenset(Traits.__dataclass_fields__)


class Codec:
    """A gradient codec with its shared per-key state; subclasses give the wire format.

    Class attributes: `name` (registry name), `wire_dtype` (what travels),
    `takes_threshold` / `default_threshold`, `options` ({name: Option}, given as
    create(name, **options) or compression_params), `feedback` (the error-feedback seam,
    feedback.ErrorFeedback, or None for a codec without memory), `TRAITS` (its Traits;
    a codec whose traits follow its options overrides `declare_traits`).
    """

    name = None
    wire_dtype = np.dtype(np.float64)
    takes_threshold = False
    default_threshold = None
    options = {}
    feedback = ErrorFeedback()
    TRAITS = Traits()

    def __init_subclass__(cls, **kwargs):
        """Refuse a trait declared as a bare class attribute (the engine reads `traits`
        alone, so it would be ignored without a word)."""
        super().__init_subclass__(**kwargs)
        bare = sorted(set(vars(cls)) & (_TRAIT_NAMES | {"is_reference"}))
        if bare:
            raise TypeError("codec class %s sets %s as class attributes; declare traits as "
                            "TRAITS = Traits(%s=...) (codecs/base.py Traits), or override "
                            "declare_traits() when they follow the options"
                            % (cls.__name__, ", ".join(bare), bare[0].replace(
                                "is_reference", "reference")))

    def __init__(self, threshold=None, num_threads=None, **options):
        threshold = check_threshold(threshold, self.name)
        if self.takes_threshold and threshold is None:
            threshold = self.default_threshold
        self._threshold = threshold if self.takes_threshold else None
        self.num_threads = num_threads
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            raise ValueError("codec %r has no option %s; its options: %s" % (
                self.name, ", ".join(unknown), ", ".join(sorted(self.options)) or "none"))
        self.option_values = {name: spec.parse(self.name, name, options.get(name, spec.default))
                              for name, spec in sorted(self.options.items())}
        self.check_options()
        self.traits = self.declare_traits()
        self.seed = 0  # this key's RNG key (rng.key_seed of the job seed and the key)
        self.pushes = 0  # sums decoded so far: the step every worker agrees on
        self.optimizer_view = None  # an OptimizerView, for a codec that wants_optimizer
        self._cache = {}

    def compensated(self, grad, residual):
        """c = grad + residual (the error feedback's compensate), or NonFiniteGradientError
        naming where the NaN/Inf are, before anything is written: a reference's first step."""
        c = self.feedback.compensate(grad, residual)
        if not np.isfinite(c).all():
            raise_nonfinite(grad, residual)
        return c

    def check_options(self):
        """Refuse a combination of options known not to train (ValueError naming the
        option, why and the fix); called once the options are parsed."""

    def declare_traits(self):
        """This instance's Traits (called once, after the options are parsed): the class's
        TRAITS, which a codec whose traits follow its options or family refines."""
        return self.TRAITS

    @property
    def threshold(self):
        """The threshold in use (float32 value as a float), or None when the codec has none."""
        return None if self._threshold is None else float(np.float32(self._threshold))

    @property
    def num_threads(self):
        return self._num_threads

    @num_threads.setter
    def num_threads(self, value):
        self._num_threads = check_num_threads(value)

    def __getattr__(self, name):
        values = self.__dict__.get("option_values")
        if values is not None and name in values:
            return values[name]
        raise AttributeError("%r has no attribute %r" % (type(self).__name__, name))

    def __repr__(self):
        opts = "".join(", %s=%r" % item for item in self.option_values.items())
        return "%s(%r, threshold=%r, num_threads=%d%s)" % (
            type(self).__name__, self.name, self.threshold, self.num_threads, opts)

    def clone(self):
        """Same parameters, fresh shared state (one instance per key)."""
        return type(self)(threshold=self._threshold, num_threads=self.num_threads,
                          **self.option_values)

    def piece_elements(self, size, num_workers, lane_bounds):
        """The element range [lo, hi) of each lane range in `lane_bounds`, when those lanes
        can be encoded from those elements alone (encodes_by_piece), else None."""
        return None

    def set_optimizer_view(self, view):
        """The optimizer's view of this key (an OptimizerView, or None: no optimizer) for the
        encodes that follow; the kvstore sets it before each push of a codec that
        wants_optimizer. It is this worker's own input, never shared state."""
        if view is not None and not isinstance(view, OptimizerView):
            raise TypeError("%s: set_optimizer_view takes an OptimizerView or None, got %s"
                            % (self.name, type(view).__name__))
        self.optimizer_view = view

    def push_seed(self):
        """The RNG key of the push about to be encoded: this key's seed and the step."""
        from .rng import mix64
        return mix64(self.seed + self.pushes)

    def state_dict(self):
        """The shared state as plain Python values (for checkpoints)."""
        return {"codec": self.name, "threshold": self.threshold, "options": self.option_values,
                "seed": self.seed, "pushes": self.pushes}

    def load_state_dict(self, state):
        """Restore state_dict(); refuses a state of another codec, threshold or options."""
        if state.get("codec") != self.name:
            raise ValueError("state of codec %r cannot load into %r"
                             % (state.get("codec"), self.name))
        if state.get("threshold") != self.threshold:
            raise ValueError("state has threshold %r but this codec uses %r; create the codec "
                             "with the same threshold" % (state.get("threshold"), self.threshold))
        if state.get("options", {}) != self.option_values:
            raise ValueError("state has options %r but this codec uses %r"
                             % (state.get("options", {}), self.option_values))
        self.seed = int(state.get("seed", 0))
        self.pushes = int(state.get("pushes", 0))

    # ------------------------------------------------------------ the wire (per family)
    def memory_size(self, size):
        """Length of this worker's error-feedback memory (`residual`) for `size` elements: the
        residual itself, first, and any further per-worker state after it (dgc's velocity)."""
        return size

    def lane_count(self, size, num_workers):
        """Length of the wire array for `size` elements."""
        raise NotImplementedError

    def wire_bits_per_element(self, num_workers):
        """Bits per element on the wire, each direction."""
        raise NotImplementedError

    def encode(self, grad, residual, num_workers, out=None, grad_checked=False, rank=0):
        """Compensate, quantize and write the wire array; `residual` is updated in place.

        rank: this worker's rank (a codec that gathers per-worker values writes its slot)."""
        raise NotImplementedError

    def decode(self, wire_sum, size, num_workers, out=None):
        """Sum over workers of the decoded values, float32 (size,), from the summed wire
        (for a gathering codec: every worker's slot side by side)."""
        raise NotImplementedError

    def momentum_advice(self, momentum):
        """A warning for training with optimizer `momentum` under this codec's options, where
        measurements found the pair unstable; None when there is nothing to say."""
        return None

    def residual_fill(self, size):
        """Pushes during which this codec's residual may rightly keep growing on a key of
        `size` elements (a sparsifier's elements wait about that long for their turn); the
        residual watch judges its growth only after them. 0: none."""
        return 0

    def compresses(self, shape):
        """False for a tensor of `shape` this codec sends in full precision (the planner
        routes it to fp_buf and gives it no codec state, e.g. PowerSGD's vectors)."""
        return True

    #: Exchanges per step: a codec with more calls next_round between them.
    rounds = 1

    def wire_rounds(self, size, shape, num_workers):
        """[(route, send shape, receive shape, dtype)] of every exchange the codec may use;
        route 'sum' or 'gather'. The kvstore declares one wire key per entry."""
        n = max(1, self.lane_count(size, num_workers))
        return [("sum", (n,), (n,), self.wire_dtype)]

    def push_rounds(self, size, num_workers):
        """Indices into wire_rounds() of the next push's exchanges, in order (default: all);
        a function of shared state only, so that every worker picks alike (dgc's stages)."""
        return tuple(range(self.rounds))

    def next_round(self, done, result, send, num_workers):
        """After round `done` came back as `result`, write round done+1's payload to `send`."""
        raise NotImplementedError

    #: Which of wire_classes() the next push uses: agreed state, changed only by decode.
    wire_class = 0

    def wire_classes(self, size, shape, num_workers):
        """Every wire format a push of this key may use, as wire_rounds lists: a codec whose
        payload size depends on the data pre-declares several slot sizes and picks one per
        push (`wire_class`). The default: one, wire_rounds()."""
        return [self.wire_rounds(size, shape, num_workers)]
