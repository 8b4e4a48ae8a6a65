"""CTTab, the communication threshold table (SlimGC Strategy 1, Algorithms 1 and 2).

Warm-up: every key alternates compressed (even steps) and full-precision (odd
steps) transfers; each transfer's time is recorded. The table then gives per
tensor size t_c, t_c^q, t_p^q and the benefit ratio t_c / (t_c^q + t_p^q), and
BestCT is the threshold from which compression pays. Afterwards the router sends
size < BestCT in full precision and the rest compressed.
"""
import csv
import io
import json
import logging
import math
import statistics

log = logging.getLogger(__name__)

NEVER = math.inf  # BestCT when compression never pays: every tensor goes full precision


class CTTab:
    """The router and its two phases: 'warmup' (measuring) -> 'trained' (fixed BestCT).

    mode: 'auto' (measure, then decide), 'off' (compress every tensor), or a
    number of bytes (fixed threshold, no warm-up; NEVER sends everything in full precision).
    """

    def __init__(self, mode="auto", warmup_steps=20):
        self.mode = mode
        self.warmup_steps = warmup_steps
        self._samples = {}  # key -> {"nbytes": int, "fp": [t_c...], "q": [t_c^q...], "proc": [t_p^q...]}
        self.rows = []
        if mode == "auto":
            self.phase = "warmup"
            self.best_ct = None
        else:
            self.phase = "trained"
            self.best_ct = 0 if mode == "off" else mode

    def compressed(self, nbytes, step):
        """Route of one transfer: True for bit_buf (compressed), False for fp_buf."""
        if self.phase == "warmup":
            return step % 2 == 0
        return nbytes >= self.best_ct

    def needs_decision(self, step):
        """True when the warm-up is over and the table must be built before `step` is routed."""
        return self.phase == "warmup" and step >= self.warmup_steps

    def record(self, key, nbytes, compressed, t_comm, t_proc=0.0):
        """Record one warm-up transfer: comm time, and encode+decode time if compressed."""
        if self.phase != "warmup":
            return
        s = self._samples.setdefault(key, {"nbytes": nbytes, "fp": [], "q": [], "proc": []})
        if compressed:
            s["q"].append(t_comm)
            s["proc"].append(t_proc)
        else:
            s["fp"].append(t_comm)

    def build(self):
        """Average the samples (median, to damp network noise) into rows sorted by size."""
        by_size = {}
        for s in self._samples.values():
            if s["fp"] and s["q"]:
                by_size.setdefault(s["nbytes"], []).append(
                    (statistics.median(s["fp"]), statistics.median(s["q"]),
                     statistics.median(s["proc"])))
        rows = []
        for nbytes in sorted(by_size):
            entries = by_size[nbytes]
            t_c = sum(e[0] for e in entries) / len(entries)
            t_cq = sum(e[1] for e in entries) / len(entries)
            t_pq = sum(e[2] for e in entries) / len(entries)
            t_q = t_cq + t_pq
            rows.append({"size": nbytes, "tensors": len(entries), "t_c": t_c, "t_c_q": t_cq,
                         "t_p_q": t_pq, "t_q": t_q,
                         "ratio": t_c / t_q if t_q > 0 else math.inf})
        self.rows = rows
        return rows

    @staticmethod
    def choose(rows):
        """BestCT: the cut that minimises the table's total time.

        Tensors below the cut cost t_c, those at or above it cost t_c^q + t_p^q
        (each row weighted by its tensor count). With benefit ratios rising with
        size this is the paper's "smallest size whose ratio > 1"; unlike that
        rule, one noisy small tensor with ratio > 1 cannot drag the cut down.
        Ties go to the larger cut (fewer tensors compressed).
        """
        if not rows:
            return NEVER
        cuts = [r["size"] for r in rows] + [NEVER]
        best, best_cost = NEVER, None
        for cut in reversed(cuts):
            cost = sum(r["tensors"] * (r["t_c"] if r["size"] < cut else r["t_q"]) for r in rows)
            if best_cost is None or cost < best_cost * (1 - 1e-9):
                best, best_cost = cut, cost
        return best

    def adopt(self, best_ct):
        """Enter the trained phase with the BestCT every worker agreed on."""
        self.best_ct = best_ct
        self.phase = "trained"
        log.info("CTTab: BestCT = %s\n%s", format_bytes(best_ct), self.format_table())

    def state_dict(self):
        return {"mode": self.mode, "warmup_steps": self.warmup_steps, "phase": self.phase,
                "best_ct": self.best_ct, "rows": self.rows}

    def load_state_dict(self, state):
        self.phase = state["phase"]
        self.best_ct = state["best_ct"]
        self.rows = list(state["rows"])

    def format_table(self):
        """The table as the paper prints it (Fig. 6), one row per tensor size."""
        head = "%12s %7s %10s %10s %10s %10s %7s" % (
            "size", "tensors", "t_c(ms)", "t_c^q(ms)", "t_p^q(ms)", "t^q(ms)", "ratio")
        lines = [head]
        for r in self.rows:
            mark = " <- BestCT" if r["size"] == self.best_ct else ""
            lines.append("%12s %7d %10.3f %10.3f %10.3f %10.3f %7.2f%s" % (
                format_bytes(r["size"]), r["tensors"], r["t_c"] * 1e3, r["t_c_q"] * 1e3,
                r["t_p_q"] * 1e3, r["t_q"] * 1e3, r["ratio"], mark))
        return "\n".join(lines)

    def to_csv(self):
        out = io.StringIO()
        fields = ["size", "tensors", "t_c", "t_c_q", "t_p_q", "t_q", "ratio"]
        writer = csv.DictWriter(out, fieldnames=fields)
        writer.writeheader()
        for r in self.rows:
            writer.writerow(r)
        return out.getvalue()

    def to_json(self):
        best = None if self.best_ct == NEVER else self.best_ct
        return json.dumps({"best_ct": best, "rows": self.rows}, indent=1)

    def save(self, prefix):
        """Write PREFIX.csv and PREFIX.json."""
        with open(prefix + ".csv", "w") as f:
            f.write(self.to_csv())
        with open(prefix + ".json", "w") as f:
            f.write(self.to_json())


def format_bytes(n):
    if n is None:
        return "-"
    if n == NEVER:
        return "never"
    for unit, size in (("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size:
            return "%.1f %s" % (n / size, unit)
    return "%d B" % n
