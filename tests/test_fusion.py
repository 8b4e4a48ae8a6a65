"""The fused full-precision route: same weights as key-by-key, fewer transfers, no stalls."""

import mxnet as mx
import numpy as np
import pytest
from mxnet import gluon

import slimgc_mx
import training_helpers as th
from slimgc_mx.engine.grad_buf import KeyBuffers
from slimgc_mx.mxnet.kvstore import SlimGC
from slimgc_mx.engine.planner import FusedRoute
from slimgc_mx.engine.cttab import CTTab
from slimgc_mx.mxnet.buffers import Buffer
from slimgc_mx.transport.keys import FUSED_BASE as FUSED_KEY_BASE
from slimgc_mx.transport.keys import WireKeys


def _net(seed=0, prefix=None):
    """Three Dense layers (6 tensors, 16 B to 1.5 KB) with seeded weights."""
    return th.dense_net((32, 16, 4), seed, prefix)


def test_buffer_view_shares_memory_and_waits_for_writes_to_the_whole_buffer():
    parent = Buffer((10,), np.float32)
    view = parent.view(2, (2, 2))
    a = mx.nd.random.uniform(shape=(800, 800))
    slow = mx.nd.dot(a, a)[:2, :2]  # queued, not finished
    slow.copyto(view.nd)
    np.testing.assert_array_equal(parent.for_read()[2:6], slow.asnumpy().ravel())
    assert view.for_read().base is not None and parent.for_read()[[0, 1, 6]].sum() == 0
    with pytest.raises(ValueError, match="outside a buffer of 10 elements"):
        parent.view(8, (3,))


class _Servers:
    """A transport stand-in with S servers that records what is declared."""

    def __init__(self, num_servers):
        self.num_servers = num_servers
        self.declared = []
        self.keys = WireKeys()

    def declare(self, wire_key, buf):
        self.declared.append((wire_key, buf.nbytes))


@pytest.mark.parametrize("servers", [1, 2, 3, 8])
def test_buckets_cut_the_keys_in_order_one_per_server(servers):
    sizes = [5, 300, 40, 40, 1000, 7, 7, 200]
    members = {"k%d" % i: KeyBuffers(i, (n,), None, 2, Buffer) for i, n in enumerate(sizes)}
    transport = _Servers(servers)
    route = FusedRoute(members, transport, Buffer)
    assert len(route.buckets) == min(servers, len(sizes))
    assert [k for b in route.buckets for k in b.members] == list(members)
    assert [w for w, _ in transport.declared] == [FUSED_KEY_BASE + i
                                                  for i in range(len(route.buckets))]
    # every member's grad_buf is its own slice of its bucket's flat buffer
    for bucket in route.buckets:
        for i, b in enumerate(bucket.members.values()):
            b.grad_buf.for_write()[:] = i + 1
        expected = np.concatenate([np.full(b.size, i + 1, np.float32)
                                   for i, b in enumerate(bucket.members.values())])
        np.testing.assert_array_equal(bucket.grad_buf.for_read(), expected)
    # balanced up to one key: no bucket exceeds its share by more than its largest member
    share = sum(sizes) / len(route.buckets)
    for bucket in route.buckets:
        assert bucket.size <= share + max(b.size for b in bucket.members.values())
    if servers == 2:
        assert [b.size for b in route.buckets] == [5 + 300 + 40 + 40 + 1000, 7 + 7 + 200]


def _fused_and_key_by_key(backup, comm_threshold, steps=10):
    """Weights and stats of the same 2-worker job with fusion on and off."""
    batches = th.batches(steps)
    return {fuse: th.slimgc_workers(2, _net, batches, compressor="2bit", threshold=0.01,
                                    backup=backup, comm_threshold=comm_threshold,
                                    warmup_steps=2, fuse=fuse, timeout=30)
            for fuse in (True, False)}


@pytest.mark.parametrize("backup", [True, False])
@pytest.mark.parametrize("comm_threshold", [10 ** 9, 256, "auto"])
def test_fused_route_trains_the_same_weights_as_key_by_key(backup, comm_threshold, monkeypatch):
    """Fixed thresholds, and a warm-up whose decision (256 B) is pinned: timings vary."""
    monkeypatch.setattr(CTTab, "decide", lambda self: 256)
    out = _fused_and_key_by_key(backup, comm_threshold)
    (w_fused, s_fused), (w_fused1, _) = out[True]
    (w_keys, s_keys), _ = out[False]
    for a, b, c in zip(w_fused, w_fused1, w_keys):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    assert s_keys["fused_keys"] == 0
    full_precision = 6 if comm_threshold == 10 ** 9 else None
    if full_precision:
        assert s_fused["fused_keys"] == full_precision and s_fused["fused_buckets"] == 1
        # 10 steps of 6 keys: the first step key by key, then one transfer per step
        assert s_fused["transfers"] == 6 + 9 and s_keys["transfers"] == 60
    if comm_threshold != 10 ** 9:  # the three biases (128, 64, 16 B) go together
        assert s_fused["fused_keys"] == 3
        assert s_fused["compressed_transfers"] == s_keys["compressed_transfers"]
        assert s_fused["comm_threshold_bytes"] == 256
    assert s_fused["bytes_pushed"] == s_keys["bytes_pushed"]


def test_a_parameter_that_stops_being_pushed_does_not_stall_the_others():
    """grad_req='null' mid-training: its bucket goes out at the end of the step, without it."""
    batches = th.batches(12)
    results = {}
    for fuse in (True, False):
        net = _net()
        kv = SlimGC(compressor="none", backup=False, fuse=fuse, timeout=20)
        trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                                kvstore=kv)
        th.train(trainer, net, batches[:4])
        frozen = list(net.collect_params().values())[1]  # the first bias
        before = frozen.data().asnumpy().copy()
        frozen.grad_req = "null"
        th.train(trainer, net, batches[4:])
        slimgc_mx.flush(trainer)
        np.testing.assert_array_equal(frozen.data().asnumpy(), before)
        results[fuse] = (th.weights(net), kv.stats())
        kv.close()
    for a, b in zip(results[True][0], results[False][0]):
        np.testing.assert_array_equal(a, b)
    assert results[True][1]["fused_keys"] == 6


def test_direct_pushes_of_part_of_a_bucket_are_sent_when_a_key_comes_again():
    """Without gluon.Trainer: keys 0 and 1 go on alone after step 2; pull still answers."""
    def run(fuse):
        kv = SlimGC(compressor="none", backup=False, fuse=fuse, timeout=20)
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5))
        weights = [mx.nd.ones(n) for n in (3, 4, 5)]
        for k, w in enumerate(weights):
            kv.init(k, w)
        for step in range(6):
            for k, w in enumerate(weights):
                if step < 2 or k < 2:
                    kv.pushpull(k, mx.nd.full(w.shape, k + step), out=w)
        kv.pull(1, out=weights[1])
        kv.pull(2, out=weights[2])
        stats = kv.stats()
        kv.close()
        return [w.asnumpy() for w in weights], stats

    fused, stats = run(True)
    for a, b in zip(fused, run(False)[0]):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(fused[2], 1 - 0.5 * (2 + 3))  # pushed at steps 0 and 1 only
    assert stats["fused_keys"] == 3


def test_nan_in_a_fused_bucket_fails_every_worker_without_updating_any_member():
    from slimgc_mx.engine.offload import NonFiniteAggregateError, PipelineError

    sizes = (3, 4, 5)

    def worker(rank, transport):
        kv = SlimGC(transport=transport, compressor="none", backup=False, timeout=30)
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1))
        weights = [mx.nd.ones(n) for n in sizes]
        for k, w in enumerate(weights):
            kv.broadcast(k, w, out=w)
        for step in range(2):
            for k, w in enumerate(weights):
                kv.pushpull(k, mx.nd.ones(w.shape), out=w)
        kv.send_pending()
        before = [w.asnumpy().copy() for w in weights]
        for k, w in enumerate(weights):
            grad = np.ones(w.shape, np.float32)
            if rank == 1 and k == 1:
                grad[2] = np.inf
            kv.pushpull(k, mx.nd.array(grad), out=w)
        with pytest.raises(PipelineError) as info:
            kv.pushpull(0, mx.nd.ones(sizes[0]), out=weights[0])
        after = [kv._agg.backup.glo_buf(k).asnumpy() for k in range(len(sizes))]
        stats = kv.stats()
        kv.close()
        return info.value, before, after, stats

    for err, before, after, stats in th.in_threads(2, worker):
        assert stats["fused_keys"] == 3
        assert isinstance(err.__cause__, NonFiniteAggregateError)
        assert "keys 0..2 (fused), step 2" in str(err)
        for a, b in zip(before, after):
            np.testing.assert_array_equal(a, b)


def test_loading_a_checkpoint_with_another_threshold_rebuilds_the_buckets(tmp_path, monkeypatch):
    """A job fused all 6 keys (BestCT 'never'); the checkpoint it loads says 256 B: 3 keys."""
    batches = th.batches(10)
    states = str(tmp_path / "a.states")

    def make():
        net = _net(prefix="resumed_")
        kv = SlimGC(compressor="2bit", threshold=0.05, backup=False, warmup_steps=2, timeout=30)
        trainer = gluon.Trainer(net.collect_params(), "sgd",
                                {"learning_rate": 0.1, "momentum": 0.9}, kvstore=kv)
        return net, kv, trainer

    monkeypatch.setattr(CTTab, "decide", lambda self: 256)
    net, kv, trainer = make()
    th.train(trainer, net, batches[:5])
    trainer.save_states(states)
    th.train(trainer, net, batches[5:])
    slimgc_mx.flush(trainer)
    expected = th.weights(net)
    kv.close()

    monkeypatch.setattr(CTTab, "decide", lambda self: 10 ** 9)
    net, kv, trainer = make()
    th.train(trainer, net, batches[:4])
    assert kv.stats()["fused_keys"] == 6
    trainer.load_states(states)
    slimgc_mx.flush(trainer)  # the parameters get the checkpoint's global weights
    th.train(trainer, net, batches[5:])
    slimgc_mx.flush(trainer)
    assert kv.stats()["fused_keys"] == 3 and kv.stats()["comm_threshold_bytes"] == 256
    for a, b in zip(expected, th.weights(net)):
        np.testing.assert_array_equal(a, b)
    kv.close()


@pytest.mark.parametrize("backup", [True, False])
def test_compressed_buckets_give_2bit_the_same_weights_with_fewer_transfers(backup):
    """2bit levels and residuals are per element, so small compressed keys fused into one
    bucket (one codec, one set of lanes) train exactly as key by key, in fewer transfers."""
    batches = th.batches(10)
    runs = {fc: th.slimgc_workers(2, _net, batches, compressor="2bit", threshold=0.01,
                                  backup=backup, comm_threshold=0, warmup_steps=2, timeout=30,
                                  fuse_compressed=fc)
            for fc in ("off", 100_000)}
    (w_fused, s_fused), (w_fused1, _) = runs[100_000]
    (w_keys, s_keys), _ = runs["off"]
    for a, b, c in zip(w_fused, w_fused1, w_keys):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    assert s_keys["transfers"] == 60 and s_fused["transfers"] == 6 + 9  # one bucket per step
    assert s_fused["compressed_transfers"] == s_fused["transfers"]


def test_a_checkpoint_carries_the_compressed_buckets_codec_state(tmp_path):
    """1bit's scale lives in the bucket's codec: a resumed job continues bitwise."""
    batches = th.batches(12, seed=4)
    states = str(tmp_path / "b.states")

    def make():
        net = _net(prefix="cb_")
        kv = SlimGC(compressor="1bit", backup=True, comm_threshold=0, timeout=30,
                    fuse_compressed=100_000)
        return net, kv, gluon.Trainer(net.collect_params(), "sgd",
                                      {"learning_rate": 0.1, "momentum": 0.9}, kvstore=kv)

    net, kv, trainer = make()
    th.train(trainer, net, batches[:6])
    trainer.save_states(states)
    net.save_parameters(str(tmp_path / "b.params"))
    th.train(trainer, net, batches[6:])
    slimgc_mx.flush(trainer)
    expected = th.weights(net)
    assert kv.stats()["fused_buckets"] == 1
    kv.close()
    net, kv, trainer = make()  # a new job: its bucket is built after the checkpoint is read
    net.load_parameters(str(tmp_path / "b.params"))
    trainer.load_states(states)
    th.train(trainer, net, batches[6:])
    slimgc_mx.flush(trainer)
    for a, b in zip(expected, th.weights(net)):
        np.testing.assert_array_equal(a, b)
    kv.close()
