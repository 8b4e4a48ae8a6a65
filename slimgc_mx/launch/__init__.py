"""Launcher for MXNet parameter-server jobs: 1 scheduler, S servers, W workers, local or ssh.

Every process runs the same COMMAND; only DMLC_* variables tell it its role. Standard
library only: launching imports nothing that imports MXNet (a server or scheduler enters
its loop inside `import mxnet`).
Usage: python -m slimgc_mx.launch -n 2 -s 2 python train.py   (see docs/launcher.md)

Nothing the package imports imports .netns (cli and plan import it where --launcher netns
needs it): `python -m slimgc_mx.launch.netns --check` would otherwise find it imported
before runpy runs it, and warn.
"""
from ..env import ENGINE_THREADS_VAR, WORKER_ENGINE_THREADS
from .cli import build_parser, main, parse_args
from .job import LaunchedJob, describe_status, exit_code
from .errors import LaunchError, StartError
from .plan import Task, build_plan, omp_threads, plural, read_hostfile
from .runners import LocalRunner, Runner, SshRunner

__all__ = ["ENGINE_THREADS_VAR", "WORKER_ENGINE_THREADS", "LaunchError", "LaunchedJob",
           "LocalRunner", "Runner", "SshRunner", "StartError", "Task", "build_parser",
           "build_plan", "describe_status", "exit_code", "main", "omp_threads", "parse_args",
           "plural", "read_hostfile"]
