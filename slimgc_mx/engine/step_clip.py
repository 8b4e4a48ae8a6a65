"""Clipping by the global norm, as torch's clip_grad_norm_ after DDP's averaging: a step's
mean gradient (each key's decoded sum / N), over every key pushed in the step, scaled by
min(1, max_norm / (norm + 1e-6)) before any of its keys' global updates.

The norm is known only once the step's last sum has arrived, so the step's updates wait
for it: the finisher holds each arriving transfer (its power sum taken) in the step's
ClipRound, and the round releases them all, scaled, once it is sealed (the training thread
has pushed every key of the step) and every sum is in. Framework-free: sums are host arrays.
"""
import math
import threading

import numpy as np

#: What torch's clip_grad_norm_ adds to the norm before dividing max_norm by it.
EPS = 1e-6

_CHUNK = 1 << 20  # elements converted to float64 at a time


def check_norm_type(norm_type):
    """norm_type as a float: positive, or inf; ValueError otherwise."""
    p = float(norm_type)
    if not p > 0:
        raise ValueError("norm_type must be positive or inf, got %r" % (norm_type,))
    return p


def check_max_norm(max_norm):
    """max_norm as a float: finite and >= 0; ValueError otherwise."""
    value = float(max_norm)
    if not 0 <= value < math.inf:
        raise ValueError("max_norm must be a finite number >= 0, got %r" % (max_norm,))
    return value


def power_sum(values, p):
    """sum(|x|**p) of a float32 array, in float64 (p = inf: max |x|)."""
    total = 0.0
    flat = values.reshape(-1)
    for i in range(0, flat.size, _CHUNK):
        part = np.abs(flat[i:i + _CHUNK], dtype=np.float64)
        if p == math.inf:
            total = max(total, float(part.max()))
        elif p == 2.0:
            total += float(np.dot(part, part))
        elif p == 1.0:
            total += float(part.sum())
        else:
            total += float(np.power(part, p).sum())
    return total


class ClipRound:
    """One clipped step: its pushes, the transfers held until its norm is known, and once
    released its mean gradient's norm and the coefficient applied."""

    def __init__(self, max_norm, norm_type, num_workers):
        self.max_norm = check_max_norm(max_norm)
        self.norm_type = check_norm_type(norm_type)
        self.num_workers = num_workers
        self.pushed = 0  # pushes made in it
        self.arrived = 0  # of them, those whose sums are in
        self.powers = []  # each arrived sum's power sum, in arrival order
        self.held = []  # (transfer, release) whose sums are in
        self.sealed = False
        self.total_norm = None  # the mean gradient's norm, once released
        self.coef = None  # min(1, max_norm / (total_norm + EPS)), once released

    def complete(self):
        return self.sealed and self.arrived == self.pushed

    def add_power(self, power):
        self.powers.append(power)

    @property
    def power(self):
        """The step's power sum, whatever order its sums arrived in (which differs between
        ranks, a multi-round codec's transfers finishing out of order): the max, or the
        exactly rounded sum (fsum), so every rank's norm is bitwise the same."""
        if self.norm_type == math.inf:
            return max(self.powers, default=0.0)
        return math.fsum(self.powers)

    def decide(self):
        p = self.norm_type
        norm_of_sum = self.power if p == math.inf else self.power ** (1.0 / p)
        self.total_norm = norm_of_sum / self.num_workers
        self.coef = min(1.0, self.max_norm / (self.total_norm + EPS))


class StepClip:
    """The gate between the finisher and backup.publish for clipped steps.

    Training thread: start() opens a round, add() records each push in it, seal() closes it.
    Finisher: take() says which round a transfer belongs to (None: not clipped, publish at
    once); arrive() holds it. The thread that completes a round (the last arrival, or the
    seal when every sum came first) scales the held sums and runs their releases.
    """

    def __init__(self, num_workers):
        self.num_workers = num_workers
        self._lock = threading.Lock()
        self._open = None  # the round the training thread pushes into
        self._rounds = {}  # (key, step) -> its round, until its sum arrives
        self.last = None  # the latest released ClipRound

    @property
    def active(self):
        """True between start() and seal()."""
        return self._open is not None

    def start(self, max_norm, norm_type):
        if self._open is not None:
            raise RuntimeError("the previous clipped step was not sealed (its pushes raised, "
                               "or end_step was not called)")
        self._open = ClipRound(max_norm, norm_type, self.num_workers)

    def add(self, key, step):
        """The push of `key` at `step` is in the open round."""
        with self._lock:
            self._open.pushed += 1
            self._rounds[(key, step)] = self._open

    def seal(self):
        """Every push of the open round is made; release it if every sum is in."""
        with self._lock:
            r, self._open = self._open, None
            r.sealed = True
            done = r.complete()
        if done:
            self._release(r)

    def take(self, transfer):
        """The round of `transfer`'s pushes (all in one), or None when it is not clipped."""
        if not self._rounds:
            return None
        with self._lock:
            found = [self._rounds.pop((p.key, p.step), None) for p in transfer.pushes]
        if any(r is not found[0] for r in found):
            raise RuntimeError("%s, step %d: its pushes are not all in one clipped step"
                               % (transfer.label, transfer.step))
        return found[0]

    def arrive(self, r, transfer, release):
        """Finisher: `transfer`'s sum (in its agg) is in round `r`; `release()` publishes its
        update once the round's coefficient has scaled the sum."""
        power = power_sum(transfer.buffers.agg.for_read(), r.norm_type)
        with self._lock:
            r.add_power(power)
            r.arrived += len(transfer.pushes)
            r.held.append((transfer, release))
            done = r.complete()
        if done:
            self._release(r)

    def _release(self, r):
        r.decide()
        if r.coef < 1.0:
            coef = np.float32(r.coef)
            for transfer, _ in r.held:
                agg = transfer.buffers.agg.for_write()
                np.multiply(agg, coef, out=agg)
        held, r.held = r.held, []
        self.last = r
        for _, release in held:
            release()
