"""Runs a script of tests/torch_jobs under torchrun (torch.distributed.run) with N CPU ranks
over Gloo, and reads back what each rank wrote: the PyTorch adapter's multi-process tests."""
import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: What a rank printed when it aborted while its interpreter exited, after its work: a Gloo
#: worker freeing a finished collective's tensors during finalization (TorchTransport keeps
#: them until Gloo lets go: collective.Collectives). The rerun stays, as a guard.
EXIT_ABORT = "terminate called without an active exception"


def torchrun(script, out, *args, nproc=2, timeout=240, extra=(), env=None):
    """Run tests/torch_jobs/SCRIPT under torchrun; (returncode, output). Ranks write to `out`.
    Past `timeout` seconds the job, ranks included, is killed and TimeoutExpired raised, its
    output (each rank's stacks at the end among it) in the exception's `output`. A job
    that fails by the known abort at exit is run once more, with a warning; a second failure
    of any kind is returned."""
    code, text = _torchrun(script, out, *args, nproc=nproc, timeout=timeout, extra=extra,
                           env=env)
    if code != 0 and EXIT_ABORT in text:
        warnings.warn("%s aborted at exit (%r); running it once more" % (script, EXIT_ABORT))
        code, text = _torchrun(script, out, *args, nproc=nproc, timeout=timeout, extra=extra,
                               env=env)
    return code, text


def _descendants(pid):
    """The pids of every process below `pid` (read from /proc; [] where there is none)."""
    children = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry) as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _torchrun(script, out, *args, nproc=2, timeout=240, extra=(), env=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *extra,
           os.path.join(HERE, "torch_jobs", script), str(out), *map(str, args)]
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SLIMGC_")}
    environ.update({"PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "SLIMGC_TIMEOUT": "60"})
    environ.update(env or {})
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=environ, cwd=ROOT, start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            ranks = _descendants(proc.pid)  # torchrun starts them in sessions of their own
            _signal(ranks, signal.SIGUSR1)  # each rank prints its stacks (torch_jobs/common.py)
            time.sleep(2)
            os.killpg(proc.pid, signal.SIGKILL)
            _signal(ranks, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            exc.output = stdout + stderr
            raise
    return proc.returncode, stdout + stderr


def _signal(pids, number):
    for pid in pids:
        try:
            os.kill(pid, number)
        except OSError:
            pass


def results(out, name, nproc=2):
    """Every rank's JSON record `name`."""
    return [json.load(open(os.path.join(out, "%s_%d.json" % (name, r)))) for r in range(nproc)]


class Batch:
    """Jobs of tests/torch_jobs, each (script, args...), that one torchrun runs one after the
    other in the same two ranks (torch_jobs/batch.py) when a test first asks for one of
    them: most of a small job's time is the start of its ranks (three interpreters
    importing torch, the group), paid here once for all of them. Each job writes to a
    folder of its own, as alone; run() copies that into the test's `out`.

    A test file lists its jobs once and calls Batch.run where it called torchrun: a job
    not listed, or one that needs torchrun options, an environment or another rank count,
    runs in a torchrun of its own as before."""

    def __init__(self, *jobs, timeout=600):
        self.jobs = [tuple(map(str, job)) for job in jobs]
        self.timeout = timeout
        self.root = None
        self.code, self.text = None, ""

    def run(self, script, out, *args, **torchrun_options):
        """(returncode, output) of the job, as torchrun(script, out, *args) gives them."""
        job = (script,) + tuple(map(str, args))
        torchrun_options.pop("timeout", None)  # the batch has its own
        if torchrun_options or job not in self.jobs:
            return torchrun(script, out, *args, **torchrun_options)
        if self.root is None:
            self._run_all()
        folder = self._folder(self.jobs.index(job))
        if not all(os.path.exists(os.path.join(folder, ".done_%d" % r)) for r in range(2)):
            return self.code or 1, "%s\n%s did not finish: the batch ended with status %s%s" % (
                self.text, " ".join(job), self.code, self._failures())
        shutil.copytree(folder, str(out), dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(".done_*"))
        return 0, self.text

    def _failures(self):
        """The tracebacks of the job that ended the batch, written by its ranks."""
        text = ""
        for number in range(len(self.jobs)):
            for rank in range(2):
                path = os.path.join(self._folder(number), ".failed_%d" % rank)
                if os.path.exists(path):
                    text += "\n" + open(path).read()
        return text

    def _folder(self, number):
        return os.path.join(self.root, "job%02d" % number)

    def _run_all(self):
        self.root = tempfile.mkdtemp(prefix="torch-batch-")
        atexit.register(shutil.rmtree, self.root, True)
        specs = [[script, self._folder(number), *args]
                 for number, (script, *args) in enumerate(self.jobs)]
        for attempt in range(2):
            for number in range(len(self.jobs)):
                shutil.rmtree(self._folder(number), True)
                os.mkdir(self._folder(number))
            try:
                self.code, self.text = _torchrun("batch.py", self.root, json.dumps(specs),
                                                 timeout=self.timeout)
            except subprocess.TimeoutExpired as exc:
                self.code, self.text = -signal.SIGKILL, "%s\nthe batch ran past %d s" % (
                    exc.output, exc.timeout)
            # the known abort at exit, after every job, changes nothing; before: once more
            if self.code == 0 or EXIT_ABORT not in self.text or self._all_done() or attempt:
                break
            warnings.warn("a torch batch aborted (%r) before its last job; running it once "
                          "more" % EXIT_ABORT)

    def _all_done(self):
        return all(os.path.exists(os.path.join(self._folder(number), ".done_%d" % rank))
                   for number in range(len(self.jobs)) for rank in range(2))
