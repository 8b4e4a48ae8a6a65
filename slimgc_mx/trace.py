"""Stage timestamps of every key and step, as a Chrome trace (chrome://tracing, Perfetto).

With the option `trace` (SLIMGC_TRACE=FILE) each worker records what each of its
threads did: the training thread's local updates, the encoder's encodes, the
transfers (each round, until the finisher sees it done) and the finisher's decodes and
global updates, each as a span named by its stage with the key and step as arguments. The file is written when the kvstore
closes; each rank writes FILE with `.rankN` before its extension, and

    python -m slimgc_mx.trace merge OUT.json trace.rank0.json trace.rank1.json

puts the ranks side by side (one process row each), and

    python -m slimgc_mx.trace cycles --first-step 12 trace.rank0.json

prints each key's median cycle (local update -> sums back -> published), over how many
of its steps, and why its other steps are left out (warm-up, fused, ...). docs/trace.md
shows one.
"""
import argparse
import json
import math
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field

#: The stages a span can name, in pipeline order (docs/trace.md says what each covers).
STAGES = ("local update", "encode", "transfer", "decode", "global update")


def rank_path(path, rank):
    """FILE.json -> FILE.rank0.json: each worker's own file."""
    stem, ext = os.path.splitext(path)
    return "%s.rank%d%s" % (stem, rank, ext or ".json")


class Trace:
    """Spans recorded from any thread; write() saves them as Chrome trace JSON."""

    def __init__(self, path, rank=0):
        self.path, self.rank = path, rank
        self._events = []
        self._tids = {}
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self._wall0 = time.time()

    def _tid(self, name=None):
        name = name or threading.current_thread().name
        with self._lock:
            tid = self._tids.get(name)
            if tid is None:
                tid = self._tids[name] = len(self._tids) + 1
        return tid

    def span(self, stage, t0, t1, key=None, step=None, thread=None, **args):
        """A span of `stage` from perf_counter() t0 to t1 on the calling thread's row, or
        on the row named `thread` (work another thread timed: MXNet's engine)."""
        if key is not None:
            args["key"] = key
        if step is not None:
            args["step"] = step
        self._events.append({"name": stage, "cat": "slimgc", "ph": "X", "pid": self.rank,
                             "tid": self._tid(thread), "ts": (t0 - self._t0) * 1e6,
                             "dur": max(0.0, t1 - t0) * 1e6, "args": args})

    def events(self):
        """The trace events, thread and process names first."""
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0,
                 "args": {"name": "worker rank %d" % self.rank}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                  "args": {"name": name}} for name, tid in sorted(self._tids.items(),
                                                                   key=lambda kv: kv[1])]
        return meta + list(self._events)

    def write(self):
        """Save to this rank's file (atomically); returns its path."""
        path = rank_path(self.path, self.rank)
        doc = {"traceEvents": self.events(), "displayTimeUnit": "ms",
               "otherData": {"rank": self.rank, "wall_clock_start": self._wall0}}
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
        return path


def read(path):
    """The JSON document of a trace file; ValueError naming the file if it is none."""
    with open(path) as f:
        try:
            doc = json.load(f)
        except ValueError as exc:
            raise ValueError("%s is not a slimgc trace (not JSON: %s)" % (path, exc)) from None
    if not isinstance(doc, dict) or "traceEvents" not in doc:
        raise ValueError("%s is not a slimgc trace (no traceEvents)" % path)
    return doc


def merge(out, paths):
    """One trace of several ranks' files, aligned on their wall-clock starts."""
    docs = [read(p) for p in paths]
    start = min(d.get("otherData", {}).get("wall_clock_start", 0.0) for d in docs)
    events = []
    for d in docs:
        shift = (d.get("otherData", {}).get("wall_clock_start", start) - start) * 1e6
        for e in d["traceEvents"]:
            if "ts" in e:
                e = dict(e, ts=e["ts"] + shift)
            events.append(e)
    with open(out, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return len(events)


@dataclass
class KeyCycle:
    """Medians over the steps of one key in one rank's trace, in ms from its local update
    (queued on the training thread): until its sums were back, and until its global
    update had published (the key's cycle); `transfer`: the transfer spans' own length.
    `steps` counts the steps measured; `left_out`, the key's other steps by reason."""

    key: str
    steps: int
    sums_back: float
    cycle: float
    transfer: float
    pieces: int  # encode spans of a streamed push (0: encoded whole)
    left_out: dict = field(default_factory=dict)  # reason (LEFT_OUT) -> steps


#: Why a step of a key is not in its cycle: each needs the key's local update, transfer
#: and global update under its own name, from --first-step on.
LEFT_OUT = {
    "early": "before --first-step",
    "fused": "fused",  # in a fused bucket (option fuse): the bucket's spans name the bucket
    "no local update": "without a local update",  # backup off, or no optimizer
    "unfinished": "unfinished",  # its transfer or global update is not in the file
}


def cycles(path, first_step=0):
    """A KeyCycle per key of a rank's trace: medians over its steps >= first_step (leave
    the warm-up out) with a local update, transfer and global update of its own (NaN
    when none has), and its other steps counted by why they are left out."""
    events = read(path)["traceEvents"]
    pushes, fused_steps = {}, set()
    for e in events:
        args = e.get("args", {})
        if e.get("ph") != "X" or "step" not in args:
            continue
        if str(args.get("key", "")).endswith("(fused)"):
            fused_steps.add(args["step"])
        else:
            pushes.setdefault((args["key"], args["step"]), {}).setdefault(e["name"], []).append(e)
    rows, left_out = {}, {}
    for (key, step), spans in pushes.items():
        out = left_out.setdefault(key, {})
        reason = _left_out(spans, step, first_step, fused_steps)
        if reason is not None:
            out[reason] = out.get(reason, 0) + 1
            continue
        start = spans["local update"][0]["ts"]
        ends = {name: max(e["ts"] + e["dur"] for e in spans[name]) for name in spans}
        first = min(e["ts"] for e in spans["transfer"])
        pieces = sum("piece" in e["args"] for e in spans.get("encode", []))
        rows.setdefault(key, []).append((ends["transfer"] - start, ends["global update"] - start,
                                         ends["transfer"] - first, pieces))
    return [KeyCycle(key, len(r), *(statistics.median(x[i] for x in r) / 1e3 if r else math.nan
                                    for i in range(3)),
                     max((x[3] for x in r), default=0), left_out[key])
            for key, r in sorted((key, rows.get(key, [])) for key in left_out)]


def _left_out(spans, step, first_step, fused_steps):
    """Why this step of a key is not measured (a LEFT_OUT key), or None."""
    if step < first_step:
        return "early"
    if "transfer" not in spans and step in fused_steps:
        return "fused"
    if "local update" not in spans:
        return "no local update"
    if not {"transfer", "global update"} <= set(spans):
        return "unfinished"
    return None


def describe_left_out(left_out):
    """'12 before --first-step, 20 fused' (or '-')."""
    return ", ".join("%d %s" % (left_out[k], text) for k, text in LEFT_OUT.items()
                     if left_out.get(k)) or "-"


#: Printed above the cycles table: what its step counts are.
CYCLES_NOTE = (
    "steps: the steps of a key measured, those from --first-step {first} on whose local "
    "update, transfer and global update all ran under the key's own name; 'left out' "
    "counts its other steps: before --first-step (the warm-up), fused (sent in a bucket "
    "with other keys, option fuse, once the CTTab has decided), without a local update "
    "(model backup off), unfinished (not complete when the trace was written)")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m slimgc_mx.trace", description=__doc__.split(
        "\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge", help="put several ranks' files side by side in one trace")
    m.add_argument("out", help="the merged trace to write")
    m.add_argument("files", nargs="+", help="the ranks' trace files")
    c = sub.add_parser("cycles", help="per key, medians in ms from its local update until "
                       "its sums are back and until its global update has published, the "
                       "steps they are over and why other steps are left out")
    c.add_argument("files", nargs="+", help="trace files (one rank each)")
    c.add_argument("--first-step", type=int, default=0,
                   help="leave out earlier steps, e.g. the warm-up (default: %(default)s)")
    try:
        args = p.parse_args(argv)
    except SystemExit as exc:
        return exc.code
    try:
        if args.command == "merge":
            n = merge(args.out, args.files)
            print("%s: %d events from %d files" % (args.out, n, len(args.files)))
            return 0
        rows = [(path, r) for path in args.files for r in cycles(path, args.first_step)]
    except (OSError, ValueError) as exc:
        print("%s: error: %s" % (p.prog, exc), file=sys.stderr)
        return 2
    print(CYCLES_NOTE.format(first=args.first_step))
    print()
    print("| file | key | steps | to sums back, ms | cycle, ms | transfer, ms | pieces | "
          "left out |")
    print("|---|---|---|---|---|---|---|---|")
    for path, r in rows:
        print("| %s | %s | %d | %s | %s | %s | %d | %s |" % (
            os.path.basename(path), r.key, r.steps, _ms(r.sums_back), _ms(r.cycle),
            _ms(r.transfer), r.pieces, describe_left_out(r.left_out)))
    return 0


def _ms(value):
    """A median in whole ms, '-' for none."""
    return "-" if math.isnan(value) else "%.0f" % value


if __name__ == "__main__":
    sys.exit(main())
