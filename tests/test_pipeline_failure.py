"""A failure in one worker's pipeline: every exchange it had announced is still made, sending
NaN naming it (offload.Pipeline._drain), so that its peer fails those sums naming it
instead of waiting for them, and a transport that pairs exchanges by their order
(TorchTransport) is never left waiting for one that was announced and never handed over.
Framework-free: two workers as threads on a ThreadGroup."""
import threading

import numpy as np
import pytest

from host_engine import make_planner
from slimgc_mx.engine.grad_buf import Push
from slimgc_mx.engine.offload import NonFiniteAggregateError, Pipeline, PipelineError
from slimgc_mx.engine.stages import Stages
from slimgc_mx.transport import HostReadiness
from thread_workers import in_threads

KEYS, SHAPE = 6, (64, 32)


class Recording:
    """A worker's transport that counts the wire keys announced and those handed over."""

    def __init__(self, inner):
        self._inner = inner
        self.announced, self.handed = [], []

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def announce(self, wire_keys):
        self.announced.extend(wire_keys)
        self._inner.announce(wire_keys)

    def push_pull(self, wire_key, *args, **kwargs):
        self.handed.append(wire_key)
        return self._inner.push_pull(wire_key, *args, **kwargs)

    def gather(self, wire_key, *args, **kwargs):
        self.handed.append(wire_key)
        return self._inner.gather(wire_key, *args, **kwargs)


class Gated(Stages):
    """Stages whose encoder starts once every transfer is submitted (so that the failure
    finds later transfers announced and queued), and fails the first one where told."""

    def __init__(self, transport, fail_encode):
        super().__init__(transport)
        self.gate = threading.Event()
        self.fail_encode = fail_encode

    def encode(self, t):
        assert self.gate.wait(30)
        if self.fail_encode:
            self.fail_encode = False
            raise RuntimeError("injected encoder failure")
        super().encode(t)


def _worker(rank, transport, name, compress, where):
    transport = Recording(transport)
    planner = make_planner(name, {}, transport)
    stages = Gated(transport, fail_encode=rank == 0 and where == "encode")
    errors = []
    pipeline = Pipeline(transport, lambda t: None, on_error=lambda exc, at: errors.append(exc),
                        notifier=HostReadiness(), stages=stages)
    rng = np.random.default_rng(rank)
    for k in range(KEYS):
        b = planner.add("w%d" % k, SHAPE)
        b.grad_buf.for_write()[:] = rng.standard_normal(b.size, dtype=np.float32)
        if rank == 0 and where == "next round" and k == 0:
            def next_round(*args):
                raise RuntimeError("injected failure between rounds")
            b.codec.next_round = next_round
        pipeline.submit(planner.transfer(Push("w%d" % k, b, 0, local=False), None, None,
                                         compress=compress))
    stages.gate.set()
    with pytest.raises(PipelineError) as raised:
        pipeline.wait_idle(20)
    pipeline.close()
    return raised.value, transport


@pytest.mark.parametrize("name, compress, where", [
    ("2bit", True, "encode"),  # one sum round, float32 lanes on the wire
    ("none", False, "encode"),  # the full-precision route: fp_buf itself
    ("topk", True, "encode"),  # a gather
    ("powersgd", True, "encode"),  # two sum rounds, the failure before the first
    ("powersgd", True, "next round"),  # ... and between them
])
def test_a_failed_worker_still_makes_every_exchange_it_announced(name, compress, where):
    (mine, t0), (peer, t1) = in_threads(2, lambda rank, transport: _worker(
        rank, transport, name, compress, where), timeout=60)
    assert "injected" in str(mine.__cause__), mine
    # the peer fails the first key's sum naming worker 0, not by a timeout
    assert isinstance(peer.__cause__, NonFiniteAggregateError), peer
    assert "sent by worker rank 0" in str(peer), peer
    for transport in (t0, t1):
        assert len(transport.announced) >= KEYS
        assert sorted(transport.handed) == sorted(transport.announced)
