"""Emulated-cluster benchmark: one network namespace per node, rate-limited veth links.

Runs scripts/train.py through the launcher for several configurations side by side
(MXNet fp32 and 2bit, SlimGC ablations, no communication; PyTorch's DDP and its hooks,
SlimGC's PyTorch adapter) and measures throughput, bytes on the wire from each worker's
interface counters, time composition and the threshold table. See docs/results.md for
what every number means, docs/benchmarks.md ("PyTorch") for the torch configurations.
"""
import argparse
import atexit
import contextlib
import importlib.util
import json
import os
import platform
import re
import resource
import shlex
import shutil
import signal
import statistics
import sys
import time
from typing import Dict, List, Optional

from .. import launch
from ..launch.netns import (DELAY_PATTERN, NODE_IFACE, RATE_PATTERN, NetnsCluster,
                            NetnsRunner, cleanup_stale, netem_available, netns_available,
                            rate_bits)
from ..codecs import available as available_codecs
from ..env import LAUNCH_INDEX_VAR, SERVER_ENV, env_count, launch_index, project_variables

DESCRIPTION = ("emulated cluster (netns + veth + tc): throughput, wire bytes, time "
               "composition, CTTab, accuracy vs MXNet's own baselines")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(ROOT, "scripts", "train.py")
TRAIN_TORCH = os.path.join(ROOT, "scripts", "train_torch.py")
CODECS = ("1bit", "2bit", "4bit")
ABLATIONS = ("classic", "cgopt", "offload", "full")
#: Horovod's DistributedTrainer (optional: bash scripts/run.sh horovod) and its compression
HOROVOD = {"horovod-fp32": "none", "horovod-fp16": "fp16"}
#: PyTorch's DistributedDataParallel over Gloo and its hook (train_torch.py --compressor)
TORCH_HOOKS = {"torch-ddp": "none", "torch-fp16": "fp16", "torch-powersgd": "powersgd"}
#: PowerSGD's rank in both torch-powersgd and slimgc-torch-powersgd-* (the codec's default)
POWERSGD_RANK = 4
#: --configs torch: PyTorch's baselines beside SlimGC's adapter (2bit, and powersgd at the
#: hook's rank), the workers alone last
TORCH_CONFIGS = ["torch-ddp", "torch-fp16", "torch-powersgd", "slimgc-torch-2bit-full",
                 "slimgc-torch-powersgd-full", "torch-no-comm"]
#: The option that runs a configuration's job through PyTorch (scripts/train_torch.py)
TORCH_ARGS = ["--framework", "torch"]


# ---------------------------------------------------------------- configurations

#: Job exit statuses that mean the user interrupted it (128 + SIGINT, SIGTERM, SIGHUP). A
#: process killed otherwise (the out-of-memory killer's SIGKILL, a SIGSEGV) fails its
#: configuration, and the next one runs.
INTERRUPTED = {128 + signal.SIGINT, 128 + signal.SIGTERM, 128 + signal.SIGHUP}


def config_args(name: str) -> List[str]:
    """train.py communication options of a configuration name (ValueError if unknown)."""
    if name == "fp32":
        return ["--kvstore", "dist_sync", "--compressor", "none"]
    if name == "mxnet-2bit":
        return ["--kvstore", "dist_sync", "--compressor", "2bit", "--threshold", "0.5"]
    if name == "no-comm":
        return ["--kvstore", "local"]
    if name in HOROVOD:
        return ["--kvstore", "horovod", "--compressor", HOROVOD[name]]
    if name in TORCH_HOOKS:
        hook = TORCH_HOOKS[name]
        return TORCH_ARGS + ["--kvstore", "ddp", "--compressor", hook] + (
            ["--powersgd-rank", str(POWERSGD_RANK), "--bucket-cap-mb", "256"]
            if hook == "powersgd" else [])
    if name == "torch-no-comm":
        return TORCH_ARGS + ["--kvstore", "local"]
    alone = re.fullmatch(r"([a-z0-9]+)(\[[^\]]*\])?-alone", name)
    if alone:  # the codec as the paper ran its baselines: everything compressed, no strategy
        name = "slimgc-%s%s-classic" % (alone.group(1), alone.group(2) or "")
    m = re.fullmatch(r"slimgc-(torch-)?([a-z0-9]+)(?:\[([^\]]*)\])?-"
                     r"(classic|cgopt|offload|full)(-nofuse|-cupcake)?", name)
    if not m or m.group(2) not in available_codecs():
        raise ValueError("unknown configuration %r; valid: %s, %s, %s, slimgc-CODEC-STEP and "
                         "CODEC-alone for the codecs %s (slimgc-torch-CODEC-STEP: through "
                         "SlimGC's PyTorch adapter; options in brackets: "
                         "slimgc-topk[ratio=0.1]-full; a slimgc one may end in -nofuse, or in "
                         "-cupcake for fuse_compressed=auto)"
                         % (name, ", ".join(all_configs()), ", ".join(HOROVOD),
                            ", ".join(TORCH_HOOKS) + ", torch-no-comm",
                            ", ".join(available_codecs())))
    torch_job, codec, options, step, fusion = m.groups()
    args = (TORCH_ARGS if torch_job else []) + ["--kvstore", "slimgc", "--compressor", codec]
    if codec != "none":  # (compressor 'none' takes no codec options)
        args += ["--threshold", "0.5"]
    for option in filter(None, (options or "").split(";")):
        args += ["--codec-option", option]
    args += {"classic": ["--comm-threshold", "off", "--no-offload", "--no-backup"],
             "cgopt": ["--comm-threshold", "auto", "--no-offload", "--no-backup"],
             "offload": ["--comm-threshold", "auto", "--no-backup"],
             "full": ["--comm-threshold", "auto"]}[step]
    return args + {None: [], "-nofuse": ["--no-fuse"],
                   "-cupcake": ["--fuse-compressed", "auto"]}[fusion]


def uses_slimgc(name: str) -> bool:
    """True for a configuration that runs the SlimGC kvstore (its servers need the heap fix)."""
    return "slimgc" in config_args(name)


def uses_torch(name: str) -> bool:
    """True for a configuration whose job runs through PyTorch (train.py --framework torch)."""
    return _torch_args(config_args(name))


def _torch_args(train_args: List[str]) -> bool:
    """True when train.py arguments hold --framework torch (the last --framework wins)."""
    found = [train_args[i + 1] for i, a in enumerate(train_args[:-1]) if a == "--framework"]
    found += [a.split("=", 1)[1] for a in train_args if a.startswith("--framework=")]
    return bool(found) and found[-1] == "torch"


def torch_all_configs() -> List[str]:
    """--configs torch-all: PyTorch's baselines and every codec through SlimGC's adapter."""
    return (TORCH_CONFIGS[:3] + ["slimgc-torch-%s-full" % c for c in available_codecs()
                                 if c != "none"] + ["torch-no-comm"])


def all_configs(codecs=CODECS) -> List[str]:
    """Every configuration, baselines first, ablations in order within each codec."""
    names = ["fp32", "mxnet-2bit"]
    for c in codecs:
        names += ["slimgc-%s-%s" % (c, a) for a in ABLATIONS]
    return names + ["no-comm"]


def parse_configs(text: str, codecs) -> List[str]:
    """--configs: 'all', or a comma list of names; 'slimgc-2bit' and 'slimgc-torch-2bit'
    expand to their 4 ablations, 'torch' to TORCH_CONFIGS, 'torch-all' to
    torch_all_configs()."""
    if text == "all":
        return all_configs(codecs)
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        if item in ("torch", "torch-all"):
            out += TORCH_CONFIGS if item == "torch" else torch_all_configs()
        elif re.fullmatch(r"slimgc-(torch-)?[a-z0-9]+(\[[^\]]*\])?", item):
            expanded = ["%s-%s" % (item, a) for a in ABLATIONS]
            config_args(expanded[0])
            out += expanded
        else:
            config_args(item)
            out.append(item)
    return out


# ---------------------------------------------------------------- the job on each node

def _netdev(iface: str) -> Optional[Dict[str, int]]:
    """rx/tx byte counters of `iface` in this process's network namespace."""
    try:
        with open("/proc/self/net/dev") as f:
            for line in f:
                name, sep, rest = line.partition(":")
                if sep and name.strip() == iface:
                    v = rest.split()
                    return {"rx_bytes": int(v[0]), "tx_bytes": int(v[8])}
    except OSError:
        pass
    return None


class _Probe:
    """Hooks gluon.Trainer.step: timestamps every step, snapshots counters around the window."""

    STAT_KEYS = ("bytes_pushed", "bytes_pulled", "bytes_fp32", "comm_s", "compress_s",
                 "blocked_s", "transfers", "compressed_transfers")

    def __init__(self, start: int, steps: int, iface: str):
        self.start, self.steps, self.iface = start, steps, iface
        self.calls, self.stamps, self.snaps = 0, [], {}

    def snapshot(self, trainer):
        # gluon.Trainer's kvstore, or the optimizer itself (SlimGC's PyTorch adapter)
        kv = getattr(trainer, "_kvstore", trainer)
        stats = kv.stats() if callable(getattr(kv, "stats", None)) else None
        t = os.times()
        return {"time": time.perf_counter(), "net": _netdev(self.iface),
                "cpu_s": t.user + t.system,
                "stats": {k: stats.get(k) for k in self.STAT_KEYS} if stats else None}

    def on_step(self, trainer):
        self.calls += 1
        self.stamps.append(time.perf_counter())
        if self.calls == self.start:
            self.snaps["begin"] = self.snapshot(trainer)
        elif self.calls == self.start + self.steps:
            self.snaps["end"] = self.snapshot(trainer)

    def result(self):
        out = {"window_steps": self.steps, "first_step": self.start, "calls": self.calls,
               "iface": self.iface, "complete": "begin" in self.snaps and "end" in self.snaps}
        if not out["complete"]:
            return out
        b, e = self.snaps["begin"], self.snaps["end"]
        n = float(self.steps)
        lo = self.start - 1
        gaps = [self.stamps[i + 1] - self.stamps[i] for i in range(lo, lo + self.steps)]
        out["step_s"] = {"median": statistics.median(gaps), "mean": (e["time"] - b["time"]) / n,
                         "all": gaps}
        out["cpu_s_per_step"] = (e["cpu_s"] - b["cpu_s"]) / n
        if b["net"] and e["net"]:
            out["wire"] = {k: (e["net"][k] - b["net"][k]) / n for k in ("rx_bytes", "tx_bytes")}
        if b["stats"] and e["stats"]:
            out["kv_per_step"] = {k: ((e["stats"][k] or 0) - (b["stats"][k] or 0)) / n
                                  for k in self.STAT_KEYS}
        return out


def peak_rss_mb() -> float:
    """This process's peak resident memory (MB): ru_maxrss, which Linux counts in KiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6


def _report_server_memory(probe_dir: str, index: int):
    """At exit, a server writes server<INDEX>.json with its peak resident memory: MXNet
    runs a server's loop inside `import mxnet` and exits the process from there."""
    def write():
        path = os.path.join(probe_dir, "server%d.json" % index)
        with open(path + ".tmp", "w") as f:
            json.dump({"launch_index": index, "peak_rss_mb": peak_rss_mb()}, f)
        os.replace(path + ".tmp", path)
    atexit.register(write)


def run_job(argv: List[str]) -> int:
    """`_job PROBE_JSON START STEPS IFACE -- TRAIN_ARGS`: what every node runs."""
    train_args = argv[argv.index("--") + 1:]
    torch_job = _torch_args(train_args)
    if not torch_job:  # (a torch worker's peak memory holds no MXNet)
        if os.environ.get("DMLC_ROLE") == "server":
            _report_server_memory(os.path.dirname(argv[0]), launch_index() or 0)
        import mxnet  # noqa: F401  (scheduler and servers run their loop here and exit)
    probe_path, start, steps, iface = argv[0], int(argv[1]), int(argv[2]), argv[3]
    probe = _Probe(start, steps, iface)
    spec = importlib.util.spec_from_file_location("slimgc_train_job",
                                                  TRAIN_TORCH if torch_job else TRAIN)
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    result = train.main(train_args, on_step=probe.on_step)
    rec = probe.result()
    rec["rank"] = result.get("rank")
    rec["launch_index"] = launch_index() or 0
    rec["final_test_acc"] = result.get("final_test_acc")
    rec["history"] = result.get("history")
    stats = result.get("kvstore_stats") or {}
    rec["cttab"] = stats.get("cttab")
    rec["cttab_link"] = stats.get("cttab_link")
    rec["comm_threshold_bytes"] = stats.get("comm_threshold_bytes")
    rec["comm_threshold_phase"] = stats.get("comm_threshold_phase")
    for k in ("keys_encoded_in_local_update", "keys_gradient_in_place"):
        rec[k] = stats.get(k)
    rec["model"] = result.get("model")
    rec["peak_rss_mb"] = peak_rss_mb()
    tmp = probe_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(rec, f, indent=1, default=str)
    os.replace(tmp, probe_path)
    return 0


# ---------------------------------------------------------------- running one configuration

@contextlib.contextmanager
def _output_to(path):
    """Send the launcher's forwarded output (and its log) to a file for the duration."""
    f = open(path, "w", buffering=1)
    old = sys.stdout, sys.stderr
    handler = None
    import logging
    handler = logging.StreamHandler(f)
    handler.setFormatter(logging.Formatter("[launcher] %(levelname)s %(message)s"))
    logger = logging.getLogger("slimgc_mx.launch")
    logger.addHandler(handler)
    logger.propagate = False
    sys.stdout = sys.stderr = f
    try:
        yield f
    finally:
        sys.stdout, sys.stderr = old
        logger.removeHandler(handler)
        logger.propagate = True
        f.close()


# Every worker of every configuration gets the launcher's engine threads (or the
# caller's value): the baselines and no-comm run with what SlimGC's workers get.
ENGINE_THREADS = launch.ENGINE_THREADS_VAR


def build_tasks(cluster: Optional[NetnsCluster], workers: int, servers: int,
                command: List[str], comm: bool, stock_servers: bool = False,
                rendezvous=None, torch_job: bool = False) -> List[launch.Task]:
    """The launcher's plan: `--launcher netns` in the harness's namespaces, or local.

    stock_servers: drop the launcher's zero-filled-heap variables from the servers, so that
    MXNet-only baselines (float32 pushes, which that fix does not concern) run as they would
    without slimgc_mx and do not pay its cost. rendezvous (a horovod.Rendezvous): workers
    only, each with Horovod's environment. torch_job: the launcher's --framework torch,
    workers only with torch.distributed's variables, Gloo on the workers' links.
    """
    if comm:
        mode = ["--launcher", "netns", "--bandwidth", cluster.bandwidth or "none"] \
            if cluster is not None else ["--launcher", "local"]
        who = ["--framework", "torch"] if torch_job else ["-s", str(servers)]
        args = launch.parse_args(["-n", str(workers)] + who + mode + ["--"] + command)
        plan = launch.build_plan(args, cluster)
        if stock_servers:
            for t in plan:
                if t.role == "server":
                    for name in SERVER_ENV:
                        t.env.pop(name, None)
        return plan
    # no-comm and Horovod: just the workers, no scheduler or servers, no DMLC roles
    runner = NetnsRunner() if cluster is not None else launch.LocalRunner()
    plan = [launch.Task("worker", i, cluster.ns("worker %d" % i) if cluster else None, runner,
                        {"PYTHONUNBUFFERED": "1", LAUNCH_INDEX_VAR: str(i),
                         **(rendezvous.worker_env(i) if rendezvous else {})})
            for i in range(workers)]
    if ENGINE_THREADS not in os.environ:  # the launcher's engine threads, as the others get
        for t in plan:
            t.env[ENGINE_THREADS] = str(launch.WORKER_ENGINE_THREADS)
    return plan


def job_command(probe_dir: str, start: int, window: int, iface: str, train_args: List[str],
                build: Optional[str] = None) -> List[str]:
    """The shell command every process runs: each worker writes the probe file of its own
    launch index (the shell expands it). `build`: run another checkout's code instead."""
    probe = shlex.quote(os.path.join(probe_dir, "worker")) + '"$%s".json' % LAUNCH_INDEX_VAR
    job = "%s -m slimgc_mx.bench.cluster _job %s %d %d %s -- %s" % (
        shlex.quote(sys.executable), probe, start, window, iface, shlex.join(train_args))
    if build is not None:
        job = "cd %s && PYTHONPATH=%s exec %s" % (shlex.quote(build), shlex.quote(build), job)
    else:
        job = "exec " + job
    return [job]


def run_config(name: str, opts, cluster: Optional[NetnsCluster], outdir: str,
               seed: int = 0, repeat: int = 0, build: Optional[tuple] = None) -> dict:
    """Run one configuration once; returns its summary (also written as NAME.json).

    build: (label, checkout) to run another checkout's code; the record's config is
    then NAME@label.
    """
    label = name if build is None else "%s@%s" % (name, build[0])
    tag = label if opts.mode == "throughput" else "%s.seed%d" % (label, seed)
    if getattr(opts, "repeats", 1) > 1:
        tag += ".r%d" % repeat
    probe_dir = os.path.join(outdir, tag + ".probe")
    os.makedirs(probe_dir, exist_ok=True)
    for f in os.listdir(probe_dir):
        os.remove(os.path.join(probe_dir, f))
    train_args = ["--model", opts.model, "--dataset", opts.dataset, "--batch-size",
                  str(opts.batch_size), "--seed", str(seed), "--no-progress",
                  "--json", os.path.join(probe_dir, "train.json")] + config_args(name)
    if opts.mode == "throughput":
        total = opts.warmup + opts.steps + 1
        train_args += ["--epochs", "1", "--steps", str(total), "--warmup-steps", str(opts.warmup)]
        if opts.dataset.startswith("synthetic"):  # enough samples for every worker's window
            train_args += ["--num-train", str(total * opts.batch_size * opts.workers)]
        start, window = opts.warmup + 1, opts.steps
    else:
        train_args += ["--epochs", str(opts.epochs)]
        start, window = 1, 1
    train_args += opts.train_arg
    iface = NODE_IFACE if cluster is not None else "lo"
    command = job_command(probe_dir, start, window, iface, train_args,
                          None if build is None else build[1])
    stack = contextlib.ExitStack()
    rendezvous = None
    if name in HOROVOD:
        rendezvous = stack.enter_context(horovod_rendezvous(cluster, opts.workers))
    comm = name not in ("no-comm", "torch-no-comm") and rendezvous is None
    plan = build_tasks(cluster, opts.workers, opts.servers, command, comm,
                       stock_servers=not uses_slimgc(name), rendezvous=rendezvous,
                       torch_job=uses_torch(name))
    env = {"SLIMGC_WARMUP_STEPS": str(opts.slimgc_warmup)}
    env["OMP_NUM_THREADS"] = str(opts.threads)
    for t in plan:
        t.env.update(env)
    log_path = os.path.join(outdir, tag + ".log")
    load_before = os.getloadavg()
    t0 = time.monotonic()
    job = launch.LaunchedJob(plan, command, ROOT, linger=opts.linger, kill_grace=3.0)
    with stack, _output_to(log_path):
        status = job.run()
    wall = time.monotonic() - t0
    summary = summarize(label, opts, probe_dir, status, wall, cluster is not None, seed)
    # Load average of the machine before and after (1-min): other work on the machine
    # competes for the same cores and shows up here.
    summary["loadavg_1min"] = [load_before[0], os.getloadavg()[0]]
    summary["log"] = os.path.relpath(log_path, outdir)
    summary["train_command"] = ["python", "scripts/train.py"] + train_args
    with open(os.path.join(outdir, tag + ".json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    return summary


@contextlib.contextmanager
def horovod_rendezvous(cluster: Optional[NetnsCluster], workers: int):
    """Horovod's rendezvous for one job: in the scheduler's namespace, each worker a host of
    its own with a hosts file of its own; on loopback, one host."""
    from . import horovod
    if cluster is None:
        with horovod.Rendezvous(["localhost"] * workers, "lo") as rz:
            yield rz
        return
    labels = ["worker %d" % i for i in range(workers)]
    files = horovod.namespace_hosts_files({cluster.ns(l): cluster.ip(l) for l in labels})
    try:
        with horovod.Rendezvous(["worker-%d" % i for i in range(workers)], NODE_IFACE,
                                (cluster.ns("scheduler"), cluster.ip("scheduler"))) as rz:
            yield rz
    finally:
        horovod.remove_hosts_files(files)


# ---------------------------------------------------------------- summaries

def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def summarize(name, opts, probe_dir, status, wall, netns, seed) -> dict:
    """Merge the workers' probe files into one record for the configuration."""
    probes = []
    for i in range(opts.workers):
        p = os.path.join(probe_dir, "worker%d.json" % i)
        if os.path.exists(p):
            with open(p) as f:
                probes.append(json.load(f))
    out = {"config": name, "seed": seed, "status": status, "wall_s": wall,
           "workers_reported": len(probes), "ok": status == 0 and len(probes) == opts.workers}
    if not probes:
        return out
    root = min(probes, key=lambda p: p.get("rank") or 0)
    out["model"] = root.get("model")
    out["final_test_acc"] = {p["launch_index"]: p.get("final_test_acc") for p in probes}
    out["history"] = root.get("history")
    out["cttab"] = root.get("cttab")
    out["cttab_link"] = root.get("cttab_link")
    out["comm_threshold_bytes"] = root.get("comm_threshold_bytes")
    out["comm_threshold_phase"] = root.get("comm_threshold_phase")
    # per worker: keys encoded in the local update's pass, and of them read in place
    out["gradient_in_place"] = {p["launch_index"]: [p.get("keys_encoded_in_local_update"),
                                                    p.get("keys_gradient_in_place")]
                                for p in probes}
    if opts.mode != "throughput":
        return out
    complete = [p for p in probes if p.get("complete")]
    if len(complete) < len(probes):
        out["ok"] = False
        out["error"] = ("%d of %d workers ran fewer than warmup + steps = %d steps; use a larger "
                        "dataset (train.py --num-train) or fewer --steps"
                        % (len(probes) - len(complete), len(probes), opts.warmup + opts.steps + 1))
    steps = [p["step_s"]["median"] for p in complete]
    step = max(steps) if steps else None  # synchronous: the slowest worker sets the pace
    out["step_s"] = {"median_per_worker": steps, "median": step,
                     "mean": _mean([p["step_s"]["mean"] for p in complete])}
    out["samples_per_s_per_worker"] = opts.batch_size / step if step else None
    out["samples_per_s_total"] = opts.workers * opts.batch_size / step if step else None
    out["cpu_s_per_step_per_worker"] = _mean([p.get("cpu_s_per_step") for p in complete])
    wires = [p["wire"] for p in complete if p.get("wire")]
    if wires and netns:
        rx = _mean([w["rx_bytes"] for w in wires])
        tx = _mean([w["tx_bytes"] for w in wires])
        out["wire_bytes_per_step_per_worker"] = {"rx": rx, "tx": tx, "total": rx + tx,
                                                 "source": "interface counters (eth0 of each "
                                                           "worker namespace, mean over workers)"}
    kvs = [p["kv_per_step"] for p in complete if p.get("kv_per_step")]
    if kvs:
        out["kvstore_per_step_per_worker"] = {k: _mean([kv[k] for kv in kvs])
                                              for k in _Probe.STAT_KEYS}
    out["peak_rss_mb"] = peak_memory(probes, probe_dir)
    return out


def peak_memory(probes, probe_dir) -> dict:
    """Peak resident memory (MB) of every worker and server (by launch index) and the
    largest of each; a server that wrote no report (killed) is missing."""
    workers = {p["launch_index"]: p["peak_rss_mb"] for p in probes if p.get("peak_rss_mb")}
    servers = {}
    for name in sorted(os.listdir(probe_dir)):
        if name.startswith("server") and name.endswith(".json"):
            with open(os.path.join(probe_dir, name)) as f:
                rec = json.load(f)
            servers[rec["launch_index"]] = rec["peak_rss_mb"]
    return {"workers": workers, "servers": servers,
            "worker_max": max(workers.values()) if workers else None,
            "server_max": max(servers.values()) if servers else None}


def time_composition(rec: dict, compute_s: Optional[float],
                     bits_per_s: Optional[float]) -> Optional[dict]:
    """Split a step (s) into compute / exposed, and the communication work that was hidden.

    compute: the no-comm step time (capped by the step); exposed = step - compute;
    wire: the time the measured bytes need at line rate (larger direction / bandwidth);
    compression: the kvstore's compress_s per step, encode + decode apart from the
    optimizer update (0 for MXNet's kvstore);
    overlap = wire + compression - exposed, >= 0: work that did not lengthen the step;
    blocked: time the training thread waited for global weights (slimgc only).
    """
    step = (rec.get("step_s") or {}).get("median")
    if not step or compute_s is None:
        return None
    compute = min(compute_s, step)
    exposed = step - compute
    kv = rec.get("kvstore_per_step_per_worker") or {}
    w = rec.get("wire_bytes_per_step_per_worker")
    wire_t = max(w["tx"], w["rx"]) * 8 / bits_per_s if w and bits_per_s else None
    compress = kv.get("compress_s") or 0.0
    overlap = max(0.0, (wire_t or 0.0) + compress - exposed) if wire_t is not None else None
    return {"step": step, "compute": compute, "exposed": exposed, "wire": wire_t,
            "compression": compress, "overlap": overlap, "blocked": kv.get("blocked_s"),
            "comm_timers_sum": kv.get("comm_s")}


def machine_info() -> dict:
    model = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import mxnet
        mxv = mxnet.__version__
    except Exception:  # noqa: BLE001  (information only)
        mxv = None
    try:  # (not imported: this process stays small)
        from importlib.metadata import version
        torchv = version("torch")
    except Exception:  # noqa: BLE001  (information only)
        torchv = None
    return {"cpu": model, "logical_cpus": os.cpu_count(),
            "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "memory_bytes": mem, "kernel": platform.release(), "python": platform.python_version(),
            "mxnet": mxv, "torch": torchv}


# ---------------------------------------------------------------- command line

def parse_args(argv, prog):
    p = argparse.ArgumentParser(
        prog=prog, description=DESCRIPTION + ".",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Configurations: fp32 (MXNet dist_sync), mxnet-2bit (MXNet's 2bit, threshold 0.5, "
               "push then pull), slimgc-CODEC-{classic,cgopt,offload,full} for CODEC in "
               "1bit/2bit/4bit (classic: compress all, no offload, no backup; cgopt: + threshold "
               "table; offload: + CPU codecs; full: + model backup; any of them + '-nofuse': "
               "full-precision tensors sent one by one), no-comm (the workers train "
               "concurrently with --kvstore local). PyTorch (scripts/train.py --framework torch, "
               "workers only, torch.distributed over Gloo on the same links): torch-ddp (DDP "
               "fp32), torch-fp16 (its fp16_compress_hook), torch-powersgd (its PowerSGD hook, "
               "rank 4, one bucket: bucket_cap_mb=256, as with several it deadlocks over "
               "Gloo), slimgc-torch-CODEC-STEP (SlimGC's DistributedOptimizer, steps as above), "
               "torch-no-comm; 'torch' runs torch-ddp, torch-fp16, torch-powersgd, "
               "slimgc-torch-2bit-full, slimgc-torch-powersgd-full (rank 4) and torch-no-comm, "
               "'torch-all' every codec's slimgc-torch-CODEC-full instead of those two.\n\n"
               "examples:\n"
               "  %(prog)s --model vgg --workers 2 --bandwidth 1gbit --configs fp32,mxnet-2bit,"
               "slimgc-2bit,no-comm\n"
               "  %(prog)s --mode accuracy --model cnn1d --dataset mnist1d --workers 4 "
               "--configs fp32,slimgc-2bit-classic,slimgc-2bit-cgopt,slimgc-2bit-full "
               "--epochs 10 --seeds 0,1,2 --no-netns\n"
               "  %(prog)s --model fc --dataset synthetic-cifar --workers 2 --configs "
               "torch,slimgc-2bit-full --repeats 3\n"
               "  %(prog)s --cleanup        # delete namespaces left by a killed run")
    p.add_argument("--mode", choices=("throughput", "accuracy"), default="throughput",
                   help="throughput: timed steps after a warm-up; accuracy: full epochs, test "
                        "accuracy per epoch (default: %(default)s)")
    p.add_argument("--model", default="vgg", help="train.py --model (default: %(default)s)")
    p.add_argument("--dataset", default="synthetic-cifar",
                   help="train.py --dataset (default: %(default)s)")
    p.add_argument("--workers", type=int, default=2, help="worker count (default: %(default)s)")
    p.add_argument("--servers", type=int, default=None, help="server count (default: = workers)")
    p.add_argument("--bandwidth", default="1gbit",
                   help="tc rate of every node's link, each direction, e.g. 1gbit, 10gbit, 'none' "
                        "(default: %(default)s)")
    p.add_argument("--delay", default=None,
                   help="extra one-way delay on every node's egress, e.g. 0.1ms (default: none)")
    p.add_argument("--configs", default="fp32,mxnet-2bit,slimgc-2bit,no-comm",
                   help="'all' or a comma list; slimgc-CODEC and slimgc-torch-CODEC expand "
                        "to their 4 ablation steps, 'torch' and 'torch-all' to PyTorch's set "
                        "(default: %(default)s)")
    p.add_argument("--codecs", default="1bit,2bit,4bit",
                   help="codecs that --configs all covers (default: %(default)s)")
    p.add_argument("--steps", type=int, default=20,
                   help="throughput: timed steps per configuration (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=1,
                   help="throughput: run every configuration this many times, interleaved "
                        "(config A, B, ..., A, B, ...); each row reports the run with the "
                        "median samples/s and the spread of all runs (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=10,
                   help="throughput: steps before the timed window; must cover the CTTab "
                        "warm-up (default: %(default)s)")
    p.add_argument("--slimgc-warmup", type=int, default=6,
                   help="SLIMGC_WARMUP_STEPS for slimgc runs (library default 20; fewer keeps "
                        "runs short) (default: %(default)s)")
    p.add_argument("--epochs", type=int, default=10, help="accuracy: epochs (default: %(default)s)")
    p.add_argument("--seeds", default="0", help="accuracy: comma list of seeds (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=32, help="per worker (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None,
                   help="OMP_NUM_THREADS for every process, the same in every configuration "
                        "(default: $OMP_NUM_THREADS, else the launcher's rule: CPUs // workers, "
                        "at least 1, since the workers share this machine's cores)")
    p.add_argument("--train-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for train.py, repeatable, e.g. --train-arg=--lr-schedule "
                        "--train-arg=cosine (default: none)")
    p.add_argument("--out", default=None,
                   help="result folder (default: results/cluster/MODEL-WORKERSw-BANDWIDTH or "
                        "results/accuracy/MODEL-WORKERSw)")
    p.add_argument("--build", action="append", default=[], metavar="LABEL=DIR",
                   help="also run every configuration with the code of another checkout DIR "
                        "(its kernels built in place), interleaved with this one's; its rows "
                        "are CONFIG@LABEL, e.g. --build before=../old-checkout (default: none)")
    p.add_argument("--no-netns", action="store_true",
                   help="run on loopback without namespaces or rate limits (no root needed; "
                        "bytes are then not measured)")
    p.add_argument("--linger", type=float, default=10.0,
                   help="seconds servers may outlive the workers (default: %(default)s)")
    p.add_argument("--cleanup", action="store_true",
                   help="delete namespaces left behind by runs that died, then exit")
    p.add_argument("--force", action="store_true", help="with --cleanup: also those of live runs")
    opts = p.parse_args(argv)
    if opts.servers is None:
        opts.servers = opts.workers
    if opts.bandwidth.lower() in ("none", "0", ""):
        opts.bandwidth = None
    elif not RATE_PATTERN.match(opts.bandwidth):
        p.error("--bandwidth %r: expected a tc rate such as 1gbit, 10gbit, 100mbit" % opts.bandwidth)
    if opts.delay and not DELAY_PATTERN.match(opts.delay):
        p.error("--delay %r: expected a time such as 0.1ms, 100us" % opts.delay)
    if opts.steps < 1 or opts.warmup < 0 or opts.workers < 1 or opts.repeats < 1:
        p.error("need --steps >= 1, --warmup >= 0, --workers >= 1, --repeats >= 1")
    codecs = [c for c in opts.codecs.split(",") if c]
    try:
        opts.config_list = parse_configs(opts.configs, codecs)
    except ValueError as e:
        p.error(str(e))
    if opts.threads is not None and opts.threads < 1:
        p.error("--threads must be at least 1")
    if opts.threads is None:
        try:
            opts.threads = env_count("OMP_NUM_THREADS", "unset it or pass --threads N")
        except ValueError as e:
            p.error(str(e))
        if opts.threads is None:
            opts.threads = launch.omp_threads(opts.workers)
    try:
        opts.engine_threads = (env_count(ENGINE_THREADS, "unset it to give workers %d"
                                         % launch.WORKER_ENGINE_THREADS)
                               or launch.WORKER_ENGINE_THREADS)
    except ValueError as e:
        p.error(str(e))
    if (opts.mode == "throughput" and any(uses_slimgc(c) for c in opts.config_list)
            and opts.warmup < opts.slimgc_warmup + 2):
        p.error("--warmup must be at least --slimgc-warmup + 2 so the window starts after the "
                "threshold table is built")
    opts.builds = [None]
    for item in opts.build:
        label, sep, path = item.partition("=")
        if not sep or not label or not os.path.isfile(os.path.join(path, "scripts", "train.py")):
            p.error("--build %r: expected LABEL=DIR with DIR a checkout of this project" % item)
        opts.builds.append((label, os.path.abspath(path)))
    opts.labels = [c if b is None else "%s@%s" % (c, b[0])
                   for c in opts.config_list for b in opts.builds]
    opts.seed_list = [int(s) for s in opts.seeds.split(",") if s.strip()]
    if opts.out is None:
        bw = opts.bandwidth or "unlimited"
        opts.out = (os.path.join("results", "cluster", "%s-%dw-%s" % (opts.model, opts.workers, bw))
                    if opts.mode == "throughput"
                    else os.path.join("results", "accuracy", "%s-%dw" % (opts.model, opts.workers)))
    opts.out = os.path.abspath(opts.out)  # the jobs run in the checkout's root, not here
    return opts


def _fmt(x, spec="%.1f"):
    return "-" if x is None else spec % x


def main(argv=None, prog="python -m slimgc_mx.bench cluster"):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "_job":
        return run_job(argv[1:])
    opts = parse_args(argv, prog)
    if opts.cleanup:
        ok, why = netns_available()
        if os.geteuid() != 0 or shutil.which("ip") is None:
            print("cleanup: nothing to do (%s)" % why)
            return 0
        removed = cleanup_stale(force=opts.force)
        print("cleanup: removed %d namespace(s)%s" % (len(removed),
                                                     (": " + ", ".join(removed)) if removed else ""))
        return 0
    os.makedirs(opts.out, exist_ok=True)
    if any(c in HOROVOD for c in opts.config_list):
        from . import horovod
        if not horovod.installed():
            skipped = [c for c in opts.config_list if c in HOROVOD]
            print("NOTE: Horovod is not installed; skipping %s (bash scripts/run.sh horovod "
                  "installs it)" % ", ".join(skipped), file=sys.stderr)
            opts.config_list = [c for c in opts.config_list if c not in HOROVOD]
            opts.labels = [l for l in opts.labels if l.split("@")[0] not in HOROVOD]
    if any(uses_torch(c) for c in opts.config_list) and importlib.util.find_spec("torch") is None:
        skipped = [c for c in opts.config_list if uses_torch(c)]
        print("NOTE: PyTorch is not installed; skipping %s" % ", ".join(skipped),
              file=sys.stderr)
        opts.config_list = [c for c in opts.config_list if not uses_torch(c)]
        opts.labels = [l for l in opts.labels if not uses_torch(l.split("@")[0])]
    netns_note = None
    use_netns = not opts.no_netns
    if use_netns:
        ok, why = netns_available()
        if not ok:
            use_netns = False
            netns_note = ("no emulated network: %s. Fell back to loopback without rate limits; "
                          "bytes on the wire are not measured." % why)
            print("WARNING: " + netns_note, file=sys.stderr)
    else:
        netns_note = "--no-netns: loopback, no rate limit, bytes on the wire not measured"
    if use_netns and opts.delay and not netem_available():
        print("error: --delay needs the kernel's netem qdisc, which this kernel lacks "
              "(tc qdisc add ... netem: unknown kind); run without --delay", file=sys.stderr)
        return 2
    header = {"command": [prog] + argv, "mode": opts.mode, "model": opts.model,
              "dataset": opts.dataset, "workers": opts.workers, "servers": opts.servers,
              "bandwidth": opts.bandwidth if use_netns else None,
              "delay": opts.delay if use_netns else None, "netns": use_netns, "note": netns_note,
              "steps": opts.steps, "warmup": opts.warmup, "slimgc_warmup_steps": opts.slimgc_warmup,
              "batch_size": opts.batch_size, "threads": opts.threads,
              "worker_engine_threads": opts.engine_threads,
              # SLIMGC_* options every process inherits from the caller (the warm-up steps
              # are slimgc_warmup_steps: the harness sets them per process)
              "builds": {b[0]: b[1] for b in opts.builds if b is not None},
              "slimgc_environment": project_variables(),
              "machine": machine_info(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    print("cluster bench: %s on %s, %s + %s, OMP_NUM_THREADS=%d, "
          "MXNET_CPU_WORKER_NTHREADS=%d (workers), %s -> %s"
          % (opts.model, opts.dataset, launch.plural(opts.workers, "worker"),
             launch.plural(opts.servers, "server"), opts.threads,
             header["worker_engine_threads"],
             ("netns, %s%s" % (opts.bandwidth or "unlimited",
                               ", delay %s" % opts.delay if opts.delay else ""))
             if use_netns else "loopback", opts.out), flush=True)
    if header["slimgc_environment"]:
        print("  every process inherits " + " ".join(
            "%s=%s" % kv for kv in header["slimgc_environment"].items()), flush=True)

    def on_signal(signum, frame):
        raise KeyboardInterrupt
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    results = []
    status = 0
    try:
        cluster = None
        with contextlib.ExitStack() as stack:
            if use_netns:
                cluster = stack.enter_context(NetnsCluster(
                    opts.servers, opts.workers, opts.bandwidth, opts.delay))
            seeds = opts.seed_list if opts.mode == "accuracy" else [0]
            repeats = opts.repeats if opts.mode == "throughput" else 1
            runs = [(c, s, k, b) for s in seeds for k in range(repeats) for c in opts.config_list
                    for b in opts.builds]
            for k, (name, seed, rep, build) in enumerate(runs, 1):
                label = name if build is None else "%s@%s" % (name, build[0])
                if opts.mode != "throughput":
                    label += " seed %d" % seed
                if repeats > 1:
                    label += " (run %d/%d)" % (rep + 1, repeats)
                print("[%d/%d] %s ..." % (k, len(runs), label), end=" ", flush=True)
                rec = run_config(name, opts, cluster, opts.out, seed, rep, build)
                rec["repeat"] = rep
                results.append(rec)
                if rec.get("status", 0) in INTERRUPTED:  # the user stopped the job: stop here
                    raise KeyboardInterrupt
                if not rec["ok"]:
                    status = 1
                    print("FAILED (exit %s; %s)" % (rec["status"], rec.get("error")
                                                     or "see " + rec["log"]), flush=True)
                elif opts.mode == "throughput":
                    wire = (rec.get("wire_bytes_per_step_per_worker") or {}).get("total")
                    rss = rec.get("peak_rss_mb") or {}
                    print("%s samples/s/worker, step %s s, %s MB/step/worker, peak RSS "
                          "worker %s / server %s MB, %.0f s"
                          % (_fmt(rec["samples_per_s_per_worker"]),
                             _fmt(rec["step_s"]["median"], "%.3f"),
                             _fmt(wire / 1e6 if wire is not None else None, "%.2f"),
                             _fmt(rss.get("worker_max"), "%.0f"),
                             _fmt(rss.get("server_max"), "%.0f"), rec["wall_s"]), flush=True)
                else:
                    accs = list(rec["final_test_acc"].values())
                    print("final acc %s, %.0f s" % (_fmt(_mean(accs), "%.4f"), rec["wall_s"]),
                          flush=True)
    except KeyboardInterrupt:
        print("\ninterrupted; namespaces removed", file=sys.stderr)
        status = 130
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        summary = dict(header, finished=time.strftime("%Y-%m-%d %H:%M:%S"), results=results)
        if opts.mode == "throughput":
            if opts.repeats > 1:
                summary.update(repeats=opts.repeats, runs=results,
                               results=merge_repeats(results, opts.labels))
            add_derived(summary)
            summary["build_ratios"] = build_ratios(results, opts.config_list, opts.builds)
        with open(os.path.join(opts.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1, default=str)
        print("wrote %s" % os.path.join(opts.out, "summary.json"), flush=True)
    if opts.mode == "throughput" and results:
        print(format_table(summary))
        for line in format_torch_ratios(summary) + format_build_ratios(
                summary.get("build_ratios") or {}):
            print(line)
    return status


def build_ratios(records: List[dict], configs: List[str], builds) -> Dict[str, dict]:
    """Per configuration and other build: this checkout's samples/s over the other's, per
    round (the runs of one repeat are side by side) and of the medians."""
    out = {}
    for name in configs:
        mine = {r.get("repeat", 0): r.get("samples_per_s_per_worker") for r in records
                if r["config"] == name and r.get("ok")}
        for build in builds[1:]:
            label = "%s@%s" % (name, build[0])
            theirs = {r.get("repeat", 0): r.get("samples_per_s_per_worker") for r in records
                      if r["config"] == label and r.get("ok")}
            rounds = [mine[k] / theirs[k] for k in sorted(mine) if theirs.get(k)]
            med = (statistics.median(mine.values()) / statistics.median(theirs.values())
                   if mine and theirs else None)
            out[label] = {"per_round": rounds, "of_medians": med}
    return out


def format_build_ratios(ratios: Dict[str, dict]) -> List[str]:
    return ["%s: this checkout / %s = %s per round, %s of the medians"
            % (label.split("@")[0], label.split("@")[1],
               ", ".join("%.3f" % x for x in r["per_round"]) or "-", _fmt(r["of_medians"], "%.3f"))
            for label, r in ratios.items()]


def merge_repeats(records: List[dict], configs: List[str]) -> List[dict]:
    """One row per configuration: its run with the median samples/s, plus every run's value.

    The median run (the lower one for an even count) stands for the configuration
    in ratios and plots, so its wire bytes and time split are from a real run.
    """
    rows = []
    for name in configs:
        mine = [r for r in records if r["config"] == name]
        runs = [r for r in mine if r.get("ok") and r.get("samples_per_s_per_worker")]
        ok = sorted(runs, key=lambda r: r["samples_per_s_per_worker"])
        if not ok:
            rows.append(dict(mine[0], runs_ok=0, runs=len(mine)))
            continue
        row = dict(ok[(len(ok) - 1) // 2])
        row["runs_ok"], row["runs"] = len(ok), len(mine)
        row["samples_per_s_runs"] = [r["samples_per_s_per_worker"] for r in runs]
        row["comm_threshold_runs"] = [r.get("comm_threshold_bytes") for r in runs]
        rows.append(row)
    return rows


def add_derived(summary: dict):
    """Ratios to mxnet-2bit / fp32 / no-comm / the better Horovod, CPU-seconds per step
    against no-comm's, and the time composition, in place."""
    by = {r["config"]: r for r in summary["results"] if r.get("ok")}

    def thr(name):
        return (by.get(name) or {}).get("samples_per_s_per_worker")

    hvd = max((thr(h) for h in HOROVOD if thr(h)), default=None)
    hook = max((thr(h) for h in TORCH_HOOKS if thr(h)), default=None)

    def alone(name):  # a row's own framework's no-comm: its compute time and CPU-seconds
        nocomm = by.get("torch-no-comm" if _is_torch(name) else "no-comm") or {}
        return (nocomm.get("step_s") or {}).get("median"), nocomm.get("cpu_s_per_step_per_worker")
    for r in summary["results"]:
        if not r.get("ok"):
            continue
        s = r.get("samples_per_s_per_worker")
        r["vs"] = {b: (s / thr(b) if s and thr(b) else None) for b in ("mxnet-2bit", "fp32", "no-comm")}
        r["vs"]["horovod"] = s / hvd if s and hvd else None  # the better of fp32 and fp16
        for b in ("torch-ddp", "torch-powersgd", "torch-no-comm"):
            r["vs"][b] = s / thr(b) if s and thr(b) else None
        r["vs"]["torch-hook"] = s / hook if s and hook else None  # the best of DDP's three
        compute, cpu_nocomm = alone(r["config"])
        cpu = r.get("cpu_s_per_step_per_worker")
        r["cpu_vs_no_comm"] = cpu / cpu_nocomm if cpu and cpu_nocomm else None
        bw = summary.get("bandwidth")
        r["time_composition_s"] = time_composition(r, compute, rate_bits(bw) if bw else None)


def _is_torch(name: str) -> bool:
    """uses_torch() for a row's config (CONFIG or CONFIG@BUILD), False for one not known."""
    try:
        return uses_torch(name.split("@")[0])
    except ValueError:
        return False


def format_torch_ratios(summary: dict) -> List[str]:
    """A line per SlimGC-on-PyTorch row: its samples/s over DDP's, the best hook's, PowerSGD's
    and torch-no-comm's (issue 31's targets), when those rows are there."""
    lines = []
    for r in summary["results"]:
        vs = r.get("vs") or {}
        if not r.get("ok") or not r["config"].startswith("slimgc-torch-"):
            continue
        parts = ["%.2fx %s" % (vs[k], label) for k, label in (
            ("torch-ddp", "torch-ddp"), ("torch-hook", "the best PyTorch hook"),
            ("torch-powersgd", "torch-powersgd"), ("torch-no-comm", "torch-no-comm"))
            if vs.get(k)]
        if parts:
            lines.append("%s: %s" % (r["config"], ", ".join(parts)))
    return lines


def format_table(summary: dict) -> str:
    """The throughput table: ratios, wire bytes, CPU-seconds per step, CTTab threshold,
    peak resident memory (MB) of the largest worker and server."""
    head = ("config", "samples/s", "xmx2bit", "xfp32", "xhvd", "xnocomm", "MB/step/wkr",
            "CPU s/step", "xcpu", "CT", "RSS wkr", "RSS srv")
    fmt = "%-26s %10s %8s %8s %8s %8s %12s %10s %6s %8s %8s %8s"
    lines = [fmt % head]
    for r in summary["results"]:
        if not r.get("ok"):
            lines.append("%-26s FAILED" % r["config"])
            continue
        vs = r.get("vs") or {}
        wire = (r.get("wire_bytes_per_step_per_worker") or {}).get("total")
        ct = r.get("comm_threshold_bytes")
        rss = r.get("peak_rss_mb") or {}
        lines.append(fmt % (
            r["config"], _fmt(r.get("samples_per_s_per_worker")),
            _fmt(vs.get("mxnet-2bit"), "%.2f"), _fmt(vs.get("fp32"), "%.2f"),
            _fmt(vs.get("horovod"), "%.2f"), _fmt(vs.get("no-comm"), "%.2f"),
            _fmt(wire / 1e6 if wire is not None else None, "%.2f"),
            _fmt(r.get("cpu_s_per_step_per_worker"), "%.3f"),
            _fmt(r.get("cpu_vs_no_comm"), "%.2f"), "-" if ct is None else str(ct),
            _fmt(rss.get("worker_max"), "%.0f"), _fmt(rss.get("server_max"), "%.0f")))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
