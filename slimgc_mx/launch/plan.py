"""The job plan: every process's role, node, runner and environment; nothing is started here."""
import errno
import logging
import shlex
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ..env import (ENGINE_THREADS_VAR, LAUNCH_INDEX_VAR, SERVER_ENV, TERMINAL_VAR,
                   WORKER_ENGINE_THREADS, available_cpus, is_set)
from ..env import value as env_value
from .errors import LaunchError
from .runners import LocalRunner, Runner, SshRunner

log = logging.getLogger("slimgc_mx.launch")


# ---------------------------------------------------------------- option parsing helpers

def parse_env_items(items: List[str], option: str) -> Dict[str, str]:
    """Turn ['K:V', 'K2'] into {K: V, K2: <launcher's value of K2>}, as launch.py's --env does."""
    env = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not key.isidentifier():
            raise LaunchError(f"{option} {item!r}: expected NAME:VALUE or NAME")
        if not sep:
            value = env_value(key)
            if value is None:
                raise LaunchError(f"{option} {key}: no value given and {key} is not set here")
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
    rank: Optional[int] = None  # a worker's kvstore rank, once it has said it
    import_error: Optional[str] = None  # its last ImportError line, if it printed one
    prefix: str = ""  # what its forwarded lines start with

    def __post_init__(self):
        self.prefix = "[%s] " % self.label

    @property
    def label(self) -> str:
        return self.role if self.role == "scheduler" else f"{self.role} {self.index}"


def plural(count: int, noun: str) -> str:
    """'1 worker', '2 workers'."""
    return "%d %s%s" % (count, noun, "" if count == 1 else "s")


def omp_threads(num_workers: int, cpus: Optional[int] = None) -> int:
    """OpenMP threads per process when num_workers MXNet workers share this host's cores.

    MXNet's default (one OpenMP thread per core in every process) oversubscribes a host
    that runs several workers: their threads spin against each other (docs/launcher.md).
    """
    return max(1, (cpus or available_cpus()) // max(1, num_workers))


def build_plan(args, cluster=None) -> List[Task]:
    """Decide every process's node and environment from the parsed options; starts nothing.

    cluster: the netns.NetnsCluster the tasks run in (--launcher netns).
    """
    if args.launcher in ("mpi", "sge", "yarn"):
        raise LaunchError(f"--launcher {args.launcher} is not supported here; use local, ssh "
                          f"or netns")
    if args.sync_dst_dir:
        raise LaunchError("--sync-dst-dir is not supported; copy the code to every host yourself "
                          "and point --remote-dir at it")
    if not args.command:
        raise LaunchError("missing COMMAND to run (e.g. python train.py)")
    if args.num_workers < 1:
        raise LaunchError("need -n >= 1 workers")
    if getattr(args, "framework", "mxnet") == "torch":
        return torch_plan(args, cluster)
    if args.num_servers < 1:
        raise LaunchError("need -s >= 1 servers: MXNet's dist kvstore sums on its servers "
                          "(leave -s out for as many servers as workers)")
    if args.launcher != "netns" and (args.bandwidth or args.delay):
        raise LaunchError("--bandwidth and --delay shape the links of --launcher netns only")

    common = {"PYTHONUNBUFFERED": "1"}
    if sys.stderr.isatty():
        common[TERMINAL_VAR] = "1"  # forwarded output reaches a terminal: progress bars show
    if args.p3:
        common.update(DMLC_PS_VAN_TYPE="p3", DMLC_PS_WATER_MARK="10")
    user_env = parse_env_items(args.env, "--env")
    server_env = {} if getattr(args, "no_server_env", False) else SERVER_ENV
    per_role = {"server": {**server_env, **parse_env_items(args.env_server, "--env-server")},
                "worker": parse_env_items(args.env_worker, "--env-worker"),
                "scheduler": {}}

    engine = ENGINE_THREADS_VAR
    if engine not in user_env and engine not in per_role["worker"] and (
            args.launcher == "ssh" or not is_set(engine)):
        per_role["worker"][engine] = str(WORKER_ENGINE_THREADS)
        log.info("%s=%d for every worker: transfers need not wait behind compute in MXNet's "
                 "engine (--env-worker %s:N sets another value)", engine, WORKER_ENGINE_THREADS,
                 engine)

    local = LocalRunner()
    host_of = {}  # node -> the address ps-lite announces (DMLC_NODE_HOST), where it differs
    if args.launcher in ("local", "netns"):
        if args.hostfile:
            log.warning("--launcher %s ignores the hostfile %s", args.launcher, args.hostfile)
        if args.launcher == "local":
            root_uri = args.root_uri or "127.0.0.1"
            sched_node, sched_runner = None, local
            node_of = lambda i: None  # noqa: E731
            runner = local
            common["DMLC_NODE_HOST"] = root_uri  # every node on loopback unless --env says so
        else:
            if cluster is None:
                raise LaunchError("--launcher netns needs its namespaces (netns.NetnsCluster)")
            from .netns import NODE_IFACE, NetnsRunner  # here: see launch/__init__.py
            runner = sched_runner = NetnsRunner()
            sched_node = cluster.ns("scheduler")
            root_uri = cluster.ip("scheduler")
            labels = ["server %d" % i for i in range(args.num_servers)]
            labels += ["worker %d" % i for i in range(args.num_workers)]
            node_of = lambda i: cluster.ns(labels[i])  # noqa: E731
            host_of = {cluster.ns(label): cluster.ip(label) for label in cluster.nodes}
            common["DMLC_INTERFACE"] = NODE_IFACE
        if not is_set("OMP_NUM_THREADS") and "OMP_NUM_THREADS" not in user_env:
            cpus = available_cpus()
            common["OMP_NUM_THREADS"] = str(omp_threads(args.num_workers, cpus))
            log.info("OMP_NUM_THREADS=%s for every process: %s share %s "
                     "(--env OMP_NUM_THREADS:N sets another value)", common["OMP_NUM_THREADS"],
                     plural(args.num_workers, "worker"), plural(cpus, "CPU"))
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
            # the address ps-lite announces (--env may override it)
            base["DMLC_NODE_HOST"] = host_of.get(node, node)
        env = {**base, **user_env, **per_role[role], **dmlc,
               "DMLC_ROLE": role, LAUNCH_INDEX_VAR: str(index)}
        return Task(role, index, node, task_runner, env)

    plan = [task("scheduler", 0, sched_node, sched_runner)]
    # Servers first, then workers, round-robin over the hosts, as launch.py's ssh mode does.
    plan += [task("server", i, node_of(i), runner) for i in range(args.num_servers)]
    plan += [task("worker", i, node_of(args.num_servers + i), runner) for i in range(args.num_workers)]
    return plan


def torch_env(rank: int, world: int, master: str, port: int, local_rank: int,
              local_world: int) -> Dict[str, str]:
    """torch.distributed's variables for one rank, as torchrun sets them."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_world), "MASTER_ADDR": master,
            "MASTER_PORT": str(port)}


def torch_plan(args, cluster=None) -> List[Task]:
    """--framework torch: W workers of torch.distributed, no scheduler or servers; rank 0's
    address is MASTER_ADDR, and Gloo binds loopback (local) or the namespace's eth0 (netns)."""
    if args.launcher not in ("local", "netns"):
        raise LaunchError("--framework torch runs with --launcher local or netns; on several "
                          "hosts start torchrun on each")
    if args.num_servers:
        raise LaunchError("--framework torch starts no servers (torch.distributed sums among "
                          "the workers): leave -s out")
    for given, option in ((args.env_server, "--env-server"), (args.p3, "--p3"),
                          (args.no_server_env, "--no-server-env")):
        if given:
            raise LaunchError(f"{option} concerns MXNet's servers, which --framework torch "
                              f"does not start: leave it out")
    if args.launcher == "netns" and cluster is None:
        raise LaunchError("--launcher netns needs its namespaces (netns.NetnsCluster)")
    if args.launcher != "netns" and (args.bandwidth or args.delay):
        raise LaunchError("--bandwidth and --delay shape the links of --launcher netns only")
    n = args.num_workers
    common = {"PYTHONUNBUFFERED": "1"}
    if sys.stderr.isatty():
        common[TERMINAL_VAR] = "1"
    user_env = {**parse_env_items(args.env, "--env"),
                **parse_env_items(args.env_worker, "--env-worker")}
    if not is_set("OMP_NUM_THREADS") and "OMP_NUM_THREADS" not in user_env:
        cpus = available_cpus()
        common["OMP_NUM_THREADS"] = str(omp_threads(n, cpus))
        log.info("OMP_NUM_THREADS=%s for every process: %s share %s "
                 "(--env OMP_NUM_THREADS:N sets another value)", common["OMP_NUM_THREADS"],
                 plural(n, "worker"), plural(cpus, "CPU"))
    if args.port:
        if args.launcher == "local":
            check_port(args.port)
        port = args.port
    else:
        port = free_port()  # in netns rank 0's namespace is fresh: any port is free there
    if args.launcher == "netns":
        from .netns import NODE_IFACE, NetnsRunner  # here: see launch/__init__.py
        runner, master, iface = NetnsRunner(), cluster.ip("worker 0"), NODE_IFACE
        nodes = [cluster.ns("worker %d" % i) for i in range(n)]
    else:
        runner, master, iface = LocalRunner(), args.root_uri or "127.0.0.1", "lo"
        nodes = [None] * n
    plan = []
    for i in range(n):
        local = (0, 1) if args.launcher == "netns" else (i, n)  # a namespace is a node
        # Gloo binds GLOO_SOCKET_IFNAME; without it, whatever the hostname resolves to
        env = {**common, "GLOO_SOCKET_IFNAME": iface, **user_env,
               **torch_env(i, n, master, port, *local), LAUNCH_INDEX_VAR: str(i)}
        plan.append(Task("worker", i, nodes[i], runner, env))
    return plan


def plan_again(plan: List[Task], fixed_port: Optional[int]) -> List[Task]:
    """The same job with fresh tasks, for a restart: a new free scheduler port (the old one
    may linger in TIME_WAIT), or `fixed_port` (--port) again, checked when it is bound here."""
    if fixed_port:
        if isinstance(plan[0].runner, LocalRunner):
            check_port(fixed_port)
        port = fixed_port
    else:
        port = free_port()
    key = "DMLC_PS_ROOT_PORT" if plan[0].role == "scheduler" else "MASTER_PORT"
    return [Task(t.role, t.index, t.node, t.runner, {**t.env, key: str(port)}) for t in plan]
