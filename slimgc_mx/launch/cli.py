"""The command line of the launcher: launch.py-compatible options plus a few of our own."""
import argparse
import contextlib
import logging
import os
import sys
from typing import List, Optional

from ..env import SERVER_ENV_TEXT, ssh_program
from .command import RUN_MODULE, prepare
from .job import NEVER_JOINED_STATUS, LaunchedJob, describe_status
from .errors import LaunchError, StartError
from .plan import build_plan, plan_again, plural
from .runners import shell_command

log = logging.getLogger("slimgc_mx.launch")

USAGE_ERROR = 2
DEFAULT_LINGER = 10.0
DEFAULT_KILL_GRACE = 3.0


def port_number(text: str) -> int:
    """--port: 0 (pick a free port) or a TCP port, 1-65535."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(
            "%r is not a port: give 1-65535, or 0 (the default) to pick a free one" % text)
    return port


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
                    "this shell sets it. Local and netns: a bare python or python3 in COMMAND "
                    "is the launcher's own interpreter, a missing SCRIPT is a usage error, and "
                    "`python SCRIPT` or `python -m MODULE` on that interpreter runs through "
                    "`python -m slimgc_mx.run`, so kvstore='slimgc' means SlimGC in every "
                    "process even where the script does not import slimgc_mx (--as-is: run "
                    "COMMAND as given). Exit status: the workers' (0 when all "
                    "succeed), 128+N when a process is killed by signal N, 2 for usage errors, "
                    "127 when COMMAND cannot start, %d when the workers succeeded without "
                    "ever joining the servers (they trained unsynchronised). --framework "
                    "torch starts W torch.distributed workers instead, no scheduler or "
                    "servers: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR "
                    "(rank 0's address), MASTER_PORT and GLOO_SOCKET_IFNAME set as torchrun "
                    "would, in local or netns mode."
                    % NEVER_JOINED_STATUS,
        epilog="examples:\n"
               "  slimgc-launch -n 2 -s 2 python scripts/train.py\n"
               "  slimgc-launch -n 4 -H hosts --env OMP_NUM_THREADS:2 python scripts/train.py\n"
               "  slimgc-launch -n 2 --framework torch --launcher netns python scripts/train.py "
               "--framework torch",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--num-workers", required=True, type=int,
                   help="number of worker processes (required)")
    p.add_argument("-s", "--num-servers", type=int, default=None,
                   help="number of server processes (default: same as -n); --framework "
                        "torch starts none")
    p.add_argument("--framework", choices=["mxnet", "torch"], default="mxnet",
                   help="mxnet: a parameter-server job (scheduler, servers, workers); torch: "
                        "workers only, with torch.distributed's variables (default: "
                        "%(default)s)")
    p.add_argument("--launcher", choices=["local", "ssh", "netns", "mpi", "sge", "yarn"],
                   default=None,
                   help="where processes run (default: ssh when -H is given, else local); "
                        "netns: each process in its own network namespace on this machine, "
                        "linked by rate-limited veths (needs root); mpi, sge, yarn are not "
                        "supported")
    p.add_argument("--bandwidth", default=None, metavar="RATE",
                   help="netns: the rate of every process's link, each direction, as tc takes "
                        "it, e.g. 1gbit, 10gbit, 100mbit (default: 1gbit; 'none' for no limit)")
    p.add_argument("--delay", default=None, metavar="TIME",
                   help="netns: extra one-way delay on every process's link, e.g. 0.1ms (needs "
                        "the kernel's netem; default: none)")
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
    p.add_argument("--no-server-env", action="store_true",
                   help="start servers without %s (for testing the lane_dtype fallback: "
                        "their float64 sums may then be inexact; default: off)" % SERVER_ENV_TEXT)
    p.add_argument("--env-worker", action="append", default=[], metavar="NAME[:VALUE]",
                   help="like --env, for workers only, wins over --env (default: none)")
    p.add_argument("--p3", action="store_true",
                   help="use the P3 van: DMLC_PS_VAN_TYPE=p3, DMLC_PS_WATER_MARK=10 (default: off)")
    p.add_argument("--port", type=port_number, default=0,
                   help="scheduler port DMLC_PS_ROOT_PORT, 1-65535 (default: 0 = a free port "
                        "picked here)")
    p.add_argument("--root-uri", default=None,
                   help="scheduler address DMLC_PS_ROOT_URI (default: 127.0.0.1 for local; for "
                        "ssh the --scheduler-host, else this machine's address toward the first host)")
    p.add_argument("--scheduler-host", default=None,
                   help="ssh: run the scheduler on this host (default: on this machine, "
                        "as launch.py does)")
    p.add_argument("--remote-dir", default=None,
                   help="ssh: directory to cd into on every host (default: the current directory)")
    p.add_argument("--ssh", default=ssh_program(),
                   help="ssh program and leading arguments (default: $SLIMGC_SSH, else ssh; "
                        "now %(default)r)")
    p.add_argument("--linger", type=float, default=DEFAULT_LINGER,
                   help="seconds servers/scheduler may run on after all workers succeeded, "
                        "then they are terminated: they never saw the workers join, an "
                        "error (exit %d) unless every worker said its kvstore rank "
                        "(default: %%(default)s)" % NEVER_JOINED_STATUS)
    p.add_argument("--kill-grace", type=float, default=DEFAULT_KILL_GRACE,
                   help="seconds between SIGTERM and SIGKILL when stopping processes "
                        "(default: %(default)s)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="when a process dies or fails, stop the job and start it again, up to "
                        "K times; the training script resumes from its checkpoints (scripts/"
                        "train.py --checkpoint-dir). Exit status: the last attempt's "
                        "(default: %(default)s)")
    p.add_argument("--as-is", action="store_true",
                   help="run COMMAND exactly as given: a bare python is the first on PATH and "
                        "a Python script does not run through slimgc_mx.run, so it must import "
                        "slimgc_mx itself for kvstore='slimgc' (default: off; ssh always "
                        "runs COMMAND as given)")
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
        args.num_servers = 0 if args.framework == "torch" else args.num_workers
    if args.launcher is None:
        args.launcher = "ssh" if args.hostfile else "local"
    if args.remote_dir is None:
        args.remote_dir = os.getcwd()
    if args.launcher == "netns" and args.bandwidth is None:
        args.bandwidth = "1gbit"
    if args.bandwidth is not None and args.bandwidth.lower() == "none":
        args.bandwidth = ""
    return args


def tell_command(given: List[str], prepared) -> None:
    """Log what the launcher made of COMMAND, when it is not word for word what was given."""
    if prepared.as_given:
        log.info("COMMAND runs as given (%s): a Python script in it must `import slimgc_mx` "
                 "for kvstore='slimgc' to mean SlimGC", prepared.as_given)
    elif prepared.command != given:
        log.info("every process runs %s%s", shell_command(prepared.command),
                 "" if RUN_MODULE not in prepared.command else
                 ": kvstore='slimgc' is SlimGC even where the script does not import "
                 "slimgc_mx (--as-is runs COMMAND as given)")


def main(argv: Optional[List[str]] = None) -> int:
    """Console entry point (slimgc-launch): parse, plan, run; returns the exit status."""
    parser = build_parser()
    args = parse_args(argv, parser)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="[launcher] %(levelname)s %(message)s")
    if args.max_restarts < 0:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: --max-restarts must be >= 0", file=sys.stderr)
        return USAGE_ERROR
    cwd = args.remote_dir if args.launcher == "ssh" else os.getcwd()
    try:
        prepared = prepare(args.command, args.launcher, cwd, args.as_is)
        with contextlib.ExitStack() as stack:
            cluster = None
            if args.launcher == "netns":
                from . import netns  # here: see launch/__init__.py
                cluster = stack.enter_context(netns.cluster_for(args))
            plan = build_plan(args, cluster)
            tell_command(args.command, prepared)
            interpreter = prepared.interpreter
            if args.launcher == "ssh":
                interpreter = "%s as each host's PATH finds it" % prepared.interpreter \
                    if prepared.interpreter else None
            for attempt in range(args.max_restarts + 1):
                if attempt:
                    plan = plan_again(plan, args.port)
                job = LaunchedJob(plan, prepared.command, cwd, args.linger, args.kill_grace,
                                  interpreter)
                again = (" (attempt %d of %d)" % (attempt + 1, args.max_restarts + 1)
                         if args.max_restarts else "")
                links = netns.describe_links(args) if cluster else ""
                if args.framework == "torch":
                    log.info("%s launcher: %s of torch.distributed (Gloo), no servers%s; "
                             "rank 0 at %s:%s%s", args.launcher,
                             plural(args.num_workers, "worker"), links,
                             plan[0].env["MASTER_ADDR"], plan[0].env["MASTER_PORT"], again)
                else:
                    log.info("%s launcher: 1 scheduler, %s, %s%s; scheduler at %s:%s%s",
                             args.launcher, plural(args.num_servers, "server"),
                             plural(args.num_workers, "worker"), links,
                             plan[0].env["DMLC_PS_ROOT_URI"], plan[0].env["DMLC_PS_ROOT_PORT"],
                             again)
                status = job.run()
                if status == 0 or job.failed is None or attempt == args.max_restarts:
                    return status
                log.warning("restart %d of %d after %s %s: every process starts again (a "
                            "training script with checkpoints resumes from its newest one)",
                            attempt + 1, args.max_restarts, job.failed.label,
                            describe_status(job.failed.status))
    except StartError as e:
        log.error("%s", e)
        return 127
    except LaunchError as e:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return USAGE_ERROR

