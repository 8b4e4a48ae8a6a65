"""topk and dgc through the SlimGC kvstore in one process: workers as threads end with
bitwise-equal global weights; dgc refuses a second momentum; its memory survives a
checkpoint. (Their sums against the reference: test_kvstore.py, with every codec.)"""
import mxnet as mx
import numpy as np
import pytest
from mxnet import gluon

import slimgc_mx
import training_helpers as th
from slimgc_mx.mxnet.kvstore import SlimGC

def _net(seed=0):
    """2 Dense layers, 4 tensors: the 32x12 and 4x32 weights and two biases."""
    return th.dense_net((32, 4), seed)


@pytest.mark.parametrize("name, options", [("topk", {"ratio": 0.1}),
                                           ("dgc", {"ratio": 0.01, "warmup_stage_steps": 2})])
@pytest.mark.parametrize("backup", [True, False])
def test_training_ends_with_bitwise_equal_weights_on_every_worker(name, options, backup):
    initial = th.weights(_net())
    momentum = 0.0 if name == "dgc" else 0.9  # dgc applies its own
    runs = th.slimgc_workers(2, _net, th.batches(12), momentum=momentum, compressor=name,
                             comm_threshold="off", backup=backup, **options)
    (w0, s0), (w1, s1) = runs
    for a, b, start in zip(w0, w1, initial):
        np.testing.assert_array_equal(a, b)
        assert not np.array_equal(a, start)
    assert s0["compressed_transfers"] == s0["transfers"] == 4 * 12
    assert s0["bytes_pulled"] == 2 * s0["bytes_pushed"]  # N = 2 slots come back
    assert s0["bytes_pushed"] < s0["bytes_fp32"]


def test_dgc_refuses_an_optimizer_with_momentum_naming_the_fix():
    fix = "create the optimizer with momentum=0 and give the codec's own option instead"
    kv = SlimGC(compressor="dgc", backup=False)
    with pytest.raises(ValueError, match="codec 'dgc' applies momentum itself.*" + fix):
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9))
    net = _net()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1,
                                                          "momentum": 0.9}, kvstore=kv)
    with pytest.raises(ValueError, match="'momentum': 0.9"):
        th.train(trainer, net, th.batches(1))
    kv.close()
    # momentum 0 is accepted, before and after the first key (the aggregator checks then)
    kv = SlimGC(compressor="dgc", backup=False, momentum=0.5)
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1))
    kv.init(0, mx.nd.zeros(10))
    with pytest.raises(ValueError, match="momentum=0.5"):
        kv.set_optimizer(mx.optimizer.NAG(learning_rate=0.1, momentum=0.5))
    kv.close()
    SlimGC(compressor="topk").set_optimizer(mx.optimizer.SGD(momentum=0.9))


def test_dgc_memory_and_warmup_step_survive_a_checkpoint(tmp_path):
    """2 workers, dgc with warm-up stages: stop after k steps (mid warm-up), resume in new
    objects: the same weights as an uninterrupted run, bit for bit."""
    batches = th.batches(16, seed=3)
    k = 8

    def make(transport):
        net = _net()
        net(batches[0][0])
        kv = SlimGC(transport=transport, compressor="dgc", backup=True, comm_threshold="off",
                    ratio=0.05, warmup_stage_steps=2)
        trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                                kvstore=kv)
        return net, kv, trainer

    def run(rank, transport, first=True, second=True, save=None, load=None):
        net, kv, trainer = make(transport)
        if load:
            net.load_parameters(str(tmp_path / ("%s%d.params" % (load, rank))))
            trainer.load_states(str(tmp_path / ("%s%d.states" % (load, rank))))
        if first:
            th.train(trainer, net, batches[rank::2][:k // 2])
        if save:
            slimgc_mx.flush(trainer)
            trainer.save_states(str(tmp_path / ("%s%d.states" % (save, rank))))
            net.save_parameters(str(tmp_path / ("%s%d.params" % (save, rank))))
        if second:
            th.train(trainer, net, batches[rank::2][k // 2:])
        slimgc_mx.flush(trainer)
        kv.close()
        return th.weights(net)

    full = th.in_threads(2, lambda r, t: run(r, t, save="full"))
    th.in_threads(2, lambda r, t: run(r, t, second=False, save="half"))
    resumed = th.in_threads(2, lambda r, t: run(r, t, first=False, load="half"))
    for rank in range(2):
        for a, b in zip(full[rank], resumed[rank]):
            np.testing.assert_array_equal(a, b)


def test_randomk_below_half_with_momentum_is_warned_about(monkeypatch):
    from slimgc_mx.engine import planner
    monkeypatch.setattr(planner, "_ADVISED", set())
    kv = SlimGC(compressor="randomk", ratio=0.1, backup=False)
    with pytest.warns(UserWarning, match="codec 'randomk': ratio=0.1 with optimizer momentum 0.9"):
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9))
    kv.close()
