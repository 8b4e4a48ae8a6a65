"""randomk and powersgd through the kvstore, workers as threads: sums equal the reference,
PowerSGD's vectors (and matrices it cannot shrink) go full precision, weights agree,
a NaN fails cleanly, checkpoints resume bit for bit."""
import mxnet as mx
import numpy as np
import pytest
from mxnet import gluon

import slimgc_mx
import training_helpers as th
from codec_contract import make, push
from slimgc_mx.mxnet.kvstore import SlimGC
from slimgc_mx.engine.offload import NonFiniteAggregateError, PipelineError


@pytest.mark.parametrize("name, options", [("randomk", {"ratio": 0.05}), ("powersgd", {}),
                                           ("powersgd", {"rank": 2})])
@pytest.mark.parametrize("offload", [True, False])
def test_allreduce_over_threads_equals_the_codec_reference(name, options, offload):
    """pushpull without an optimizer returns the decoded sum of every round, bit for bit.

    Two workers: a float32 sum of two arrays does not depend on the arrival order.
    """
    n, shape, steps = 2, (50, 40), 3
    size = 2000
    rng = np.random.RandomState(7)
    grads = rng.randn(steps, n, size).astype(np.float32)

    results = th.pushpull_workers(grads, shape, compressor=name, comm_threshold="off",
                                  backup=False, offload=offload, **options)
    cs = make(name, n, True, options, size=size, shape=shape)  # key #0 of a job with seed 0
    residuals = [np.zeros(size, np.float32) for _ in range(n)]
    sent = 0
    for s in range(steps):
        wires, decoded = push(cs, list(grads[s]), residuals, size, shape)
        sent += wires[0].nbytes
        for outs, _ in results:
            np.testing.assert_array_equal(outs[s], decoded[0])
    for _, stats in results:
        assert stats["compressed_transfers"] == steps
        assert stats["bytes_pushed"] == sent < stats["bytes_fp32"]  # every round counted


def _params(kv):
    """{parameter name: the planner's KeyBuffers}."""
    return {kv._agg.name_of(k): b for k, b in kv._agg.planner.keys.items()}


@pytest.mark.parametrize("comm_threshold", ["off", "auto"])
def test_powersgd_trains_matrices_compressed_and_vectors_in_full_precision(comm_threshold):
    data = th.batches(16)

    def worker(rank, transport):
        net = th.dense_net((64, 32, 4), seed=0)
        kv = SlimGC(transport=transport, compressor="powersgd", comm_threshold=comm_threshold,
                    warmup_steps=4, cttab_rule="measured")  # (a warm-up for keys this small)
        trainer = gluon.Trainer(net.collect_params(),
                                mx.optimizer.SGD(learning_rate=0.1, momentum=0.9), kvstore=kv)
        th.train(trainer, net, data[rank::2] * 2)
        slimgc_mx.flush(trainer)
        keys = {name: (b.codec is not None, b.residual is None, len(b.rounds))
                for name, b in _params(kv).items()}
        samples = dict(kv._agg.cttab._samples)
        stats = kv.stats()
        kv.close()
        return th.weights(net), keys, samples, stats

    (w0, keys, samples, stats), (w1, *_) = th.in_threads(2, worker)
    for a, b in zip(w0, w1):
        np.testing.assert_array_equal(a, b)
    compressed = sorted(name for name, (has_codec, _, _) in keys.items() if has_codec)
    assert [name.split("_", 1)[1] for name in compressed] == ["dense0_weight", "dense1_weight"]
    for name, (has_codec, no_residual, rounds) in keys.items():
        assert (has_codec, no_residual, rounds) == ((True, False, 2) if has_codec
                                                   else (False, True, 0)), name
    # 64x12 and 32x64 at rank 4 compress; 4x32 (factors no smaller) and the biases do not,
    # not even in the warm-up, which alternates routes for the others.
    for label, s in samples.items():
        assert bool(s["q"]) == (label in compressed), label
    assert stats["compressed_transfers"] > 0
    assert stats["bytes_pushed"] < stats["bytes_fp32"]


def test_a_nan_on_one_worker_fails_every_worker_before_the_second_round():
    shape = (20, 30)

    def worker(rank, transport):
        kv = SlimGC(transport=transport, compressor="powersgd", comm_threshold="off",
                    backup=False, timeout=30)
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1))
        w = mx.nd.ones(shape)
        kv.broadcast(0, w, out=w)
        kv.pushpull(0, mx.nd.ones(shape), out=w)
        before = w.asnumpy().copy()
        grad = np.ones(shape, np.float32)
        if rank == 1:
            grad[3, 7] = np.nan
        rounds = []
        codec = kv._agg.planner.keys[0].codec
        original = codec.next_round
        codec.next_round = lambda *a: (rounds.append(a[0]), original(*a))[1]
        kv.pushpull(0, mx.nd.array(grad), out=w)
        with pytest.raises(PipelineError) as info:
            kv.pushpull(0, mx.nd.ones(shape), out=w)
        after = kv._agg.backup.glo_buf(0).asnumpy()
        param = w.asnumpy()
        kv.close()
        return info.value, before, after, param, rounds

    for err, before, after, param, rounds in th.in_threads(2, worker):
        assert isinstance(err.__cause__, NonFiniteAggregateError)
        assert "key 0, step 1" in str(err)
        assert rounds == []  # the summed P held the NaN: no Q round was computed
        np.testing.assert_array_equal(before, after)
        np.testing.assert_array_equal(param, before)


def test_powersgd_checkpoint_resume_is_bitwise_identical(tmp_path):
    """The warm-start Q and the residuals are in the checkpoint: a resumed job goes on as the
    uninterrupted one."""
    batches = th.batches(16, seed=3)
    k = 8

    def make_job(transport):
        net = th.dense_net((64, 4), seed=0, prefix="net_")
        kv = SlimGC(transport=transport, compressor="powersgd", backup=True,
                    comm_threshold="off")
        trainer = gluon.Trainer(net.collect_params(), "sgd",
                                {"learning_rate": 0.1, "momentum": 0.9}, kvstore=kv)
        return net, kv, trainer

    def uninterrupted(rank, transport):
        net, kv, trainer = make_job(transport)
        th.train(trainer, net, batches[rank::2][:k // 2] * 2)
        trainer.save_states(str(tmp_path / ("full%d.states" % rank)))  # flushes, as saving does
        th.train(trainer, net, batches[rank::2][k // 2:] * 2)
        slimgc_mx.flush(trainer)
        kv.close()
        return th.weights(net)

    def first_half(rank, transport):
        net, kv, trainer = make_job(transport)
        th.train(trainer, net, batches[rank::2][:k // 2] * 2)
        trainer.save_states(str(tmp_path / ("half%d.states" % rank)))
        net.save_parameters(str(tmp_path / ("half%d.params" % rank)))
        kv.close()

    def second_half(rank, transport):
        net, kv, trainer = make_job(transport)
        net.load_parameters(str(tmp_path / ("half%d.params" % rank)))
        trainer.load_states(str(tmp_path / ("half%d.states" % rank)))
        q = _params(kv)["net_dense0_weight"].codec.q  # restored
        th.train(trainer, net, batches[rank::2][k // 2:] * 2)
        slimgc_mx.flush(trainer)
        kv.close()
        return th.weights(net), q

    full = th.in_threads(2, uninterrupted)
    th.in_threads(2, first_half)
    resumed = th.in_threads(2, second_half)
    for rank in range(2):
        assert resumed[rank][1] is not None and resumed[rank][1].any()
        for a, b in zip(full[rank], resumed[rank][0]):
            np.testing.assert_array_equal(a, b)
