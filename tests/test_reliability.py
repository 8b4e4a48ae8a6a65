"""Reliability: killed processes, timeouts, checkpoint/resume across processes, bad input.

The multi-process tests run tests/reliability_job.py (a small SlimGC MLP job whose
batches depend only on rank and step) with MXNet's own scheduler and servers on
loopback, through the launcher or started by hand. Every wait is bounded and every
process a test starts is killed in a `finally`, so a failure cannot hang the suite.
See docs/reliability.md for the failure model these tests pin down.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import mxnet as mx
import numpy as np
import pytest
from mxnet import gluon

from slimgc_mx import codecs
from slimgc_mx.engine.agreement import ConfigMismatchError
from slimgc_mx.mxnet.kvstore import SlimGC
from slimgc_mx.env import SERVER_ENV
from slimgc_mx.transport import LocalTransport, ThreadGroup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join("tests", "reliability_job.py")
RUN_LIMIT = 150  # seconds: hard limit on any single launched job (the machine may be loaded)


# ---------------------------------------------------------------- process helpers

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid):
    """True while `pid` exists and is not a zombie."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def _children(pid):
    kids = set()
    try:
        tasks = os.listdir("/proc/%d/task" % pid)
    except FileNotFoundError:
        return kids
    for tid in tasks:
        try:
            with open("/proc/%d/task/%s/children" % (pid, tid)) as f:
                kids.update(int(x) for x in f.read().split())
        except FileNotFoundError:
            pass
    return kids


def _wait_for(predicate, timeout, what, poll=0.1):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(poll)
    raise AssertionError("timed out after %g s waiting for %s" % (timeout, what))


def _read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _pids(out):
    d = os.path.join(out, "pids")
    pids = {}
    for name in os.listdir(d) if os.path.isdir(d) else []:
        if name.endswith(".pid"):
            text = _read(os.path.join(d, name)).strip()
            if text:
                pids[name[:-4]] = int(text)
    return pids


def _kill_all(pids):
    """SIGKILL each pid's process group (every test process leads its own), then the pid."""
    for pid in pids:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


class Launched:
    """`python -m slimgc_mx.launch -n 2 -s 2 ... reliability_job.py`, output in files."""

    def __init__(self, out, job_args, workers=2, servers=2, env=None):
        self.out = str(out)
        os.makedirs(self.out, exist_ok=True)
        self.stdout_path = os.path.join(self.out, "launcher.out")
        self.stderr_path = os.path.join(self.out, "launcher.err")
        argv = [sys.executable, "-m", "slimgc_mx.launch", "-n", str(workers), "-s", str(servers),
                "--launcher", "local", "--kill-grace", "2", "--",
                sys.executable, JOB, "--out", self.out] + list(job_args)
        with open(self.stdout_path, "w") as o, open(self.stderr_path, "w") as e:
            self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=o, stderr=e,
                                         env=dict(os.environ, **(env or {})),
                                         start_new_session=True)
        self.seen = {self.proc.pid}

    @property
    def stdout(self):
        return _read(self.stdout_path)

    @property
    def stderr(self):
        return _read(self.stderr_path)

    def snapshot(self):
        """Remember every process of the job seen so far (children of the launcher, pid files)."""
        self.seen |= _children(self.proc.pid) | set(_pids(self.out).values())
        return self.seen

    def wait(self, timeout=RUN_LIMIT):
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError("launcher still running after %g s\n%s\n%s"
                                 % (timeout, self.stdout[-3000:], self.stderr[-3000:]))

    def cleanup(self):
        self.snapshot()
        if self.proc.poll() is None:
            self.proc.terminate()  # the launcher tears its job down on SIGTERM
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        _kill_all(sorted(self.seen))
        self.proc.wait()

    def run(self, timeout=RUN_LIMIT):
        """Run to the end; fail with the job's output unless it exits 0."""
        try:
            code = self.wait(timeout)
            assert code == 0, "exit %d\n%s\n%s" % (code, self.stdout[-3000:], self.stderr[-3000:])
        finally:
            self.cleanup()
        return self

    def rank_json(self, rank):
        return json.loads(_read(os.path.join(self.out, "rank%d.json" % rank)))

    def weights(self, rank):
        return dict(np.load(os.path.join(self.out, "weights_rank%d.npz" % rank)))


def _reached(text, step, workers=2):
    """True once `workers` launcher lines read '[rank R] rank R step STEP' (a worker's lines
    are labelled by launch index until it says its kvstore rank)."""
    return sum(1 for line in text.splitlines()
               if line.startswith(("[worker ", "[rank ")) and line.endswith(" step %d" % step)
               ) >= workers


# ---------------------------------------------------------------- 1. kill -9 under the launcher

@pytest.mark.multiprocess
@pytest.mark.parametrize("victim, label", [("worker-1", "worker 1"), ("server-0", "server 0")])
def test_launched_job_stops_when_a_process_is_killed(tmp_path, victim, label):
    job = Launched(tmp_path / "job", ["--steps", "1000000", "--print-every", "10"])
    try:
        _wait_for(lambda: _reached(job.stdout, 20) or job.proc.poll() is not None, RUN_LIMIT,
                  "both workers at step 20")
        assert job.proc.poll() is None, job.stdout[-2000:] + job.stderr[-2000:]
        pids = _pids(job.out)
        assert sorted(pids) == ["scheduler-0", "server-0", "server-1", "worker-0", "worker-1"]
        children = _children(job.proc.pid)
        assert set(pids.values()) <= children, (pids, children)  # the job's tasks, plus the reaper
        everyone = job.snapshot()
        killed_at = time.monotonic()
        os.kill(pids[victim], signal.SIGKILL)
        code = job.wait(30)
        took = time.monotonic() - killed_at
        _wait_for(lambda: not any(_alive(p) for p in everyone), 5, "every job process gone")
    finally:
        job.cleanup()
    print("%s killed: launcher exited %.1f s later" % (label, took))
    assert took < 30
    assert code == 128 + signal.SIGKILL, job.stderr[-3000:]
    assert "%s was killed by signal SIGKILL" % label in job.stderr
    assert not [p for p in everyone if _alive(p)]


# ---------------------------------------------------------------- 2. kill -9 without the launcher

def _start_by_hand(out, job_args, timeout_s):
    """Scheduler, 1 server and 2 workers with DMLC_* set by hand; output to OUT/ROLE-I.log."""
    port = _free_port()
    base = dict(os.environ, DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(port),
                DMLC_NUM_SERVER="1", DMLC_NUM_WORKER="2", DMLC_NODE_HOST="127.0.0.1",
                SLIMGC_TIMEOUT=str(timeout_s), PYTHONUNBUFFERED="1")
    procs = {}
    for role, index in (("scheduler", 0), ("server", 0), ("worker", 0), ("worker", 1)):
        env = dict(base, DMLC_ROLE=role, SLIMGC_LAUNCH_INDEX=str(index))
        if role == "server":  # what any launcher must give MXNet 1.9.1 servers (docs/launcher.md)
            env.update(SERVER_ENV)
        name = "%s-%d" % (role, index)
        with open(os.path.join(out, name + ".log"), "w") as log:
            procs[name] = subprocess.Popen(
                [sys.executable, JOB, "--out", out] + job_args, cwd=ROOT, env=env,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return procs


@pytest.fixture(scope="module")
def killed_peer_without_launcher(tmp_path_factory):
    """Kill -9 worker 1 mid-run; watch worker 0 (SLIMGC_TIMEOUT=5) raise, then try to exit."""
    out = str(tmp_path_factory.mktemp("by_hand"))
    procs = _start_by_hand(out, ["--steps", "1000000", "--print-every", "10"], 5)
    logs = {name: os.path.join(out, name + ".log") for name in procs}
    result = {"out": out}
    try:
        _wait_for(lambda: "step 20\n" in _read(logs["worker-0"])
                  and "step 20\n" in _read(logs["worker-1"])
                  or any(p.poll() is not None for p in procs.values()),
                  RUN_LIMIT, "both workers at step 20")
        assert all(p.poll() is None for p in procs.values()), \
            {n: _read(path)[-1500:] for n, path in logs.items()}
        survivor = procs["worker-0"]
        result["t_kill"] = time.time()
        procs["worker-1"].kill()
        _wait_for(lambda: "TRAINING-ERROR" in _read(logs["worker-0"])
                  or survivor.poll() is not None, 40, "worker 0 to report an error")
        result["t_seen"] = time.time()
        info_path = os.path.join(out, "rank%d.json" % _rank_of(logs["worker-0"]))
        _wait_for(lambda: os.path.exists(info_path), 10, "worker 0's result file")
        time.sleep(0.2)
        result["info"] = json.loads(_read(info_path))
        try:
            survivor.wait(10)  # it called sys.exit(3) after the error
            result["exit_s"] = time.time() - result["info"]["t_error"]
            result["exit_code"] = survivor.returncode
        except subprocess.TimeoutExpired:
            result["exit_s"] = None
            survivor.send_signal(signal.SIGUSR1)  # where it hangs: Python stacks into its log
            time.sleep(1)
        result["others_alive"] = {n: procs[n].poll() is None for n in ("scheduler-0", "server-0")}
        result["log"] = _read(logs["worker-0"])
    finally:
        _kill_all([p.pid for p in procs.values()])
        for p in procs.values():
            p.wait()
    return result


def _rank_of(log_path):
    for line in _read(log_path).splitlines():
        if line.startswith("rank ") and " ready " in line:
            return int(line.split()[1])
    raise AssertionError("no 'ready' line in %s" % log_path)


@pytest.mark.multiprocess
def test_without_launcher_the_survivor_raises_instead_of_hanging(killed_peer_without_launcher):
    r = killed_peer_without_launcher
    info = r["info"]
    assert "error_type" in info, r["log"][-3000:]
    assert info["error_type"] in ("BackupTimeout", "TransportTimeout", "PipelineError"), info
    assert "may have died" in info["error"], info["error"]
    waited = info["t_error"] - r["t_kill"]
    print("survivor raised %s %.1f s after the kill; exit: %s; still running: %s"
          % (info["error_type"], waited, r["exit_s"], r["others_alive"]))
    assert 3 <= waited <= 15, "raised %.1f s after the kill (timeout 5 s)" % waited


@pytest.mark.multiprocess
def test_without_launcher_the_survivor_exits_after_the_error(killed_peer_without_launcher):
    r = killed_peer_without_launcher
    assert r["exit_s"] is not None, "worker 0 still running 10 s after its error:\n" + \
        r["log"][-2500:]


# ---------------------------------------------------------------- 3. checkpoint / resume

@pytest.mark.multiprocess
def test_checkpoint_resume_across_processes_is_bitwise_identical(tmp_path):
    """A: 2k steps, saving at k; B: k steps, saving; C: loads B and trains k more. C == A."""
    k = 20
    common = ["--compressor", "2bit", "--comm-threshold", "off", "--print-every", "0"]
    # A and B are independent jobs (own scheduler port each): run them side by side.
    a = Launched(tmp_path / "A", servers=1, job_args=common + [
        "--steps", str(2 * k), "--save-at", str(k), "--save-dir", str(tmp_path / "A" / "ckpt")])
    b = Launched(tmp_path / "B", servers=1, job_args=common + [
        "--steps", str(k), "--save-at", str(k), "--save-dir", str(tmp_path / "B" / "ckpt")])
    try:
        a.run()
    finally:
        b.run()
    c = Launched(tmp_path / "C", servers=1, job_args=common + [
        "--start", str(k), "--steps", str(2 * k), "--load-dir", str(tmp_path / "B" / "ckpt")]).run()
    for rank in range(2):
        # The checkpoints of A and B are the same state...
        ckpt = "rank%d.params" % rank
        assert (tmp_path / "A" / "ckpt" / ckpt).read_bytes() == \
            (tmp_path / "B" / "ckpt" / ckpt).read_bytes()
        wa, wb, wc = a.weights(rank), b.weights(rank), c.weights(rank)
        assert sorted(wa) == sorted(wc)
        for name in wa:
            np.testing.assert_array_equal(wc[name], wa[name], err_msg=name)
        # ...and the second half did train (C is not B's weights handed through).
        assert any(not np.array_equal(wb[name], wa[name]) for name in wa)
    assert a.rank_json(0)["sha256"] == a.rank_json(1)["sha256"] == c.rank_json(0)["sha256"] \
        == c.rank_json(1)["sha256"]


# ---------------------------------------------------------------- 4. bad input, end to end

@pytest.mark.multiprocess
def test_nan_gradient_on_one_worker_fails_both_workers(tmp_path):
    # A normal exit after the error: the kvstore skips MXNet's finalize (which would wait for
    # transfers the other worker dropped) and leaves with status 1.
    job = Launched(tmp_path / "nan", ["--steps", "60", "--nan-at", "12", "--print-every", "0",
                                      "--error-wait-peers", "45", "--on-error", "exit"])
    try:
        code = job.wait(90)
    finally:
        job.cleanup()
    assert code == 1, job.stderr[-3000:]
    assert "exiting without MXNet's kvstore shutdown" in job.stderr
    for rank in range(2):  # (a rank waits up to 45 s for the other's record: a loaded machine)
        assert os.path.exists(os.path.join(job.out, "rank%d.json" % rank)), (
            "rank %d wrote no record\n%s\n%s" % (rank, job.stdout[-3000:], job.stderr[-3000:]))
        info = job.rank_json(rank)
        assert info.get("error_cause") == "NonFiniteAggregateError", info
        assert info["error_type"] == "PipelineError"
        assert "no weights were updated" in info["error"]
        # the NaN's payload, summed by MXNet's own servers, names the worker that sent it
        assert "sent by worker rank 1" in info["error"], info["error"]
        assert 12 <= info["error_step"] <= 14  # raised at the next wait of the training thread
        # Steps 0..11 were applied, step 12 was not, and both workers hold the same weights.
        assert info["glo_versions"] and set(info["glo_versions"]) == {12}, info["glo_versions"]
        assert info["glo_finite"]
    assert job.rank_json(0)["glo_sha256"] == job.rank_json(1)["glo_sha256"]


def _two_workers(fn):
    group = ThreadGroup(2)
    results, errors = [None, None], [None, None]

    def run(rank):
        try:
            results[rank] = fn(rank, group.transport(rank))
        except BaseException as exc:  # inspected by the caller
            errors[rank] = exc

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a worker thread hung"
    return results, errors


@pytest.mark.parametrize("setting, rank1, needle", [
    ("compressor", {"compressor": "4bit"}, "compressor="),
    ("threshold", {"threshold": 0.25}, "threshold="),
    ("backup", {"backup": False}, "backup="),
])
def test_workers_that_disagree_fail_on_every_rank(setting, rank1, needle):
    def worker(rank, transport):
        options = {"compressor": "2bit", "threshold": 0.5, "backup": True}
        if rank == 1:
            options.update(rank1)
        kv = SlimGC(transport=transport, **options)
        try:
            kv.init(0, mx.nd.zeros(10))
        finally:
            kv.close()

    _, errors = _two_workers(worker)
    for rank, err in enumerate(errors):
        assert isinstance(err, ConfigMismatchError), (rank, err)
        assert needle in str(err) and "rank %d" % rank in str(err)


def test_key_shape_disagreement_fails_on_every_rank():
    def worker(rank, transport):
        kv = SlimGC(transport=transport, compressor="2bit")
        try:
            kv.init(0, mx.nd.zeros((10,) if rank == 0 else (11,)))
        finally:
            kv.close()

    _, errors = _two_workers(worker)
    for err in errors:
        assert isinstance(err, ConfigMismatchError) and "shape" in str(err), err


@pytest.mark.parametrize("dtype", ["float16", "float64"])
def test_non_float32_parameters_are_refused(dtype):
    kv = SlimGC(compressor="2bit")
    with pytest.raises(TypeError, match="float32 parameters only.*net.cast"):
        kv.init(0, mx.nd.zeros(10, dtype=dtype))
    kv.close()
    if dtype == "float16":
        return  # MXNet has no float16 FullyConnected on CPU: the Trainer path below needs one
    net = gluon.nn.Dense(4, in_units=3)
    net.initialize()
    net.cast(dtype)
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                            kvstore=SlimGC(compressor="2bit"))
    with pytest.raises(TypeError, match=dtype):
        with mx.autograd.record():
            loss = net(mx.nd.ones((2, 3), dtype=dtype)).sum()
        loss.backward()
        trainer.step(2)


def test_unknown_option_through_trainer_compression_params():
    net = gluon.nn.Dense(4, in_units=3)
    net.initialize()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                            kvstore="slimgc", compression_params={"type": "2bit", "tresh": 1})
    with pytest.raises(ValueError, match="unknown SlimGC option 'tresh'"):
        with mx.autograd.record():
            loss = net(mx.nd.ones((2, 3))).sum()
        loss.backward()
        trainer.step(2)


@pytest.mark.parametrize("raw", ["0", "-1", "nan", "inf"])
def test_bad_threshold_from_the_environment(monkeypatch, raw):
    monkeypatch.setenv("SLIMGC_THRESHOLD", raw)
    with pytest.raises(ValueError, match="threshold must be a positive finite number"):
        mx.kv.create("slimgc")


def _max_workers(name):
    """The largest N whose radix N*(L-1)+1 still fits one float64 lane exactly."""
    c = codecs.create(name)
    lo, hi = 1, 1 << 60
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            c.wire_bits_per_element(mid)
            lo = mid
        except ValueError:
            hi = mid - 1
    return lo


class _ManyWorkers(LocalTransport):
    """One worker of a job that claims `num_workers`; collectives answer as if all agreed."""

    def __init__(self, num_workers):
        self.num_workers = num_workers

    def allgather(self, values):
        return np.tile(np.asarray(values, np.float64).ravel(), (2, 1))


@pytest.mark.parametrize("name", ["1bit", "2bit", "4bit"])
def test_more_workers_than_the_lane_format_holds(name):
    n = _max_workers(name)
    assert n < 1 << 59
    kv = SlimGC(transport=_ManyWorkers(n), compressor=name)
    kv.init(0, mx.nd.zeros(10))  # exactly the limit still works
    kv.close()
    kv = SlimGC(transport=ThreadGroup(n + 1).transport(0), compressor=name)
    with pytest.raises(ValueError, match="%d workers need radix .* use fewer workers or codec "
                                         "'none'" % (n + 1)):
        kv.init(0, mx.nd.zeros(10))
    kv.close()


class _SlowLink(LocalTransport):
    """Every transfer takes 0.3 s: the training thread really has to wait."""

    def push_pull(self, wire_key, send, recv, priority=0, in_pieces=False):
        time.sleep(0.3)
        return super().push_pull(wire_key, send, recv)


@pytest.mark.parametrize("timeout", [float("inf"), 1e12])
def test_an_unbounded_timeout_waits_or_is_refused(timeout):
    try:
        kv = SlimGC(transport=_SlowLink(), compressor="none", backup=False, timeout=timeout)
    except ValueError as exc:  # refused up front with a clear message: fine too
        assert "timeout" in str(exc)
        return
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1))
    w = mx.nd.zeros(10)
    kv.broadcast(0, w, out=w)
    try:
        kv.pushpull(0, mx.nd.ones(10), out=w)
        np.testing.assert_allclose(w.asnumpy(), -0.1)
    finally:
        kv.close()
