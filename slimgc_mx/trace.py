"""Stage timestamps of every key and step, as a Chrome trace (chrome://tracing, Perfetto).

With the option `trace` (SLIMGC_TRACE=FILE) each worker records what each of its
threads did: the training thread's local updates, the encoder's encodes, the
transfers (each round, until the finisher sees it done) and the finisher's decodes and
global updates, each as a span named by its stage with the key and step as arguments. The file is written when the kvstore
closes; each rank writes FILE with `.rankN` before its extension, and

    python -m slimgc_mx.trace merge OUT.json trace.rank0.json trace.rank1.json

puts the ranks side by side (one process row each). docs/trace.md shows one.
"""
import json
import os
import sys
import threading
import time

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


def merge(out, paths):
    """One trace of several ranks' files, aligned on their wall-clock starts."""
    docs = []
    for p in paths:
        with open(p) as f:
            doc = json.load(f)
        if "traceEvents" not in doc:
            raise ValueError("%s is not a slimgc trace (no traceEvents)" % p)
        docs.append(doc)
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


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3 or argv[0] != "merge":
        print("usage: python -m slimgc_mx.trace merge OUT.json RANK_FILE.json...",
              file=sys.stderr)
        return 2
    n = merge(argv[1], argv[2:])
    print("%s: %d events from %d files" % (argv[1], n, len(argv) - 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
