"""Runs a script of tests/torch_jobs under torchrun (torch.distributed.run) with N CPU ranks
over Gloo, and reads back what each rank wrote: the PyTorch adapter's multi-process tests."""
import json
import os
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script, out, *args, nproc=2, timeout=240, extra=(), env=None):
    """Run tests/torch_jobs/SCRIPT under torchrun; (returncode, output). Ranks write to `out`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *extra,
           os.path.join(HERE, "torch_jobs", script), str(out), *map(str, args)]
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SLIMGC_")}
    environ.update({"PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "SLIMGC_TIMEOUT": "60"})
    environ.update(env or {})
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=environ,
                          cwd=ROOT)
    return proc.returncode, proc.stdout + proc.stderr


def results(out, name, nproc=2):
    """Every rank's JSON record `name`."""
    return [json.load(open(os.path.join(out, "%s_%d.json" % (name, r)))) for r in range(nproc)]
