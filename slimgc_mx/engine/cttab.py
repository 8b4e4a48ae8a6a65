"""CTTab, the communication threshold table (SlimGC Strategy 1, Algorithms 1 and 2).

Warm-up: the last SAMPLES_PER_SIZE keys of each tensor size alternate compressed (even
steps) and full-precision (odd steps) transfers, each sent alone; each transfer's time is
recorded, and each key keeps its fastest. The table is per size, so the other keys of a
size are not timed: they travel in full precision, fused (the planner's warm-up buckets),
and a model of many same-sized tensors does not pay one timed transfer per tensor per
step. The last keys declared are the last pushed (both adapters push in key order), so
the timed transfers run after the step's other pushes rather than beside them: measured
on 500 tiny tensors, timing the first keys cost a third more per step than timing the last
(threads contending with the training thread's pushes). The table then gives per tensor
size t_c, t_c^q, t_p^q and the benefit ratio t_c / (t_c^q + t_p^q), weighted by how many
tensors have that size, and
BestCT is the threshold from which compression pays. Afterwards the router sends
size < BestCT in full precision and the rest compressed.

Two rules pick BestCT from the table. 'measured' compares each row's measured
t_c with t_c^q + t_p^q, as the paper does. 'fit' (the default) first fits one
link, t = latency + wire bytes / bandwidth, to the transfers of both routes,
and compares the fitted times: on a host whose cores are shared with training,
two identical small transfers can differ tenfold, and the fit keeps that noise
from deciding.

Under 'fit', a job whose compressible tensors are all smaller than MIN_FIT_SPAN has no
warm-up: no fit can read a bandwidth from them, and without one compression never pays,
so the CTTab decides 'never' before the first step's routes (foregone()).

The margin makes the decision reproducible: each compressed tensor counts 1 + margin
times its t_c^q + t_p^q (cttab_margin, 0.5 in the kvstore), and BestCT is the cut with
the least total time. So a size whose benefit ratio t_c / (t_c^q + t_p^q) sits within
the margin of 1 goes full precision on every run instead of flipping with the noise of
the warm-up. The cut compresses every size from BestCT up: a size below the bar can be
compressed when the larger ones pay for it, and one above it left out when the sizes
between it and BestCT lose more; explain() says which. A decision saved with save() can
be replayed: give its JSON file as comm_threshold and the table is loaded instead of
measured.
"""
import csv
import fractions
import io
import json
import logging
import math

log = logging.getLogger(__name__)

NEVER = math.inf  # BestCT when compression never pays: every tensor goes full precision

#: Keys of one size timed by the warm-up (their fastest transfers are averaged). One: each
#: timed key adds a serial transfer to every warm-up step, and a key's fastest of its
#: warmup_steps / 2 transfers per route already discards the noise of a contended host.
SAMPLES_PER_SIZE = 1


class CTTab:
    """The router and its two phases: 'warmup' (measuring) -> 'trained' (fixed BestCT).

    mode: 'auto' (measure, then decide), 'off' (compress every tensor), or a
    number of bytes (fixed threshold, no warm-up; NEVER sends everything in full precision).
    rule: 'fit' or 'measured', how BestCT is read from the table (see the module doc).
    """

    def __init__(self, mode="auto", warmup_steps=20, rule="fit", margin=0.0, places=False,
                 fused_fp=False):
        """places: the model is on a device (a GPU) that can also encode (offload='auto'):
        the warm-up measures the compressed route encoded there too, and each size is
        compressed where its t^q is least. fused_fp: full-precision tensors travel in fused
        buckets after the decision (option fuse), so the 'fit' rule counts their bytes
        alone: a bucket's one latency is shared by all its members, while a compressed
        tensor pays its own."""
        check_rule(rule)
        self.fused_fp = fused_fp
        self.places = places
        self.placement = {}  # size -> 'device' where the device encodes it (offload='auto')
        self.mode = mode
        self.warmup_steps = warmup_steps
        self.rule = rule
        self.margin = margin
        self._samples = {}  # key -> {"nbytes", "wire_q", "fp": [t_c..], "q": [t_c^q..], "proc": [t_p^q..]}
        self._declared = {}  # size -> the compressible keys of that size, in order (declare())
        self._largest = 0  # the largest size declared (foregone(), asked at every push)
        self._timed = None  # the keys the warm-up times, chosen at the first timed()
        self.rows = []
        self.link = None  # the fitted {"latency_s", "bandwidth_Bps"} once the table is built
        self.reason = None  # one sentence: why best_ct is what it is
        if mode == "auto":
            self.phase = "warmup"
            self.best_ct = None
        elif isinstance(mode, str) and mode != "off":  # a saved decision: replay it
            self.phase = "trained"
            saved = load_decision(mode)
            self.best_ct, self.rows, self.link = saved["best_ct"], saved["rows"], saved["link"]
            self.placement = {r["size"]: "device" for r in self.rows
                              if r.get("where") == "device"}
            self.reason = "replayed from %s (%s)" % (mode, saved.get("reason") or "saved table")
        else:
            self.phase = "trained"
            self.best_ct = 0 if mode == "off" else mode
            self.reason = ("comm_threshold=off: every tensor compressed" if mode == "off" else
                           "fixed by comm_threshold=%s" % (format_bytes(mode),))

    def declare(self, key, nbytes):
        """A compressible tensor of `nbytes` (key: the planner's index, in push order)."""
        keys = self._declared.setdefault(nbytes, [])
        self._largest = max(self._largest, nbytes)
        if self._timed is not None and sum(k in self._timed for k in keys) < SAMPLES_PER_SIZE:
            self._timed.add(key)  # declared once routing began: timed while its size lacks
        keys.append(key)

    def timed(self, key):
        """Whether the warm-up times key `key` (routes it); the others go full precision.
        The keys timed are the last SAMPLES_PER_SIZE of each size declared when this is
        first asked; a key declared later, where its size has fewer timed."""
        if self._timed is None:
            self._timed = {k for keys in self._declared.values()
                           for k in keys[-SAMPLES_PER_SIZE:]}
        return key in self._timed

    def compressed(self, nbytes, step):
        """Route of one transfer: True for bit_buf (compressed), False for fp_buf."""
        if self.phase == "warmup":
            return step % 2 == 0 if not self.places else step % 3 != 1
        return nbytes >= self.best_ct

    def where(self, nbytes, step):
        """Where a compressed transfer of `nbytes` at `step` is encoded: 'host' (CPU threads)
        or 'device' (the gradient's device). Warm-up with placement: steps 0, 3, ... on the
        host, 2, 5, ... on the device (1, 4, ... go full precision)."""
        if not self.places:
            return "host"
        if self.phase == "warmup":
            return "device" if step % 3 == 2 else "host"
        return self.placement.get(nbytes, "host")

    def needs_decision(self, step):
        """True when the warm-up is over (or has nothing to learn: foregone()) and the table
        must be built before `step` is routed."""
        return self.phase == "warmup" and (step >= self.warmup_steps or self.foregone())

    def foregone(self):
        """Why the warm-up cannot change the decision, or None. Under the 'fit' rule, where
        every compressible tensor is smaller than MIN_FIT_SPAN, no two transfers can span
        enough bytes for the fit to read a bandwidth, and without one compression never
        pays (a compressed tensor's fitted time is the link's latency plus its codec's);
        so the job goes full precision, fused, from its first step instead of timing
        transfers it cannot use (500 tiny tensors: one serial transfer a step)."""
        if self.phase != "warmup" or self.rule != "fit" or not self._declared:
            return None
        if self._largest >= MIN_FIT_SPAN:
            return None
        return ("every compressible tensor is under %s, too few bytes for the fit to read "
                "the link's bandwidth from, so compression cannot pay and there is no "
                "warm-up" % format_bytes(MIN_FIT_SPAN))

    def record(self, key, nbytes, compressed, t_comm, t_proc=0.0, wire_bytes=None,
               where="host"):
        """Record one warm-up transfer: comm time, and encode+decode time if compressed.

        wire_bytes: bytes the compressed transfer sent (its lanes); the fit needs it.
        where: where it was encoded and decoded, 'host' or 'device'.
        """
        if self.phase != "warmup":
            return
        s = self._samples.setdefault(key, {"nbytes": nbytes, "wire_q": None, "fp": [], "q": [],
                                           "proc": [], "proc_device": []})
        if compressed and where == "device":
            s["q"].append(t_comm)
            s["proc_device"].append(t_proc)
        elif compressed:
            s["q"].append(t_comm)
            s["proc"].append(t_proc)
            if wire_bytes is not None:
                s["wire_q"] = wire_bytes
        else:
            s["fp"].append(t_comm)

    def build(self):
        """The samples of each key reduced to its fastest transfer, averaged over the keys
        of one size into rows sorted by size.

        Interference (other transfers, training on the same cores) only ever adds time,
        so the fastest of a key's warm-up transfers is what the transfer itself costs, and
        the most reproducible of the estimates: the paper's averaging over steps, without
        the noise a busy host adds to it.

        Each row also gets the fitted times fit_t_c and fit_t_q (see fit_link).
        """
        by_size = {}
        for s in self._samples.values():
            if s["fp"] and s["q"] and (s["proc"] or s["proc_device"]):
                by_size.setdefault(s["nbytes"], []).append(
                    (min(s["fp"]), min(s["q"]), min(s["proc"] or [math.inf]),
                     min(s["proc_device"] or [math.inf]), s["wire_q"]))
        rows = []
        for nbytes in sorted(by_size):
            entries = by_size[nbytes]
            t_c = sum(e[0] for e in entries) / len(entries)
            t_cq = sum(e[1] for e in entries) / len(entries)
            host = sum(e[2] for e in entries) / len(entries)
            device = sum(e[3] for e in entries) / len(entries)
            t_pq = min(host, device)
            t_q = t_cq + t_pq
            wire_q = entries[0][4]
            tensors = max(len(self._declared.get(nbytes, ())), len(entries))
            row = {"size": nbytes, "tensors": tensors, "wire_q": wire_q, "t_c": t_c,
                   "t_c_q": t_cq, "t_p_q": t_pq, "t_q": t_q,
                   "ratio": t_c / t_q if t_q > 0 else math.inf}
            if self.places:  # t_p^q measured twice: the row takes the faster place
                row.update(t_p_q_host=host, t_p_q_device=device,
                           where="device" if device < host else "host")
            rows.append(row)
        self.link = fit_rows(rows, self.fused_fp)
        self.rows = rows
        return rows

    @staticmethod
    def choose(rows, rule="fit", margin=0.0):
        """BestCT: the cut that minimises the table's total time.

        Tensors below the cut cost t_c, those at or above it cost (1 + margin) times
        t_c^q + t_p^q (each row weighted by its tensor count); rule 'fit' takes both
        from the fitted link, 'measured' as measured. With benefit ratios rising with
        size this is the paper's "smallest size whose ratio > 1 + margin"; unlike that
        rule, one noisy small tensor with a high ratio cannot drag the cut down. The
        sums are exact, so explain() can state the decision's reasons without rounding;
        ties go to the larger cut (fewer tensors compressed).
        """
        check_rule(rule)
        saved, best, most = 0, NEVER, 0
        for r in reversed(rows):
            saved += _saving(r, rule, margin)
            if saved > most:
                best, most = r["size"], saved
        return best

    def decide(self):
        """Build the table and read this worker's BestCT from it with the configured rule."""
        return self.choose(self.build(), self.rule, self.margin)

    def placement_votes(self, sizes):
        """Per size in `sizes` (every worker's same list): 1.0 where this worker's table
        encodes it on the device, else 0.0 (rank 0's votes are adopted)."""
        where = {r["size"]: r.get("where") for r in self.rows}
        return [1.0 if where.get(size) == "device" else 0.0 for size in sizes]

    def adopt(self, best_ct, placement=None):
        """Enter the trained phase with the BestCT (and, with placement, the sizes encoded
        on the device) every worker agreed on."""
        self.best_ct = best_ct
        if placement is not None:
            self.placement = dict(placement)
            for r in self.rows:  # the table shows the adopted place
                if "where" in r:
                    r["where"] = self.placement.get(r["size"], "host")
        foregone = None if self.rows else self.foregone()
        self.phase = "trained"
        self.reason = foregone or self.explain()
        log.info("CTTab: BestCT = %s: %s\n%s", format_bytes(best_ct), self.reason,
                 self.format_table())

    def fuse_limit(self):
        """Bytes below which a compressed tensor's fixed costs (the link's latency and the
        codec's per-call time) exceed what its bytes cost, from the table's fits: such
        tensors pay less fused (Cupcake). 0 without a table."""
        rows = [r for r in self.rows if r.get("wire_q")]
        if len(rows) < 2 or self.link is None:
            return 0
        sizes = [float(r["size"]) for r in rows]
        procs = [float(r["t_p_q"]) for r in rows]
        mean_s, mean_p = sum(sizes) / len(sizes), sum(procs) / len(procs)
        var = sum((s - mean_s) ** 2 for s in sizes)
        per_byte = max(0.0, sum((s - mean_s) * (p - mean_p) for s, p in zip(sizes, procs))
                       / var) if var else 0.0
        fixed = self.link["latency_s"] + max(0.0, mean_p - per_byte * mean_s)
        ratio = sorted(r["wire_q"] / r["size"] for r in rows)[len(rows) // 2]
        bandwidth = self.link["bandwidth_Bps"]
        variable = per_byte + (0.0 if bandwidth == NEVER else ratio / bandwidth)
        return int(fixed / variable) if variable > 0 else 0

    def explain(self):
        """Why BestCT is what it is, in one sentence, from the table and the rule.

        Every number it states agrees with the decision: a benefit on the wrong side of
        the bar at two decimals is printed with more, or said to be just below or above.
        """
        if not self.rows:
            return "no tensor was measured with both routes, so none is compressed"
        own = self.choose(self.rows, self.rule, self.margin)
        if own != self.best_ct:
            return ("rank 0's choice, which every worker adopts; this worker's own table gives "
                    "%s" % format_bytes(own))
        rows = sorted(self.rows, key=lambda r: r["size"])
        say = _Benefits(rows, self.rule, self.margin)
        bar = say.bar_text
        cost = "a compressed size counting %s times its t^q (cttab_margin %s)" % (
            bar, plain_number(self.margin))
        how = "%s benefit t_c / t^q" % ("fitted" if self.rule == "fit" else "measured")
        if self.best_ct == NEVER:
            top = rows[-1]
            text = ("no cut lowers the table's total time, %s: compression does not pay on "
                    "this link; the %s of the largest size, %s, is %s, not above %s"
                    % (cost, how, format_bytes(top["size"]), say.of(top), bar))
            return text + say.smaller_paying(rows, "compressing from there")
        at = [r for r in rows if r["size"] >= self.best_ct]
        below = [r for r in rows if r["size"] < self.best_ct]
        if not at:  # a cut no measured size reaches (a fixed or replayed one)
            return "%s is above every measured size, so none is compressed" % (
                format_bytes(self.best_ct),)
        text = ("%s and every larger size compressed give the table's least total time, %s: "
                "the %s is %s at %s, above %s" % (format_bytes(self.best_ct), cost, how,
                                                  say.of(at[0]), format_bytes(self.best_ct),
                                                  bar))
        if below:
            text += "; the next smaller size, %s, has %s, not above %s" % (
                format_bytes(below[-1]["size"]), say.of(below[-1]), bar)
        losing = [r for r in at if not say.pays(r)]
        if losing:
            text += ("; compressed though not above %s, as the sizes around them save more: %s"
                     % (bar, say.listed(losing)))
        return text + say.smaller_paying(below[:-1], "compressing them")

    def state_dict(self):
        return {"mode": self.mode, "warmup_steps": self.warmup_steps, "rule": self.rule,
                "margin": self.margin, "phase": self.phase, "best_ct": self.best_ct,
                "rows": self.rows, "link": self.link, "reason": self.reason,
                "fused_fp": self.fused_fp,
                "placement": sorted(s for s, w in self.placement.items() if w == "device")}

    def load_state_dict(self, state):
        self.placement = {int(s): "device" for s in state.get("placement", [])}
        self.phase = state["phase"]
        self.best_ct = state["best_ct"]
        self.rows = list(state["rows"])
        self.link = state.get("link")
        self.reason = state.get("reason")
        self.fused_fp = state.get("fused_fp", self.fused_fp)

    def format_table(self):
        """The table as the paper prints it (Fig. 6), one row per tensor size."""
        head = "%12s %7s %10s %10s %10s %10s %7s %10s %10s" % (
            "size", "tensors", "t_c(ms)", "t_c^q(ms)", "t_p^q(ms)", "t^q(ms)", "ratio",
            "fit t_c", "fit t^q")
        lines = [head]
        for r in self.rows:
            mark = " <- BestCT" if r["size"] == self.best_ct else ""
            if "where" in r:
                mark = " (%s: host %.3f, device %.3f ms)%s" % (
                    r["where"], r["t_p_q_host"] * 1e3, r["t_p_q_device"] * 1e3, mark)
            lines.append("%12s %7d %10.3f %10.3f %10.3f %10.3f %7.2f %10.3f %10.3f%s" % (
                format_bytes(r["size"]), r["tensors"], r["t_c"] * 1e3, r["t_c_q"] * 1e3,
                r["t_p_q"] * 1e3, r["t_q"] * 1e3, r["ratio"], r["fit_t_c"] * 1e3,
                r["fit_t_q"] * 1e3, mark))
        if self.link is not None:
            lines.append("rule %s, margin %.2f; fitted link: latency %.3f ms, %s%s"
                         % (self.rule, self.margin, self.link["latency_s"] * 1e3,
                            format_bandwidth(self.link["bandwidth_Bps"]),
                            "; full precision fused: fit t_c without the latency"
                            if self.fused_fp else ""))
        return "\n".join(lines)

    def to_csv(self):
        out = io.StringIO()
        fields = ["size", "tensors", "wire_q", "t_c", "t_c_q", "t_p_q", "t_q", "ratio", "fit_t_c",
                  "fit_t_q"]
        if self.places:
            fields += ["t_p_q_host", "t_p_q_device", "where"]
        writer = csv.DictWriter(out, fieldnames=fields)
        writer.writeheader()
        for r in self.rows:
            writer.writerow(r)
        return out.getvalue()

    def to_json(self):
        best = None if self.best_ct == NEVER else self.best_ct
        return json.dumps({"format": DECISION_FORMAT, "best_ct": best, "never": best is None,
                           "rule": self.rule, "margin": self.margin,
                           "link": self.link_report(), "reason": self.reason,
                           "rows": self.rows}, indent=1)

    def link_report(self):
        """The fitted link for JSON: bandwidth None when no bandwidth cost was seen."""
        if self.link is None:
            return None
        bw = self.link["bandwidth_Bps"]
        return {"latency_s": self.link["latency_s"], "bandwidth_Bps": None if bw == NEVER else bw}

    def save(self, prefix):
        """Write PREFIX.csv and PREFIX.json."""
        with open(prefix + ".csv", "w") as f:
            f.write(self.to_csv())
        with open(prefix + ".json", "w") as f:
            f.write(self.to_json())


RULES = ("fit", "measured")


def check_rule(rule):
    """Reject a BestCT rule that is not one of RULES."""
    if rule not in RULES:
        raise ValueError("unknown CTTab rule %r (option cttab_rule); valid: %s"
                         % (rule, ", ".join(RULES)))


#: Bytes the fitted points must span for their slope to be read as the link's bandwidth:
#: over a smaller span, a tenth of a millisecond of timing noise passes for a slow link
#: (16 B and its 4 B of lanes, 1 ms apart by chance, would "fit" 12 KiB/s).
MIN_FIT_SPAN = 64 * 1024


def fit_link(rows):
    """Least-squares fit of t = latency + bytes / bandwidth to both routes' row medians.

    Points: (size, t_c) and (wire_q, t_c^q) per row. Both routes share one link,
    so only the slope decides; a slope <= 0 (no sign that bytes cost time), or points
    spanning fewer than MIN_FIT_SPAN bytes (no sign that can be told from noise), give
    infinite bandwidth, and then compression never pays.
    """
    points = [(r["size"], r["t_c"]) for r in rows]
    points += [(r["wire_q"], r["t_c_q"]) for r in rows if r["wire_q"] is not None]
    if len({x for x, _ in points}) < 2:
        return {"latency_s": 0.0, "bandwidth_Bps": NEVER}
    mean_x = sum(x for x, _ in points) / len(points)
    mean_t = sum(t for _, t in points) / len(points)
    if max(x for x, _ in points) - min(x for x, _ in points) < MIN_FIT_SPAN:
        return {"latency_s": max(0.0, mean_t), "bandwidth_Bps": NEVER}
    var = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (t - mean_t) for x, t in points) / var
    if slope <= 0:
        return {"latency_s": max(0.0, mean_t), "bandwidth_Bps": NEVER}
    return {"latency_s": max(0.0, mean_t - slope * mean_x), "bandwidth_Bps": 1.0 / slope}


def fit_rows(rows, fused_fp=False):
    """Fit the link to `rows` and give each row its fitted times fit_t_c and fit_t_q
    (fused_fp: full precision travels fused, its fit_t_c is its bytes' time alone)."""
    link = fit_link(rows)
    for r in rows:
        r.update(_fitted(r, link, fused_fp))
    return link


def _fitted(row, link, fused_fp=False):
    """fit_t_c and fit_t_q of one row on the fitted link (the codec time t_p^q as measured);
    fused_fp: the full-precision route pays no latency of its own (a fused bucket's one
    latency is shared by its members: 500 tiny tensors pay it once, not 500 times)."""
    per_byte = 0.0 if link["bandwidth_Bps"] == NEVER else 1.0 / link["bandwidth_Bps"]
    wire_q = row["wire_q"] if row["wire_q"] is not None else row["size"]
    latency_c = 0.0 if fused_fp else link["latency_s"]
    return {"fit_t_c": latency_c + per_byte * row["size"],
            "fit_t_q": link["latency_s"] + per_byte * wire_q + row["t_p_q"]}


def _columns(rule):
    """The (full precision, compressed) time columns a rule compares."""
    return ("fit_t_c", "fit_t_q") if rule == "fit" else ("t_c", "t_q")


def _exact(x):
    """A float as an exact fraction, so sums and comparisons of times do not round."""
    return fractions.Fraction(x) if math.isfinite(x) else x


def _saving(row, rule, margin):
    """Time a row saves compressed, its compressed time counted 1 + margin times (exact)."""
    fp, q = _columns(rule)
    need = 1 + _exact(margin)
    return row["tensors"] * (_exact(row[fp]) - need * _exact(row[q]))


def plain_number(x):
    """A number with as few digits as it needs: 1.5 -> '1.50', 1.333 -> '1.333'."""
    for digits in range(2, 7):
        if float("%.*f" % (digits, x)) == x:
            return "%.*f" % (digits, x)
    return "%.6f" % x


class _Benefits:
    """The benefit ratios of a table's rows and their bar 1 + margin, written with the same
    digits, as many as keep each ratio on its side of the bar (up to 6)."""

    def __init__(self, rows, rule, margin):
        self.rule, self.margin = rule, margin
        self.bar = 1 + margin
        fp, q = _columns(rule)
        self.ratio = {id(r): r[fp] / r[q] if r[q] > 0 else math.inf for r in rows}
        self.digits = len(plain_number(self.bar).split(".")[1])
        while self.digits < 6 and not all(self._reads_right(r, self.digits) for r in rows):
            self.digits += 1
        self.bar_text = "%.*f" % (self.digits, self.bar)

    def pays(self, row):
        """Whether the row's benefit is above the bar (as choose() weighs it)."""
        return _saving(row, self.rule, self.margin) > 0

    def _reads_right(self, row, digits):
        side = _saving(row, self.rule, self.margin)
        shown = float("%.*f" % (digits, self.ratio[id(row)]))
        bar = float("%.*f" % (digits, self.bar))
        return (shown > bar) == (side > 0) and (shown < bar) == (side < 0)

    def of(self, row):
        """The row's benefit, or 'just below/above BAR' where no 6 digits tell it apart."""
        if self._reads_right(row, self.digits):
            return "%.*f" % (self.digits, self.ratio[id(row)])
        side = _saving(row, self.rule, self.margin)
        where = "just above" if side > 0 else "just below" if side < 0 else "exactly"
        return "%s %s" % (where, self.bar_text)

    def listed(self, rows):
        """'4.0 KiB (2.10), 8.0 KiB (1.90)': the first three of `rows`, then how many more."""
        text = ", ".join("%s (%s)" % (format_bytes(r["size"]), self.of(r)) for r in rows[:3])
        return text + (" and %d more" % (len(rows) - 3) if len(rows) > 3 else "")

    def smaller_paying(self, rows, doing):
        """'; left in full precision though above BAR, ...' for those of `rows` that pay."""
        paying = [r for r in rows if self.pays(r)]
        if not paying:
            return ""
        return ("; left in full precision though above %s, as %s would also compress the "
                "larger sizes between, which lose more: %s"
                % (self.bar_text, doing, self.listed(paying)))


DECISION_FORMAT = "slimgc-cttab-1"


def load_decision(path):
    """A CTTab decision saved by CTTab.save (PREFIX.json): best_ct, rows, link, reason.

    A ValueError names the file and what is wrong with it.
    """
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as exc:
        raise ValueError("comm_threshold=%r: expected 'auto', 'off', a size in bytes or the "
                         "file of a saved CTTab decision, but cannot read the saved CTTab "
                         "decision (%s)" % (path, exc.strerror)) from None
    except ValueError:
        raise ValueError("comm_threshold=%r: not a JSON file; give a PREFIX.json written by "
                         "CTTab.save (train.py --json writes one beside its result)"
                         % (path,)) from None
    best = data.get("best_ct") if isinstance(data, dict) else None
    never = isinstance(data, dict) and (data.get("never") or "best_ct" in data and best is None)
    if not (never or isinstance(best, int) and best >= 0):
        raise ValueError("comm_threshold=%r: no best_ct in it; give a PREFIX.json written by "
                         "CTTab.save" % (path,))
    link = data.get("link")
    if link and link.get("bandwidth_Bps") is None:
        link = dict(link, bandwidth_Bps=NEVER)
    return {"best_ct": NEVER if never else best, "rows": list(data.get("rows") or []),
            "link": link, "reason": data.get("reason")}


def format_bytes(n):
    """Bytes in binary units: '512 B', '2.0 KiB', '3.0 MiB'; 'never' for NEVER."""
    if n is None:
        return "-"
    if n == NEVER:
        return "never"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return "%.1f %s" % (n / size, unit)
    return "%d B" % n


def format_bandwidth(bytes_per_s):
    """'bandwidth 112.3 MiB/s', or what it means when no cost per byte was measured."""
    if bytes_per_s == NEVER or bytes_per_s is None:
        return "no cost per byte measured (bytes did not slow transfers)"
    return "bandwidth %s/s" % format_bytes(bytes_per_s)
