"""GPU benchmark of the PyTorch adapter: peak memory, samples/s and step composition.

Issue 32's Fig. 14 (peak GPU memory and samples/s of DDP, its hooks, GPU 2bit with error
feedback and SlimGC) and Fig. 12/13 (a step's compute, copies, encode, transfer and
overlap for all-GPU compression, all-CPU offload and the CTTab's placement, with and
without backup), and the device path. Each configuration runs in fresh processes (P ranks
sharing one device on loopback: an NCCL group for one rank on a GPU, else Gloo;
--backend), so peak memory never leaks from one into the next; a configuration that fails
or hangs is recorded and the next one runs (--reuse-ranks: on the CPU, the configs in the
same ranks, one after another). The measured compute and codec times are projected onto 10
and 100 Gbit/s links with the pieces of the cost model (scale.py).

torch is imported lazily: `python -m slimgc_mx.bench` keeps working without it.
"""
import argparse
import contextlib
import itertools
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict

from ..launch.plan import free_port
from .jobtools import write_json

DESCRIPTION = "PyTorch on a GPU: peak memory, samples/s, step composition (DDP vs SlimGC)"

#: config -> what it runs
CONFIGS = OrderedDict([
    ("no-ddp", "the model alone, torch.optim.SGD, no communication"),
    ("ddp", "DistributedDataParallel, float32 allreduce"),
    ("ddp-fp16", "DDP + fp16_compress_hook"),
    ("ddp-powersgd", "DDP + PowerSGD hook, rank 4, one bucket"),
    ("ddp-powersgd-buckets", "ddp-powersgd with DDP's default buckets (over Gloo with "
     "several buckets the hook can deadlock: --timeout then ends it)"),
    ("ddp-gpu-2bit", "DDP + a 2bit hook with error feedback on the GPU (residual per bucket)"),
    ("ddp-gpu-1bit", "DDP + a 1bit hook with error feedback on the GPU: the paper's Fig. 12 "
     "baseline, which the table's throughput is normalised against"),
    ("slimgc-device", "SlimGC 2bit, the device path (data_path='device'), backup"),
    ("slimgc-device-nobackup", "slimgc-device without model backup"),
    ("slimgc-device-nooverlap", "slimgc-device with every bucket started in step() "
     "(overlap=False), not during backward"),
    ("slimgc-device-cttab", "slimgc-device with the CTTab choosing each bucket's route "
     "(comm_threshold='auto'; its warm-up is the run's warm-up)"),
    ("slimgc-device-offload", "slimgc-device with glo_buf, the optimizer's state and the "
     "residuals offloaded to pinned host memory, staged for each bucket's pass "
     "(state_on='host')"),
    ("slimgc-device-powersgd", "SlimGC powersgd, rank 4, on the device path, backup (every "
     "matrix compressed; against ddp-powersgd, PyTorch's hook of the same rank)"),
    ("slimgc-offload", "SlimGC 2bit, every tensor compressed on the CPU (offload), backup"),
    ("slimgc-gpu", "SlimGC 2bit, every tensor compressed on the gradient's device, backup"),
    ("slimgc-placement", "SlimGC 2bit, the CTTab's placement (offload='auto'), backup"),
    ("slimgc-offload-nobackup", "slimgc-offload without model backup"),
    ("slimgc-gpu-nobackup", "slimgc-gpu without model backup"),
    ("slimgc-placement-nobackup", "slimgc-placement without model backup"),
])
MODELS = ("vgg16", "resnet50", "tiny")
#: (input side, classes) per model
INPUTS = {"vgg16": (224, 1000), "resnet50": (224, 1000), "tiny": (32, 10)}
LINKS = ("10gbit", "100gbit")
GIB = float(1 << 30)
#: Every config's SGD. At lr 0.01 random VGG-16 on one batch oscillates, and the CTTab
#: warm-up's 2bit steps took it to Inf in 3 of 8 runs on an H200 (docs/benchmarks.md).
LR, MOMENTUM = 0.001, 0.9
POWERSGD_RANK = 4
#: What a rank prints when it aborts at exit after its work (run_config keeps its result).
EXIT_ABORT = "terminate called without an active exception"


# ---------------------------------------------------------------- arguments

def _list(text, valid, what):
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in valid]
    if bad or not items:
        raise argparse.ArgumentTypeError("unknown %s %s; valid: %s" % (
            what, ", ".join(map(repr, bad)) or "(none given)", ", ".join(valid)))
    return items


def _counts(text):
    """A comma list of integers >= 1 (--procs, --project-workers)."""
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("expected counts >= 1 separated by commas, e.g. 1 or "
                                         "1,2; got %r" % text)
    return values


def _positive(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError("expected an integer >= 1, got %r" % text)
    return value


def _count(text):
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError("expected an integer >= 0, got %r" % text)
    return value


def parse_args(argv, prog):
    p = argparse.ArgumentParser(
        prog=prog, description=DESCRIPTION + ". Each config runs in fresh processes "
        "(on the CPU, --reuse-ranks: the configs in the same ones); results.json, table.md "
        "and fig14.png go to --out.",
        epilog="configs:\n" + "\n".join("  %-26s %s" % kv for kv in CONFIGS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=lambda t: _list(t, MODELS, "model"), default=["vgg16"],
                   help="vgg16, resnet50 (torchvision, random weights, 224x224) or tiny (a "
                        "small conv net on 32x32, for CPU smoke tests); a comma list runs "
                        "each (default vgg16)")
    p.add_argument("--batch", type=_positive, default=32, help="samples per rank (default 32)")
    p.add_argument("--steps", type=_positive, default=30,
                   help="timed steps after the warm-up (default 30)")
    p.add_argument("--warmup", type=_count, default=10,
                   help="untimed steps first; also the CTTab's warm-up of the placement "
                        "configs (at least 2 there; default 10)")
    p.add_argument("--configs", type=lambda t: _list(t, list(CONFIGS), "config"),
                   default=list(CONFIGS), help="comma list (default: all, listed below)")
    p.add_argument("--procs", type=_counts, default=[1],
                   help="ranks sharing the device on loopback; a comma list runs each "
                        "(default 1)")
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                   help="the job's process group: auto is NCCL for one rank on a GPU (as a "
                        "GPU job's would be; NCCL refuses two ranks on one GPU), else Gloo")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="where the model runs (default cuda; every rank on GPU 0)")
    p.add_argument("--timeout", type=_positive, default=240,
                   help="seconds one config may take before its ranks are killed (240)")
    p.add_argument("--profile", type=_count, default=0, metavar="STEPS",
                   help="after the timed steps, rank 0 runs STEPS more under torch.profiler "
                        "and writes its busiest operators (device and host time) to "
                        "profile-MODEL-CONFIG-pP.txt in --out (default 0: none)")
    p.add_argument("--project-workers", type=_counts,
                   default=[8, 16], help="worker counts of the projection (default 8,16)")
    p.add_argument("--out", default=os.path.join("results", "gpu"),
                   help="folder of results.json, table.md and fig14.png (default results/gpu)")
    p.add_argument("--reuse-ranks", action="store_true",
                   help="--device cpu only: the configs of a model and rank count run one "
                        "after another in the same P rank processes (one process group) "
                        "instead of fresh ones each, which saves each config's start; on "
                        "the CPU there is no peak memory to keep apart. A config that fails "
                        "is recorded and the ones after it run in fresh ranks")
    args = p.parse_args(argv)
    if args.reuse_ranks and args.device != "cpu":
        p.error("--reuse-ranks needs --device cpu (on a GPU each config runs in fresh "
                "processes, so that peak memory never carries over)")
    return args


# ---------------------------------------------------------------- the orchestrator

def machine_info(device):
    """GPU name, torch/CUDA versions and the host, for the record."""
    import torch
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "host": platform.node(), "cpus": os.cpu_count(),
            "device": device}
    try:
        import torchvision
        info["torchvision"] = torchvision.__version__
    except ImportError:
        info["torchvision"] = None
    if device == "cuda":
        # nvidia-smi, not torch.cuda: this process must not hold a CUDA context
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                "--format=csv,noheader"], capture_output=True, text=True,
                               timeout=30)
            info["gpu"] = q.stdout.strip().splitlines()[0] if q.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired, IndexError):
            info["gpu"] = None
    return info


def placement_support():
    """None when DistributedOptimizer takes offload='auto', else why not (one rank, CPU)."""
    import torch
    try:
        import slimgc_mx.torch as slimgc
    except ImportError as exc:
        return "slimgc_mx.torch does not import: %s" % exc
    model = torch.nn.Linear(4, 2)
    env = {k: os.environ.pop(k) for k in ("WORLD_SIZE", "RANK") if k in os.environ}
    try:
        opt = slimgc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), model,
                                          compression="2bit", offload="auto")
    except (TypeError, ValueError) as exc:
        return "DistributedOptimizer rejects offload='auto': %s" % exc
    finally:
        os.environ.update(env)
    opt.close()
    return None


def _tail(path, limit=1500):
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    return text[-limit:].strip()


def _kill(procs):
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the rank and children
            except OSError:
                pass
    for proc in procs:
        proc.wait()


def _spec(config, model, procs, args):
    return {"config": config, "model": model, "batch": args.batch, "steps": args.steps,
            "warmup": args.warmup, "device": args.device, "backend": args.backend,
            "profile": args.profile,
            "profile_path": os.path.abspath(os.path.join(
                args.out, "profile-%s-%s-p%d.txt" % (model, config, procs)))}


def _config_out(out_path, index):
    """Where a rank of --reuse-ranks writes the result of its index-th config."""
    return "%s-c%d.json" % (out_path[:-len(".json")], index)


def _start_ranks(spec, procs, folder):
    """`procs` fresh rank processes on `spec` (a config's, or --reuse-ranks' list of them):
    (the processes, their log files, their result paths)."""
    spec_path = os.path.join(folder, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    port = free_port()
    # the ranks import the same slimgc_mx as this process
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    running, logs, outs = [], [], []
    for rank in range(procs):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(procs), LOCAL_RANK=str(rank), PYTHONUNBUFFERED="1",
                   PYTHONPATH=path)
        log = os.path.join(folder, "rank%d.log" % rank)
        logs.append(log)
        outs.append(os.path.join(folder, "rank%d.json" % rank))
        with open(log, "w") as out:
            running.append(subprocess.Popen(
                [sys.executable, "-m", "slimgc_mx.bench.gpu", spec_path, outs[-1]],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True))
    return running, logs, outs


def _read_ranks(paths):
    ranks = []
    for path in paths:
        if os.path.exists(path):
            with open(path) as f:
                ranks.append(json.load(f))
    return ranks


def _settle(record, ranks, codes, logs):
    """The record of a config whose ranks wrote `ranks`; codes: the rank processes' exit
    codes (None: still running, past this config)."""
    procs = record["procs"]
    skipped = [r["skipped"] for r in ranks if r.get("skipped")]
    # a rank that wrote its result and then aborted while the interpreter exited (a Gloo
    # job's defect at exit, fixed in SlimGC's transport: docs/benchmarks.md) measured its
    # steps: kept, and said so
    aborted = [r for r, code in enumerate(codes) if len(ranks) == procs
               and code == -signal.SIGABRT and EXIT_ABORT in _tail(logs[r], 4000)]
    if aborted:
        record["exit_abort"] = aborted
    if record["status"] == "ok" and skipped:
        record.update(status="skipped", error=skipped[0])
    elif record["status"] == "ok" and (len(ranks) < procs or any(
            code not in (0, None) and r not in aborted for r, code in enumerate(codes))):
        bad = next((r for r, code in enumerate(codes) if code not in (0, None)), 0)
        record.update(status="error", error="rank %d exited with %s: %s" % (
            bad, codes[bad], _tail(logs[bad])))
    elif record["status"] == "timeout":
        record["error"] += ": " + _tail(logs[0], 600)
    record["ranks"] = ranks if record["status"] == "ok" else []
    record.update(summarize(record["ranks"]))
    return record


def _new_record(config, model, procs):
    return {"config": config, "model": model, "procs": procs, "status": "ok", "error": None}


def _timed_out(record, args):
    record.update(status="timeout", error="timed out after %d s (--timeout); ranks "
                  "killed" % args.timeout)


def _verdict(codes, since, args, failed_at):
    """What the rank processes' exit `codes` say of a config begun at `since`: 'exited',
    'timeout' (past --timeout), 'failed' (a rank failed over 10 s ago: the others wait on
    its collectives) or None (go on); with when a rank was first seen failed."""
    if all(c is not None for c in codes):
        return "exited", failed_at
    now = time.time()
    if now - since > args.timeout:
        return "timeout", failed_at
    if any(c not in (None, 0) for c in codes):
        failed_at = failed_at or now
        if now - failed_at > 10:
            return "failed", failed_at
    return None, failed_at


def run_config(config, model, procs, args, work):
    """One config at `procs` ranks, in fresh processes: a record with each rank's result,
    or the error / timeout that stopped it."""
    folder = tempfile.mkdtemp(prefix="%s-%s-%d-" % (model, config, procs), dir=work)
    running, logs, outs = _start_ranks(_spec(config, model, procs, args), procs, folder)
    start = time.time()
    record = _new_record(config, model, procs)
    failed_at = None
    while True:
        state, failed_at = _verdict([p.poll() for p in running], start, args, failed_at)
        if state == "timeout":
            _timed_out(record, args)
        if state:
            break
        time.sleep(0.2)
    _kill(running)
    record["wall_s"] = round(time.time() - start, 1)
    return _settle(record, _read_ranks(outs), [p.returncode for p in running], logs)


def run_reusing_ranks(configs, model, procs, args, work, report):
    """--reuse-ranks: `configs` one after another in the same `procs` rank processes (one
    process group); each config's record, in order, goes to report(record) as it finishes
    (wall_s: from the one before it to its last rank's result). A config that fails or
    passes --timeout is recorded as run_config records it, and the configs after it run in
    fresh ranks."""
    while configs:
        folder = tempfile.mkdtemp(prefix="%s-%d-reused-" % (model, procs), dir=work)
        running, logs, outs = _start_ranks(
            [_spec(c, model, procs, args) for c in configs], procs, folder)
        results = [[_config_out(out, i) for out in outs] for i in range(len(configs))]
        done, since, failed_at, late = 0, time.time(), None, None

        def finish(record, codes):
            """Report configs[done]'s record; when it ended (its last result written)."""
            written = [os.path.getmtime(p) for p in results[done] if os.path.exists(p)]
            end = max(written) if len(written) == procs else time.time()
            record["wall_s"] = round(max(0.0, end - since), 1)
            report(_settle(record, _read_ranks(results[done]), codes, logs))
            return end

        def finish_written():
            """Every config but the last is settled once its results are written; the last
            when the ranks have exited (their exit codes count for it)."""
            nonlocal done, since
            while done < len(configs) - 1 and all(map(os.path.exists, results[done])):
                since = finish(_new_record(configs[done], model, procs), [None] * procs)
                done += 1

        while True:
            codes = [p.poll() for p in running]
            finish_written()
            state, failed_at = _verdict(codes, since, args, failed_at)
            if state == "timeout":
                late = _new_record(configs[done], model, procs)
                _timed_out(late, args)
            if state:
                break
            time.sleep(0.2)
        _kill(running)
        if late is None:
            finish_written()
        finish(late or _new_record(configs[done], model, procs),
               [p.returncode for p in running])
        configs = configs[done + 1:]


def summarize(ranks):
    """The config's numbers over its ranks: mean ms/step, total samples/s, max peak."""
    if not ranks:
        return {}
    out = {"ms_step": statistics.mean(r["ms_step"] for r in ranks),
           "samples_per_s": sum(r["samples_per_s"] for r in ranks),
           "peak_gib": max(r["peak_gib"] for r in ranks) if ranks[0]["peak_gib"] is not None
           else None}
    for key in ("ms_fwd_bwd", "ms_opt_step"):
        out[key] = statistics.mean(r[key] for r in ranks)
    if "composition" in ranks[0]:
        out["composition"] = {k: statistics.mean(r["composition"][k] for r in ranks)
                              for k in ranks[0]["composition"]}
    if ranks[0].get("step_copies"):  # rank 0's: every rank copies alike
        out["step_copies"] = ranks[0]["step_copies"]
    return out


def _skip_record(config, model, procs, reason):
    return {"config": config, "model": model, "procs": procs, "status": "skipped",
            "error": reason, "ranks": [], "wall_s": 0.0}


def main(argv=None, prog="python -m slimgc_mx.bench gpu"):
    args = parse_args(sys.argv[1:] if argv is None else argv, prog)
    try:
        import torch
    except ImportError:
        print("%s: needs PyTorch (pip install torch); the other bench subcommands do not"
              % prog, file=sys.stderr)
        return 2
    if any(m in ("vgg16", "resnet50") for m in args.model):
        try:
            import torchvision  # noqa: F401
        except ImportError:
            print("%s: --model vgg16/resnet50 needs torchvision (pip install torchvision), "
                  "or use --model tiny" % prog, file=sys.stderr)
            return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("%s: --device cuda, but torch sees no CUDA device; use --device cpu for a "
              "smoke test" % prog, file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    info = machine_info(args.device)
    placement = None
    if any("placement" in c for c in args.configs):
        placement = placement_support()
        if placement:
            print("slimgc-placement skipped: %s" % placement, flush=True)
    doc = {"machine": info, "args": {k: v for k, v in vars(args).items()}, "results": []}
    started = time.time()

    def report(rec):
        doc["results"].append(rec)
        print(_progress(rec), flush=True)
        write_json(doc, os.path.join(args.out, "results.json"))
    # the ranks' folders (specs, logs, results): read into the records, then removed
    with tempfile.TemporaryDirectory(prefix="slimgc-bench-gpu-",
                                     ignore_cleanup_errors=True) as work:
        for model in args.model:
            for procs in args.procs:
                for skip, configs in itertools.groupby(
                        args.configs, lambda c: bool("placement" in c and placement)):
                    configs = list(configs)
                    if skip:
                        for config in configs:
                            report(_skip_record(config, model, procs, placement))
                    elif args.reuse_ranks:
                        run_reusing_ranks(configs, model, procs, args, work, report)
                    else:
                        for config in configs:
                            report(run_config(config, model, procs, args, work))
    doc["wall_s"] = round(time.time() - started, 1)
    doc["projection"] = projection(doc["results"], args.project_workers, args.batch)
    doc["checks"] = checks(doc["results"])
    write_json(doc, os.path.join(args.out, "results.json"))
    table = format_table(doc)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(table)
    print(table)
    try:
        plot(doc["results"], os.path.join(args.out, "fig14.png"))
    except ImportError as exc:
        print("fig14.png not drawn: %s (pip install matplotlib)" % exc, file=sys.stderr)
    print("wrote %s" % ", ".join(os.path.join(args.out, n)
                                 for n in ("results.json", "table.md", "fig14.png")))
    failed = [r for r in doc["results"] if r["status"] in ("error", "timeout")]
    return 1 if failed else 0


def _progress(rec):
    head = "%-9s P=%d %-26s" % (rec["model"], rec["procs"], rec["config"])
    if rec["status"] != "ok":
        return "%s %s (%.0f s): %s" % (head, rec["status"], rec.get("wall_s", 0),
                                       (rec["error"] or "").splitlines()[-1][:200]
                                       if rec["error"] else "")
    peak = "" if rec["peak_gib"] is None else ", peak %.2f GiB" % rec["peak_gib"]
    return "%s %.1f ms/step, %.1f samples/s%s (%.0f s)" % (
        head, rec["ms_step"], rec["samples_per_s"], peak, rec["wall_s"])


# ---------------------------------------------------------------- one rank

def build_model(name):
    """vgg16/resnet50 from torchvision with random weights, or the tiny conv net."""
    import torch.nn as nn
    if name not in MODELS:
        raise ValueError("unknown model %r; valid: %s" % (name, ", ".join(MODELS)))
    if name == "tiny":
        return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
    import torchvision.models as tvm
    return getattr(tvm, name)(weights=None)


class LaneHookState:
    """State of the GPU lane-codec hook (2bit, or 1bit: `codec`): per bucket its
    error-feedback residual on the bucket's device (and, with the project's
    TorchDeviceCodec, the codec and its lanes)."""

    def __init__(self, group, world, threshold=0.5, codec="2bit"):
        self.group = group
        self.world = world
        self.threshold = threshold
        self.codec = codec
        self.buckets = {}
        self.kind = None
        try:
            from ..torch.device import TorchDeviceCodec
            self._device_codec = TorchDeviceCodec
            self.kind = "TorchDeviceCodec (the project's lanes)"
        except ImportError:
            self._device_codec = None
            self.kind = "plain torch ops (int8 levels summed)"

    def entry(self, buf):
        import torch
        from .. import codecs
        e = self.buckets.get(self._key(buf))
        if e is None or e["residual"].numel() != buf.numel():
            e = {"residual": torch.zeros_like(buf)}
            if self._device_codec is not None:
                made = codecs.create(self.codec, threshold=self.threshold) \
                    if self.codec == "2bit" else codecs.create(self.codec)
                e["codec"] = self._device_codec(made)
                n = e["codec"].codec.lane_count(buf.numel(), self.world)
                e["lanes"] = torch.empty(n, dtype=torch.float64, device=buf.device)
            self.buckets[self._key(buf)] = e
        return e

    @staticmethod
    def _key(buf):
        return (buf.device, buf.numel())


def gpu_lane_hook(state, bucket):
    """DDP comm hook: state.codec (2bit, 1bit) with error feedback on the bucket's device;
    the mean gradient."""
    import torch.distributed as dist
    buf = bucket.buffer()
    e = state.entry(buf)
    if "codec" not in e and state.codec != "2bit":
        raise RuntimeError("the GPU %s hook needs the project's TorchDeviceCodec" % state.codec)
    if "codec" in e:
        codec = e["codec"]
        codec.encode(buf, e["residual"], state.world, out=e["lanes"])
        fut = dist.all_reduce(e["lanes"], group=state.group, async_op=True).get_future()

        def decode(f):
            codec.decode(f.value()[0], buf.numel(), state.world, out=buf)
            return buf.div_(state.world)
        return fut.then(decode)
    return _plain_2bit(state, e, buf)


def _plain_2bit(state, e, buf):
    """The hook without the project's device codec: levels -1/0/+1 of grad + residual at
    the threshold, summed as int8, residual = what the levels did not send."""
    import torch
    import torch.distributed as dist
    t = state.threshold
    c = buf + e["residual"]
    q = (c >= t).to(torch.int8) - (c <= -t).to(torch.int8)
    torch.sub(c, q.to(c.dtype) * t, out=e["residual"])
    fut = dist.all_reduce(q, group=state.group, async_op=True).get_future()

    def decode(f):
        return buf.copy_(f.value()[0].to(buf.dtype)).mul_(t / state.world)
    return fut.then(decode)


def _counting(hook, info):
    """`hook`, counting DDP's buckets into info['buckets'] (PowerSGD's one bucket checked)."""
    def counted(state, bucket):
        info["buckets"] = max(info.get("buckets", 0), bucket.index() + 1)
        return hook(state, bucket)
    return counted


def _setup(config, model, device, world, warmup):
    """(the training object whose forward runs, the optimizer, hook info) for a config."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    sgd = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    ids = [device.index] if device.type == "cuda" else None
    if config == "no-ddp":
        return model, sgd, {}
    if config.startswith("ddp"):
        params_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2 ** 20
        cap = int(params_mb) + 2 if config == "ddp-powersgd" else None  # one bucket
        ddp = DDP(model, device_ids=ids, bucket_cap_mb=cap)
        info = {}
        if config == "ddp-fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif config.startswith("ddp-powersgd"):
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
            state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=POWERSGD_RANK,
                                     start_powerSGD_iter=2)
            ddp.register_comm_hook(state, _counting(ps.powerSGD_hook, info))
            info["bucket_cap_mb"] = cap
        elif config in ("ddp-gpu-2bit", "ddp-gpu-1bit"):
            state = LaneHookState(dist.group.WORLD, world, codec=config[len("ddp-gpu-"):])
            ddp.register_comm_hook(state, _counting(gpu_lane_hook, info))
            info["hook"] = state.kind
        return ddp, sgd, info
    import slimgc_mx.torch as slimgc
    options = {"backup": not config.endswith("-nobackup")}
    compression = "2bit"
    if config == "slimgc-device-powersgd":
        compression = "powersgd"
        options.update(data_path="device", comm_threshold=0, rank=POWERSGD_RANK)
    elif config == "slimgc-device-cttab":
        options.update(data_path="device", comm_threshold="auto", warmup_steps=max(2, warmup))
    elif config.startswith("slimgc-device"):
        options.update(data_path="device", comm_threshold=0)
        if config.endswith("-nooverlap"):
            options["overlap"] = False
        if config.endswith("-offload"):
            options["state_on"] = "host"
    elif config.startswith("slimgc-placement"):
        options.update(offload="auto", comm_threshold="auto", warmup_steps=max(2, warmup))
    else:
        options.update(offload=config.startswith("slimgc-offload"), comm_threshold=0)
    options.setdefault("data_path", "host")
    try:
        opt = slimgc.DistributedOptimizer(sgd, model, compression=compression, **options)
    except ImportError as exc:  # offload=False needs the torch device codec
        raise RuntimeError("%s: the codec on the gradient's device (offload=False) is not "
                           "available: %s" % (config, exc)) from exc
    return model, opt, {"options": options}


def _sync(device):
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train_step(opt, net, x, y, F):
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(net(x), y).backward()
    opt.step()


def _profile(spec, rank, device, step):
    """spec['profile'] more steps (every rank takes them: they exchange), rank 0's under
    torch.profiler; its busiest operators by device and by host time go to profile_path."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) if rank == 0 else contextlib.nullcontext() as prof:
        for _ in range(spec["profile"]):
            step()
        _sync(device)
    if rank != 0:
        return
    table = prof.key_averages()
    parts = ["%s, %s, %d steps profiled on rank 0 (times are totals over them)\n"
             % (spec["model"], spec["config"], spec["profile"])]
    if device.type == "cuda":
        parts.append(table.table(sort_by="self_cuda_time_total", row_limit=30))
    parts.append(table.table(sort_by="self_cpu_time_total", row_limit=30))
    with open(spec["profile_path"], "w") as f:
        f.write("\n".join(parts))


def _copy_ms(model, device, repeats=5):
    """Median ms of copying every parameter's gradient to pinned host memory and back (the
    D2H/H2D a step moves when the codec runs on the CPU); a memcpy on the CPU."""
    import torch
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    host = torch.empty(flat.numel(), dtype=flat.dtype, pin_memory=device.type == "cuda")
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        host.copy_(flat, non_blocking=True)
        _sync(device)
        flat.copy_(host, non_blocking=True)
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_rank(spec, keep_group=False):
    """Train spec's config for warmup + steps on this rank; its result as a dict. The
    process group is made unless one is there (--reuse-ranks: the configs before this one
    made it), and destroyed after unless keep_group."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = spec["device"] == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    backend = spec.get("backend", "auto")
    if backend == "auto":
        backend = "nccl" if cuda and world == 1 else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world)
    torch.manual_seed(0)
    side, classes = INPUTS[spec["model"]]
    with torch.device(device):
        model = build_model(spec["model"])
        x = torch.randn(spec["batch"], 3, side, side)
        y = torch.randint(0, classes, (spec["batch"],))
    config, steps, warmup = spec["config"], spec["steps"], spec["warmup"]
    try:
        net, opt, info = _setup(config, model, device, world, warmup)
    except (TypeError, ValueError) as exc:
        if "placement" in config:
            return {"rank": rank, "skipped": "DistributedOptimizer rejects offload='auto': "
                    "%s" % exc}
        raise
    slim = config.startswith("slimgc")
    before = opt.stats() if slim and warmup == 0 else None
    step_ms, fb_ms, opt_ms = [], [], []
    for i in range(warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        _sync(device)
        t1 = time.perf_counter()
        opt.step()
        _sync(device)
        t2 = time.perf_counter()
        if i >= warmup:
            step_ms.append((t2 - t0) * 1e3)
            fb_ms.append((t1 - t0) * 1e3)
            opt_ms.append((t2 - t1) * 1e3)
        if slim and i == warmup - 1:
            before = opt.stats()
    last_copies = opt.stats().get("step_copies") if slim else None
    flush_ms = None
    if slim:
        t0 = time.perf_counter()
        opt.flush()
        _sync(device)
        flush_ms = (time.perf_counter() - t0) * 1e3
        after = opt.stats()
    peak = torch.cuda.max_memory_allocated(device) / GIB if cuda else None
    reserved = torch.cuda.max_memory_reserved(device) / GIB if cuda else None
    ms = statistics.median(step_ms)
    out = {"rank": rank, "world": world, "ms_step": ms, "samples_per_s": spec["batch"] * 1e3 / ms,
           "ms_fwd_bwd": statistics.median(fb_ms), "ms_opt_step": statistics.median(opt_ms),
           "ms_step_mean": statistics.mean(step_ms), "peak_gib": peak,
           "peak_reserved_gib": reserved, "loss": float(loss.detach()), "info": info,
           "tensors": [list(p.shape) for p in model.parameters()],
           "elements": sum(p.numel() for p in model.parameters())}
    if slim:
        out["stats"] = {k: after[k] for k in ("comm_threshold_bytes", "transfers",
                                              "compressed_transfers", "fused_keys",
                                              "fused_buckets", "cttab_reason", "data_path",
                                              "buckets", "compressed_buckets",
                                              "compressed_keys", "cttab_phase", "overlap",
                                              "compressor")
                        if k in after}
        out["stats"]["cttab_rows"] = len(after.get("cttab") or [])
        out["step_copies"] = last_copies  # the last timed step's (stats()' step_copies)
        per = {k: (after[k] - before[k]) / steps
               for k in ("compress_s", "comm_s", "blocked_s", "bytes_pushed", "bytes_pulled",
                         "bytes_fp32")}
        copies = _copy_ms(model, device)
        comp = {"step": ms, "fwd_bwd": out["ms_fwd_bwd"], "opt_step": out["ms_opt_step"],
                "copies": copies, "encode": per["compress_s"] * 1e3,
                "transfer": per["comm_s"] * 1e3, "blocked": per["blocked_s"] * 1e3,
                "flush": flush_ms}
        comp["overlap"] = (comp["fwd_bwd"] + comp["copies"] + comp["encode"]
                           + comp["transfer"] - ms)
        out["composition"] = comp
        out["per_step"] = per
        out["keys"] = sum(1 for p in model.parameters() if p.requires_grad)
    if spec.get("profile"):  # after the numbers above: its steps count in none of them
        _profile(spec, rank, device, lambda: _train_step(opt, net, x, y, F))
        out["profile"] = spec["profile_path"] if rank == 0 else None
    if slim:
        opt.close()
    dist.barrier()
    if not keep_group:
        dist.destroy_process_group()
    return out


def _worker_main(argv):
    spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    if isinstance(spec, list):  # --reuse-ranks: the configs in turn, in one process group
        for i, one in enumerate(spec):
            write_json(run_rank(one, keep_group=i < len(spec) - 1),
                       _config_out(out_path, i))
        return 0
    write_json(run_rank(spec), out_path)
    return 0


# ---------------------------------------------------------------- projection

def project_step(tensors, compute_s, codec_s, procs, link, workers, backup, on_device,
                 batch, per_key_s=None):
    """One step at `workers` on `link` from measured times, with scale.py's pieces: every
    tensor 2bit-compressed (codec_s: this model's measured encode+decode per step; None: all
    float32, as DDP), wire on torch.distributed's ring; a codec on the device shares the
    compute's processor (scale's 'cpu' overlap), an offloaded one overlaps it."""
    from . import scale
    elements = sum(math.prod(s) for s in tensors) or 1
    rates = scale.CodecRates({"2bit": elements / codec_s if codec_s else math.inf},
                             {"2bit": math.inf}, scale.DEFAULT_MEMCPY, max(1, procs),
                             "measured")
    setup = scale.Setup(workers, scale.parse_link(link), compute_s, batch=batch, backend="ring",
                        per_key_s=scale.PER_KEY_S if per_key_s is None else per_key_s)
    scheme = scale.Scheme("2bit", "full" if backup else "alone", "2bit")
    costs, keys = [], 0.0
    for shape in reversed(tensors):
        q = codec_s is not None and scale.compresses(scheme, tuple(shape))
        costs.append(scale.tensor_cost(scheme, tuple(shape), workers, q, rates))
        if codec_s is not None:
            keys += setup.per_key_s
    wire = scale.wire_seconds(costs, setup, scheme)
    codec = sum(c.codec_s for c in costs)
    step = scale.step_seconds(compute_s, wire, codec, keys, backup and codec_s is not None,
                              "cpu" if on_device else "accelerator")
    return {"step_ms": step * 1e3, "wire_ms": wire * 1e3, "codec_ms": codec * 1e3,
            "keys_ms": keys * 1e3, "samples_per_s": batch / step}


def projection(results, workers_list, batch):
    """Projected ms/step at each link and worker count for ddp and the SlimGC configs, from
    the compute of no-ddp and each config's measured encode and per-key host time."""
    rows = []
    by = {(r["model"], r["procs"], r["config"]): r for r in results if r["status"] == "ok"}
    for (model, procs, config), r in by.items():
        base = by.get((model, procs, "no-ddp"))
        if base is None or not (config == "ddp" or config.startswith("slimgc")):
            continue
        if "placement" in config:
            continue  # its per-tensor choice is not one codec rate: not modelled here
        rank = r["ranks"][0]
        compute = base["ms_fwd_bwd"] / 1e3
        codec_s = per_key = None
        if config != "ddp":
            codec_s = rank["per_step"]["compress_s"]
            per_key = max(0.0, r["ms_opt_step"] - r["composition"]["blocked"]) / 1e3 / max(
                1, rank["keys"])
        for link in LINKS:
            for n in workers_list:
                p = project_step(rank["tensors"], compute, codec_s, procs, link, n,
                                 not config.endswith("-nobackup"), "gpu" in config, batch,
                                 per_key)
                rows.append(dict(p, model=model, procs=procs, config=config, link=link,
                                 workers=n))
    return rows


# ---------------------------------------------------------------- checks, table, figure

def checks(results):
    """Issue 32's targets, each 'met', 'not met' or why it could not be read."""
    out = []
    by = {(r["model"], r["procs"], r["config"]): r for r in results}

    def ok(model, procs, config):
        r = by.get((model, procs, config))
        return r if r is not None and r["status"] == "ok" else None
    for model, procs in sorted({(r["model"], r["procs"]) for r in results}):
        off, ddp, g2 = (ok(model, procs, c) for c in ("slimgc-offload", "ddp", "ddp-gpu-2bit"))

        def step_row(a, b, target, factor=1.0):  # a's step against factor times b's
            out.append({"model": model, "procs": procs, "target": target,
                         "value": "%.1f vs %.1f ms (%.2fx)" % (
                             a["ms_step"], b["ms_step"], a["ms_step"] / b["ms_step"]),
                         "met": a["ms_step"] <= factor * b["ms_step"]})

        def peak_row(a, b, target):  # a's peak memory against b's, where measured
            if a.get("peak_gib") is not None:
                out.append({"model": model, "procs": procs, "target": target,
                            "value": "%.2f vs %.2f GiB" % (a["peak_gib"], b["peak_gib"]),
                            "met": a["peak_gib"] <= b["peak_gib"]})
        if off and ddp:
            peak_row(off, ddp, "slimgc-offload peak <= ddp peak")
        if off and g2 and off.get("peak_gib") is not None and model == "vgg16":
            drop = 1 - off["peak_gib"] / g2["peak_gib"]
            out.append({"model": model, "procs": procs,
                        "target": "slimgc-offload peak >= 8% below ddp-gpu-2bit",
                        "value": "%.1f%% below" % (100 * drop), "met": drop >= 0.08})
        dev = ok(model, procs, "slimgc-device")
        if dev and ddp:  # the GPU data path issue's targets at one rank
            limit = 1.1 if procs == 1 else 1.0
            step_row(dev, ddp, "slimgc-device step <= %.1fx ddp" % limit, limit)
            peak_row(dev, ddp, "slimgc-device peak <= ddp peak")
        home, alone = ok(model, procs, "slimgc-device-offload"), ok(model, procs, "no-ddp")
        if home and alone:  # the item 4
            peak_row(home, alone, "slimgc-device-offload peak <= no-ddp peak")
        if home and ddp:
            step_row(home, ddp, "slimgc-device-offload step <= 1.5x ddp", 1.5)
        low, hook = ok(model, procs, "slimgc-device-powersgd"), ok(model, procs, "ddp-powersgd")
        if low and hook and procs > 1:  # the same rank: only backup can hide its rounds
            step_row(low, hook, "slimgc-device-powersgd step <= ddp-powersgd")
        for suffix in ("", "-nobackup"):
            pl, gpu, cpu = (ok(model, procs, c + suffix) for c in
                            ("slimgc-placement", "slimgc-gpu", "slimgc-offload"))
            skipped = by.get((model, procs, "slimgc-placement" + suffix))
            if not pl and skipped is not None:
                out.append({"model": model, "procs": procs,
                            "target": "slimgc-placement%s <= min(gpu, offload)" % suffix,
                            "value": "not measured (%s)" % skipped["status"], "met": None})
            if pl and (gpu or cpu):
                best = min(r["ms_step"] for r in (gpu, cpu) if r)
                out.append({"model": model, "procs": procs,
                            "target": "slimgc-placement%s <= min(gpu, offload)" % suffix,
                            "value": "%.1f vs %.1f ms" % (pl["ms_step"], best),
                            "met": pl["ms_step"] <= best})
    return out


def _f(x, spec="%.1f"):
    return "-" if x is None else spec % x


def _notes(record):
    """DDP's bucket count and hook, SlimGC's compressed transfers per step."""
    if not record["ranks"]:
        return ""
    rank = record["ranks"][0]
    info, notes = rank.get("info") or {}, []
    if info.get("buckets"):
        notes.append("%d bucket%s" % (info["buckets"], "s" * (info["buckets"] > 1)))
    if info.get("hook"):
        notes.append(info["hook"])
    if rank.get("stats", {}).get("data_path") == "device":
        st = rank["stats"]
        notes.append("device path: %d buckets (%d compressed), %d of %d keys compressed" % (
            st["buckets"], st["compressed_buckets"], st["compressed_keys"], rank["keys"]))
    elif "stats" in rank:
        notes.append("%d of %d keys compressed" % (
            round(rank["stats"]["compressed_transfers"] / max(1, rank["stats"]["transfers"])
                  * rank["keys"]), rank["keys"]))
    if record.get("exit_abort"):
        notes.append("rank %s aborted at exit after its result" % ",".join(
            map(str, record["exit_abort"])))
    return ", ".join(notes)


def _normalised(results):
    """Fig. 12's view: each config's samples/s over the GPU 1bit hook's at the same model
    and P (the paper's baseline), where that hook ran."""
    base = {(r["model"], r["procs"]): r["samples_per_s"] for r in results
            if r["config"] == "ddp-gpu-1bit" and r["status"] == "ok"}
    rows = [r for r in results if (r["model"], r["procs"]) in base and r["status"] == "ok"]
    if not rows:
        return []
    lines = ["", "## Fig. 12: throughput over the GPU 1bit hook's", "",
             "samples/s of each config over ddp-gpu-1bit's at the same model and P (the "
             "paper normalises Fig. 12 against GPU 1bit compression).", "",
             "| model | P | config | samples/s | x ddp-gpu-1bit |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append("| %s | %d | %s | %.1f | %.2f |" % (
            r["model"], r["procs"], r["config"], r["samples_per_s"],
            r["samples_per_s"] / base[(r["model"], r["procs"])]))
    return lines


def format_table(doc):
    """The Markdown of results.json: machine, Fig. 14, Fig. 12/13, projection, targets."""
    m = doc["machine"]
    lines = ["# GPU benchmark (`python -m slimgc_mx.bench gpu`)", "",
             "Device: %s, %s; torch %s, CUDA %s; %s CPUs; %s steps after %s of warm-up, "
             "batch %s per rank." % (m.get("device"), m.get("gpu") or "no GPU", m["torch"],
                                     m["cuda"], m["cpus"], doc["args"]["steps"],
                                     doc["args"]["warmup"], doc["args"]["batch"]), "",
             "## Fig. 14: peak memory and throughput", "",
             "ms/step: median over the timed steps (mean over ranks); samples/s: all ranks "
             "together; peak: torch.cuda.max_memory_allocated, the largest rank's.", "",
             "| model | P | config | ms/step | fwd+bwd ms | opt.step ms | samples/s | "
             "peak GiB | notes | status |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        status = r["status"] if r["status"] == "ok" else "%s: %s" % (
            r["status"], (r["error"] or "").splitlines()[-1][:120].replace("|", "/"))
        lines.append("| %s | %d | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            r["model"], r["procs"], r["config"], _f(r.get("ms_step")),
            _f(r.get("ms_fwd_bwd")), _f(r.get("ms_opt_step")), _f(r.get("samples_per_s")),
            _f(r.get("peak_gib"), "%.2f"), _notes(r), status))
    lines += _normalised(doc["results"])
    comp = [r for r in doc["results"] if r.get("composition")]
    if comp:
        lines += ["", "## Fig. 12/13: step composition (ms per step)", "",
                  "copies: every gradient D2H and back H2D, timed alone; encode and transfer: "
                  "stats()' compress_s and comm_s per step, summed over keys; a transfer "
                  "counts while it is in flight, queued ones too, so with backup transfer "
                  "can exceed the step many times; blocked: waiting for global weights; "
                  "overlap: fwd+bwd + copies + encode + transfer - step (negative: time "
                  "the parts above do not account for, such as the training thread's "
                  "per-key work).", "",
                  "| model | P | config | step | fwd+bwd | copies | encode | transfer | "
                  "blocked | overlap |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in comp:
            c = r["composition"]
            parts = (_f(c[k]) for k in ("step", "fwd_bwd", "copies", "encode", "transfer",
                                        "blocked", "overlap"))
            lines.append("| %s | %d | %s | %s |" % (r["model"], r["procs"], r["config"],
                                                    " | ".join(parts)))
    counted = [r for r in doc["results"] if r.get("step_copies")]
    if counted:
        lines += ["", "## Per-step accounting (the last timed step, stats()' step_copies)", "",
                  "What the step's copies moved, the bytes of those from or to pageable host "
                  "memory, and the training thread's host synchronisations counted by the "
                  "adapter.", "",
                  "| model | P | config | H2D MB | D2H MB | pageable MB | host syncs |",
                  "|---|---|---|---|---|---|---|"]
        for r in counted:
            c = r["step_copies"]
            lines.append("| %s | %d | %s | %.1f | %.1f | %.1f | %d |" % (
                r["model"], r["procs"], r["config"], c["h2d_bytes"] / 1e6,
                c["d2h_bytes"] / 1e6, c["pageable_bytes"] / 1e6, c["host_syncs"]))
    if doc.get("projection"):
        lines += ["", "## Projection onto 10 and 100 Gbit/s (slimgc_mx/bench/scale.py)", "",
                  "Modelled: compute = no-ddp's fwd+bwd here; every tensor 2bit (or float32 "
                  "for ddp) on torch.distributed's ring (scale.ring_seconds, 100 us latency); "
                  "codec time = this run's encode+decode per step; per-key host time = "
                  "(opt.step - blocked) / keys; with backup the offloaded codec and the wire "
                  "overlap the next compute, the on-device codec does not (it shares the GPU). "
                  "Not modelled: DDP's overlap of the allreduce with backward (its row is an "
                  "upper bound), the CTTab's placement, contention for the host's cores.", "",
                  "| model | P | config | link | N | ms/step | wire ms | codec ms | keys ms | "
                  "samples/s/worker |", "|---|---|---|---|---|---|---|---|---|---|"]
        for p in doc["projection"]:
            lines.append("| %s | %d | %s | %s | %d | %.1f | %.1f | %.1f | %.1f | %.1f |" % (
                p["model"], p["procs"], p["config"], p["link"], p["workers"], p["step_ms"],
                p["wire_ms"], p["codec_ms"], p["keys_ms"], p["samples_per_s"]))
    if doc.get("checks"):
        lines += ["", "## Targets", "", "| model | P | target | measured | met |",
                  "|---|---|---|---|---|"]
        for c in doc["checks"]:
            met = {True: "yes", False: "no"}.get(c["met"], "-")
            lines.append("| %s | %d | %s | %s | %s |" % (c["model"], c["procs"], c["target"],
                                                       c["value"], met))
    lines += ["", "Loopback is not a network: the ranks share one GPU, its copy engines and "
              "the host's cores, and Gloo's transfer is a memcpy through the kernel. These "
              "runs show memory, the compute and codec costs and how much of them overlap; "
              "they cannot show what a slow link costs or saves (the projection models that)."]
    return "\n".join(lines) + "\n"


def plot(results, path):
    """fig14.png: peak memory and samples/s per config, one row per model, one bar per P."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = sorted({r["model"] for r in results}, key=MODELS.index)
    procs = sorted({r["procs"] for r in results})
    fig, axes = plt.subplots(len(models), 2, figsize=(13, 3.6 * len(models)), squeeze=False)
    for row, model in enumerate(models):
        configs = [c for c in CONFIGS if any(r["config"] == c and r["model"] == model
                                             for r in results)]
        width = 0.8 / len(procs)
        for col, (key, label) in enumerate((("peak_gib", "peak allocated (GiB)"),
                                            ("samples_per_s", "samples/s (all ranks)"))):
            ax = axes[row][col]
            for j, p in enumerate(procs):
                got = {r["config"]: r.get(key) for r in results
                       if r["model"] == model and r["procs"] == p and r["status"] == "ok"}
                xs = [i + (j - (len(procs) - 1) / 2) * width for i in range(len(configs))]
                ax.bar(xs, [got.get(c) or 0 for c in configs], width, label="P=%d" % p)
            if key == "peak_gib" and not any(r.get(key) for r in results):
                ax.text(0.5, 0.5, "no GPU memory (--device cpu)", ha="center",
                        transform=ax.transAxes)
            ax.set_xticks(range(len(configs)))
            ax.set_xticklabels(configs, rotation=35, ha="right", fontsize=8)
            ax.set_ylabel(label)
            ax.set_title("%s: %s" % (model, label))
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":  # one rank, spawned by run_config
    sys.exit(_worker_main(sys.argv[1:]))
