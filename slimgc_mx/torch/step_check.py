"""Every step's hyperparameters compared across ranks, at no collective of its own.

step() sends a 52-bit hash of the step's settings (framework.StepSettings) with the step's
first exchange (TorchTransport.ride). The global update of that step waits for it (it is
in with that exchange) and writes nothing where ranks differ; the next step(), flush() or
state_dict() raises ConfigMismatchError naming the setting, the step and each rank's
value, which an allgather then gathers. Every rank learns the same verdict and raises at
the same call, so none is left waiting in a collective.
"""
import numbers
import threading

import numpy as np

from ..engine.agreement import ConfigMismatchError, fingerprint

ADVICE = ("change hyperparameters on every rank alike (e.g. step a ReduceLROnPlateau on a "
          "metric averaged over ranks)")


def _code(value):
    """A hyperparameter as one float64: a number as itself, anything else by its hash."""
    if isinstance(value, numbers.Real):
        return float(value)
    return fingerprint(value)


def _same(a, b):
    """Elementwise a == b, NaN equal to NaN (a NaN hyperparameter is the same everywhere)."""
    return (a == b) | (np.isnan(a) & np.isnan(b))


class StepSettingsCheck:
    """The settings of each step, compared over `transport` (a TorchTransport); `settings`
    (the StepSettings at construction, which every rank agreed on) fixes the layout of the
    values that name a difference."""

    def __init__(self, transport, settings):
        self._transport = transport
        self._names = [(g, name) for g, group in enumerate(settings.groups) for name, _ in group]
        self._last = self._hash = None
        self._steps = {}  # step -> [Rider, StepSettings, verdict: None, True (same), False]
        self._lock = threading.Lock()
        self.error = None  # the first difference found: raised by every later call

    def start(self, step, settings):
        """Training thread, before the step's pushes: send the hash of `settings` (a
        StepSettings), hashed again only when they changed."""
        if settings != self._last:
            self._last, self._hash = settings, int(fingerprint(settings.groups))
        rider = self._transport.ride([self._hash])
        with self._lock:
            for old in [s for s in self._steps if s < step - 2]:  # its updates are all done
                del self._steps[old]
            self._steps[step] = [rider, settings, None]

    def drop(self, step):
        """The step that started `step` raised before its exchanges: nothing to compare."""
        with self._lock:
            entry = self._steps.pop(step, None)
        if entry is not None:
            entry[0].fail()

    def differs(self, step):
        """True when the ranks sent different settings for `step` (False when this check
        did not start it); waits for the exchange that carries them. Either thread."""
        with self._lock:
            entry = self._steps.get(step)
        if entry is None:
            return False
        if entry[2] is None:
            entry[2] = entry[0].same()
        return not entry[2]

    def raise_found(self, before=None):
        """Training thread, at a call every rank makes alike: raise ConfigMismatchError for
        the first step started (before step `before`) whose settings differ across ranks."""
        if self.error is None:
            with self._lock:
                steps = sorted(s for s in self._steps if before is None or s < before)
            for step in steps:
                if self.differs(step):
                    self.error = self._message(step, self._steps[step][1])
                    break
        if self.error is not None:
            raise ConfigMismatchError(self.error)

    def _message(self, step, settings):
        """The first setting whose values differ, with each rank's value (an allgather)."""
        groups = [dict(g) for g in settings.groups]
        gathered = self._transport.allgather([
            _code(groups[g].get(name)) if g < len(groups) else float("nan")
            for g, name in self._names])
        mine = self._transport.rank
        for col, (g, name) in enumerate(self._names):
            column = gathered[:, col]
            if _same(column, column[mine]).all():
                continue
            value = groups[g].get(name) if g < len(groups) else None
            if isinstance(value, numbers.Real):
                ranks = {}
                for r, v in enumerate(column.tolist()):
                    ranks.setdefault(v, []).append(r)
                values = ", ".join("rank %d has %r" % (rs[0], v) if len(rs) == 1 else
                                   "ranks %s have %r" % (", ".join(map(str, rs)), v)
                                   for v, rs in ranks.items())
            else:
                others = [r for r in range(len(column)) if not _same(column[r], column[mine])]
                values = "rank %d has %r, ranks %s another value" % (mine, value, others)
            return "ranks disagree on param group %d %s at step %d: %s; %s" % (
                g, name, step, values, ADVICE)
        return ("ranks disagree on the optimizer's param groups at step %d (a setting that "
                "not every rank has; rank %d has %s); %s" % (step, mine, groups, ADVICE))
