"""The push side in one pass: a lane codec's encode with the backup's local SGD step fused in.

The oracle is what the pipeline did before fusing: sgd_step (momentum read, not written)
then encode of the same gradient. Every result must be bitwise the same.
"""
import threading

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon

import slimgc_mx
import training_helpers as th
from slimgc_mx import codecs
from slimgc_mx.engine.stages import Stages
from slimgc_mx.mxnet.framework import MXNetFramework
from slimgc_mx.codecs.base import NonFiniteGradientError, kernels
from slimgc_mx.mxnet.kvstore import SlimGC
from slimgc_mx.mxnet.buffers import ArrayInPlace

FUSED = [("1bit", {}), ("2bit", {}), ("4bit", {}), ("terngrad", {}), ("qsgd", {}),
         ("thc", {})]


def _arrays(n, seed=3):
    rng = np.random.RandomState(seed)
    g, w, m = (rng.randn(n).astype(np.float32) for _ in range(3))
    residual = (rng.randn(n) * 0.1).astype(np.float32)
    return g, w, m, residual


@pytest.mark.parametrize("name, options", FUSED)
@pytest.mark.parametrize("momentum, clip", [(0.9, -1.0), (0.0, -1.0), (0.9, 0.3)])
def test_encode_with_local_is_bitwise_sgd_step_then_encode(name, options, momentum, clip):
    n, workers = 150001, 3  # several chunks, the last one partial
    g, w, m, residual = _arrays(n)
    lr, wd, rescale = 0.05, 1e-3, 1.0 / 48
    mom = m if momentum else None
    for step in range(2):  # the second push encodes with the state agreed by the first
        ref, fused = (codecs.create(name, num_threads=t, **options) for t in (1, 2))
        for c in (ref, fused):
            c.seed = 11
        expected_out = np.empty(n, np.float32)
        kernels().sgd_step(w, g, mom, None, expected_out, lr, wd, rescale, momentum, clip, 1)
        r1, r2 = residual.copy(), residual.copy()
        for _ in range(step + 1):
            lanes1 = ref.encode(g, r1, workers, rank=1)
            out = np.full(n, np.nan, np.float32)
            local = kernels().LocalSGD(w, mom, out, lr, wd, rescale, momentum, clip)
            lanes2 = fused.encode(g, r2, workers, rank=1, local=local)
            np.testing.assert_array_equal(lanes2, lanes1)
            np.testing.assert_array_equal(r2, r1)
            np.testing.assert_array_equal(out, expected_out)
            total = lanes1 * workers if ref.gathered == 0 else lanes1
            ref.decode(total, n, workers)
            fused.decode(total, n, workers)


def test_a_non_finite_gradient_is_found_in_the_fused_pass():
    n = 5000
    g, w, m, residual = _arrays(n)
    g[4321] = np.inf
    out = np.zeros(n, np.float32)
    codec = codecs.create("2bit")
    with pytest.raises(NonFiniteGradientError, match=r"grad\[4321\]"):
        codec.encode(g, residual, 2, local=kernels().LocalSGD(w, m, out, 0.1, 0, 1, 0.9, -1))
    assert np.isinf(out[4321])  # the same pass wrote the local update: no second read


def test_fused_encode_refuses_what_it_cannot_do():
    n = 100
    g, w, m, residual = _arrays(n)
    local = kernels().LocalSGD(w, m, np.zeros(n, np.float32), 0.1, 0, 1, 0.9, -1)
    with pytest.raises(TypeError, match="cannot run the local update"):
        codecs.create("2bit", reference=True).encode(g, residual, 2, local=local)
    with pytest.raises(TypeError, match="cannot run the local update"):
        codecs.create("thc", hadamard=True).encode(g, residual, 2, local=local)
    with pytest.raises(ValueError, match="local update has 100 elements, grad 99"):
        codecs.create("2bit").encode(g[:99], residual[:99], 2, local=local)
    with pytest.raises(ValueError, match="must not overlap"):
        codecs.create("2bit").encode(g, residual, 2, local=kernels().LocalSGD(
            w, m, residual, 0.1, 0, 1, 0.9, -1))
    with pytest.raises(ValueError, match="elements differ"):
        kernels().LocalSGD(w, m[:5], np.zeros(n, np.float32), 0.1, 0, 1, 0.9, -1)


@pytest.mark.parametrize("name, options", [("2bit", {}), ("4bit", {}), ("qsgd", {})])
def test_training_weights_are_bitwise_those_of_the_separate_passes(monkeypatch, name, options):
    """Two workers with backup: the local update encoding in its pass gives the weights of
    the local update and the encoder thread run one after the other."""
    encoders, sources = [], []
    original, source_of = Stages.in_local_update, MXNetFramework.gradient

    def counted(self, transfer):
        encoder = original(self, transfer)
        encoders.append(encoder is not None)
        return encoder

    def recorded(self, b, grads, fused=False, **kw):
        grad, source = source_of(self, b, grads, fused, **kw)
        sources.append(type(source))
        return grad, source

    monkeypatch.setattr(Stages, "in_local_update", counted)
    monkeypatch.setattr(MXNetFramework, "gradient", recorded)
    run = dict(compressor=name, codec_options=options, threshold=0.01, comm_threshold=256,
               warmup_steps=2)
    fused = th.slimgc_workers(2, lambda: th.dense_net((32, 4), 0), th.batches(12), **run)
    assert sum(encoders) > 0  # the 32x12 weight went compressed, encoded by the local update
    # Its gradient read where MXNet keeps it, from the push after the layout was probed.
    assert 0 < sources.count(ArrayInPlace) < sum(encoders)
    monkeypatch.setattr(Stages, "in_local_update", lambda self, transfer: None)
    separate = th.slimgc_workers(2, lambda: th.dense_net((32, 4), 0), th.batches(12), **run)
    for (w_fused, _), (w_separate, s) in zip(fused, separate):
        assert s["compressed_transfers"] > 0
        for a, b in zip(w_fused, w_separate):
            np.testing.assert_array_equal(a, b)



def _conv_net():
    with th._INIT_LOCK:
        mx.random.seed(5)
        net = gluon.nn.HybridSequential()
        net.add(gluon.nn.Conv2D(8, 3, activation="relu"), gluon.nn.Dense(4))
        net.initialize(mx.init.Xavier())
        net.hybridize()
        net(mx.nd.zeros((1, 3, 6, 6)))
        mx.nd.waitall()
    return net


def _conv_worker(rank, transport):
    """Trains with an inference pass after every step (MKLDNN relays the conv weights)."""
    net = _conv_net()
    kv = SlimGC(transport=transport, compressor="2bit", threshold=0.01, comm_threshold=256,
                warmup_steps=2)
    trainer = gluon.Trainer(net.collect_params(), mx.optimizer.SGD(learning_rate=0.1,
                                                                   momentum=0.9), kvstore=kv)
    rng = np.random.RandomState(rank)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for _ in range(10):
        x = mx.nd.array(rng.randn(8, 3, 6, 6))
        y = mx.nd.array(rng.randint(0, 4, 8))
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(8)
        net(x).wait_to_read()  # not recorded: an inference forward
    slimgc_mx.flush(trainer)
    stats = kv.stats()
    kv.close()
    return th.weights(net), stats


def test_conv_gradients_are_read_in_place_with_the_copy_paths_weights(monkeypatch):
    """MKLDNN keeps a conv layer's weights in its own layout after an inference pass, but
    backward writes the gradient in the default layout: it is read in place, and the
    weights are bitwise those of training with the gradient copied into grad_buf."""
    sources, source_of = [], MXNetFramework.gradient

    def recorded(self, b, grads, fused=False, **kw):
        grad, source = source_of(self, b, grads, fused, **kw)
        sources.append((b.shape, type(source)))
        return grad, source

    monkeypatch.setattr(MXNetFramework, "gradient", recorded)
    in_place = th.in_threads(2, _conv_worker)
    assert ((8, 3, 3, 3), ArrayInPlace) in sources
    monkeypatch.setattr(MXNetFramework, "gradient",
                        lambda self, b, grads, fused=False, **kw: source_of(self, b, grads, False,
                                                                           **kw))
    copied = th.in_threads(2, _conv_worker)
    for (a_w, stats), (b_w, _) in zip(in_place, copied):
        assert stats["compressed_transfers"] > 0
        for a, b in zip(a_w, b_w):
            np.testing.assert_array_equal(a, b)


def _relaid_on_demand(monkeypatch, size):
    """A list: ArrayInPlace.held refuses the arrays put in it (LayoutError), as it refuses
    one that MXNet has relaid in MKLDNN's layout since the probe."""
    from slimgc_mx.mxnet.buffers import LayoutError

    relaid = []
    original = ArrayInPlace.held

    def held(self):
        if any(self.nd.handle.value == nd.handle.value for nd in relaid):
            raise LayoutError("an array of shape (%d,) is in MKLDNN's layout" % size)
        return original(self)

    monkeypatch.setattr(ArrayInPlace, "held", held)
    return relaid


def _pushed_in_place(transport, size, rank):
    """(kv, w, grad, glo, in_place): a 2bit store with backup after four pushes of this
    worker's gradient, drained; glo its global weights then, in_place whether the push
    read the gradient in place."""
    kv, w = th.compressed_sgd_store(transport, size)
    grad = mx.nd.array(np.linspace(-1, 1, size) * (rank + 1))
    for _ in range(4):
        kv.pushpull(0, grad, out=w)
    kv._agg.pipeline.wait_idle(30)
    glo = kv._agg.backup.glo_buf(0).asnumpy()
    return kv, w, grad, glo, kv._agg.planner.keys[0].grad_in_place


def test_a_gradient_relaid_after_the_probe_fails_loudly(monkeypatch):
    """Should a gradient read in place turn up in MKLDNN's layout, the operator refuses it
    (LayoutError through DLPack) and every worker's next wait raises it: nothing is sent
    from a relaid array (the refused push goes out as NaN naming its worker, so no sum of
    that step is used) and no weight is updated."""
    from slimgc_mx.engine.offload import PipelineError

    size = 3000
    relaid = _relaid_on_demand(monkeypatch, size)
    both = threading.Barrier(2)

    def worker(rank, transport):
        kv, w, grad, glo, in_place = _pushed_in_place(transport, size, rank)
        pushed = kv.stats()["bytes_pushed"]
        both.wait()  # both workers have read in place before the layout changes
        relaid.append(grad)
        kv.pushpull(0, grad, out=w)
        with pytest.raises(PipelineError) as info:
            kv.pushpull(0, grad, out=w)
        after = (kv._agg.backup.glo_buf(0).asnumpy(), kv.stats()["bytes_pushed"])
        kv.close()
        return in_place, info.value, glo, pushed, after

    for in_place, err, glo, pushed, (glo_after, pushed_after) in th.in_threads(2, worker):
        assert in_place is True
        assert "MKLDNN's layout" in str(err)
        np.testing.assert_array_equal(glo_after, glo)
        assert pushed_after == pushed  # the refused step was not sent


def test_one_workers_relaid_gradient_fails_its_peer_too(monkeypatch):
    """Only worker 1's gradient is relaid: it raises the LayoutError, and its push goes out
    as NaN naming it, so worker 0 fails that sum too instead of adding a stale bit_buf
    (an earlier step's encode) to its weights, or waiting for a push that never comes."""
    from slimgc_mx.engine.offload import NonFiniteAggregateError, PipelineError

    size = 3000
    relaid = _relaid_on_demand(monkeypatch, size)  # worker 1's gradient, once it is relaid
    both = threading.Barrier(2)

    def worker(rank, transport):
        kv, w, grad, glo, in_place = _pushed_in_place(transport, size, rank)
        both.wait()
        if rank == 1:
            relaid.append(grad)
        both.wait()
        with pytest.raises(PipelineError) as info:
            for _ in range(3):
                kv.pushpull(0, grad, out=w)
            kv._agg.pipeline.wait_idle(30)
        after = kv._agg.backup.glo_buf(0).asnumpy()
        kv.close()
        return in_place, info.value, glo, after

    (in0, err0, glo0, after0), (in1, err1, glo1, after1) = th.in_threads(2, worker)
    assert in0 is True and in1 is True
    assert "MKLDNN's layout" in str(err1)
    assert isinstance(err0.__cause__, NonFiniteAggregateError), err0
    assert "sent by worker rank 1" in str(err0)
    np.testing.assert_array_equal(after0, glo0)
    np.testing.assert_array_equal(after1, glo1)
