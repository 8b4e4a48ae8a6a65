"""Codec throughput against memcpy and the NumPy reference, and wire bits per element.

Every rate is elements per second, the best of --repeat runs of the public API with
caller-owned outputs (as the pipeline calls it), all measured in the same run so the
ratios compare like with like. The full run takes minutes (the NumPy references of
gcomp and thc are slow): it says up front about how long, from a short trial of every
codec, and reports each codec as it goes, on stderr; --quick is a run of seconds.
"""
import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

import numpy as np

from .. import codecs
from ..env import available_cpus, default_num_threads
from . import jobtools

DESCRIPTION = "codec encode/decode throughput vs memcpy and the NumPy reference; wire bits"
WIRE_WORKERS = (1, 2, 4, 8, 16, 32, 64)
FULL = {"size": 1 << 24, "repeat": 5, "reference_repeat": 2}  # the defaults
QUICK = {"size": 1 << 20, "repeat": 3, "reference_repeat": 1}  # --quick
TRIAL_SIZE = 1 << 16  # elements of the trial run that times the estimate
#: What bench_codec times of each codec, in order: (its key prefix, how progress names it)
PHASES = (("", "all threads"), ("_1thread", "1 thread"), ("reference_", "NumPy reference"))


def parse_args(argv, prog):
    p = argparse.ArgumentParser(
        prog=prog, description=DESCRIPTION + ".",
        epilog="Rates are elements/s, best of --repeat runs (the median is in the JSON). "
               "Encode includes the NaN/Inf pre-check and a multi-round codec's next_round; "
               "decode starts from the wire of --workers identical workers summed. A codec "
               "that compresses matrices only is timed on the squarest matrix of --size. "
               "An estimate of the run's duration, then a line per codec, go to stderr. "
               "JSON keys: memcpy_elems_per_s, "
               "codecs.<name>.{encode,decode}_elems_per_s (all threads), "
               "codecs.<name>.{encode,decode}_1thread_elems_per_s, "
               "codecs.<name>.reference_{encode,decode}_elems_per_s, ratios, and "
               "wire_bits.<name>.<N> for N in %s." % (", ".join(map(str, WIRE_WORKERS))))
    p.add_argument("--size", type=int, default=None,
                   help="float32 elements per array (default: %d; %d with --quick)"
                        % (FULL["size"], QUICK["size"]))
    p.add_argument("--repeat", type=int, default=None,
                   help="timed runs per measurement, after one warm-up (default: %d; %d with "
                        "--quick)" % (FULL["repeat"], QUICK["repeat"]))
    p.add_argument("--reference-repeat", type=int, default=None,
                   help="timed runs of the (slow) NumPy reference (default: %d; %d with "
                        "--quick)" % (FULL["reference_repeat"], QUICK["reference_repeat"]))
    p.add_argument("--quick", action="store_true",
                   help="a short run: --size %d --repeat %d --reference-repeat %d unless "
                        "given (under a minute on 2 cores; the full run takes several)"
                        % (QUICK["size"], QUICK["repeat"], QUICK["reference_repeat"]))
    p.add_argument("--workers", type=int, default=2,
                   help="number of workers N, which sets the lane geometry (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None,
                   help="kernel threads for the all-threads rates (default: SLIMGC_NUM_THREADS, "
                        "else the CPUs this process may use)")
    p.add_argument("--threshold", type=float, default=0.5,
                   help="2bit threshold (default: %(default)s)")
    p.add_argument("--codecs", default=",".join(codecs.available()),
                   help="comma-separated codec names (default: %(default)s)")
    p.add_argument("--codec-option", action="append", default=[], metavar="NAME=VALUE",
                   help="an option over the codecs' defaults, for every codec of --codecs "
                        "(repeatable), e.g. --codecs randomk --codec-option ratio=0.01")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    p.add_argument("--seed", type=int, default=0, help="gradient RNG seed (default: 0)")
    args = p.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    names = [n.strip() for n in args.codecs.split(",") if n.strip()]
    unknown = sorted(set(names) - set(codecs.available()))
    if unknown:
        p.error("unknown codec(s) %s; valid: %s" % (", ".join(unknown),
                                                    ", ".join(codecs.available())))
    for name in ("size", "repeat", "reference_repeat", "workers"):
        if getattr(args, name) < 1:
            p.error("--%s must be >= 1" % name.replace("_", "-"))
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    args.codecs = names
    args.options = jobtools.codec_options(args.codec_option)
    for name in names:
        try:
            make(name, args)
        except (TypeError, ValueError) as exc:
            p.error("--codec-option: %s" % exc)
    return args


def timed(fn, repeat):
    """(best, median) seconds of `repeat` calls of fn, after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def rates(size, seconds):
    best, median = seconds
    return size / best, size / median


def bench_shape(codec, size):
    """The tensor shape a codec is timed on: flat, or for a codec that compresses matrices
    only (powersgd), the squarest rows x columns holding `size` elements."""
    if codec.compresses((size,)):
        return (size,)
    rows = max(d for d in range(1, math.isqrt(size) + 1) if size % d == 0)
    return (rows, size // rows)


def _from_identical_workers(send, recv, route, n_workers):
    """recv <- what the servers return when N workers send `send` (every digit sum of a lane
    codec stays below R)."""
    if route == "gather":
        recv.reshape((n_workers,) + send.shape)[...] = send
    else:
        np.multiply(send, n_workers, out=recv)


def optimizer_view(n, seed):
    """For a codec that wants the optimizer's view: SGD with momentum 0.9, lr 0.05, weights
    N(0, 0.05^2) and a gradient averaged over a batch of 64 (rescale 1/64)."""
    w = (0.05 * np.random.default_rng(seed + 1).standard_normal(n)).astype(np.float32)
    m = np.zeros(n, np.float32)
    return codecs.OptimizerView("sgd", lambda: (w, m, None), lr=0.05, momentum=0.9,
                                rescale_grad=1.0 / 64)


class _Wire:
    """Send and receive arrays of every round the codec's next push exchanges."""

    def __init__(self, codec, size, shape, n_workers):
        declared = codec.wire_rounds(size, shape, n_workers)
        self.rounds = [declared[i] for i in codec.push_rounds(size, n_workers)]
        self.sends = [np.empty(int(np.prod(send)), dtype) for _, send, _, dtype in self.rounds]
        self.recvs = [np.empty(int(np.prod(recv)), dtype) for _, _, recv, dtype in self.rounds]

    def encode(self, codec, grad, residual, n_workers):
        """Every round a worker computes before decoding; the last round's result in recvs."""
        codec.encode(grad, residual, n_workers, out=self.sends[0])
        for done in range(len(self.rounds)):
            _from_identical_workers(self.sends[done], self.recvs[done], self.rounds[done][0],
                                    n_workers)
            if done + 1 < len(self.rounds):
                codec.next_round(done, self.recvs[done], self.sends[done + 1], n_workers)


def make(name, args, **impl):
    """Codec `name` with --threshold (2bit) and --codec-option over its defaults."""
    return codecs.create(name, threshold=args.threshold if name == "2bit" else None,
                         **dict(args.options, **impl))


def bench_codec(name, args, grad, n_threads, on_phase=None):
    """Rates of one codec: encode/decode with all threads and with one, and the reference.

    Encode covers every round a worker computes before decoding (a codec with several
    rounds: encode, then next_round from the sums of N identical workers). One push is
    encoded and decoded first, so that state agreed through decode (scales, code tables,
    slot sizes) is as in training; each timed decode starts from that state.
    on_phase(title, seconds), if given, hears each of PHASES as it ends.
    """
    n, n_workers = grad.shape[0], args.workers
    view = optimizer_view(n, args.seed) if make(name, args).traits.wants_optimizer else None
    result = {}
    impls = {"": dict(num_threads=n_threads), "_1thread": dict(num_threads=1),
             "reference_": dict(reference=True)}
    for label, title in PHASES:
        started = time.perf_counter()
        impl = impls[label]
        c = make(name, args, **impl)
        c.set_optimizer_view(view)
        shape = bench_shape(c, n)
        residual = np.zeros(c.memory_size(n), np.float32)
        out = np.empty(n, np.float32)
        first = _Wire(c, n, shape, n_workers)
        first.encode(c, grad, residual, n_workers)
        c.decode(first.recvs[-1], n, n_workers, out=out)
        state = c.state_dict()
        residual[:] = 0
        wire = _Wire(c, n, shape, n_workers)
        repeat = args.reference_repeat if impl.get("reference") else args.repeat
        enc = rates(n, timed(lambda: wire.encode(c, grad, residual, n_workers), repeat))

        # decode from the state of the push (slot class, code table); a codec with several
        # rounds keeps its push's earlier rounds instead, which a restore would drop
        restore = c.rounds == 1

        def decode():
            if restore:
                c.load_state_dict(state)
            c.decode(wire.recvs[-1], n, n_workers, out=out)
        dec = rates(n, timed(decode, repeat))
        if label == "reference_":
            keys = ("reference_encode", "reference_decode")
        else:
            keys = ("encode" + label, "decode" + label)
        result[keys[0] + "_elems_per_s"], result[keys[0] + "_median_elems_per_s"] = enc
        result[keys[1] + "_elems_per_s"], result[keys[1] + "_median_elems_per_s"] = dec
        if on_phase is not None:
            on_phase(title, time.perf_counter() - started)
    return result


def _gradient(size, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(size) * 0.5).astype(np.float32)


def estimate(args, n_threads):
    """({codec: seconds}, trial seconds): each codec's time in this run, roughly, scaled
    from a trial of it on TRIAL_SIZE elements with one timed run of each measurement.

    Each measurement makes 2 + repeat calls of encode and of decode (a first push, a
    warm-up, the timed runs): the trial's 3, times the size ratio."""
    trial = argparse.Namespace(**dict(vars(args), size=min(args.size, TRIAL_SIZE), repeat=1,
                                      reference_repeat=1))
    grad = _gradient(trial.size, args.seed)
    started = time.perf_counter()
    out = {}
    for name in args.codecs:
        phases = {}
        bench_codec(name, trial, grad, n_threads, lambda title, t: phases.update({title: t}))
        scale = args.size / trial.size
        out[name] = sum(phases[title] * scale / 3 * (2 + (
            args.reference_repeat if label == "reference_" else args.repeat))
            for label, title in PHASES)
    return out, time.perf_counter() - started


def duration(seconds):
    """'under 1 s', 'about 40 s', 'about 7 min'."""
    if seconds < 1:
        return "under 1 s"
    return "about %.0f s" % seconds if seconds < 90 else "about %.0f min" % (seconds / 60)


class Progress:
    """What the run is doing, on stderr, flushed: the estimate first, then each codec."""

    def __init__(self, stream=None):
        self.stream = stream if stream is not None else sys.stderr

    def write(self, text):
        self.stream.write(text)
        self.stream.flush()

    def start(self, args, guess, trial_s):
        self.write("codecs: %d codec%s on %d elements, best of %d (NumPy reference: best of %d)"
                   "; %s in all (scaled from a trial on %d elements, %.1f s)%s\n"
                   % (len(args.codecs), "" if len(args.codecs) == 1 else "s", args.size,
                      args.repeat, args.reference_repeat, duration(sum(guess.values())),
                      min(args.size, TRIAL_SIZE), trial_s,
                      "" if args.quick or args.size <= QUICK["size"] else
                      "; --quick runs in seconds"))

    def codec(self, k, total, name, guess):
        self.write("[%d/%d] %s, %s:" % (k, total, name, duration(guess)))
        self._first = True

    def phase(self, title, seconds):
        self.write("%s %s %.1f s" % ("" if self._first else ",", title, seconds))
        self._first = False

    def done(self, seconds):
        self.write("; done in %.1f s\n" % seconds)


def gathers(codec, size, num_workers):
    """True when the codec's wire is every worker's slot side by side, not a sum."""
    return codec.wire_rounds(size, bench_shape(codec, size), num_workers)[0][0] == "gather"


def memcpy_rates(src, repeat):
    """(best, median) elements per second of numpy.copyto of `src`, the reference rate."""
    dst = np.empty_like(src)
    return rates(src.shape[0], timed(lambda: np.copyto(dst, src), repeat))


def run(args, progress=None):
    """The report of the run; `progress` (a Progress) hears the estimate and each codec."""
    n_threads = args.threads or default_num_threads()
    guess = None
    if progress is not None:
        guess, trial_s = estimate(args, n_threads)
        progress.start(args, guess, trial_s)
    grad = _gradient(args.size, args.seed)
    memcpy = memcpy_rates(grad, args.repeat)
    report = {
        "machine": {"cpus_available": available_cpus(), "threads": n_threads,
                    "platform": platform.platform(), "processor": platform.processor(),
                    "python": platform.python_version(), "numpy": np.__version__,
                    "load_average": list(os.getloadavg())},
        "params": {"size": args.size, "repeat": args.repeat,
                   "reference_repeat": args.reference_repeat, "workers": args.workers,
                   "threshold_2bit": args.threshold, "codec_options": args.options,
                   "seed": args.seed, "shapes": {},
                   "timing": "elements/s of the best run; *_median_* of the median run"},
        "memcpy_elems_per_s": memcpy[0],
        "memcpy_median_elems_per_s": memcpy[1],
        "codecs": {},
        "wire_bits": {},
        "wire_route": {},
    }
    for k, name in enumerate(args.codecs, 1):
        started = time.perf_counter()
        if progress is not None:
            progress.codec(k, len(args.codecs), name, guess[name])
        r = bench_codec(name, args, grad, n_threads,
                        progress.phase if progress is not None else None)
        if progress is not None:
            progress.done(time.perf_counter() - started)
        for op in ("encode", "decode"):
            r[op + "_vs_memcpy"] = r[op + "_elems_per_s"] / memcpy[0]
            r[op + "_vs_reference"] = r[op + "_elems_per_s"] / r["reference_%s_elems_per_s" % op]
            r[op + "_thread_speedup"] = r[op + "_elems_per_s"] / r[op + "_1thread_elems_per_s"]
        report["codecs"][name] = r
        c = make(name, args)
        shape = bench_shape(c, args.size)
        c.wire_rounds(args.size, shape, 1)  # a codec whose wire depends on the shape learns it
        report["params"]["shapes"][name] = list(shape)
        report["wire_bits"][name] = {str(w): c.wire_bits_per_element(w) for w in WIRE_WORKERS}
        report["wire_route"][name] = "gather" if gathers(c, args.size, 1) else "sum"
    report["machine"]["load_average_after"] = list(os.getloadavg())
    return report


def format_table(report):
    m = report["machine"]
    p = report["params"]
    lines = ["codec benchmark: %d float32 elements, N=%d workers, %d threads (%d CPUs), "
             "best of %d" % (p["size"], p["workers"], m["threads"], m["cpus_available"],
                             p["repeat"]),
             "memcpy (numpy.copyto): %.1f M elem/s" % (report["memcpy_elems_per_s"] / 1e6), "",
             "%-9s %-6s %10s %10s %10s %9s %9s %8s" % (
                 "codec", "op", "M elem/s", "1 thread", "reference", "x memcpy", "x ref",
                 "x thr")]
    for name, r in report["codecs"].items():
        for op in ("encode", "decode"):
            lines.append("%-9s %-6s %10.1f %10.1f %10.1f %9.2f %9.1f %8.2f" % (
                name, op, r[op + "_elems_per_s"] / 1e6, r[op + "_1thread_elems_per_s"] / 1e6,
                r["reference_%s_elems_per_s" % op] / 1e6, r[op + "_vs_memcpy"],
                r[op + "_vs_reference"], r[op + "_thread_speedup"]))
    for name, shape in p.get("shapes", {}).items():
        if len(shape) > 1:
            lines.append("%s: a %s matrix; encode includes every round before decode"
                         % (name, "x".join(map(str, shape))))
    lines += ["", "wire bits per element (N workers): each direction for a sum; a gather "
              "pulls what is shown and pushes 1/N of it:",
              "%-9s %-6s " % ("codec", "route")
              + " ".join("%7s" % ("N=" + w) for w in map(str, WIRE_WORKERS))]
    for name, bits in report["wire_bits"].items():
        lines.append("%-9s %-6s " % (name, report["wire_route"][name])
                     + " ".join("%7.2f" % bits[str(w)] for w in WIRE_WORKERS))
    lines.append("load average before/after: %s / %s" % (
        ", ".join("%.2f" % x for x in m["load_average"]),
        ", ".join("%.2f" % x for x in m["load_average_after"])))
    return "\n".join(lines)


def main(argv=None, prog="python -m slimgc_mx.bench codecs"):
    args = parse_args(sys.argv[1:] if argv is None else argv, prog)
    report = run(args, Progress())
    print(format_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, sort_keys=True)
            f.write("\n")
        print("wrote %s" % args.json)
    return 0
