"""The device path's CTTab (SlimGC Strategy 1, per bucket): which route each bucket takes,
the device codec or full precision.

With comm_threshold='auto', every bucket that could be compressed (one whose codec the
device serves) alternates the two routes for the warm-up's steps: even steps (counted from
the warm-up's start) the compressed route (error feedback and encode, the lanes' sum,
decode), odd steps the full-precision route (the flat gradient summed in float32 and
divided, as an uncompressed bucket's). DevicePath times each route of each bucket (CUDA
events read once at the decision, or wall time on the CPU) and hands the times to
record(); each bucket keeps its fastest sample per route, since interference only adds
time (as engine/cttab.py's keys do).

At the end of the warm-up each bucket is compressed only where its compressed time, counted
1 + cttab_margin times, is below its full-precision time (choose(): the host CTTab's
margin, per bucket instead of per size cut; a tie, or a bucket not timed on both routes,
goes full precision). Full precision is always a candidate, so on a link where compression
does not pay every bucket goes full precision and the job runs DDP's schedule. Every rank
adopts rank 0's routes (agree()), and from then on each bucket keeps its route.

The third candidate of the paper's Strategy 1, CPU offload, is the host path's
(data_path='host', offload='auto').
"""
import math

from ..engine.cttab import format_bytes, plain_number

#: A bucket's route, as stats() reports it.
COMPRESSED, FULL, WARMUP = "compressed", "full precision", "warm-up"


def choose(samples, margin):
    """Per bucket, True where the compressed route wins: samples[j] is bucket j's
    {'q': fastest compressed time, 'fp': fastest full-precision time} (either None where
    not timed), or None for a bucket that cannot be compressed. Compressed only if
    q * (1 + margin) < fp: a tie, or a missing time, is full precision."""
    out = []
    for s in samples:
        q, fp = (s or {}).get("q"), (s or {}).get("fp")
        out.append(q is not None and fp is not None and q * (1 + margin) < fp)
    return out


def agree(transport, routes):
    """Rank 0's routes (a list of bools) on every rank, gathered over `transport` (the
    host transport's allgather, as the host CTTab agrees on its BestCT)."""
    if transport is None or transport.num_workers == 1:
        return list(routes)
    rows = transport.allgather([1.0 if r else 0.0 for r in routes])
    return [bool(v > 0) for v in rows[0]]


class BucketRoutes:
    """The routes of a DevicePath's buckets and, with mode 'auto', their warm-up.

    candidates[j]: bucket j can be compressed (it has a codec); sizes[j]: its bytes in
    float32; names[j]: how messages name it. mode: 'auto', or 'fixed' (comm_threshold a
    size or 'off': every candidate compressed from the start, no warm-up)."""

    def __init__(self, candidates, sizes, names, mode="auto", warmup_steps=20, margin=0.5):
        self.candidates = list(candidates)
        self.sizes = list(sizes)
        self.names = list(names)
        self.mode = mode
        self.warmup_steps = int(warmup_steps)
        self.margin = float(margin)
        self.start = 0  # the step the warm-up starts at
        self.samples = [{"q": None, "fp": None} if c else None for c in self.candidates]
        if mode == "auto" and any(self.candidates):
            self.phase = "warmup"
            self.routes = None
            self.reason = None
        else:
            self.phase = "fixed"
            self.routes = list(self.candidates)
            self.reason = None

    @property
    def warming(self):
        return self.phase == "warmup"

    def due(self, step):
        """True when the warm-up is over and the routes must be chosen before `step`."""
        return self.warming and step >= self.start + self.warmup_steps

    def compressed(self, j, step):
        """Bucket j's route at `step`: True for the device codec, False for full precision."""
        if not self.candidates[j]:
            return False
        if self.warming:
            return (step - self.start) % 2 == 0
        return self.routes[j]

    def record(self, j, compressed, seconds, step):
        """One warm-up sample: bucket j's route (`compressed`) took `seconds` at `step`;
        the fastest of each route is kept."""
        if not self.warming or self.samples[j] is None:
            return
        key = "q" if compressed else "fp"
        best = self.samples[j][key]
        if best is None or seconds < best:
            self.samples[j][key] = seconds

    def own_routes(self):
        """This rank's routes from its samples (choose())."""
        return choose(self.samples, self.margin)

    def adopt(self, routes):
        """Enter the decided phase with the `routes` every rank agreed on."""
        self.routes = [bool(r) and c for r, c in zip(routes, self.candidates)]
        self.phase = "decided"
        self.reason = self.explain(own=self.own_routes())

    def route_names(self):
        """Each bucket's route as stats() says it."""
        if self.warming:
            return [WARMUP if c else FULL for c in self.candidates]
        return [COMPRESSED if r else FULL for r in self.routes]

    def _ratio(self, s):
        return s["fp"] / s["q"] if s["q"] else math.inf

    def _listed(self, js):
        text = ", ".join("%s, %s (%s)" % (self.names[j], format_bytes(self.sizes[j]),
                                           self._benefit(j)) for j in js[:3])
        return text + (" and %d more" % (len(js) - 3) if len(js) > 3 else "")

    def _benefit(self, j):
        s = self.samples[j]
        if s["q"] is None or s["fp"] is None:
            return "not timed on both routes"
        return "t_fp %.3f ms / t_q %.3f ms = %.2f" % (s["fp"] * 1e3, s["q"] * 1e3,
                                                     self._ratio(s))

    def explain(self, own=None):
        """Why the routes are what they are, in one sentence."""
        if self.phase == "fixed":
            return "fixed by comm_threshold (no warm-up)"
        bar = "1 + cttab_margin = %s" % plain_number(1 + self.margin)
        how = ("each bucket compressed only where its full-precision time over its compressed "
               "time (encode, sum, decode; the fastest of its warm-up samples) is above %s"
               % bar)
        if own is not None and list(own) != [bool(r) and c for r, c in
                                             zip(self.routes, self.candidates)]:
            how += "; rank 0's choice, which every rank adopts (this rank's own differs)"
        on = [j for j, r in enumerate(self.routes) if r]
        off = [j for j, c in enumerate(self.candidates) if c and not self.routes[j]]
        text = how
        if on:
            text += "; compressed: " + self._listed(on)
        if off:
            text += "; full precision: " + self._listed(off)
        return text

    def summary(self):
        """The line rank 0 tells at the decision."""
        on = [j for j, r in enumerate(self.routes) if r]
        text = "device path CTTab: %d of %d buckets compressed (%s of %s): %s" % (
            len(on), len(self.routes), format_bytes(sum(self.sizes[j] for j in on)),
            format_bytes(sum(self.sizes)), self.reason)
        if not on:
            text += ("; nothing is compressed, so the step is DDP's (comm_threshold='off' "
                     "compresses every bucket)")
        return text

    def opening(self):
        """The line rank 0 tells at start of a warm-up."""
        return ("device path CTTab: a warm-up of %d steps times each of the %d buckets that "
                "can be compressed on both routes, compressed and full precision, then "
                "routes each to the faster (a compressed one must win by cttab_margin %s)"
                % (self.warmup_steps, sum(self.candidates), plain_number(self.margin)))

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
        self.routes = None if state["routes"] is None else [bool(r) for r in state["routes"]]
        self.samples = [None if s is None else dict(s) for s in state["samples"]]
        self.reason = state.get("reason")


def _mode_text(mode):
    return "'auto'" if mode == "auto" else "fixed (a size or 'off')"
