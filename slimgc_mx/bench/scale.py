"""A cost model of one training step at N workers, from the project's own measurements.

A step is the model's compute, the codecs' CPU time (per-element rates from `bench codecs`),
the wire (bytes from the codecs' own wire_rounds at N, on a parameter server with its fan-in,
or on torch.distributed's ring), SlimGC's per-key host work, and the overlap that model
backup gives. docs/scale.md states every formula; each is in one function here:

    wire bytes of a tensor ...... tensor_cost        codec CPU time ..... CodecRates.seconds
    PS transfer (flow shop) ..... ps_seconds         ring collectives ... ring_seconds
    CTTab's choice .............. cttab_choice       step time .......... step_seconds

`python -m slimgc_mx.bench scale` tabulates N = 8..256 for VGG-16, ResNet-50 and BERT-base;
`--validate summary.json` sets the model against a cluster-harness run; `--paper` against
the paper's 16-GPU numbers.
"""
import argparse
import json
import math
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from typing import Dict, List, Optional, Sequence, Tuple

from .. import codecs
from ..engine.config import PIECE_BYTES, SlimGCConfig
from ..launch.netns import DELAY_PATTERN, rate_bits
from ..engine.cttab import NEVER, CTTab
from . import shapes

DESCRIPTION = "cost model of a training step at 8-256 workers: tabulate, validate, plot"

# ---------------------------------------------------------------- defaults and provenance

#: Per-element rates (elements/s, both threads) of `python -m slimgc_mx.bench codecs
#: --json codecs.json` as docs/benchmarks.md reports them: a shared 2-vCPU AMD EPYC VM,
#: 16 Mi float32 elements, N = 2 workers, codec options at their defaults (randomk's ratio
#: 0.5 and qsgd's 16 levels: the rates at their former defaults, ratio 0.01 and 4 levels,
#: times the ratio of two side-by-side runs).
DEFAULT_RATES = {
    "1bit": (647e6, 3023e6), "2bit": (1122e6, 3261e6), "4bit": (445e6, 1065e6),
    "dgc": (769e6, 5616e6), "gcomp": (139e6, 117e6), "none": (917e6, 2219e6),
    "powersgd": (228e6, 1791e6), "qsgd": (197e6, 1539e6), "randomk": (399e6, 515e6),
    "terngrad": (473e6, 3147e6), "thc": (654e6, 1581e6), "topk": (1229e6, 4294e6),
}
DEFAULT_MEMCPY = 2292e6
DEFAULT_RATES_SOURCE = ("docs/benchmarks.md: bench codecs on a 2-vCPU AMD EPYC VM, "
                        "16 Mi elements, N = 2, 2 threads")
#: SlimGC's host work per key sent on its own, per step (docs/benchmarks.md, "Per-key
#: cost": 0.3-0.5 ms of CPU); a key in a fused full-precision bucket costs 3.1x less.
PER_KEY_S = 0.4e-3
FUSED_KEY_SHARE = 1 / 3.1
#: The same without offload (CODEC-alone): the codec and the push run on the training
#: thread, one key after another. Fitted once on the harness's ResNet-20 (65 tensors),
#: 2 workers, 1 Gbit/s: the alone rows' CPU-seconds per step above no-comm's, less the
#: codec, per key (docs/scale.md, "Validation"); held fixed for every other run.
PER_KEY_INLINE_S = 1.0e-3
#: A TCP round trip through ps-lite on a data-centre LAN: assumed, not measured here.
DEFAULT_LATENCY_S = 100e-6
#: Training FLOPs per second of one accelerator (about a V100 in fp32; its peak is 15.7
#: TFLOP/s): an assumption, used when no compute time is given. A training step is taken
#: as 3 forward passes' FLOPs (backward about twice forward).
DEFAULT_DEVICE_FLOPS = 10e12
DEFAULT_BATCH = 32
WORKERS = (8, 16, 32, 64, 128, 256)
LINKS = ("10gbit", "100gbit")
MODELS = ("vgg16", "resnet50", "bert-base")
CODECS = ("1bit", "2bit", "4bit", "terngrad", "thc", "qsgd", "topk", "dgc", "randomk",
          "powersgd")
MARGIN = SlimGCConfig.cttab_margin
MAX_SCAN_N = 1024


# ---------------------------------------------------------------- inputs

@dataclass(frozen=True)
class Link:
    """Each node's link: per-transfer latency (push to pull answered) and rate, each way at
    once ('full' duplex) or one way at a time ('half': pushes and pulls take turns)."""

    latency_s: float
    bandwidth_Bps: float
    label: str = ""
    duplex: str = "full"


@dataclass(frozen=True)
class CodecRates:
    """Per-element encode and decode rates of each codec, measured at `workers` workers."""

    encode: Dict[str, float]
    decode: Dict[str, float]
    memcpy_elems_per_s: float
    workers: int
    source: str
    #: The same rates with one kernel thread, where the file has them (bench codecs
    #: measures both); a job run with one thread per process is charged these.
    encode_1thread: Optional[Dict[str, float]] = None
    decode_1thread: Optional[Dict[str, float]] = None

    def for_threads(self, threads: Optional[int]) -> "CodecRates":
        """The rates a process with `threads` kernel threads gets: the one-thread rates
        for 1 where measured, else these."""
        if threads != 1 or not self.encode_1thread or not self.decode_1thread:
            return self
        return CodecRates(self.encode_1thread, self.decode_1thread, self.memcpy_elems_per_s,
                          self.workers, self.source + ", 1 thread")

    def seconds(self, codec: str, elements: int, pulled: float, pulled_at_rates: float):
        """Encode + decode of one tensor. The decode reads what was pulled, so bytes pulled
        beyond those at the measured N cost memcpy's rate (4 bytes per element)."""
        extra = max(0.0, pulled - pulled_at_rates) / (4 * self.memcpy_elems_per_s)
        return elements / self.encode[codec] + elements / self.decode[codec] + extra


DEFAULT_CODEC_RATES = CodecRates({k: v[0] for k, v in DEFAULT_RATES.items()},
                                 {k: v[1] for k, v in DEFAULT_RATES.items()},
                                 DEFAULT_MEMCPY, 2, DEFAULT_RATES_SOURCE)


@dataclass(frozen=True)
class Setup:
    """The cluster and the run: N workers, S servers (None: S = N), 'ps' or 'ring', the
    link, compute per step, where compute runs ('accelerator': the host's codec work
    overlaps it; 'cpu': it shares the cores), and SlimGC's fixed costs. On 'cpu',
    `cores_per_worker` (None: not a limit) bounds the step from below by the worker's
    CPU-seconds, `compute_cpu_s` of compute plus the codec and the per-key work."""

    workers: int
    link: Link
    compute_s: float
    batch: int = DEFAULT_BATCH
    servers: Optional[int] = None
    backend: str = "ps"
    device: str = "accelerator"
    per_key_s: float = PER_KEY_S
    piece_bytes: int = PIECE_BYTES
    margin: float = MARGIN
    per_key_inline_s: float = PER_KEY_INLINE_S
    cores_per_worker: Optional[float] = None
    compute_cpu_s: Optional[float] = None

    @property
    def fan_in(self) -> float:
        """Server bytes over worker bytes: S servers each take N pushes of 1/S of a key."""
        return max(1.0, self.workers / (self.servers or self.workers))


@dataclass(frozen=True)
class Scheme:
    """What a step sends: kind 'fp32', 'mxnet-2bit', 'horovod-fp32', 'horovod-fp16' (MXNet's
    and Horovod's own), or a codec 'alone' (every tensor compressed, no backup), with the
    CTTab ('offload'), or with CTTab and backup ('full', SlimGC)."""

    label: str
    kind: str
    codec: Optional[str] = None
    options: Tuple[Tuple[str, str], ...] = ()

    @property
    def slimgc(self) -> bool:
        return self.kind in ("alone", "offload", "full")

    @property
    def cttab(self) -> bool:
        return self.kind in ("offload", "full")

    @property
    def backup(self) -> bool:
        return self.kind == "full"


BASELINES = ("fp32", "mxnet-2bit", "horovod-fp32", "horovod-fp16")
MODES = ("alone", "offload", "full")
NOT_MODELLED = {"classic": "runs the NDArray-op codecs, whose rates bench codecs does not "
                           "measure", "cgopt": "runs the NDArray-op codecs, whose rates bench "
                                               "codecs does not measure",
                "no-comm": "is the compute the model takes, not a prediction"}


def parse_scheme(text: str) -> Scheme:
    """'fp32', 'mxnet-2bit', 'horovod-fp32|fp16', or CODEC[opt=v;...]-{alone,offload,full}
    (the harness's 'slimgc-' prefix allowed). ValueError says what is valid."""
    if text in BASELINES:
        return Scheme(text, text)
    m = re.fullmatch(r"(?:slimgc-)?([a-z0-9]+)(?:\[([^\]]*)\])?-([a-z-]+)", text)
    if m and m.group(3) in ("classic", "cgopt"):
        raise ValueError("%s: not modelled: %s" % (text, NOT_MODELLED[m.group(3)]))
    if text == "no-comm":
        raise ValueError("no-comm: not modelled: %s" % NOT_MODELLED["no-comm"])
    valid = ("valid: %s, or CODEC-MODE with MODE one of %s and CODEC one of %s (options in "
             "brackets: topk[ratio=0.1]-alone)" % (", ".join(BASELINES), ", ".join(MODES),
                                                   ", ".join(codecs.available())))
    if not m or m.group(3) not in MODES:
        raise ValueError("unknown scheme %r; %s" % (text, valid))
    name, opts, mode = m.groups()
    if name not in codecs.available():
        raise ValueError("unknown codec %r in scheme %r; %s" % (name, text, valid))
    options = []
    for item in filter(None, (opts or "").split(";")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError("scheme %r: option %r must be NAME=VALUE" % (text, item))
        options.append((key.strip(), value.strip()))
    _codec(name, tuple(options))  # the codec's own check of its options
    return Scheme(text[len("slimgc-"):] if text.startswith("slimgc-") else text, mode, name,
                  tuple(options))


def parse_link(text: str, latency_s: float = DEFAULT_LATENCY_S) -> Link:
    """'10gbit' or '10gbit@50us': a rate in bits/s (k, m, g, t) and an optional latency."""
    rate, _, lat = text.strip().lower().partition("@")
    if not re.fullmatch(r"\d+(\.\d+)?[kmgt]?bit", rate):
        raise ValueError("link %r: expected RATE[@LATENCY] with RATE in bits per second such "
                         "as 10gbit or 100mbit (tc's 'bps' means bytes: write 'bit') and "
                         "LATENCY such as 50us or 0.2ms" % text)
    if lat:
        if not DELAY_PATTERN.match(lat):
            raise ValueError("link %r: latency %r: expected a time such as 50us, 0.2ms"
                             % (text, lat))
        latency_s = _seconds(lat)
    bps = rate_bits(rate)
    if bps <= 0:
        raise ValueError("link %r: the rate must be above 0" % text)
    return Link(latency_s, bps / 8, "%s@%s" % (rate, _fmt_time(latency_s)))


def _seconds(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(us|ms|s)", text.strip().lower())
    return float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(2)]


def _fmt_time(s: float) -> str:
    return "%gus" % round(s * 1e6, 3) if s < 1e-3 else "%gms" % round(s * 1e3, 3)


def link_from_cttab(path: str, label: str = None) -> Link:
    """The link a CTTab fitted: a decision file (CTTab.save) or a harness summary.json
    (its first record's cttab_link). Its bandwidth is effective: what a byte of a transfer's
    larger direction cost end to end on that cluster."""
    data = _read_json(path, "a CTTab decision (PREFIX.json) or a harness summary.json")
    link = data.get("link") if isinstance(data, dict) else None
    if link is None and isinstance(data, dict):
        link = next((r.get("cttab_link") for r in data.get("results") or []
                     if r.get("cttab_link")), None)
    if not link or not link.get("bandwidth_Bps") or link["bandwidth_Bps"] == NEVER:
        raise ValueError("%s: no fitted link with a bandwidth in it (a CTTab fit that saw no "
                         "cost per byte gives none); give --link RATE instead" % path)
    return Link(float(link["latency_s"]), float(link["bandwidth_Bps"]),
                label or "fitted (%s)" % os.path.basename(path))


def load_rates(path: str) -> CodecRates:
    """Rates from `python -m slimgc_mx.bench codecs --json FILE`."""
    data = _read_json(path, "the JSON of `python -m slimgc_mx.bench codecs --json FILE`")
    try:
        per = data["codecs"]
        enc = {k: float(v["encode_elems_per_s"]) for k, v in per.items()}
        dec = {k: float(v["decode_elems_per_s"]) for k, v in per.items()}
        one = [{k: float(v[f]) for k, v in per.items() if f in v}
               for f in ("encode_1thread_elems_per_s", "decode_1thread_elems_per_s")]
        memcpy = float(data["memcpy_elems_per_s"])
        workers = int(data["params"]["workers"])
    except (KeyError, TypeError, ValueError, AttributeError):
        raise ValueError("%s: not the JSON of `python -m slimgc_mx.bench codecs --json FILE` "
                         "(no codecs.<name>.encode_elems_per_s, memcpy_elems_per_s or "
                         "params.workers)" % path) from None
    complete = all(set(d) == set(enc) for d in one)
    return CodecRates(enc, dec, memcpy, workers, "%s (bench codecs, N = %d)" % (path, workers),
                      *(one if complete else (None, None)))


def _read_json(path, what):
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise ValueError("cannot read %s: %s; expected %s" % (path, e.strerror, what)) from None
    except ValueError:
        raise ValueError("%s is not JSON; expected %s" % (path, what)) from None


def default_compute_s(model: shapes.ModelShapes, batch: int,
                      flops: float = DEFAULT_DEVICE_FLOPS) -> float:
    """Compute per step: batch x 3 forward passes' FLOPs at `flops` per second."""
    return batch * 3 * model.forward_flops / flops


# ---------------------------------------------------------------- per tensor

@lru_cache(maxsize=None)
def _codec(name, options):
    return codecs.create(name, **dict(options))


@dataclass(frozen=True)
class TensorCost:
    """One tensor on one route: bytes one worker pushes and pulls per step, the rounds
    (exchanges in sequence), whether it gathers, and the codec's CPU seconds."""

    push: float
    pull: float
    rounds: Tuple[Tuple[float, float], ...]
    gather: bool = False
    codec_s: float = 0.0
    compressed: bool = False


@lru_cache(maxsize=None)
def _wire(name, options, shape, workers):
    """(rounds [(push, pull)], gather) of a codec's next push, from its wire_rounds (an
    instance per key: a codec may keep a key's shape)."""
    c = _codec(name, options).clone()
    size = math.prod(shape)
    declared = c.wire_rounds(size, shape, workers)
    rounds, gather = [], False
    for i in c.push_rounds(size, workers):
        route, send, recv, dtype = declared[i]
        rounds.append((math.prod(send) * dtype.itemsize, math.prod(recv) * dtype.itemsize))
        gather |= route == "gather"
    return tuple(rounds), gather


def compresses(scheme: Scheme, shape) -> bool:
    """True when the scheme's codec compresses a tensor of `shape` (powersgd: matrices)."""
    return scheme.codec is not None and _codec(scheme.codec, scheme.options).compresses(shape)


def tensor_cost(scheme: Scheme, shape, workers: int, compressed: bool,
                rates: CodecRates) -> TensorCost:
    """Bytes and codec time of one tensor: full precision (fp32, Horovod's fp16) or the
    codec's wire at N workers (a sum pulls what it pushed, a gather pulls N slots)."""
    elements = math.prod(shape)
    if scheme.kind == "mxnet-2bit":  # 2 bits up (16 per float32 word), float32 down
        push = 4 * math.ceil(elements / 16)
        return TensorCost(push, 4 * elements, ((push, 4 * elements),),
                          codec_s=elements / rates.encode["2bit"], compressed=True)
    if not compressed:
        b = (2 if scheme.kind == "horovod-fp16" else 4) * elements
        return TensorCost(b, b, ((b, b),))
    key = (scheme.codec, scheme.options, tuple(shape))
    rounds, gather = _wire(*key, workers)
    pull = sum(r[1] for r in rounds)
    pulled_at_rates = sum(r[1] for r in _wire(*key, rates.workers)[0])
    return TensorCost(sum(r[0] for r in rounds), pull, rounds, gather,
                      rates.seconds(scheme.codec, elements, pull, pulled_at_rates), True)


# ---------------------------------------------------------------- the wire

def ps_seconds(costs: Sequence[TensorCost], setup: Setup, pieces: bool) -> float:
    """Parameter server: a two-stage flow shop, in the order the keys are sent. A key's push
    takes the uplink after the one before it; its pull starts one latency after its push
    ends (the servers have every worker's part) and after the pull before it. Each stage
    moves fan_in x bytes / bandwidth (the servers' links carry N / S workers' bytes). With
    pieces (SlimGC's sum route), a key's buffer moves as pieces of piece_bytes that overlap.
    On a half-duplex link the two stages are one: every push and pull in turn."""
    link, f = setup.link, setup.fan_in
    half = link.duplex == "half"
    up = down = 0.0
    for c in costs:
        ready = 0.0  # a later round waits for the sum of the round before it
        for push, pull in c.rounds:
            n = max(1, math.ceil(max(push, pull) / setup.piece_bytes)) \
                if pieces and not c.gather else 1
            for _ in range(n):
                up = max(up, ready, down if half else 0.0) + f * push / n / link.bandwidth_Bps
                down = max(down, up + link.latency_s) + f * pull / n / link.bandwidth_Bps
            ready = down
    return down


def ring_seconds(costs: Sequence[TensorCost], setup: Setup) -> float:
    """torch.distributed on a ring, the keys of a route fused into one collective per round:
    allreduce 2(N-1) latencies + 2(N-1)/N x bytes / bandwidth; allgather (N-1) latencies +
    (N-1) x slot bytes / bandwidth; each byte term doubled on a half-duplex link, where a
    node's send and receive take turns."""
    n, link = setup.workers, setup.link
    bandwidth = link.bandwidth_Bps / (2 if link.duplex == "half" else 1)
    total = 0.0
    for gather in (False, True):
        group = [c for c in costs if c.gather == gather]
        for r in range(max((len(c.rounds) for c in group), default=0)):
            sent = sum(c.rounds[r][0] for c in group if r < len(c.rounds))
            if gather:
                total += (n - 1) * (link.latency_s + sent / bandwidth)
            else:
                total += 2 * (n - 1) * link.latency_s + 2 * (n - 1) / n * sent / bandwidth
    return total


def wire_seconds(costs: Sequence[TensorCost], setup: Setup, scheme: Scheme) -> float:
    """The step's transfers on the setup's backend (Horovod always on the ring)."""
    if not costs:
        return 0.0
    if setup.backend == "ring" or scheme.kind.startswith("horovod"):
        return ring_seconds(costs, setup)
    return ps_seconds(costs, setup, pieces=scheme.slimgc)


# ---------------------------------------------------------------- CTTab and the step

def cttab_choice(model: shapes.ModelShapes, scheme: Scheme, setup: Setup,
                 rates: CodecRates) -> float:
    """BestCT as the CTTab would pick it: one row per tensor size with each route's time
    alone (t_c; t_c^q + t_p^q), read by cttab.CTTab.choose with the 'measured' rule and
    the margin (rows are model times, so 'measured' compares them as they are)."""
    by_size = {}
    for _, shape in model.tensors:
        if compresses(scheme, shape):
            by_size.setdefault(4 * math.prod(shape), []).append(shape)
    rows = []
    for size in sorted(by_size):
        fp, q, proc, wire_q = [], [], [], []
        for shape in by_size[size]:
            c_fp = tensor_cost(scheme, shape, setup.workers, False, rates)
            c_q = tensor_cost(scheme, shape, setup.workers, True, rates)
            fp.append(wire_seconds([c_fp], setup, scheme))
            q.append(wire_seconds([c_q], setup, scheme))
            proc.append(c_q.codec_s)
            wire_q.append(max(c_q.push, c_q.pull))
        k = len(by_size[size])
        t_c, t_cq, t_pq = sum(fp) / k, sum(q) / k, sum(proc) / k
        rows.append({"size": size, "tensors": k, "wire_q": sum(wire_q) / k, "t_c": t_c,
                     "t_c_q": t_cq, "t_p_q": t_pq, "t_q": t_cq + t_pq})
    return CTTab.choose(rows, "measured", setup.margin)


@dataclass
class Prediction:
    """One scheme's step at one setup: times in seconds, bytes per worker and step."""

    scheme: str
    model: str
    link: str
    workers: int
    backend: str
    step_s: float
    samples_per_s: float
    compute_s: float
    wire_s: float
    codec_s: float
    keys_s: float
    bytes_pushed: float
    bytes_pulled: float
    best_ct: Optional[float]
    compressed_share: float  # of the model's elements
    cpu_s: Optional[float] = None  # a worker's CPU-seconds (Setup.compute_cpu_s given)
    cpu_floor_s: float = 0.0  # the step's lower bound by CPU (Setup.cores_per_worker)

    @property
    def bytes_total(self):
        return self.bytes_pushed + self.bytes_pulled


def step_seconds(compute: float, wire: float, codec: float, keys: float, backup: bool,
                 device: str, cpu_floor: float = 0.0) -> float:
    """Without backup the parts add up. With backup the next step's compute overlaps the
    communication: max(compute, wire + codec) + keys on an accelerator; on a CPU the codec
    shares the cores with the compute, max(compute + codec, wire) + keys. `keys`, SlimGC's
    per-key host work (copies, local update), is never overlapped. No step is shorter than
    `cpu_floor`, the CPU work of a step over the cores a worker has."""
    if not backup:
        step = compute + wire + codec + keys
    elif device == "cpu":
        step = max(compute + codec, wire) + keys
    else:
        step = max(compute, wire + codec) + keys
    return max(step, cpu_floor)


def worker_cpu_s(setup: Setup, codec: float, keys: float) -> Optional[float]:
    """A worker's CPU-seconds of a step: compute, codec and per-key work; None without
    the compute's CPU time."""
    return None if setup.compute_cpu_s is None else setup.compute_cpu_s + codec + keys


def cpu_floor(setup: Setup, codec: float, keys: float) -> float:
    """On CPUs shared by several workers: the worker's CPU-seconds of a step over its
    share of the cores; 0 where the cores are not a limit."""
    cpu = worker_cpu_s(setup, codec, keys)
    if setup.device != "cpu" or not setup.cores_per_worker or cpu is None:
        return 0.0
    return cpu / setup.cores_per_worker


def predict(model: shapes.ModelShapes, scheme: Scheme, setup: Setup,
            rates: CodecRates = DEFAULT_CODEC_RATES) -> Prediction:
    """The step of `model` with `scheme` on `setup`."""
    if scheme.kind == "mxnet-2bit" and setup.backend == "ring":
        raise ValueError("mxnet-2bit runs on MXNet's parameter servers only, not on the ring")
    if scheme.codec is not None and scheme.codec not in rates.encode:
        raise ValueError("no rates for codec %r in %s; rerun `python -m slimgc_mx.bench "
                         "codecs --json FILE` with it in --codecs" % (scheme.codec, rates.source))
    best_ct = None
    if scheme.cttab:
        best_ct = cttab_choice(model, scheme, setup, rates)
    elif scheme.slimgc:
        best_ct = 0
    costs, keys, done = [], 0.0, 0
    for _, shape in reversed(model.tensors):  # backward produces the last layer's first
        q = scheme.kind == "mxnet-2bit" or (
            compresses(scheme, shape) and 4 * math.prod(shape) >= best_ct)
        costs.append(tensor_cost(scheme, shape, setup.workers, q, rates))
        done += math.prod(shape) if q else 0
        if scheme.kind == "alone":  # every key encoded and sent from the training thread
            keys += setup.per_key_inline_s
        elif scheme.slimgc:  # a compressed key goes alone; a full-precision one fused
            keys += setup.per_key_s * (1.0 if q else FUSED_KEY_SHARE)
    wire = wire_seconds(costs, setup, scheme)
    codec = sum(c.codec_s for c in costs)
    floor = cpu_floor(setup, codec, keys)
    step = step_seconds(setup.compute_s, wire, codec, keys, scheme.backup, setup.device, floor)
    return Prediction(scheme.label, model.name, setup.link.label, setup.workers,
                      "ring" if scheme.kind.startswith("horovod") else setup.backend, step,
                      setup.batch / step, setup.compute_s, wire, codec, keys,
                      sum(c.push for c in costs), sum(c.pull for c in costs), best_ct,
                      done / model.elements, worker_cpu_s(setup, codec, keys), floor)


def stops_paying(model, scheme, setup, rates, limit=MAX_SCAN_N) -> Optional[int]:
    """The first N >= 2 at which `scheme` is slower than fp32 (powers of two, then one by
    one inside the bracket); 2 if it never pays, None if it still pays at `limit`."""
    fp32 = Scheme("fp32", "fp32")

    def pays(n):
        s = replace(setup, workers=n, servers=None if setup.servers is None else n)
        return predict(model, scheme, s, rates).step_s < predict(model, fp32, s, rates).step_s
    lo, n = 1, 2
    while n <= limit:
        if not pays(n):
            for m in range(lo + 1, n):
                if not pays(m):
                    return m
            return n
        lo, n = n, n * 2
    return None


# ---------------------------------------------------------------- tabulation

@dataclass
class Table:
    """Predictions of the schemes over N for one model and link."""

    model: shapes.ModelShapes
    link: Link
    setup: Setup
    rows: Dict[str, List[Prediction]] = field(default_factory=dict)
    stops: Dict[str, Optional[int]] = field(default_factory=dict)


def tabulate(model_names, links, workers, schemes, rates, batch=DEFAULT_BATCH,
             compute_s=None, backend="ps", per_key_s=PER_KEY_S,
             per_key_inline_s=PER_KEY_INLINE_S, progress=None) -> List[Table]:
    """Every scheme at every N for every model and link, with the N where each stops paying."""
    tables = []
    for name in model_names:
        model = shapes.get(name)
        compute = compute_s if compute_s is not None else default_compute_s(model, batch)
        for link in links:
            t0 = time.monotonic()
            setup = Setup(workers[0], link, compute, batch, backend=backend, per_key_s=per_key_s,
                          per_key_inline_s=per_key_inline_s)
            table = Table(model, link, setup)
            for scheme in schemes:
                if scheme.kind == "mxnet-2bit" and backend == "ring":
                    continue
                table.rows[scheme.label] = [predict(model, scheme, replace(setup, workers=n),
                                                    rates) for n in workers]
                if scheme.kind != "fp32":
                    table.stops[scheme.label] = stops_paying(model, scheme, setup, rates)
            tables.append(table)
            if progress:
                progress("%s at %s: %.1f s" % (name, link.label, time.monotonic() - t0))
    return tables


def _stop_text(n):
    return "never" if n == 2 else ">%d" % MAX_SCAN_N if n is None else str(n)


def format_tables(tables: List[Table], rates: CodecRates) -> str:
    lines = []
    for t in tables:
        ns = [p.workers for p in next(iter(t.rows.values()))]
        fp32 = t.rows.get("fp32")
        s = t.setup
        lines += ["", "%s: %.1f M elements in %d tensors; %s; %s; compute %.0f ms per step "
                  "(batch %d); codec rates: %s"
                  % (t.model.name, t.model.elements / 1e6, len(t.model.tensors),
                     _link_text(t.link), "ring (torch.distributed)" if s.backend == "ring"
                     else "parameter server, S = N servers", s.compute_s * 1e3, s.batch,
                     rates.source), "",
                  "samples/s per worker (x fp32); 'stops paying': the first N slower than fp32"]
        lines.append("%-22s" % "scheme" + "".join("%15s" % ("N=%d" % n) for n in ns)
                     + "%14s" % "stops paying")
        for label, preds in t.rows.items():
            cells = "".join("%15s" % ("%.1f" % p.samples_per_s + (
                " (%.2fx)" % (fp32[i].step_s / p.step_s) if fp32 else ""))
                for i, p in enumerate(preds))
            stop = _stop_text(t.stops[label]) if label in t.stops else "-"
            lines.append("%-22s%s%14s" % (label, cells, stop))
        lines += ["", "MB per step and worker (pushed + pulled); with the CTTab: "
                  "BestCT / share of elements compressed"]
        lines.append("%-22s" % "scheme" + "".join("%15s" % ("N=%d" % n) for n in ns))
        for label, preds in t.rows.items():
            lines.append("%-22s" % label + "".join("%15s" % _bytes_cell(p) for p in preds))
        lines.append("")
    return "\n".join(lines[1:])


def _link_text(link):
    return "link %s: %.3g Gbit/s, latency %s%s" % (
        link.label, link.bandwidth_Bps * 8 / 1e9, _fmt_time(link.latency_s),
        ", half duplex" if link.duplex == "half" else "")


def _bytes_cell(p: Prediction) -> str:
    mb = "%.0f" % (p.bytes_total / 1e6)
    if p.best_ct is None or p.best_ct == 0:
        return mb
    return "%s %s %d%%" % (mb, _short_bytes(p.best_ct), round(100 * p.compressed_share))


def _short_bytes(n) -> str:
    """'never', '512B', '144K', '2.0M': a threshold in a narrow column."""
    if n == NEVER:
        return "never"
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size:
            return ("%.1f%s" if n < 10 * size else "%.0f%s") % (n / size, unit)
    return "%dB" % n


# ---------------------------------------------------------------- validation

def validate(summary_path: str, rates: CodecRates, latency_s: Optional[float] = None,
             link: Optional[Link] = None, compute_s: Optional[float] = None,
             per_key_s: float = PER_KEY_S, per_key_inline_s: float = PER_KEY_INLINE_S,
             duplex: str = "full") -> dict:
    """Predicted against measured for every configuration of a harness summary.json that the
    model covers. The link: the run's rate limit with the latency its CTTab fitted (else
    `latency_s`, else the default) plus twice its one-way delay; compute: the run's no-comm
    step unless `compute_s` is given. The harness runs every process on one host: each
    worker gets usable CPUs / N cores, no-comm's CPU-seconds of compute, and the codec
    rates of the run's kernel threads (one-thread rates where `rates` has them)."""
    data = _read_json(summary_path, "a summary.json of `python -m slimgc_mx.bench cluster`")
    if not isinstance(data, dict) or not isinstance(data.get("results"), list) \
            or "workers" not in data or "model" not in data:
        raise ValueError("%s: not a summary.json of `python -m slimgc_mx.bench cluster` (no "
                         "results, workers or model)" % summary_path)
    if data.get("mode", "throughput") != "throughput":
        raise ValueError("%s: an accuracy run; validate a throughput run" % summary_path)
    model = shapes.get(data["model"])
    if link is None:
        if not data.get("bandwidth"):
            raise ValueError("%s: the run had no rate limit (bandwidth: none); give --link "
                             "RATE" % summary_path)
        if latency_s is None:
            fitted = next((r["cttab_link"] for r in data["results"]
                           if isinstance(r.get("cttab_link"), dict)), None)
            latency_s = float(fitted["latency_s"]) if fitted else DEFAULT_LATENCY_S
        latency_s += 2 * (_seconds(data["delay"]) if data.get("delay") else 0.0)
        link = Link(latency_s, rate_bits(data["bandwidth"]) / 8,
                    "%s@%s" % (data["bandwidth"], _fmt_time(latency_s)), duplex)
    by = {r["config"]: r for r in data["results"] if r.get("ok")}
    if compute_s is None:
        compute_s = ((by.get("no-comm") or {}).get("step_s") or {}).get("median")
        if compute_s is None:
            raise ValueError("%s has no no-comm run to take the compute from; give "
                             "--compute-ms" % summary_path)
    workers = int(data["workers"])
    cores = (data.get("machine") or {}).get("usable_cpus")
    compute_cpu = (by.get("no-comm") or {}).get("cpu_s_per_step_per_worker")
    threads = data.get("threads")
    rates = rates.for_threads(threads)
    setup = Setup(workers, link, compute_s, int(data.get("batch_size") or 32),
                  servers=int(data.get("servers") or workers), device="cpu",
                  per_key_s=per_key_s, per_key_inline_s=per_key_inline_s,
                  cores_per_worker=cores / workers if cores else None,
                  compute_cpu_s=compute_cpu)
    rows, skipped = [], []
    for name, rec in by.items():
        try:
            scheme = parse_scheme(name.split("@")[0])
            p = predict(model, scheme, setup, rates)
        except ValueError as e:
            skipped.append(str(e))
            continue
        measured = rec.get("samples_per_s_per_worker")
        wire = (rec.get("wire_bytes_per_step_per_worker") or {}).get("total")
        rows.append({"config": name, "predicted": p.samples_per_s, "measured": measured,
                     "error": p.samples_per_s / measured - 1 if measured else None,
                     "predicted_step_s": p.step_s,
                     "measured_step_s": (rec.get("step_s") or {}).get("median"),
                     "predicted_bytes": p.bytes_total, "measured_wire_bytes": wire,
                     "predicted_best_ct": p.best_ct,
                     "measured_best_ct": rec.get("comm_threshold_bytes"),
                     "parts_s": {"compute": p.compute_s, "wire": p.wire_s, "codec": p.codec_s,
                                 "keys": p.keys_s, "cpu_floor": p.cpu_floor_s},
                     "predicted_cpu_s": p.cpu_s,
                     "measured_cpu_s": rec.get("cpu_s_per_step_per_worker")})
    return {"summary": summary_path, "model": model.name, "workers": setup.workers,
            "servers": setup.servers, "link": _link_text(link), "compute_s": compute_s,
            "compute_cpu_s": compute_cpu, "cores": cores, "rates": rates.source,
            "rows": rows, "skipped": skipped}


def format_validation(v: dict) -> str:
    cpu = ("" if v.get("cores") is None or v.get("compute_cpu_s") is None else
           ", %.1f ms CPU on %g cores per worker" % (v["compute_cpu_s"] * 1e3,
                                                      v["cores"] / v["workers"]))
    lines = ["%s: %s, %d workers + %d servers, %s, compute %.1f ms (no-comm step)%s, "
             "device cpu; rates: %s" % (v["summary"], v["model"], v["workers"], v["servers"],
                                        v["link"], v["compute_s"] * 1e3, cpu, v["rates"]),
             "%-28s %10s %10s %8s %11s %11s %10s %10s %9s %9s" % (
                 "config", "predicted", "measured", "error", "pred MB", "wire MB",
                 "pred CT", "meas CT", "pred CPU", "meas CPU")]
    for r in v["rows"]:
        lines.append("%-28s %10.1f %10s %8s %11.1f %11s %10s %10s %9s %9s" % (
            r["config"], r["predicted"], _opt(r["measured"], "%.1f"),
            _opt(r["error"] and 100 * r["error"], "%+.0f%%"), r["predicted_bytes"] / 1e6,
            _opt(r["measured_wire_bytes"] and r["measured_wire_bytes"] / 1e6, "%.1f"),
            _ct(r["predicted_best_ct"]), _ct(r["measured_best_ct"]),
            _opt(r.get("predicted_cpu_s"), "%.3f"), _opt(r.get("measured_cpu_s"), "%.3f")))
    lines.append("(samples/s per worker; wire MB: interface counters, tx + rx, headers "
                 "included; CPU: CPU-seconds per step of one worker, the model's compute, "
                 "codec and per-key work against the run's)")
    for s in v["skipped"]:
        lines.append("skipped: " + s)
    return "\n".join(lines)


def _opt(x, spec):
    return "-" if x is None else spec % x


def _ct(x):
    return "-" if x is None else "all" if x == 0 else _short_bytes(x)


# ---------------------------------------------------------------- the paper

#: The paper's Table 3: samples/s at 100 Gbps, 8 machines x 2 V100 (16 workers).
PAPER_TABLE3 = {
    "vgg16": {"terngrad-alone": 92.25, "topk[ratio=0.1]-alone": 52.17,
              "dgc[ratio=0.1]-alone": 37.33, "thc-alone": 69.3, "2bit-full": 107.78},
    "bert-base": {"terngrad-alone": 123.75, "topk[ratio=0.1]-alone": 102.20,
                  "dgc[ratio=0.1]-alone": 92.44, "thc-alone": 118.08, "2bit-full": 143.15},
}
#: The paper's Fig. 12 at 100 Gbps: SlimGC over 1bit compressed on the GPU.
PAPER_FIG12 = {"vgg16": {"1bit-full": 1.395, "2bit-full": 1.374},
               "bert-base": {"1bit-full": 1.299, "2bit-full": 1.687}}


def paper_comparison(rates, batch=DEFAULT_BATCH, per_key_s=PER_KEY_S,
                     per_key_inline_s=PER_KEY_INLINE_S) -> List[dict]:
    """The model at the paper's setup (16 workers + 16 servers, 100 Gbps) beside Table 3 and
    Fig. 12 (the paper's 1bit baseline compressed on the GPU: the model's 1bit-alone)."""
    out = []
    link = parse_link("100gbit")
    for name, table in PAPER_TABLE3.items():
        model = shapes.get(name)
        setup = Setup(16, link, default_compute_s(model, batch), batch, per_key_s=per_key_s,
                      per_key_inline_s=per_key_inline_s)
        base = predict(model, parse_scheme("1bit-alone"), setup, rates)
        for label, paper in table.items():
            p = predict(model, parse_scheme(label), setup, rates)
            out.append({"model": name, "scheme": label, "what": "samples/s", "paper": paper,
                        "model_value": p.samples_per_s})
        for label, paper in PAPER_FIG12[name].items():
            p = predict(model, parse_scheme(label), setup, rates)
            out.append({"model": name, "scheme": label + " / 1bit-alone", "what": "ratio",
                        "paper": paper, "model_value": base.step_s / p.step_s})
    return out


def format_paper(rows) -> str:
    lines = ["the paper's 16 workers (8 machines x 2 V100) at 100 Gbps against the model "
             "(16 workers + 16 servers, default compute and rates)",
             "%-10s %-34s %10s %10s %10s" % ("model", "scheme", "paper", "model",
                                             "model/paper")]
    for r in rows:
        spec = "%.2f" if r["what"] == "ratio" else "%.1f"
        lines.append("%-10s %-34s %10s %10s %10.2f" % (
            r["model"], r["scheme"] + (" (ratio)" if r["what"] == "ratio" else ""),
            spec % r["paper"], spec % r["model_value"], r["model_value"] / r["paper"]))
    return "\n".join(lines)


# ---------------------------------------------------------------- the figure

def plot(tables: List[Table], path: str):
    """Speedup over fp32 against N per scheme: one panel per model and link; a codec's
    'alone' dashed, its 'full' (SlimGC) solid, in one colour; baselines grey."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    models = list(dict.fromkeys(t.model.name for t in tables))
    links = list(dict.fromkeys(t.link.label for t in tables))
    fig, axes = plt.subplots(len(models), len(links), squeeze=False,
                             figsize=(5.2 * len(links), 3.4 * len(models)), sharex=True)
    names = list(dict.fromkeys(_codec_of(l) for t in tables for l in t.rows))
    color = {n: PALETTE[i % len(PALETTE)]
             for i, n in enumerate(x for x in names if x not in BASELINES)}
    for t in tables:
        ax = axes[models.index(t.model.name)][links.index(t.link.label)]
        fp32 = t.rows.get("fp32")
        if not fp32:
            continue
        for label, preds in t.rows.items():
            if label == "fp32":
                continue
            base = _codec_of(label)
            ax.plot([p.workers for p in preds],
                    [f.step_s / p.step_s for f, p in zip(fp32, preds)],
                    ls="-." if base in BASELINES else "--" if label.endswith("-alone")
                    else ":" if label.endswith("-offload") else "-", marker=".",
                    color=color.get(base, "#888888"), label=label, lw=1.2)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ns = [p.workers for p in fp32]
        ax.set_xticks(ns)
        ax.set_xticklabels([str(n) for n in ns])
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_title("%s, %s" % (t.model.name, t.link.label), fontsize=9)
        ax.set_ylabel("speedup over fp32")
        ax.set_xlabel("workers N")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="lower center", ncol=6)
    fig.tight_layout(rect=(0, 0.04 + 0.012 * len(labels) / 6, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


#: One colour per codec, none of them the baselines' grey.
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#bcbd22", "#17becf", "#000080", "#808000", "#800000")


def _codec_of(label):
    return label if label in BASELINES else label.rsplit("-", 1)[0]


# ---------------------------------------------------------------- command line

def parse_args(argv, prog):
    p = argparse.ArgumentParser(
        prog=prog, description=DESCRIPTION + ".",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Schemes: fp32 and mxnet-2bit (MXNet's dist_sync), horovod-fp32/-fp16 (ring), "
               "CODEC-alone (every tensor compressed, no backup), CODEC-offload (+ CTTab), "
               "CODEC-full (+ backup: SlimGC); options in brackets, topk[ratio=0.1]-alone. "
               "Default compute: batch x 3 x forward FLOPs at %g TFLOP/s. docs/scale.md has "
               "the formulas.\n\nexamples:\n"
               "  %%(prog)s --figure docs/figures/scale_speedup.png\n"
               "  %%(prog)s --models bert-base --links 100gbit@20us --workers 16,64 "
               "--schemes fp32,2bit-full,topk-alone\n"
               "  %%(prog)s --validate results/cluster/fc-2w-1gbit/summary.json\n"
               "  %%(prog)s --paper" % (DEFAULT_DEVICE_FLOPS / 1e12))
    p.add_argument("--models", default=",".join(MODELS),
                   help="comma list of %s (default: %%(default)s)" % ", ".join(shapes.names()))
    p.add_argument("--links", default=",".join(LINKS),
                   help="comma list of RATE[@LATENCY], e.g. 10gbit@50us (default: "
                        "%(default)s, latency 100us)")
    p.add_argument("--link-from", metavar="JSON",
                   help="use the link a CTTab fitted instead: a decision file (CTTab.save) or "
                        "a harness summary.json")
    p.add_argument("--workers", default=",".join(map(str, WORKERS)),
                   help="comma list of N >= 2 (default: %(default)s)")
    p.add_argument("--schemes", default=None,
                   help="comma list (default: fp32, mxnet-2bit, and CODEC-alone and CODEC-full "
                        "for %s)" % ", ".join(CODECS))
    p.add_argument("--backend", choices=("ps", "ring"), default="ps",
                   help="parameter server with S = N servers, or torch.distributed's ring "
                        "(default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH,
                   help="samples per worker and step (default: %(default)s)")
    p.add_argument("--compute-ms", type=float, default=None,
                   help="compute per step in ms (default: from the model's FLOPs)")
    p.add_argument("--rates", metavar="JSON",
                   help="codec rates from `python -m slimgc_mx.bench codecs --json JSON` "
                        "(default: the table in docs/benchmarks.md)")
    p.add_argument("--per-key-us", type=float, default=PER_KEY_S * 1e6,
                   help="SlimGC's host work per key sent alone, us (default: %(default)g)")
    p.add_argument("--per-key-inline-us", type=float, default=PER_KEY_INLINE_S * 1e6,
                   help="the same without offload (CODEC-alone), us (default: %(default)g)")
    p.add_argument("--latency", default=None,
                   help="latency of links given without one (default: 100us) and of "
                        "--validate's link (default: the latency the run's CTTab fitted)")
    p.add_argument("--half-duplex", action="store_true",
                   help="links carry one direction at a time (pushes and pulls take turns); "
                        "default: full duplex")
    p.add_argument("--validate", metavar="SUMMARY", nargs="+",
                   help="predicted against measured for harness summary.json files")
    p.add_argument("--paper", action="store_true",
                   help="the model at the paper's 16-worker setup against its Table 3, Fig. 12")
    p.add_argument("--out", metavar="DIR",
                   help="write scale.json and the figure scale_speedup.png into DIR")
    p.add_argument("--figure", metavar="PNG", help="write the figure to PNG")
    p.add_argument("--json", metavar="FILE", help="write the predictions as JSON to FILE")
    args = p.parse_args(argv)
    try:
        args.latency_s = None
        if args.latency is not None:
            if not DELAY_PATTERN.match(args.latency):
                raise ValueError("--latency %r: expected a time such as 50us, 0.2ms"
                                 % args.latency)
            args.latency_s = _seconds(args.latency)
        args.model_list = [m.strip() for m in args.models.split(",") if m.strip()]
        for m in args.model_list:
            shapes.get(m)
        if args.link_from:
            args.link_list = [link_from_cttab(args.link_from)]
        else:
            args.link_list = [parse_link(l, DEFAULT_LATENCY_S if args.latency_s is None
                                         else args.latency_s)
                              for l in args.links.split(",") if l.strip()]
        if args.half_duplex:
            args.link_list = [replace(link, duplex="half") for link in args.link_list]
        args.worker_list = _workers(args.workers)
        text = args.schemes or ",".join(["fp32", "mxnet-2bit"] + [
            "%s-%s" % (c, m) for c in CODECS for m in ("alone", "full")])
        args.scheme_list = [parse_scheme(s.strip()) for s in text.split(",") if s.strip()]
        if not any(s.kind == "fp32" for s in args.scheme_list):
            args.scheme_list.insert(0, parse_scheme("fp32"))
        args.codec_rates = load_rates(args.rates) if args.rates else DEFAULT_CODEC_RATES
        for s in args.scheme_list:
            if s.codec and s.codec not in args.codec_rates.encode:
                raise ValueError("no rates for codec %r in %s; rerun `python -m slimgc_mx."
                                 "bench codecs --json FILE` with it in --codecs"
                                 % (s.codec, args.codec_rates.source))
        if args.backend == "ring" and any(s.kind == "mxnet-2bit" for s in args.scheme_list) \
                and args.schemes:
            raise ValueError("mxnet-2bit runs on MXNet's parameter servers only; drop it or "
                             "use --backend ps")
    except ValueError as e:
        p.error(str(e))
    if args.batch_size < 1:
        p.error("--batch-size must be >= 1")
    if args.compute_ms is not None and args.compute_ms < 0:
        p.error("--compute-ms must be >= 0")
    if args.per_key_us < 0 or args.per_key_inline_us < 0:
        p.error("--per-key-us and --per-key-inline-us must be >= 0")
    return args


def _workers(text):
    try:
        ns = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError("--workers %r: expected a comma list of integers such as 8,16,32"
                         % text) from None
    if not ns or min(ns) < 2:
        raise ValueError("--workers %r: every N must be at least 2 (one worker has nothing to "
                         "exchange)" % text)
    return sorted(set(ns))


def _progress(text):
    print("  " + text, file=sys.stderr, flush=True)


def main(argv=None, prog="python -m slimgc_mx.bench scale"):
    args = parse_args(sys.argv[1:] if argv is None else argv, prog)
    rates = args.codec_rates
    per_key = (args.per_key_us * 1e-6, args.per_key_inline_us * 1e-6)
    compute = None if args.compute_ms is None else args.compute_ms * 1e-3
    report = {"rates": asdict(rates), "per_key_s": per_key[0], "per_key_inline_s": per_key[1],
              "batch": args.batch_size}
    if args.validate:
        report["validation"] = []
        for path in args.validate:
            try:
                v = validate(path, rates, args.latency_s,
                             args.link_list[0] if args.link_from else None, compute, *per_key,
                             duplex="half" if args.half_duplex else "full")
            except ValueError as e:
                print("%s: error: %s" % (prog, e), file=sys.stderr)
                return 2
            report["validation"].append(v)
            print(format_validation(v))
    elif args.paper:
        report["paper"] = paper_comparison(rates, args.batch_size, *per_key)
        print(format_paper(report["paper"]))
    else:
        tables = tabulate(args.model_list, args.link_list, args.worker_list, args.scheme_list,
                          rates, args.batch_size, compute, args.backend, *per_key,
                          progress=_progress)
        print(format_tables(tables, rates))
        report["tables"] = [{"model": t.model.name, "link": asdict(t.link),
                             "compute_s": t.setup.compute_s, "backend": t.setup.backend,
                             "stops_paying": t.stops,
                             "rows": {k: [asdict(p) for p in v] for k, v in t.rows.items()}}
                            for t in tables]
        figures = [args.figure] if args.figure else []
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            figures.append(os.path.join(args.out, "scale_speedup.png"))
        for figure in figures:
            plot(tables, figure)
            print("wrote %s" % figure)
    paths = [args.json] if args.json else []
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        paths.append(os.path.join(args.out, "scale.json"))
    for path in paths:
        with open(path, "w") as f:
            json.dump(_finite(report), f, indent=1)
            f.write("\n")
        print("wrote %s" % path)
    return 0


def _finite(x):
    """The report with BestCT's 'never' (infinity) as the string 'never': valid JSON."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return "never" if x == NEVER else x
