"""The global update: with an lr scheduler every update takes the rate of its own push, in
whatever order the keys finish aggregating, as MXNet's Updater does stepping them in order."""
from types import SimpleNamespace

import mxnet as mx
import numpy as np
import pytest

import training_helpers as th
from slimgc_mx.mxnet.update import GlobalUpdate

SIZE = 50
#: Two keys, two steps. With backup a key's next push waits only for its own last update,
#: so key 0 may finish step 1 before key 1 finishes step 0 (the second order).
IN_ORDER = [("push", 0, 0), ("push", 1, 0), ("finish", 0, 0), ("finish", 1, 0),
            ("push", 0, 1), ("push", 1, 1), ("finish", 0, 1), ("finish", 1, 1)]
KEY_0_AHEAD = [("push", 0, 0), ("push", 1, 0), ("finish", 0, 0), ("push", 0, 1),
               ("finish", 0, 1), ("finish", 1, 0), ("push", 1, 1), ("finish", 1, 1)]

OPTIMIZERS = {
    "sgd, factor": lambda: mx.optimizer.SGD(
        learning_rate=0.1, momentum=0.9,
        lr_scheduler=mx.lr_scheduler.FactorScheduler(step=1, factor=0.5)),
    "sgd, cosine": lambda: mx.optimizer.SGD(
        learning_rate=0.1, momentum=0.9,
        lr_scheduler=mx.lr_scheduler.CosineScheduler(max_update=4, base_lr=0.1)),
    "adam, factor": lambda: mx.optimizer.Adam(
        learning_rate=0.01, lr_scheduler=mx.lr_scheduler.FactorScheduler(step=1, factor=0.5)),
}


def grads():
    rng = np.random.default_rng(4)
    return {(k, s): rng.standard_normal(SIZE).astype(np.float32) for k in (0, 1) for s in (0, 1)}


def run(make_optimizer, events):
    update = GlobalUpdate(make_optimizer(), num_threads=1)
    glos = {k: th.buffer_of(np.ones(SIZE, np.float32)) for k in (0, 1)}
    g, settings = grads(), {}
    for what, key, step in events:
        if what == "push":
            settings[key, step] = update.settings(key)
            continue
        buffers = SimpleNamespace(index=key, agg=th.buffer_of(g[key, step]))
        transfer = SimpleNamespace(settings=settings[key, step], decode_in_update=False,
                                   pushes=[SimpleNamespace(buffers=buffers)])
        update(transfer, None, [glos[key]])
    return [glos[k].for_read().copy() for k in (0, 1)]


def mxnet_updater(make_optimizer):
    """MXNet's own Updater stepping every key in order, as gluon.Trainer does."""
    updater = mx.optimizer.get_updater(make_optimizer())
    weights = {k: mx.nd.ones(SIZE) for k in (0, 1)}
    g = grads()
    for step in (0, 1):
        for key in (0, 1):
            updater(key, mx.nd.array(g[key, step]), weights[key])
    return [weights[k].asnumpy() for k in (0, 1)]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_each_update_takes_its_push_s_rate_whatever_the_finish_order(name):
    make = OPTIMIZERS[name]
    ordered, ahead = run(make, IN_ORDER), run(make, KEY_0_AHEAD)
    for a, b in zip(ordered, ahead):
        np.testing.assert_array_equal(a, b)
    for ours, theirs in zip(ordered, mxnet_updater(make)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)
    assert not np.array_equal(ordered[0], np.ones(SIZE))


def test_the_checkpointed_optimizer_keeps_the_trainer_s_scheduler():
    make = OPTIMIZERS["sgd, factor"]
    update = GlobalUpdate(make(), num_threads=1)
    state = update.state()
    assert state["optimizer"]["scheduler"]["class"].endswith("FactorScheduler")
    other = GlobalUpdate(make(), num_threads=1)
    other.load_state(state, "the checkpoint")
    assert other.updater.optimizer.lr_scheduler is None  # the rate comes with each push
    assert other.optimizer.lr_scheduler is not None
