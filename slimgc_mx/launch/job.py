"""Running a planned job: start every task, forward its output, watch it, always clean up."""
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import List, Optional

from ..env import RANK_MARKER_PATTERN
from .errors import StartError
from .plan import Task

log = logging.getLogger("slimgc_mx.launch")

POLL_INTERVAL = 0.05
RANK_MARKER = re.compile(RANK_MARKER_PATTERN)
IMPORT_ERROR = re.compile(rb"^(?:ModuleNotFoundError|ImportError): .*")
#: The launcher's status when every worker succeeded but never joined the servers.
NEVER_JOINED_STATUS = 1


_SEGMENT = re.compile(rb"([^\r\n]*)([\r\n])")


def _segments(data: bytes):
    """([(segment, terminator)] for the complete segments of `data`, ended by a newline or
    a carriage return; the bytes consumed)."""
    found = [(m.group(1), m.group(2)) for m in _SEGMENT.finditer(data)]
    return found, sum(len(s) + 1 for s, _ in found)


def _is_terminal(sink) -> bool:
    try:
        return sink.isatty()
    except (AttributeError, ValueError):
        return False


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


class LaunchedJob:
    """Start the planned tasks, forward their output, watch them, and always clean up."""

    def __init__(self, plan: List[Task], command: List[str], cwd: str, linger: float,
                 kill_grace: float, interpreter: Optional[str] = None):
        """interpreter: the Python that runs COMMAND, when the launcher knows it (for the
        message about a process that cannot import a module)."""
        self.plan, self.command, self.cwd = plan, command, cwd
        self.linger, self.kill_grace = linger, kill_grace
        self.interpreter = interpreter
        self.out_lock = threading.Lock()
        self.failed = None  # the task whose failure ended the job, if one did
        self.interrupted = False  # the launcher itself got a signal
        self.never_joined = []  # servers/scheduler that outlived workers that never joined
        self.diagnosis = None  # the launcher's last word on a failed job, if it has one

    def _forward(self, task: Task, stream, sink, terminal: bool):
        """Copy one child stream to our own, line by line, each line prefixed with its task.

        A segment ended by a carriage return (a progress bar's refresh) is passed on as
        such to a terminal and dropped elsewhere. A worker's line RANK_MARKER relabels its
        task with its kvstore rank, which can differ from its launch index.
        """
        pending = b""
        while True:
            chunk = stream.read1(65536)
            if not chunk:
                break
            pending += chunk
            found, consumed = _segments(pending)
            pending = pending[consumed:]
            for segment, end in found:
                self._relabel(task, segment)
                if IMPORT_ERROR.match(segment):
                    task.import_error = segment.decode(errors="replace")
                if end == b"\r" and not terminal:
                    continue
                self._write(sink, task.prefix.encode() + segment + end)
        if pending:
            self._write(sink, task.prefix.encode() + pending + b"\n")
        stream.close()

    def _write(self, sink, data: bytes):
        with self.out_lock:
            try:
                sink.write(data)
                sink.flush()
            except (OSError, ValueError):
                pass

    @staticmethod
    def _relabel(task: Task, segment: bytes):
        m = RANK_MARKER.match(segment) if task.role == "worker" else None
        if m is not None and task.rank is None:
            task.rank = int(m.group(1))
            task.prefix = "[rank %d] " % task.rank
            log.info("worker %d is kvstore rank %d; its lines are labelled [rank %d]",
                     task.index, task.rank, task.rank)

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
            for stream, sink in ((t.proc.stdout, sys.stdout), (t.proc.stderr, sys.stderr)):
                th = threading.Thread(target=self._forward, daemon=True,
                                      args=(t, stream, getattr(sink, "buffer", sink),
                                            _is_terminal(sink)))
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
                self.failed = failed
                log.error("%s %s; stopping the job", failed.label, describe_status(failed.status))
                self.diagnosis = self._import_diagnosis(failed)
                return exit_code(failed.status)
            if all(t.status is not None for t in workers):
                break
            time.sleep(POLL_INTERVAL)
        deadline = time.monotonic() + self.linger
        while any(t.status is None for t in others) and time.monotonic() < deadline:
            time.sleep(POLL_INTERVAL)
            self._poll()
        lingering = [t.label for t in others if t.status is None]
        for t in others:
            if t.status not in (None, 0):
                log.warning("%s %s after all workers succeeded", t.label, describe_status(t.status))
        if lingering and any(t.rank is None for t in workers):
            # Workers that joined a dist kvstore leave it together with the servers and
            # the scheduler, which then exit; these never saw the workers.
            self.never_joined = lingering
            self.diagnosis = (
                "every worker exited 0, but %s still ran %g s later, waiting for workers "
                "that never joined: no worker created a dist kvstore, so each trained alone, "
                "unsynchronised. Likely cause: kvstore='slimgc' or 'dist_sync_slimgc' in a "
                "script that does not `import slimgc_mx` (MXNet then makes no store for one "
                "device), or a kvstore name without 'dist' on one device. Fix: add `import "
                "slimgc_mx` to the script, or run it as `python -m slimgc_mx.run SCRIPT` "
                "(the launcher does so for `python SCRIPT` on its own interpreter); or use a "
                "'dist_*' kvstore" % (", ".join(lingering), self.linger))
            return NEVER_JOINED_STATUS
        if lingering:
            log.warning("all workers succeeded but %s still ran %g s later; terminating them",
                        ", ".join(lingering), self.linger)
        return 0

    def _import_diagnosis(self, failed: Task) -> Optional[str]:
        """What to say when the failed task (or another) could not import a module."""
        for th in failed.threads:
            th.join(timeout=1.0)  # its last lines may still be on their way
        culprit = failed if failed.import_error else next(
            (t for t in self.plan if t.import_error), None)
        if culprit is None:
            return None
        python = self.interpreter or "whichever Python COMMAND started (a bare `python`: " \
                                     "the first on its PATH)"
        return ("%s could not import a module (%s). It ran %s: run the launcher with the "
                "Python that has the job's packages (e.g. .venv/bin/python -m slimgc_mx.launch "
                "...: a bare `python` in COMMAND is the launcher's own, except over ssh), or "
                "give that interpreter's path in COMMAND"
                % (culprit.label, culprit.import_error, python))

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
            status = self._wait()
        except _Interrupted as e:
            self.interrupted = True
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
        if self.diagnosis:
            log.error("%s", self.diagnosis)
        return status
