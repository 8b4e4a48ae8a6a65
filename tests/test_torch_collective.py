"""TorchTransport on a one-rank Gloo group: close() lets go of the group (so that
destroy_process_group frees it while the interpreter is alive) once Gloo holds none of the
tensors it was handed, and a collective asked of a closed transport fails at once instead of
waiting for an issuer that is gone, and one behind an exchange never handed over fails after
the timeout."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from slimgc_mx.torch.collective import Rider, TorchTransport  # noqa: E402
from slimgc_mx.transport.host import HostBuffer  # noqa: E402


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method="file://%s" % (tmp_path / "store"), rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def test_close_lets_go_of_the_group_and_refuses_later_collectives(one_rank):
    transport = TorchTransport(timeout=30)
    buf = HostBuffer((4,))
    buf.for_write()[:] = [1, 2, 3, 4]
    transport.broadcast(0, buf)
    assert np.array_equal(buf.for_read(), [1, 2, 3, 4])
    assert transport.close(timeout=5)
    assert transport._group is None
    with pytest.raises(RuntimeError, match="the transport is closed"):
        transport.broadcast(0, buf)


def test_close_waits_until_gloo_has_let_go_of_every_tensor(one_rank, monkeypatch):
    """Gloo's worker thread lets go of a finished collective a moment after wait() has
    returned. Where it held the last reference to a tensor Python made while the interpreter
    exited, it was ended inside a C++ destructor and the finished job aborted ('terminate
    called without an active exception'). close() now returns once nothing is held. The
    stand-in for the worker holds each tensor (a C++ reference) 0.3 s after the collective."""
    import threading

    held = []

    class Done:
        def wait(self):
            return True

        def is_completed(self):
            return True

    def broadcast(tensor, src=0, group=None, async_op=False):
        holder = torch.zeros_like(tensor, requires_grad=True)
        holder.grad = tensor  # a reference from C++, as the worker's
        held.append(holder)
        threading.Timer(0.3, held.remove, [holder]).start()
        return Done()

    monkeypatch.setattr(dist, "broadcast", broadcast)
    transport = TorchTransport(timeout=30)
    transport.broadcast(0, HostBuffer((4,)))
    assert held
    assert transport.close(timeout=5)
    assert not held


def test_a_collective_behind_an_exchange_never_handed_over_raises_instead_of_waiting(one_rank):
    """A pipeline that announced an exchange and failed before handing it over left the
    training thread's next collective (a forward's buffer broadcast) waiting forever."""
    import threading

    transport = TorchTransport(timeout=0.5)
    transport.announce([("w",)])  # announced, then never handed over
    raised = []

    def broadcast():
        try:
            transport.broadcast_tensors([torch.zeros(2)])
        except TimeoutError as exc:
            raised.append(exc)
    caller = threading.Thread(target=broadcast, daemon=True)
    caller.start()
    caller.join(30)
    assert not caller.is_alive(), "the collective is still waiting"
    assert raised and "exchange ('w',), announced before it, was never handed" in str(raised[0])
    assert transport.close(timeout=5)


def test_no_transport_starts_on_a_group_where_an_aggregation_failed(one_rank):
    """Ranks stop at different collectives after a failed aggregation: a later transport on
    the group would pair its collectives with those left over (tests/torch_jobs/errors.py
    'again' in a real job)."""
    first = TorchTransport(timeout=30)
    second = TorchTransport(timeout=30)  # a sound one is not refused
    assert second.close(timeout=5)
    first.mark_uneven()
    assert first.close(timeout=5)
    with pytest.raises(RuntimeError, match="failed on this process group.*afresh"):
        TorchTransport(timeout=30)


@pytest.mark.slow
def test_riders_tell_every_rank_whether_all_sent_the_same_and_leave_exchanges_intact(tmp_path):
    """TorchTransport.ride: the per-step settings check's values travel with the next
    exchange (a sum or a gather, float32 or float64), alone when it is too large or not an
    exchange; every rank learns the same verdict."""
    from torch_launch import results, torchrun
    torchrun("rider.py", tmp_path)
    ranks = results(tmp_path, "rider")  # (recorded before the exit)
    assert ranks[0] == ranks[1]
    assert len(ranks[0]) == 10
    for case, r in ranks[0].items():
        assert r["intact"], case
        assert r["same"] is case.endswith("False"), case


def test_a_riders_verdict_is_the_same_for_every_thread_that_asks():
    """The global update's thread and the training thread's flush both ask a rider of the
    last step. One that asked first but read the exchange after the other had finished
    found the carrier let go and took it for a rider sent by no rank: 'same', so the last
    step's mismatch went unreported at the flush. Here the second caller is held between
    its first look and its read until the first caller is done."""
    import threading

    class Carrier:
        def wait(self):
            pass

    class Gate:  # the rider's 'placed' event, holding the thread named 'second'
        def __init__(self):
            self.entered, self.first_done = threading.Event(), threading.Event()

        def wait(self, timeout=None):
            if threading.current_thread().name == "second":
                self.entered.set()
                assert self.first_done.wait(10)
            return True

    rider = Rider([5], num_workers=2)
    rider.sums = np.array([3.0, 5.0])  # 2 * 5 != 3 * 3: the ranks sent different values
    rider._carrier, rider._placed = Carrier(), Gate()
    verdicts = {}
    second = threading.Thread(target=lambda: verdicts.update(second=rider.same()),
                              name="second")
    second.start()
    assert rider._placed.entered.wait(10)
    verdicts["first"] = rider.same()
    rider._placed.first_done.set()
    second.join(10)
    assert verdicts == {"first": False, "second": False}


def test_a_job_is_rerun_once_after_the_known_abort_at_exit_only(monkeypatch):
    import torch_launch
    calls = []

    def fake(script, out, *args, **kw):
        calls.append(script)
        return answers.pop(0)

    monkeypatch.setattr(torch_launch, "_torchrun", fake)
    answers = [(1, "done\n" + torch_launch.EXIT_ABORT), (0, "done")]
    with pytest.warns(UserWarning, match="aborted at exit"):
        assert torch_launch.torchrun("x.py", "out") == (0, "done")
    answers, calls[:] = [(1, "RuntimeError: bad option"), (0, "never")], []
    assert torch_launch.torchrun("x.py", "out") == (1, "RuntimeError: bad option")
    assert calls == ["x.py"]
    answers = [(1, torch_launch.EXIT_ABORT), (1, torch_launch.EXIT_ABORT)]
    with pytest.warns(UserWarning):
        assert torch_launch.torchrun("x.py", "out")[0] == 1  # twice: returned


def test_a_job_past_its_time_leaves_no_process_behind(tmp_path, monkeypatch):
    """torchrun starts its ranks in sessions of their own, so killing its process group left
    them running; _torchrun kills every process below it."""
    import os
    import subprocess
    import sys
    import time

    import torch_launch
    script = tmp_path / "hang.py"
    pidfile = tmp_path / "pid"
    # a 'rank' in a session of its own that outlives its parent's group
    script.write_text("import os, subprocess, sys, time\n"
                      "p = subprocess.Popen([sys.executable, '-c', 'import time; "
                      "time.sleep(120)'], start_new_session=True, "
                      "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
                      "open(%r, 'w').write(str(p.pid))\n"
                      "time.sleep(120)\n" % str(pidfile))
    real = subprocess.Popen

    def popen(cmd, **kw):  # the job's command in torchrun's place
        return real([sys.executable, str(script)], **kw)
    monkeypatch.setattr(torch_launch.subprocess, "Popen", popen)
    with pytest.raises(subprocess.TimeoutExpired):
        torch_launch._torchrun("x.py", str(tmp_path), timeout=3)
    pid = int(pidfile.read_text())

    def running():  # (a killed process no one has reaped yet counts as gone)
        try:
            with open("/proc/%d/stat" % pid) as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False
    for _ in range(50):
        if not running():
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        raise AssertionError("the rank in its own session was left running")
