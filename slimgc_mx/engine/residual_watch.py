"""Error feedback that keeps growing: compression that wrecks training, found in the run.

A key's error-feedback residual keeps what its pushes did not send. Where the codec suits
the job, rho = ||residual|| / ||gradient|| settles: near 1 for a quantizer, higher for a
sparsifier while its elements wait their turn. Where a quantizer cannot send what the
gradients bring (2bit's fixed +-threshold), or momentum amplifies the stale steps that error
feedback releases until the weights run away, the residual keeps growing and training
diverges (docs/codecs.md, "Compression that wrecks training").

Every EVERY compressed pushes of a key, its encoder adds up the squared norms of the push's
gradient and of the residual the last push left (Plan.measure; read before encoding, so a
codec's later rounds are in it, and piece by piece for a streamed push); the finisher
judges the sample. The key is found growing when, at CHECKS samples in a row, its residual
norm has grown more than GROWTH-fold since half as many pushes before, it holds at least
FLOOR gradients' worth, and either rho grew as much (the residual outgrows the gradient: a
saturated quantizer) or the gradient's norm did (the weights run away, and the residual
with them). A residual that rightly fills up (the first START pushes, a sparsifier's
Codec.residual_fill) is no reference. On the host path keys encoded on a device are not
watched (their residual stays there); the torch device path samples its buckets' norms on
the device into the step's tail and judges them with Series.record. The aggregator (or the
device path) warns once per process, on the training thread.
"""
import collections
import math
import threading
import warnings
from dataclasses import dataclass

import numpy as np

EVERY = 10  # compressed pushes of a key between samples
#: Least growth since the sample of half as many pushes before: more than a residual that
#: fills up at a steady rate (a quantizer's dead zone under a small steady gradient), which
#: doubles exactly.
GROWTH = 2.1
CHECKS = 3  # samples in a row that must show it
FLOOR = 4.0  # least rho: the residual holds this many gradients' worth
START = 20  # pushes before a sample may be a reference: the residual first fills up
HISTORY = 64  # samples kept: growth is judged over at most HISTORY * EVERY pushes


class ResidualGrowthWarning(UserWarning):
    """A key's error-feedback residual keeps growing: compression is likely wrecking training."""


def due(codec):
    """True when the push about to be encoded with `codec` is sampled (every EVERY pushes)."""
    return codec.pushes > 0 and codec.pushes % EVERY == 0


@dataclass(frozen=True)
class Growth:
    """What was found: rho at push `push`, and at the reference push `since`."""

    push: int
    rho: float
    since: int
    rho_then: float


class Series:
    """The samples of one key (or fused bucket): norms added where it is encoded, judged at
    the finisher; `fill`: pushes its residual may rightly grow for (Codec.residual_fill)."""

    def __init__(self, fill=0):
        self.fill = fill
        self.samples = collections.deque(maxlen=HISTORY)  # (push, ||grad||, ||residual||)
        self.pushes = 0  # pushes watched: EVERY per sample
        self.run = 0  # samples in a row that showed growth
        self.found = None  # the Growth, once found
        self._sums = [0.0, 0.0]
        self._lock = threading.Lock()  # the pieces of a streamed push add from several threads

    def add(self, grad, residual):
        """Add the push's gradient (or a piece of it) and the residual the last push left
        (its first len(grad) elements: a codec may keep further state after it)."""
        memory = residual[:grad.shape[0]]
        g2, r2 = float(np.dot(grad, grad)), float(np.dot(memory, memory))
        with self._lock:
            self._sums[0] += g2
            self._sums[1] += r2

    def close(self):
        """The push's sample is complete: judge it; the Growth when first found, else None."""
        with self._lock:
            g2, r2 = self._sums
            self._sums = [0.0, 0.0]
        self.pushes += EVERY
        return self.record(self.pushes, math.sqrt(g2), math.sqrt(r2))

    def record(self, push, grad_norm, residual_norm):
        """Judge the sample (push, ||grad||, ||residual||); the Growth when first found."""
        if not (math.isfinite(grad_norm) and math.isfinite(residual_norm)) or grad_norm <= 0:
            self.run = 0
            return None
        self.samples.append((push, grad_norm, residual_norm))
        since, g0, r0 = self._reference(push / 2)
        rho, rho0 = residual_norm / grad_norm, r0 / g0
        grew = (since >= max(START, self.fill) and rho >= FLOOR and residual_norm >= GROWTH * r0
                and (rho >= GROWTH * rho0 or grad_norm >= GROWTH * g0))
        self.run = self.run + 1 if grew else 0
        if self.run < CHECKS or self.found is not None:
            return None
        self.found = Growth(push, rho, since, rho0)
        return self.found

    def _reference(self, half):
        """(push, ||grad||, ||residual||) at push `half`: the sample there, or between the two
        around it (linearly); the oldest kept where that one is newer (HISTORY)."""
        while len(self.samples) > 2 and self.samples[1][0] <= half:
            self.samples.popleft()
        p0, g0, r0 = self.samples[0]
        if p0 >= half or len(self.samples) < 2:
            return p0, g0, r0
        p1, g1, r1 = self.samples[1]
        w = (half - p0) / (p1 - p0)
        return half, g0 + w * (g1 - g0), r0 + w * (r1 - r0)


def _settings(codec):
    """The codec's settings as its user gives them, e.g. "threshold=0.5" or "ratio=0.1"."""
    values = {"threshold": codec.threshold} if codec.takes_threshold else {}
    values.update((k, v) for k, v in codec.option_values.items() if not k.startswith("allow_"))
    return ", ".join("%s=%r" % item for item in values.items())


def message(label, codec, found):
    """What the user is told about `found` (a Growth) on `label` under `codec`."""
    own = _settings(codec)
    return (
        "codec %r is likely wrecking training: the error-feedback residual of %s keeps "
        "growing (%.3g times the gradient's norm at its push %d, %.3g at push %d; at %d "
        "samples in a row its norm had more than doubled since half as many pushes before), "
        "as when the codec cannot send what the gradients bring or momentum amplifies the "
        "stale steps that error feedback releases. "
        "Fixes: keep small tensors in full precision (comm_threshold='auto', or a size such "
        "as 15360 bytes, the paper's 15 KB), less optimizer momentum, or %s (docs/codecs.md, "
        "\"Compression that wrecks training\")"
        % (codec.name, label, found.rho, found.push, found.rho_then, found.since, CHECKS,
           "other codec settings than %s" % own if own else "another codec"))


_told = False
_lock = threading.Lock()


def warn(text):
    """Warn with `text` (ResidualGrowthWarning) unless this process already has; True if it did."""
    global _told
    with _lock:
        if _told:
            return False
        _told = True
    warnings.warn(text, ResidualGrowthWarning, stacklevel=3)
    return True
