"""Launcher for MXNet parameter-server jobs: 1 scheduler, S servers, W workers, local or over ssh.

Every process runs the same COMMAND; only DMLC_* variables tell it its role.
Usage: python -m slimgc_mx.launch -n 2 -s 2 python train.py   (see docs/launcher.md)
"""
import argparse
import errno
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ._threads import available_cpus
from .servers import SERVER_ENV, SERVER_ENV_TEXT

log = logging.getLogger("slimgc_mx.launch")

USAGE_ERROR = 2
DEFAULT_LINGER = 10.0
DEFAULT_KILL_GRACE = 3.0
POLL_INTERVAL = 0.05


class LaunchError(Exception):
    """A problem with the options or the environment, reported as a usage error (exit 2)."""


class StartError(Exception):
    """A task's command could not be started at all (exit 127, as a shell does)."""


# ---------------------------------------------------------------- option parsing helpers

def parse_env_items(items: List[str], option: str) -> Dict[str, str]:
    """Turn ['K:V', 'K2'] into {K: V, K2: <launcher's value of K2>}, as launch.py's --env does."""
    env = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not key.isidentifier():
            raise LaunchError(f"{option} {item!r}: expected NAME:VALUE or NAME")
        if not sep:
            if key not in os.environ:
                raise LaunchError(f"{option} {key}: no value given and {key} is not set here")
            value = os.environ[key]
        env[key] = value
    return env


def read_hostfile(path: str) -> List[Tuple[str, Optional[int]]]:
    """Read 'host' or 'host:sshport' lines ('#' comments, blank lines ignored) into (host, port)."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError as e:
        raise LaunchError(f"cannot read hostfile {path}: {e.strerror}") from None
    hosts = []
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host, sep, port_text = line.partition(":")
        bad = not host or any(c.isspace() for c in line) or (sep and not port_text.isdigit())
        port = int(port_text) if sep and not bad else None
        if bad or (port is not None and not 0 < port < 65536):
            raise LaunchError(f"hostfile {path} line {number}: {raw.strip()!r} is not HOST or HOST:SSH_PORT")
        hosts.append((host, port))
    if not hosts:
        raise LaunchError(f"hostfile {path} lists no hosts")
    return hosts


def free_port() -> int:
    """Ask the kernel for a TCP port nobody listens on."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def check_port(port: int) -> None:
    """Fail with a clear message when `port` cannot be bound here (the scheduler would die)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the scheduler's socket does
        try:
            s.bind(("", port))
        except OSError as e:
            why = "is already in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
            raise LaunchError(
                f"port {port} {why}; pass another --port, or leave --port out to pick a free one"
            ) from None


def route_ip(host: str) -> str:
    """The address of this machine that `host` reaches us at (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        log.warning("cannot find a route to %s; using 127.0.0.1 as root URI (set --root-uri)", host)
        return "127.0.0.1"


def shell_command(command: List[str]) -> str:
    """One argument is a shell string as is; several are an argv, quoted into one."""
    return command[0] if len(command) == 1 else shlex.join(command)


# ---------------------------------------------------------------- node runners

class Runner:
    """How to start a command with extra environment on one node; subclass for new node kinds.

    start() returns a Popen whose process leads its own session (so its whole group can be
    killed), with stdout/stderr as pipes. A runner must make the job on the node end when
    that process is killed.
    """

    def start(self, node: Optional[str], command: List[str], env: Dict[str, str],
              cwd: str) -> subprocess.Popen:
        raise NotImplementedError

    @staticmethod
    def spawn(argv: List[str], env: Optional[Dict[str, str]], cwd: Optional[str],
              stdin=subprocess.DEVNULL) -> subprocess.Popen:
        """Popen in a new session with piped output: the common part of every runner."""
        return subprocess.Popen(argv, env=env, cwd=cwd, stdin=stdin, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)


class LocalRunner(Runner):
    """Run on this machine with the launcher's environment plus `env`."""

    def start(self, node, command, env, cwd):
        argv = ["/bin/sh", "-c", command[0]] if len(command) == 1 else list(command)
        return self.spawn(argv, {**os.environ, **env}, cwd)


# Remote side of an ssh task: run the job in its own session and kill that session when
# stdin reaches EOF (the launcher's ssh client died or the launcher closed it), and when
# the job's main process exits (no grandchild outlives it).
# (fd 3 keeps stdin: a background list without job control otherwise reads /dev/null.)
_REMOTE_WATCH = (
    'exec 3<&0; if command -v setsid >/dev/null 2>&1; then setsid sh -c "$1" </dev/null 3<&- & '
    'else sh -c "$1" </dev/null 3<&- & fi; c=$!; '
    '(cat <&3 >/dev/null; kill -TERM -$c || kill -TERM $c; sleep {grace}; kill -KILL -$c) '
    '2>/dev/null & w=$!; exec 3<&-; wait $c; s=$?; kill $w 2>/dev/null; '
    'kill -TERM -$c 2>/dev/null && sleep 1 && kill -KILL -$c 2>/dev/null; exit $s'
)


class SshRunner(Runner):
    """Run on a host through `ssh -o StrictHostKeyChecking=no HOST 'cd DIR && export ... && CMD'`."""

    def __init__(self, ssh: List[str], ports: Dict[str, Optional[int]], kill_grace: float):
        self.ssh = ssh
        self.ports = ports
        self.kill_grace = kill_grace

    def remote_command(self, command, env, cwd) -> str:
        """The string the remote shell runs: cd, export the job's variables, run under the watcher."""
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        watch = _REMOTE_WATCH.replace("{grace}", str(max(1, int(self.kill_grace + 0.5))))
        return (f"cd {shlex.quote(cwd)} && export {exports} && "
                f"exec sh -c {shlex.quote(watch)} slimgc-job {shlex.quote(shell_command(command))}")

    def start(self, node, command, env, cwd):
        argv = list(self.ssh) + ["-o", "StrictHostKeyChecking=no"]
        if self.ports.get(node):
            argv += ["-p", str(self.ports[node])]
        argv += [node, self.remote_command(command, env, cwd)]
        return self.spawn(argv, None, None, stdin=subprocess.PIPE)


# ---------------------------------------------------------------- the job plan

@dataclass
class Task:
    """One process of the job: its role, launch index, node, runner and DMLC environment."""

    role: str
    index: int
    node: Optional[str]
    runner: Runner
    env: Dict[str, str]
    proc: Optional[subprocess.Popen] = None
    status: Optional[int] = None
    threads: List[threading.Thread] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.role if self.role == "scheduler" else f"{self.role} {self.index}"


def omp_threads(num_workers: int, cpus: Optional[int] = None) -> int:
    """OpenMP threads per process when num_workers MXNet workers share this host's cores.

    MXNet's default (one OpenMP thread per core in every process) oversubscribes a host
    that runs several workers: their threads spin against each other (docs/launcher.md).
    """
    return max(1, (cpus or available_cpus()) // max(1, num_workers))


# MXNet's engine runs CPU operators on MXNET_CPU_WORKER_NTHREADS threads (default 1).
# With one, a worker's transfers (the kvstore's push and pull operators) and SlimGC's
# copies wait behind every forward and backward operator queued before them; a second
# thread lets them start while compute runs (docs/launcher.md).
ENGINE_THREADS_VAR = "MXNET_CPU_WORKER_NTHREADS"
WORKER_ENGINE_THREADS = 2


def describe_status(code: int) -> str:
    """'exited with code 3' or 'was killed by signal SIGKILL (9)' for a Popen returncode."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "signal"
        return f"was killed by signal {name} ({-code})"
    return f"exited with code {code}"


def exit_code(code: int) -> int:
    """Shell convention: a child killed by signal N makes the launcher exit 128+N."""
    return 128 - code if code < 0 else code


def build_plan(args) -> List[Task]:
    """Decide every process's node and environment from the parsed options; starts nothing."""
    if args.launcher in ("mpi", "sge", "yarn"):
        raise LaunchError(f"--launcher {args.launcher} is not supported here; use local or ssh")
    if args.sync_dst_dir:
        raise LaunchError("--sync-dst-dir is not supported; copy the code to every host yourself "
                          "and point --remote-dir at it")
    if not args.command:
        raise LaunchError("missing COMMAND to run (e.g. python train.py)")
    if args.num_workers < 1 or args.num_servers < 0:
        raise LaunchError("need -n >= 1 workers and -s >= 0 servers")

    common = {"PYTHONUNBUFFERED": "1"}
    if args.p3:
        common.update(DMLC_PS_VAN_TYPE="p3", DMLC_PS_WATER_MARK="10")
    user_env = parse_env_items(args.env, "--env")
    per_role = {"server": {**SERVER_ENV, **parse_env_items(args.env_server, "--env-server")},
                "worker": parse_env_items(args.env_worker, "--env-worker"),
                "scheduler": {}}

    engine = ENGINE_THREADS_VAR
    if engine not in user_env and engine not in per_role["worker"] and (
            args.launcher != "local" or engine not in os.environ):
        per_role["worker"][engine] = str(WORKER_ENGINE_THREADS)
        log.info("%s=%d for every worker: transfers need not wait behind compute in MXNet's "
                 "engine (--env-worker %s:N sets another value)", engine, WORKER_ENGINE_THREADS,
                 engine)

    local = LocalRunner()
    if args.launcher == "local":
        if args.hostfile:
            log.warning("--launcher local ignores the hostfile %s", args.hostfile)
        root_uri = args.root_uri or "127.0.0.1"
        sched_node, sched_runner = None, local
        node_of = lambda i: None  # noqa: E731
        runner = local
        common["DMLC_NODE_HOST"] = root_uri  # every node on loopback unless --env says otherwise
        if "OMP_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in user_env:
            cpus = available_cpus()
            common["OMP_NUM_THREADS"] = str(omp_threads(args.num_workers, cpus))
            log.info("OMP_NUM_THREADS=%s for every process: %d workers share %d CPUs "
                     "(--env OMP_NUM_THREADS:N sets another value)", common["OMP_NUM_THREADS"],
                     args.num_workers, cpus)
    else:
        if not args.hostfile:
            raise LaunchError("--launcher ssh needs -H HOSTFILE")
        hosts = read_hostfile(args.hostfile)
        ssh_prog = shlex.split(args.ssh)
        if not ssh_prog:
            raise LaunchError("--ssh must name a program")
        runner = SshRunner(ssh_prog, dict(hosts), args.kill_grace)
        node_of = lambda i: hosts[i % len(hosts)][0]  # noqa: E731
        if args.scheduler_host:
            sched_node, sched_runner = args.scheduler_host, runner
            runner.ports.setdefault(args.scheduler_host, None)
            root_uri = args.root_uri or args.scheduler_host
        else:
            sched_node, sched_runner = None, local
            root_uri = args.root_uri or route_ip(hosts[0][0])

    launcher_hosts_scheduler = sched_runner is local
    if args.port:
        if launcher_hosts_scheduler:
            check_port(args.port)
        port = args.port
    else:
        port = free_port()  # free here; a remote scheduler host is trusted to agree

    dmlc = {"DMLC_PS_ROOT_URI": root_uri, "DMLC_PS_ROOT_PORT": str(port),
            "DMLC_NUM_SERVER": str(args.num_servers), "DMLC_NUM_WORKER": str(args.num_workers)}

    def task(role, index, node, task_runner):
        base = dict(common)
        if node is not None:
            base["DMLC_NODE_HOST"] = node  # the address ps-lite announces; --env may override
        env = {**base, **user_env, **per_role[role], **dmlc,
               "DMLC_ROLE": role, "SLIMGC_LAUNCH_INDEX": str(index)}
        return Task(role, index, node, task_runner, env)

    plan = [task("scheduler", 0, sched_node, sched_runner)]
    # Servers first, then workers, round-robin over the hosts, as launch.py's ssh mode does.
    plan += [task("server", i, node_of(i), runner) for i in range(args.num_servers)]
    plan += [task("worker", i, node_of(args.num_servers + i), runner) for i in range(args.num_workers)]
    return plan


# ---------------------------------------------------------------- running the job

# The reaper outlives a launcher killed with SIGKILL: it reads the process-group ids of the
# job's tasks from stdin and, at EOF (the launcher ended, however), stops those still alive.
_REAPER = """
import os, signal, sys, time
groups = [int(line) for line in sys.stdin]
def alive():
    left = []
    for g in groups:
        try:
            os.killpg(g, 0)
            left.append(g)
        except OSError:
            pass
    return left
def send(gs, sig):
    for g in gs:
        try:
            os.killpg(g, sig)
        except OSError:
            pass
send(alive(), signal.SIGTERM)
end = time.monotonic() + float(sys.argv[1])
while alive() and time.monotonic() < end:
    time.sleep(0.05)
send(alive(), signal.SIGKILL)
"""


def start_reaper(kill_grace: float) -> subprocess.Popen:
    """Start the guard process that cleans up after a launcher that died without teardown."""
    return subprocess.Popen([sys.executable, "-c", _REAPER, str(kill_grace)], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, start_new_session=True)


class _Interrupted(Exception):
    """The launcher got SIGINT/SIGTERM/SIGHUP: tear the job down and exit 128+signal."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


class Job:
    """Start the planned tasks, forward their output, watch them, and always clean up."""

    def __init__(self, plan: List[Task], command: List[str], cwd: str, linger: float,
                 kill_grace: float):
        self.plan, self.command, self.cwd = plan, command, cwd
        self.linger, self.kill_grace = linger, kill_grace
        self.out_lock = threading.Lock()

    def _forward(self, stream, sink, prefix: bytes):
        """Copy one child stream to our own, line by line, each line prefixed with its task."""
        for line in iter(stream.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            with self.out_lock:
                try:
                    sink.write(prefix + line)
                    sink.flush()
                except (OSError, ValueError):
                    pass
        stream.close()

    def _start_all(self):
        for t in self.plan:
            try:
                t.proc = t.runner.start(t.node, self.command, t.env, self.cwd)
            except OSError as e:
                raise StartError(f"cannot start {t.label}: {e}") from None
            self.reaper.stdin.write(f"{t.proc.pid}\n".encode())
            self.reaper.stdin.flush()
            where = f" on {t.node}" if t.node else ""
            log.debug("started %s%s (pid %d)", t.label, where, t.proc.pid)
        for t in self.plan:
            prefix = f"[{t.label}] ".encode()
            for stream, sink in ((t.proc.stdout, sys.stdout), (t.proc.stderr, sys.stderr)):
                th = threading.Thread(target=self._forward, daemon=True,
                                      args=(stream, getattr(sink, "buffer", sink), prefix))
                th.start()
                t.threads.append(th)

    def _poll(self) -> Optional[Task]:
        """Record exits; return a task newly found failed (a worker if several), if any."""
        failed = []
        for t in self.plan:
            if t.proc and t.status is None and t.proc.poll() is not None:
                t.status = t.proc.returncode
                log.debug("%s %s", t.label, describe_status(t.status))
                if t.status != 0:
                    failed.append(t)
        failed.sort(key=lambda t: t.role != "worker")
        return failed[0] if failed else None

    def _wait(self) -> int:
        """Until a failure or the workers' end (plus --linger for the rest); the exit status."""
        workers = [t for t in self.plan if t.role == "worker"]
        others = [t for t in self.plan if t.role != "worker"]
        while True:
            failed = self._poll()
            if failed is not None:
                log.error("%s %s; stopping the job", failed.label, describe_status(failed.status))
                return exit_code(failed.status)
            if all(t.status is not None for t in workers):
                break
            time.sleep(POLL_INTERVAL)
        deadline = time.monotonic() + self.linger
        while any(t.status is None for t in others) and time.monotonic() < deadline:
            time.sleep(POLL_INTERVAL)
            self._poll()
        lingering = [t.label for t in others if t.status is None]
        if lingering:
            log.warning("all workers succeeded but %s still ran %g s later; terminating them",
                        ", ".join(lingering), self.linger)
        for t in others:
            if t.status not in (None, 0):
                log.warning("%s %s after all workers succeeded", t.label, describe_status(t.status))
        return 0

    def _groups_alive(self) -> List[Task]:
        """Tasks whose process group still has a member (a child, or a grandchild it left)."""
        alive = []
        for t in self.plan:
            if t.proc is None:
                continue
            t.proc.poll()
            try:
                os.killpg(t.proc.pid, 0)
                alive.append(t)
            except (ProcessLookupError, PermissionError):
                pass
        return alive

    def teardown(self):
        """SIGTERM every task's process group, SIGKILL what is left after the grace period."""
        for t in self.plan:
            if t.proc and t.proc.stdin:
                try:
                    t.proc.stdin.close()  # an ssh task's remote side stops on this EOF
                except OSError:
                    pass
        alive = self._groups_alive()
        for t in alive:
            if t.status is None:
                log.info("terminating %s (pid %d)", t.label, t.proc.pid)
            self._signal(t, signal.SIGTERM)
        deadline = time.monotonic() + self.kill_grace
        while alive and time.monotonic() < deadline:
            time.sleep(POLL_INTERVAL)
            alive = self._groups_alive()
        for t in alive:
            log.warning("killing %s (pid %d): still running %.1f s after SIGTERM",
                        t.label, t.proc.pid, self.kill_grace)
            self._signal(t, signal.SIGKILL)
        for t in self.plan:
            if t.proc:
                t.proc.wait()
                for th in t.threads:
                    th.join(timeout=2)

    @staticmethod
    def _signal(t: Task, sig):
        try:
            os.killpg(t.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def run(self) -> int:
        """Run the job to the end; every path, including signals to us, ends in teardown()."""
        interrupted = []

        def on_signal(signum, frame):
            if not interrupted:
                interrupted.append(signum)
                raise _Interrupted(signum)

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        self.reaper = start_reaper(self.kill_grace)
        try:
            self._start_all()
            return self._wait()
        except _Interrupted as e:
            log.error("launcher got %s; stopping the job", signal.Signals(e.signum).name)
            return 128 + e.signum
        finally:
            try:
                self.teardown()
            except _Interrupted:
                self.teardown()
            self.reaper.stdin.close()  # nothing left for it to do: it exits
            self.reaper.wait()
            for s, h in old.items():
                signal.signal(s, h)


# ---------------------------------------------------------------- command line

def build_parser() -> argparse.ArgumentParser:
    """The launch.py-compatible options plus a few of our own, each help naming its default."""
    p = argparse.ArgumentParser(
        prog="slimgc-launch",
        description="Launch an MXNet parameter-server job: 1 scheduler, S servers and W workers, "
                    "each running the same COMMAND with DMLC_ROLE etc. set. Output lines are "
                    "prefixed [scheduler], [server I], [worker I] (launch index; MXNet's kv.rank "
                    "may differ). Local mode sets OMP_NUM_THREADS to CPUs // workers (at least 1) "
                    "unless this shell or --env sets it. Workers get MXNET_CPU_WORKER_NTHREADS=2 "
                    "(MXNet's engine threads) unless --env, --env-worker or, in local mode, "
                    "this shell sets it. Exit status: the workers' (0 when all "
                    "succeed), 128+N when a process is killed by signal N, 2 for usage errors, "
                    "127 when COMMAND cannot start.",
        epilog="examples:\n"
               "  slimgc-launch -n 2 -s 2 python scripts/train.py\n"
               "  slimgc-launch -n 4 -H hosts --env OMP_NUM_THREADS:2 python scripts/train.py",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--num-workers", required=True, type=int,
                   help="number of worker processes (required)")
    p.add_argument("-s", "--num-servers", type=int, default=None,
                   help="number of server processes (default: same as -n)")
    p.add_argument("--launcher", choices=["local", "ssh", "mpi", "sge", "yarn"], default=None,
                   help="where processes run (default: ssh when -H is given, else local); "
                        "mpi, sge, yarn are not supported")
    p.add_argument("-H", "--hostfile", default=None,
                   help="file with one HOST or HOST:SSH_PORT per line; needed for ssh "
                        "(default: none)")
    p.add_argument("--sync-dst-dir", default=None,
                   help="not supported: copy the code to the hosts yourself, then use --remote-dir")
    p.add_argument("--env", action="append", default=[], metavar="NAME[:VALUE]",
                   help="set NAME=VALUE for every process; NAME alone passes this shell's value; "
                        "repeatable (default: none)")
    p.add_argument("--env-server", action="append", default=[], metavar="NAME[:VALUE]",
                   help="like --env, for servers only, wins over --env (default: %s, which "
                        "keeps MXNet 1.9.1's servers summing float64 exactly; see "
                        "docs/launcher.md)" % SERVER_ENV_TEXT)
    p.add_argument("--env-worker", action="append", default=[], metavar="NAME[:VALUE]",
                   help="like --env, for workers only, wins over --env (default: none)")
    p.add_argument("--p3", action="store_true",
                   help="use the P3 van: DMLC_PS_VAN_TYPE=p3, DMLC_PS_WATER_MARK=10 (default: off)")
    p.add_argument("--port", type=int, default=0,
                   help="scheduler port DMLC_PS_ROOT_PORT (default: 0 = a free port picked here)")
    p.add_argument("--root-uri", default=None,
                   help="scheduler address DMLC_PS_ROOT_URI (default: 127.0.0.1 for local; for "
                        "ssh the --scheduler-host, else this machine's address toward the first host)")
    p.add_argument("--scheduler-host", default=None,
                   help="ssh: run the scheduler on this host (default: on this machine, "
                        "as launch.py does)")
    p.add_argument("--remote-dir", default=None,
                   help="ssh: directory to cd into on every host (default: the current directory)")
    p.add_argument("--ssh", default=os.environ.get("SLIMGC_SSH", "ssh"),
                   help="ssh program and leading arguments (default: $SLIMGC_SSH, else ssh; "
                        "now %(default)r)")
    p.add_argument("--linger", type=float, default=DEFAULT_LINGER,
                   help="seconds servers/scheduler may run on after all workers succeeded, "
                        "then they are terminated (default: %(default)s)")
    p.add_argument("--kill-grace", type=float, default=DEFAULT_KILL_GRACE,
                   help="seconds between SIGTERM and SIGKILL when stopping processes "
                        "(default: %(default)s)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="launcher log level (default: %(default)s)")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="what every process runs: one argument is a shell string, several an argv")
    return p


def parse_args(argv: Optional[List[str]] = None, parser=None) -> argparse.Namespace:
    """Parse the command line and fill in the defaults that depend on other options."""
    args = (parser or build_parser()).parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if args.num_servers is None:
        args.num_servers = args.num_workers
    if args.launcher is None:
        args.launcher = "ssh" if args.hostfile else "local"
    if args.remote_dir is None:
        args.remote_dir = os.getcwd()
    return args


def main(argv: Optional[List[str]] = None) -> int:
    """Console entry point (slimgc-launch): parse, plan, run; returns the exit status."""
    parser = build_parser()
    args = parse_args(argv, parser)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="[launcher] %(levelname)s %(message)s")
    try:
        plan = build_plan(args)
        job = Job(plan, args.command, args.remote_dir if args.launcher == "ssh" else os.getcwd(),
                  args.linger, args.kill_grace)
        log.info("%s launcher: 1 scheduler, %d servers, %d workers; scheduler at %s:%s",
                 args.launcher, args.num_servers, args.num_workers,
                 plan[0].env["DMLC_PS_ROOT_URI"], plan[0].env["DMLC_PS_ROOT_PORT"])
        return job.run()
    except StartError as e:
        log.error("%s", e)
        return 127
    except LaunchError as e:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())
