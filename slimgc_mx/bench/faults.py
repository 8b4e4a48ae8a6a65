"""Fault drills: kill -9 a worker, a server or the scheduler of a training job at a random
moment, let the launcher restart it (--max-restarts) from its checkpoints, and check that
the job ends with the same weights as an uninterrupted run.

Each drill runs scripts/train.py through the launcher with --checkpoint-dir and
--log-every 1, watches rank 0's step lines, kills its victim when the chosen step is
reached (step 0: during start-up), and measures the time from the kill to the first
step trained again and the steps trained twice. See docs/reliability.md.
"""
import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import List, Optional

from ..env import LAUNCH_INDEX_VAR

DESCRIPTION = "fault drills: kill -9 a node at a random moment; restart, resume, same weights"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(ROOT, "scripts", "train.py")
VICTIMS = ("worker", "server", "scheduler")

_STEP = re.compile(r"^\[rank 0\] step (\d+) ")
_RESUMED = re.compile(r"^\[rank 0\] resumed from (\S+): .*\((\d+) steps done\)")
_RESTART = re.compile(r"restart (\d+) of (\d+) after")


@dataclass
class Drill:
    """One run: what was killed when, and what the job did about it."""
    victim: str                         # 'worker 1', 'server 0', 'scheduler'
    target_step: int                    # kill once rank 0 has logged this step (0: start-up)
    exit_code: Optional[int] = None
    killed: bool = False
    killed_after_step: Optional[int] = None   # rank 0's last logged step at the kill
    resumed_from_step: Optional[int] = None   # the checkpoint the restart loaded (0: none)
    steps_recomputed: Optional[int] = None
    restarts: int = 0
    detect_s: Optional[float] = None    # kill -> the launcher announces the restart
    resumed_s: Optional[float] = None   # kill -> the restarted job has loaded its checkpoint
    recover_s: Optional[float] = None   # kill -> the first step trained after the restart
    weights_sha256: Optional[str] = None
    same_weights: Optional[bool] = None
    wall_s: Optional[float] = None
    log: List[str] = field(default_factory=list, repr=False)


def _descendants(pid):
    """Every process below `pid` (from /proc/PID/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir("/proc/%d/task" % p)
        except FileNotFoundError:
            continue
        for t in tasks:
            try:
                with open("/proc/%d/task/%s/children" % (p, t)) as f:
                    kids = [int(x) for x in f.read().split()]
            except FileNotFoundError:
                kids = []
            out += kids
            todo += kids
    return out


def _environ(pid):
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(i.decode(errors="replace").split("=", 1) for i in items if b"=" in i)


def find_node(launcher_pid, role, index):
    """The pid of the job's process with DMLC_ROLE=role and launch index `index`, the topmost
    one if a shell wraps it (killing it ends the node: the launcher watches that pid)."""
    for pid in _descendants(launcher_pid):
        env = _environ(pid)
        if env.get("DMLC_ROLE") == role and env.get(LAUNCH_INDEX_VAR, "0") == str(index):
            return pid
    return None


def _command(args, out, checkpoint_dir, restarts):
    train = ["--model", args.model, "--dataset", args.dataset, "--epochs", str(args.epochs),
             "--batch-size", str(args.batch_size), "--compressor", args.compressor,
             "--comm-threshold", args.comm_threshold, "--seed", str(args.seed),
             "--checkpoint-dir", checkpoint_dir, "--checkpoint-every", str(args.checkpoint_every),
             "--log-every", "1", "--no-progress", "--json", os.path.join(out, "result.json")]
    if args.steps:
        train += ["--steps", str(args.steps)]
    return ([sys.executable, "-m", "slimgc_mx.launch", "-n", str(args.workers),
             "-s", str(args.servers), "--launcher", "local", "--kill-grace", str(args.kill_grace),
             "--max-restarts", str(restarts), "--"] + [sys.executable, TRAIN] + train)


def run_job(args, out, victim=None, target_step=0, rng=None):
    """Run the job once (a drill when `victim` is (role, index)); returns a Drill."""
    os.makedirs(out, exist_ok=True)
    label = "none" if victim is None else (
        victim[0] if victim[0] == "scheduler" else "%s %d" % victim)
    drill = Drill(victim=label, target_step=target_step)
    argv = _command(args, out, os.path.join(out, "checkpoints"),
                    args.max_restarts if victim else 0)
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    lines = []  # (time, line)
    cond = threading.Condition()

    def read():
        for raw in proc.stdout:
            with cond:
                lines.append((time.monotonic(), raw.decode(errors="replace").rstrip("\n")))
                cond.notify_all()
        with cond:
            lines.append((time.monotonic(), None))
            cond.notify_all()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = t0 + args.job_timeout
    kill_time = None
    try:
        if victim is not None:
            kill_time = _kill_when(proc, lines, cond, victim, target_step, rng, deadline, drill)
        proc.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _stop(proc)
        raise RuntimeError("job in %s still running after %g s (--job-timeout); its last "
                           "lines:\n%s" % (out, args.job_timeout,
                                           "\n".join(l for _, l in lines[-30:] if l)))
    finally:
        if proc.poll() is None:
            _stop(proc)
        reader.join(10)
    drill.wall_s = time.monotonic() - t0
    drill.exit_code = proc.returncode
    drill.log = [l for _, l in lines if l is not None]
    if kill_time is not None:
        _measure(drill, lines, kill_time)
    try:
        with open(os.path.join(out, "result.json")) as f:
            drill.weights_sha256 = json.load(f)["weights_sha256"]
    except (OSError, ValueError, KeyError):
        pass
    with open(os.path.join(out, "output.log"), "w") as f:
        f.write("\n".join(drill.log) + "\n")
    return drill


def _kill_when(proc, lines, cond, victim, target_step, rng, deadline, drill):
    """Wait for the moment, then SIGKILL the victim; returns the kill's time (None if the
    job ended first)."""
    role, index = victim
    pid, seen, last_step, moment = None, 0, 0, None
    while time.monotonic() < deadline and proc.poll() is None:
        with cond:
            cond.wait_for(lambda: len(lines) > seen, timeout=0.05)
            new, seen = lines[seen:], len(lines)
        for _, line in new:
            m = line and _STEP.match(line)
            if m:
                last_step = int(m.group(1))
        if pid is None:
            pid = find_node(proc.pid, role, index)
            if pid is not None and target_step == 0:
                moment = time.monotonic() + rng.uniform(0.0, 1.5)  # somewhere in start-up
        if pid is None:
            continue
        if (target_step and last_step >= target_step) or (moment and time.monotonic() >= moment):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                return None
            drill.killed, drill.killed_after_step = True, last_step
            return time.monotonic()
    return None


def _measure(drill, lines, kill_time):
    """Restart, resumed checkpoint, first step after it: from the lines after the kill."""
    after = [(t, l) for t, l in lines if l is not None and t >= kill_time]
    restart = next(((t, l) for t, l in after if _RESTART.search(l)), None)
    drill.restarts = sum(1 for _, l in after if _RESTART.search(l))
    if restart is None:
        return
    drill.detect_s = restart[0] - kill_time
    later = [(t, l) for t, l in after if t >= restart[0]]
    resumed = next(((t, int(_RESUMED.match(l).group(2))) for t, l in later if _RESUMED.match(l)),
                   None)
    drill.resumed_from_step = resumed[1] if resumed else 0
    if resumed:
        drill.resumed_s = resumed[0] - kill_time
    # The job may train on after the kill until it is torn down (a dead scheduler is
    # noticed by the launcher, not by the workers): count every step it trained.
    trained = [int(_STEP.match(l).group(1)) for t, l in lines
               if l is not None and t < restart[0] and _STEP.match(l)]
    drill.steps_recomputed = max(0, max(trained, default=0) - drill.resumed_from_step)
    first = next((t for t, l in later if _STEP.match(l)), None)
    if first is not None:
        drill.recover_s = first - kill_time


def _stop(proc):
    """SIGTERM the launcher (it tears its job down), SIGKILL its group if it lingers."""
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            pass


def markdown(drills):
    """The drills as a Markdown table (docs/reliability.md)."""
    rows = ["| node killed | moment | exit | restarts | resumed from step | steps recomputed "
            "| kill -> restart | kill -> resumed | kill -> training again | same weights |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for d in drills:
        moment = ("start-up" if d.target_step == 0 else "after step %s" % d.killed_after_step)
        rows.append("| %s | %s | %s | %d | %s | %s | %s | %s | %s | %s |" % (
            d.victim, moment if d.killed else "not killed (job ended first)", d.exit_code,
            d.restarts, _fmt(d.resumed_from_step), _fmt(d.steps_recomputed),
            _secs(d.detect_s), _secs(d.resumed_s), _secs(d.recover_s),
            "yes" if d.same_weights else "**no**"))
    return "\n".join(rows)


def _fmt(v):
    return "-" if v is None else str(v)


def _secs(v):
    return "-" if v is None else "%.1f s" % v


def build_parser(prog):
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--victims", default=",".join(VICTIMS),
                   help="comma list of node kinds to kill, one drill each per --moments "
                        "(default: %(default)s)")
    p.add_argument("--moments", type=int, default=1,
                   help="drills per node kind, each at its own random moment (default: 1)")
    p.add_argument("--rng-seed", type=int, default=None,
                   help="seed of the random moments and victims (default: random, printed)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--max-restarts", type=int, default=2)
    p.add_argument("--kill-grace", type=float, default=2.0,
                   help="the launcher's --kill-grace (default: %(default)s)")
    p.add_argument("--model", default="mlp")
    p.add_argument("--dataset", default="digits")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--steps", type=int, default=None, help="cap on steps per epoch")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--compressor", default="2bit")
    p.add_argument("--comm-threshold", default="4000",
                   help="fixed, so the route of every tensor does not depend on timing "
                        "(default: %(default)s bytes)")
    p.add_argument("--seed", type=int, default=0, help="train.py --seed")
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--job-timeout", type=float, default=300.0,
                   help="seconds any one job may take (default: %(default)s)")
    p.add_argument("--out", default="results/faults", help="output directory")
    return p


def main(argv=None, prog=None):
    args = build_parser(prog).parse_args(argv)
    victims = [v.strip() for v in args.victims.split(",") if v.strip()]
    bad = [v for v in victims if v not in VICTIMS]
    if bad or not victims or args.moments < 1:
        print("%s: error: --victims takes a comma list of %s, --moments >= 1"
              % (prog, ", ".join(VICTIMS)), file=sys.stderr)
        return 2
    seed = args.rng_seed if args.rng_seed is not None else random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    print("fault drills, --rng-seed %d" % seed, flush=True)
    reference = run_job(args, os.path.join(args.out, "reference"))
    total = sum(1 for l in reference.log if _STEP.match(l))
    print("reference: exit %s, %d steps, %.1f s, weights %s"
          % (reference.exit_code, total, reference.wall_s, reference.weights_sha256), flush=True)
    if reference.exit_code != 0 or not reference.weights_sha256 or total < 2:
        print("the uninterrupted run failed; see %s/reference/output.log" % args.out,
              file=sys.stderr)
        return 1
    drills = []
    for kind in victims:
        for m in range(args.moments):
            index = 0 if kind == "scheduler" else rng.randrange(
                args.workers if kind == "worker" else args.servers)
            target = rng.randrange(total)  # 0: during start-up
            out = os.path.join(args.out, "%s-%d" % (kind, m))
            d = run_job(args, out, (kind, index), target, rng)
            d.same_weights = d.weights_sha256 == reference.weights_sha256
            drills.append(d)
            print("%-9s killed %s: exit %s, %d restart(s), resumed from step %s, %s steps "
                  "recomputed, training again %s after the kill, same weights: %s"
                  % (d.victim, "in start-up" if target == 0 else
                     "after step %s" % d.killed_after_step,
                     d.exit_code, d.restarts, _fmt(d.resumed_from_step),
                     _fmt(d.steps_recomputed), _secs(d.recover_s), d.same_weights), flush=True)
    table = markdown(drills)
    print("\n" + table)
    with open(os.path.join(args.out, "faults.json"), "w") as f:
        json.dump({"rng_seed": seed, "args": vars(args), "reference_steps": total,
                   "reference": {k: v for k, v in asdict(reference).items() if k != "log"},
                   "drills": [{k: v for k, v in asdict(d).items() if k != "log"}
                              for d in drills]}, f, indent=1)
    ok = all(d.exit_code == 0 and d.same_weights and d.killed for d in drills)
    return 0 if ok else 1
