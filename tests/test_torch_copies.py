"""A device model's gradients reach grad_buf by asynchronous copies: no buffer is read
before its copy's event, fused or not, in the warm-up or after it, and no event is left
behind. copies.DeferredCopies stands in for a GPU's copies on CPU tensors: a copy fills its
destination with NaN until the test releases it, so a read too early is seen."""
import contextlib
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from slimgc_mx.torch import DistributedOptimizer  # noqa: E402
from slimgc_mx.torch.copies import DeferredCopies, EventReadiness  # noqa: E402
from slimgc_mx.torch.framework import TorchFramework  # noqa: E402
from slimgc_mx.transport.host import HostBuffer  # noqa: E402


def _optimizer(copies, model, **options):
    """DistributedOptimizer over `model` (a job of one) whose gradients arrive by `copies`."""

    class Deferred(DistributedOptimizer):
        @staticmethod
        def _framework(params, group_of, num_workers, cuda):
            return TorchFramework(params, group_of, num_workers, copies=copies)

    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return Deferred(inner, model, **options)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 96),
                               torch.nn.ReLU(), torch.nn.Linear(96, 8))


class Spy:
    """Wraps the transport's push_pull: counts the exchanges and the ones whose send held
    NaN (a buffer read before its copy landed)."""

    def __init__(self, transport):
        self.calls = 0
        self.torn = []
        self._push_pull = transport.push_pull
        transport.push_pull = self

    def __call__(self, wire_key, send, recv, *args, **kwargs):
        self.calls += 1
        if np.isnan(send.for_read()).any():
            self.torn.append(wire_key)
        return self._push_pull(wire_key, send, recv, *args, **kwargs)


def _grads(model, step):
    gen = torch.Generator().manual_seed(step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def _parked(opt, timeout=10.0):
    """Wait until every transfer in flight waits for a copy (nothing else can run)."""
    agg = opt._agg
    readiness = agg.framework.readiness
    end = time.monotonic() + timeout
    while agg.pipeline.in_flight != readiness.waiting():
        assert time.monotonic() < end, "the pipeline did not settle"
        time.sleep(0.005)


def _run(steps, release_each_step, **options):
    """(global weights, stats, spy, copies, readiness) of `steps` steps of a job of one."""
    copies = DeferredCopies()
    model = _model()
    opt = _optimizer(copies, model, **options)
    spy = Spy(opt._transport)
    for step in range(steps):
        _grads(model, step)
        opt.step()
        if release_each_step:
            _parked(opt)  # whatever could run before the copies land has run
            assert spy.torn == [], "step %d read a buffer before its copy landed" % step
        copies.release()
    opt.flush()
    weights = [p.detach().clone() for p in model.parameters()]
    stats = opt.stats()
    readiness = opt._agg.framework.readiness
    opt.close()
    return weights, stats, spy, copies, readiness


@pytest.mark.parametrize("threshold", [4096, 1 << 30])
def test_no_fused_bucket_is_read_before_its_members_copies_land(threshold):
    # fixed routes from step 0: biases in a full-precision fused bucket and weights 2bit,
    # or every key in the bucket
    options = dict(compression="2bit", comm_threshold=threshold, backup=True)
    weights, stats, spy, copies, readiness = _run(6, True, **options)
    assert stats["fused_buckets"] >= 1 and stats["fused_keys"] >= 3
    assert (stats["compressed_transfers"] > 0) == (threshold == 4096)
    assert spy.torn == [] and spy.calls > 0
    assert readiness.pending() == 0 and readiness.waiting() == 0  # no event left behind
    assert copies.queued == [] and copies.copies == 6 * 6
    # the same job whose copies land at once: the same global weights, bit for bit
    eager, _, eager_spy, _, _ = _run(6, False, **options)
    assert eager_spy.torn == []
    for a, b in zip(weights, eager):
        assert torch.equal(a, b)


def test_no_buffer_is_read_early_without_fusion_or_backup():
    for options in (dict(fuse=False, backup=True), dict(fuse=True, backup=False)):
        copies = DeferredCopies()
        model = _model()
        opt = _optimizer(copies, model, compression="2bit", comm_threshold=4096, **options)
        spy = Spy(opt._transport)
        with landing_late(copies):
            _train(opt, model, 5)
        assert spy.torn == [] and spy.calls > 0, options
        assert opt._agg.framework.readiness.pending() == 0
        opt.close()


@contextlib.contextmanager
def landing_late(copies):
    """While inside: a thread lands the copies queued, each a little late; all on exit."""
    stop = threading.Event()

    def land():
        while not stop.is_set():
            time.sleep(0.01)
            copies.release(1)
        copies.release()

    lander = threading.Thread(target=land, daemon=True)
    lander.start()
    try:
        yield
    finally:
        stop.set()
        lander.join()


def _train(opt, model, steps):
    for step in range(steps):
        _grads(model, step)
        opt.step()
    opt.flush()


def test_the_warmup_waits_for_its_copies_too():
    # the CTTab's warm-up sends each key alone and timed (serial), in the trainer's order
    copies = DeferredCopies()
    model = _model()
    opt = _optimizer(copies, model, compression="2bit", warmup_steps=4, backup=True)
    spy = Spy(opt._transport)
    with landing_late(copies):
        _train(opt, model, 7)
    assert opt.stats()["comm_threshold_phase"] == "trained"
    assert spy.torn == [] and spy.calls > 0
    assert opt._agg.framework.readiness.pending() == 0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    opt.close()


def test_readiness_waits_for_every_copy_into_a_buffers_memory():
    readiness = EventReadiness()
    copies = DeferredCopies()
    bucket = HostBuffer((10,))
    members = [bucket.view(0, (4,)), bucket.view(4, (6,))]
    for i, m in enumerate(members):
        dst = torch.from_numpy(m.for_write())
        readiness.copied(m, copies.to_host(torch.full((m.shape[0],), float(i)), dst))
    admitted = threading.Event()
    readiness.when_readable(bucket, admitted.set)
    copies.release(1)
    assert not admitted.wait(0.1)  # the second member's copy is still in flight
    copies.release()
    assert admitted.wait(5)
    np.testing.assert_array_equal(bucket.for_read(), [0] * 4 + [1] * 6)
    assert readiness.pending() == 0
    # a buffer no copy wrote is admitted, after those asked for before it
    order = []
    late = copies.to_host(torch.ones(4), torch.from_numpy(members[0].for_write()))
    readiness.copied(members[0], late)
    readiness.when_readable(members[0], lambda: order.append("copied"))
    readiness.when_readable(HostBuffer((3,)), lambda: order.append("plain"))
    time.sleep(0.05)
    assert order == []
    copies.release()
    deadline = time.monotonic() + 5
    while len(order) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert order == ["copied", "plain"]


@pytest.mark.parametrize("backup", [True, False])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_steady_step_copies_no_pageable_byte_and_does_not_wait_for_the_device(backup,
                                                                                 optimizer):
    copies = DeferredCopies()
    model = _model()
    make = (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)) if optimizer == "sgd" else (
        lambda ps: torch.optim.Adam(ps, lr=1e-3))

    class Deferred(DistributedOptimizer):
        @staticmethod
        def _framework(params, group_of, num_workers, cuda):
            return TorchFramework(params, group_of, num_workers, copies=copies)

    opt = Deferred(make(model.parameters()), model, compression="2bit", comm_threshold=4096,
                   backup=backup)
    nbytes = sum(4 * p.numel() for p in model.parameters())
    for step in range(4):
        _grads(model, step)
        # without backup the step waits for its aggregation: land the copies meanwhile
        with landing_late(copies) if not backup else contextlib.nullcontext():
            opt.step()
        copies.release()
        counts = opt.stats()["step_copies"]
        assert opt.stats()["step_s"] > 0
        assert counts["d2h_bytes"] == nbytes  # every gradient, once
        if step >= 2:  # steady: the optimizer's state exists and is pinned
            assert counts["pageable_bytes"] == 0, counts
            assert counts["host_syncs"] <= 1, counts
            # glo_buf into the parameter; with backup, the state the local step reads too
            state = {"sgd": 1, "adam": 2}[optimizer] if backup else 0
            assert counts["h2d_bytes"] == nbytes * (1 + state), counts
    opt.flush()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    opt.close()


def test_a_resumed_device_model_continues_bit_for_bit():
    # a checkpoint's optimizer state is loaded pageable and moved to pinned memory at the
    # next update: the update must write the state it then keeps
    def job(steps, resume_at=None):
        copies = DeferredCopies()
        model = _model()
        opt = _optimizer(copies, model, compression="2bit", comm_threshold=4096, backup=True)
        for step in range(steps):
            if step == resume_at:
                state = opt.state_dict()
                copies.release()
                opt.close()
                copies = DeferredCopies()
                opt = _optimizer(copies, model, compression="2bit", comm_threshold=4096,
                                 backup=True)
                opt.load_state_dict(state)
            _grads(model, step)
            opt.step()
            copies.release()
        opt.flush()
        opt.close()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(job(6), job(6, resume_at=3)):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backup", [True, False])
def test_a_cuda_model_gives_the_cpu_models_global_weights_without_pageable_copies(backup):
    def job(device):
        model = _model().to(device)
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   model, compression="2bit", comm_threshold=4096,
                                   backup=backup, data_path="host")
        for step in range(5):
            gen = torch.Generator().manual_seed(step)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen).to(device)
            opt.step()
        counts = opt.stats()["step_copies"]
        opt.flush()
        weights = [p.detach().cpu() for p in model.parameters()]
        opt.close()
        return weights, counts

    cpu, _ = job("cpu")
    cuda, counts = job("cuda")
    for a, b in zip(cpu, cuda):
        assert torch.equal(a, b)
    assert counts["pageable_bytes"] == 0 and counts["host_syncs"] <= 1, counts
    assert counts["d2h_bytes"] == sum(4 * w.numel() for w in cpu)
