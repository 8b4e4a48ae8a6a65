"""The CTTab per bucket (SlimGC Strategy 1, the device path's placement): which route each
bucket takes, the device codec, the host codec (the Cython codec on the CPU) or full
precision. Framework-free: the adapter times the routes and hands the times to record();
push_plan.bucket_plan turns the route into the sites of the bucket's pass.

With comm_threshold='auto', every bucket that could be compressed (one whose codec the
device serves) cycles through its routes for the warm-up's steps, counted from the
warm-up's start: the device codec (error feedback and encode in torch ops, the lanes' sum,
decode), the host codec where the bucket has one (host_route(): the gradient and residual
brought to the host, the Cython codec's encode on its CPU threads, the lanes and residual
back; the same lanes bit for bit), and full precision (the flat gradient summed in float32
and divided, as an uncompressed bucket's). The adapter (torch/device_path.py) times each
route of each bucket (CUDA events read once at the decision, or wall time on the CPU) and
hands the times to record(); each bucket keeps its fastest sample per route, since
interference only adds time (as engine/cttab.py's keys do).

At the end of the warm-up each bucket takes its faster compressed route only where that
route's time, counted 1 + cttab_margin times, is below its full-precision time (choose():
the host CTTab's margin, per bucket instead of per size cut; a tie, or a bucket not timed
on full precision and a compressed route, goes full precision; a tie between the device
and the host goes to the device). Full precision is always a candidate, so on a link where
compression does not pay every bucket goes full precision and the job runs DDP's schedule.
Every rank adopts rank 0's routes (agree()), and from then on each bucket keeps its route.

The host codec runs on the training thread, waiting for the gradient's copy to the host: it
wins where the CPU encodes faster than the device (a model on the CPU: the Cython kernel
against torch ops), not where the paper's offload hides the CPU's work behind the device's
(that is the host path's, data_path='host', offload='auto').
"""
import math

from .cttab import format_bytes, plain_number
from .push_plan import COMPRESSED, FULL, HOST

#: What stats() reports for a bucket while the warm-up times its routes.
WARMUP = "warm-up"
#: Each route's sample in a bucket's warm-up record, and its code in agree()'s allgather.
_SAMPLE = {COMPRESSED: "q", HOST: "host", FULL: "fp"}
_CODE = {FULL: 0.0, COMPRESSED: 1.0, HOST: 2.0}


def choose(samples, margin):
    """Per bucket, its route: samples[j] is bucket j's {'q': fastest device-codec time,
    'host': fastest host-codec time, 'fp': fastest full-precision time} (each None, or
    absent, where not timed), or None for a bucket that cannot be compressed. The faster
    compressed route (the device on a tie) only if its time * (1 + margin) < fp: a tie, or a
    missing time, is full precision."""
    out = []
    for s in samples:
        s = s or {}
        fp, best, route = s.get("fp"), None, FULL
        for name in (COMPRESSED, HOST):
            t = s.get(_SAMPLE[name])
            if t is not None and (best is None or t < best):
                best, route = t, name
        out.append(route if best is not None and fp is not None and best * (1 + margin) < fp
                   else FULL)
    return out


def agree(transport, routes):
    """Rank 0's routes (a list of route names) on every rank, gathered over `transport`
    (the host transport's allgather, as the host CTTab agrees on its BestCT)."""
    if transport is None or transport.num_workers == 1:
        return list(routes)
    rows = transport.allgather([_CODE[r] for r in routes])
    names = {code: name for name, code in _CODE.items()}
    return [names[float(v)] for v in rows[0]]


class BucketRoutes:
    """The routes of a DevicePath's buckets and, with mode 'auto', their warm-up.

    candidates[j]: bucket j can be compressed (it has a codec); sizes[j]: its bytes in
    float32; names[j]: how messages name it; hosts[j]: it has a host codec too (default
    none). mode: 'auto', or 'fixed' (comm_threshold a size or 'off': every candidate on the
    device codec from the start, no warm-up)."""

    def __init__(self, candidates, sizes, names, mode="auto", warmup_steps=20, margin=0.5,
                 hosts=None):
        self.candidates = list(candidates)
        self.hosts = [bool(h) and c for h, c in zip(hosts or [False] * len(self.candidates),
                                                     self.candidates)]
        self.sizes = list(sizes)
        self.names = list(names)
        self.mode = mode
        self.warmup_steps = int(warmup_steps)
        self.margin = float(margin)
        self.start = 0  # the step the warm-up starts at
        self.samples = [self._empty(j) if c else None for j, c in enumerate(self.candidates)]
        if mode == "auto" and any(self.candidates):
            self.phase = "warmup"
            self.routes = None
            self.reason = None
        else:
            self.phase = "fixed"
            self.routes = [COMPRESSED if c else FULL for c in self.candidates]
            self.reason = None

    def _empty(self, j):
        return {_SAMPLE[r]: None for r in self._cycle(j)}

    def _cycle(self, j):
        """Bucket j's routes in the warm-up's order."""
        return (COMPRESSED, HOST, FULL) if self.hosts[j] else (COMPRESSED, FULL)

    @property
    def warming(self):
        return self.phase == "warmup"

    def due(self, step):
        """True when the warm-up is over and the routes must be chosen before `step`."""
        return self.warming and step >= self.start + self.warmup_steps

    def route(self, j, step):
        """Bucket j's route at `step`: COMPRESSED (the device codec), HOST or FULL."""
        if not self.candidates[j]:
            return FULL
        if self.warming:
            cycle = self._cycle(j)
            return cycle[(step - self.start) % len(cycle)]
        return self.routes[j]

    def record(self, j, route, seconds, step):
        """One warm-up sample: bucket j's `route` took `seconds` at `step`; the fastest of
        each route is kept."""
        if not self.warming or self.samples[j] is None:
            return
        key = _SAMPLE[route]
        best = self.samples[j].get(key)
        if best is None or seconds < best:
            self.samples[j][key] = seconds

    def own_routes(self):
        """This rank's routes from its samples (choose())."""
        return choose(self.samples, self.margin)

    def adopt(self, routes):
        """Enter the decided phase with the `routes` every rank agreed on."""
        self.routes = self._allowed(routes)
        self.phase = "decided"
        self.reason = self.explain(own=self.own_routes())

    def _allowed(self, routes):
        """`routes` where each bucket can take them (FULL elsewhere)."""
        return [r if c and (r != HOST or h) else FULL
                for r, c, h in zip(routes, self.candidates, self.hosts)]

    def route_names(self):
        """Each bucket's route as stats() says it."""
        if self.warming:
            return [WARMUP if c else FULL for c in self.candidates]
        return list(self.routes)

    def _listed(self, js):
        text = ", ".join("%s, %s (%s)" % (self.names[j], format_bytes(self.sizes[j]),
                                           self._benefit(j)) for j in js[:3])
        return text + (" and %d more" % (len(js) - 3) if len(js) > 3 else "")

    def _benefit(self, j):
        s = self.samples[j]
        q = [(s.get(_SAMPLE[r]), r) for r in (COMPRESSED, HOST) if s.get(_SAMPLE[r]) is not None]
        if s["fp"] is None or not q:
            return "not timed on both routes"
        t, route = min(q, key=lambda x: x[0])
        text = "t_fp %.3f ms / t_q %.3f ms = %.2f" % (s["fp"] * 1e3, t * 1e3, s["fp"] / t
                                                      if t else math.inf)
        if s.get("host") is not None:
            text += ", %s" % ("on the host" if route == HOST else "on the device")
            other = s["host"] if route == COMPRESSED else s["q"]
            if other is not None:
                text += " (%s %.3f ms)" % ("host" if route == COMPRESSED else "device",
                                           other * 1e3)
        return text

    def explain(self, own=None):
        """Why the routes are what they are, in one sentence."""
        if self.phase == "fixed":
            return "fixed by comm_threshold (no warm-up)"
        bar = "1 + cttab_margin = %s" % plain_number(1 + self.margin)
        how = ("each bucket compressed only where its full-precision time over its compressed "
               "time (encode, sum, decode; the fastest of its warm-up samples, on the device "
               "or the host, whichever is faster) is above %s" % bar)
        if own is not None and self._allowed(own) != list(self.routes):
            how += "; rank 0's choice, which every rank adopts (this rank's own differs)"
        on = [j for j, r in enumerate(self.routes) if r != FULL]
        off = [j for j, c in enumerate(self.candidates) if c and self.routes[j] == FULL]
        text = how
        if on:
            text += "; compressed: " + self._listed(on)
        if off:
            text += "; full precision: " + self._listed(off)
        return text

    def summary(self):
        """The line rank 0 tells at the decision."""
        on = [j for j, r in enumerate(self.routes) if r != FULL]
        host = sum(self.routes[j] == HOST for j in on)
        text = "device path CTTab: %d of %d buckets compressed%s (%s of %s): %s" % (
            len(on), len(self.routes), " (%d on the host)" % host if host else "",
            format_bytes(sum(self.sizes[j] for j in on)), format_bytes(sum(self.sizes)),
            self.reason)
        if not on:
            text += ("; nothing is compressed, so the step is DDP's (comm_threshold='off' "
                     "compresses every bucket)")
        return text

    def opening(self):
        """The line rank 0 tells at start of a warm-up."""
        return ("device path CTTab: a warm-up of %d steps times each of the %d buckets that "
                "can be compressed on each of its routes, compressed on the device%s and full "
                "precision, then routes each to the fastest (a compressed one must win by "
                "cttab_margin %s)" % (self.warmup_steps, sum(self.candidates),
                                      ", compressed on the host" if any(self.hosts) else "",
                                      plain_number(self.margin)))

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self):
        return {"mode": self.mode, "phase": self.phase, "start": self.start,
                "warmup_steps": self.warmup_steps, "margin": self.margin,
                "routes": None if self.routes is None else list(self.routes),
                "samples": [None if s is None else dict(s) for s in self.samples],
                "reason": self.reason}

    def load_state_dict(self, state):
        if state.get("mode") != self.mode:
            raise ValueError("this checkpoint's device-path routes were chosen with "
                             "comm_threshold %s and this optimizer's are %s: save and load "
                             "with the same comm_threshold" % (
                                 _mode_text(state.get("mode")), _mode_text(self.mode)))
        if len(state["samples"]) != len(self.candidates):
            raise ValueError("this checkpoint routes %d buckets, this optimizer has %d"
                             % (len(state["samples"]), len(self.candidates)))
        self.phase = state["phase"]
        self.start = int(state["start"])
        routes = state["routes"]  # route names; True/False in checkpoints of two routes
        self.routes = None if routes is None else self._allowed(
            [{True: COMPRESSED, False: FULL}.get(r, r) for r in routes])
        self.samples = [None if s is None else dict(self._empty(j), **s)
                        for j, s in enumerate(state["samples"])]
        self.reason = state.get("reason")


def _mode_text(mode):
    return "'auto'" if mode == "auto" else "fixed (a size or 'off')"
